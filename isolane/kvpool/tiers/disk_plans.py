"""Where a batch of keys is stored on the disk tier's devices, and the pieces its read is
cut into (``DiskTier.locate`` makes a plan, ``DiskTier.read_located`` reads it).

Two forms of one plan, the same pieces either way (``coalesce``: ``column_ranges`` cuts
what ``coalesce_ranges`` + ``split_ranges`` cut):

* ``ColumnPlan``: one vectorised probe of each log's key directory, numpy columns and
  no object per key, pieces cut from the columns one at a time: long restores.
* ``KeyPlan``: a ``Location`` per key (``SegmentLog.locate_many``, key by key): a few
  keys, where numpy's ~1-5 µs a call on arrays of a few elements would be most of a
  small-prompt restore's fixed cost.

Pure: a plan holds no lock and reads nothing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from isolane.kvpool.log.coalesce import (
    Piece,
    ReadRange,
    coalesce_ranges,
    column_ranges,
    split_ranges,
)
from isolane.kvpool.log.keydir import LocatedColumns, Location
from isolane.kvpool.log.reader import piece_bytes_for


class DiskPlan(ABC):
    """Where each of ``keys`` is stored: ``found`` says which some device holds, and
    ``pieces_on`` cuts the reads of one device's share."""

    keys: list[bytes]

    @property
    @abstractmethod
    def found(self) -> npt.NDArray[np.bool_]:
        """Whether some device holds ``keys[i]``."""

    @abstractmethod
    def pieces_on(self, device: int, skip: Sequence[bool] | None, readers: int
                  ) -> Iterable[Piece]:
        """The pieces reading the keys device ``device`` holds (not those ``skip``
        marks), cut for ``readers`` threads."""


@dataclass(frozen=True)
class ColumnPlan(DiskPlan):
    """``owner[i]``: the index of the log that reads ``keys[i]`` (-1: on no device);
    ``cols[log]``: that log's probe of the whole batch."""

    keys: list[bytes]
    owner: npt.NDArray[np.int64]
    cols: list[LocatedColumns]

    @property
    def found(self) -> npt.NDArray[np.bool_]:
        return self.owner >= 0

    def pieces_on(self, device: int, skip: Sequence[bool] | None, readers: int
                  ) -> Iterable[Piece]:
        mine = self.owner == device
        if skip is not None:
            mine &= ~np.asarray(skip, bool)
        positions = np.flatnonzero(mine)
        if not len(positions):
            return ()
        ranges = column_ranges(self.cols[device], positions)
        return ranges.pieces(piece_bytes_for(ranges.nbytes, readers))


@dataclass(frozen=True)
class KeyPlan(DiskPlan):
    """``locations[i]``: where ``keys[i]`` is, on log ``owner[i]`` (None and -1: on no
    device)."""

    keys: list[bytes]
    owner: list[int]
    locations: list[Location | None]

    @property
    def found(self) -> npt.NDArray[np.bool_]:
        return np.array([o >= 0 for o in self.owner], bool)

    def pieces_on(self, device: int, skip: Sequence[bool] | None, readers: int
                  ) -> Iterable[Piece]:
        if skip is None and all(owner == device for owner in self.owner):
            mine = self.locations  # the usual small restore: every key on this device
        else:
            mine = [loc if owner == device and not (skip and skip[i]) else None
                    for i, (owner, loc) in enumerate(zip(self.owner, self.locations,
                                                         strict=True))]
        return cut_locations(mine, readers)


def cut_locations(locations: Sequence[Location | None], readers: int) -> list[ReadRange]:
    """The pieces reading ``locations`` (None entries skipped): coalesced ranges cut
    for ``readers`` threads; one location is one piece without the grouping."""
    found = [(i, loc) for i, loc in enumerate(locations) if loc is not None]
    if len(found) == 1:  # a record is never cut: one piece, whatever the size
        loc = found[0][1]
        return [ReadRange(loc.segment_id, loc.record_offset, loc.record_end, (found[0],))]
    if not found:
        return []
    ranges = coalesce_ranges(locations)
    total = sum(r.nbytes for r in ranges)
    return split_ranges(ranges, piece_bytes_for(total, readers))
