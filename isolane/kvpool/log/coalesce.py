"""Range coalescing for batched KV reads (pure, no I/O).

A batch of block locations is grouped by segment, sorted by offset and merged into as
few byte ranges as possible: records that touch or sit less than ``max_gap_bytes``
apart share one read, up to ``max_range_bytes`` a range. A prompt's blocks are appended
together, so restoring a prefix is usually one range.

``column_ranges`` does the same from ``LocatedColumns`` (the numpy columns of one key
directory probe) without a ``Location`` per block, and cuts its pieces one at a time
(``ColumnRanges.pieces``): the restore path (``DiskTier.read_into``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

from isolane.kvpool.log.keydir import LocatedColumns, Location


@dataclass(frozen=True)
class ReadRange:
    """Bytes ``[start, end)`` of one segment, holding the records of ``members``
    (``(position in the batch, location)`` pairs, in offset order)."""

    segment_id: int
    start: int
    end: int
    members: tuple[tuple[int, Location], ...]

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def coalesce_ranges(
    locations: Sequence[Location | None], *, max_gap_bytes: int = 64 << 10,
    max_range_bytes: int = 64 << 20,
) -> list[ReadRange]:
    """Merge the records of ``locations`` (None entries are skipped) into read ranges."""
    by_segment: dict[int, list[tuple[int, Location]]] = defaultdict(list)
    for position, location in enumerate(locations):
        if location is not None:
            by_segment[location.segment_id].append((position, location))
    ranges: list[ReadRange] = []
    for segment_id in sorted(by_segment):
        members = sorted(by_segment[segment_id], key=lambda m: m[1].record_offset)
        run: list[tuple[int, Location]] = []
        start = end = 0
        for member in members:
            loc = member[1]
            if run and (loc.record_offset - end <= max_gap_bytes
                        and max(end, loc.record_end) - start <= max_range_bytes):
                run.append(member)
                end = max(end, loc.record_end)
                continue
            if run:
                ranges.append(ReadRange(segment_id, start, end, tuple(run)))
            run, start, end = [member], loc.record_offset, loc.record_end
        if run:
            ranges.append(ReadRange(segment_id, start, end, tuple(run)))
    return ranges


def split_ranges(ranges: Sequence[ReadRange], piece_bytes: int) -> list[ReadRange]:
    """Cut each range between records into pieces of about ``piece_bytes`` (a record is
    never cut; a record larger than that is a piece of its own), so one restore keeps
    several reads in flight instead of one long pread."""
    pieces: list[ReadRange] = []
    for read_range in ranges:
        run: list[tuple[int, Location]] = []
        for member in read_range.members:
            if run and member[1].record_end - run[0][1].record_offset > piece_bytes:
                pieces.append(_piece(read_range.segment_id, run))
                run = []
            run.append(member)
        if run:
            pieces.append(_piece(read_range.segment_id, run))
    return pieces


def _piece(segment_id: int, run: list[tuple[int, Location]]) -> ReadRange:
    return ReadRange(segment_id, run[0][1].record_offset,
                     max(loc.record_end for _, loc in run), tuple(run))


class ColumnPiece:
    """A piece cut from ``LocatedColumns`` (``column_ranges``): bytes ``[start, end)``
    of one segment holding the records of ``positions`` (in offset order). Its
    ``members`` (``ReadRange``'s ``(position, Location)`` pairs) are built on first use,
    on the thread that reads the piece, not while the restore is being planned."""

    __slots__ = ("_cols", "_members", "end", "positions", "segment_id", "start")

    def __init__(self, segment_id: int, start: int, end: int, cols: LocatedColumns,
                 positions: npt.NDArray[np.intp]) -> None:
        self.segment_id, self.start, self.end = segment_id, start, end
        self.positions = positions
        self._cols = cols
        self._members: tuple[tuple[int, Location], ...] | None = None

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def members(self) -> tuple[tuple[int, Location], ...]:
        members = self._members
        if members is None:
            members = self._members = tuple(zip(
                self.positions.tolist(), self._cols.locations(self.positions), strict=True))
        return members


Piece: TypeAlias = ReadRange | ColumnPiece
"""What the readers (``reader.py``) read: a ``ReadRange`` or a ``ColumnPiece``."""


class ColumnRanges:
    """The read ranges of some positions of ``LocatedColumns`` (``column_ranges``), as
    index bounds into those positions sorted by (segment, offset)."""

    def __init__(self, cols: LocatedColumns, order: npt.NDArray[np.intp],
                 segment_ids: list[int], record_offsets: npt.NDArray[np.int64],
                 record_ends: npt.NDArray[np.int64], bounds: list[tuple[int, int]]) -> None:
        self.cols, self.order, self.bounds = cols, order, bounds
        self._sid, self._roff, self._rend = segment_ids, record_offsets, record_ends

    def spans(self) -> list[tuple[int, int, int]]:
        """(segment_id, start, end) of each range."""
        return [(self._sid[a], int(self._roff[a]), int(self._rend[b - 1]))
                for a, b in self.bounds]

    @property
    def nbytes(self) -> int:
        return sum(end - start for _, start, end in self.spans())

    def pieces(self, piece_bytes: int) -> Iterator[ColumnPiece]:
        """``split_ranges`` of these ranges, one piece at a time (so the first can be
        read while the others are cut)."""
        roff, rend, order = self._roff, self._rend, self.order
        for a, b in self.bounds:
            i = a
            while i < b:
                j = _greedy_end(roff, rend, i, b, piece_bytes)
                yield ColumnPiece(self._sid[i], int(roff[i]), int(rend[j - 1]), self.cols,
                                  order[i:j])
                i = j


def column_ranges(cols: LocatedColumns, positions: npt.NDArray[np.intp], *,
                  max_gap_bytes: int = 64 << 10,
                  max_range_bytes: int = 64 << 20) -> ColumnRanges:
    """``coalesce_ranges`` of ``cols`` at ``positions`` (all found), vectorised: the
    same ranges for a log's records (which never overlap), without a ``Location``."""
    order = positions[np.lexsort((cols.record_offset[positions],
                                  cols.segment_id[positions]))]
    sid = cols.segment_id[order]
    roff = cols.record_offset[order].astype(np.int64)
    rend = cols.record_end[order].astype(np.int64)
    n = len(order)
    breaks = np.flatnonzero((sid[1:] != sid[:-1])
                            | (roff[1:] - rend[:-1] > max_gap_bytes)) + 1
    bounds: list[tuple[int, int]] = []
    for a, b in zip([0, *breaks.tolist()], [*breaks.tolist(), n], strict=True):
        i = a
        while i < b:  # a run longer than max_range_bytes is cut between records
            j = _greedy_end(roff, rend, i, b, max_range_bytes)
            bounds.append((i, j))
            i = j
    return ColumnRanges(cols, order, sid.tolist(), roff, rend, bounds)


def _greedy_end(roff: npt.NDArray[Any], rend: npt.NDArray[Any], i: int, b: int,
                limit: int) -> int:
    """End index of the run from ``i`` (before ``b``) whose records end within
    ``limit`` bytes of record ``i``'s start; at least one record."""
    j = i + int(np.searchsorted(rend[i:b], int(roff[i]) + limit, side="right"))
    return max(j, i + 1)
