"""The KV pool's disk tier: the segment logs of the read group's devices (``kvpool.log``)
behind the tier seam, one ``SegmentLog`` per device.

Writes: ``put_many`` places a batch on the devices by chain segment
(``cluster.chain_segments``: a prompt's segments of ``segment_blocks`` blocks each go to
one device each, or all to the device of a given segment digest), skips keys already on
some device and appends each device's run as one batch on the put lane
(``SegmentLog.append_blocks``). A full device is logged, not raised: the cache keeps
serving, those blocks are not stored.

Reads: the keys are located in each log's key directory (one vectorised probe), their
records coalesced into byte ranges (``log.coalesce``) and cut into pieces of a few MiB
(``reader.piece_bytes_for``), each read on the read lane. ``get_many``: one pread a
piece (two gets of the same range share it), values are zero-copy views into the run.
``read_into``: one preadv a piece that scatters every value straight into its
destination tensor (``reader.scatter_piece``; a bounce tensor when the destination is
not CPU memory). ``log.reader`` checks every record (the one place reads check them)
and a damaged record is dropped from its log; a block of the wrong size for the
namespace (``block_bytes``, set by the pool once its layout is known) is dropped too.
A piece whose segment went away meanwhile (compaction) reads as a miss: the next read
locates it anew. Thread-safe.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from isolane.cluster.chain_segments import device_runs
from isolane.errors import CapacityError, IntegrityError, StorageError
from isolane.kvpool.log.coalesce import (
    Piece,
    ReadRange,
    coalesce_ranges,
    column_ranges,
    split_ranges,
)
from isolane.kvpool.log.compaction import should_compact
from isolane.kvpool.log.keydir import Location
from isolane.kvpool.log.keytable import SCALAR_BATCH
from isolane.kvpool.log.reader import (
    PieceOutcome,
    TensorTargets,
    drop_damaged,
    piece_bytes_for,
    read_piece,
    scatter_piece,
    verify_members,
)
from isolane.kvpool.log.segment_log import SegmentLog, StaleLocationError
from isolane.kvpool.tiers.base import Block, WritableTier
from isolane.lanes.scheduler import LaneHandle

log = logging.getLogger(__name__)

__all__ = ["DiskTier"]


class DiskTier(WritableTier):
    """The local devices' segment logs (see the module docstring)."""

    name = "disk"

    def __init__(self, logs: Sequence[SegmentLog], devices: Sequence[Path], *,
                 read_lane: LaneHandle, put_lane: LaneHandle, readers: int,
                 segment_blocks: int) -> None:
        self.logs = list(logs)
        self.devices = list(devices)
        self.block_bytes: int | None = None  # set by the pool once the layout is known
        self._read_lane, self._put_lane = read_lane, put_lane
        self._readers = readers
        self._segment_blocks = segment_blocks
        # Batches up to this many keys are located key by key (``plan_read``).
        self.scalar_batch = SCALAR_BATCH
        self._lock = threading.Lock()
        self._inflight: dict[tuple[int, int, int, int], Future[memoryview]] = {}

    # -- index -----------------------------------------------------------------------------
    def contains_many(self, keys: Sequence[bytes]) -> npt.NDArray[np.bool_]:
        found = np.zeros(len(keys), bool)
        for segment_log in self.logs:
            found |= segment_log.contains_many(keys)
        return found

    def __len__(self) -> int:
        return sum(len(lg) for lg in self.logs)

    @property
    def nbytes(self) -> int:
        return sum(lg.total_bytes for lg in self.logs)

    def over_budget(self, budget_bytes: int) -> bool:
        """Whether some device holds more than ``budget_bytes``."""
        return any(lg.total_bytes > budget_bytes for lg in self.logs)

    def _locate_many(self, segment_log: SegmentLog, keys: list[bytes]
                     ) -> list[Location | None]:
        """``segment_log.locate_many(keys)``, but a stored block of the wrong size (see
        ``block_bytes``) is dropped and reads as a miss."""
        locs = segment_log.locate_many(keys)
        size = self.block_bytes
        if size is None:
            return locs
        for i, loc in enumerate(locs):
            if loc is not None and loc.value_length != size:
                _drop_wrong_size(segment_log, loc.key, loc.value_length, size)
                locs[i] = None
        return locs

    # -- writes ----------------------------------------------------------------------------
    def put_many(self, keys: Sequence[bytes], values: Sequence[Block]) -> int:
        return len(self.store(keys, [memoryview(v) for v in values]))

    def store(self, keys: Sequence[bytes], views: Sequence[memoryview], *,
              chain: bytes | None = None) -> list[int]:
        """Store the blocks not on some device yet (placed as the module docstring
        says; ``chain``: the segment digest all of them belong to); the positions
        stored. Views, not copies: the log checksums and writes them before this
        returns."""
        stored: list[int] = []
        runs = ([(0, 0, len(keys))] if len(self.logs) == 1 and keys else  # no placement
                _merge_runs(device_runs(keys, len(self.logs), self._segment_blocks, chain)))
        for device, start, stop in runs:
            run_keys = [bytes(k) for k in keys[start:stop]]
            fresh = list(range(start, stop))
            local = self.contains_many(run_keys)
            if local.any():
                fresh = [start + i for i in np.flatnonzero(~local).tolist()]
                run_keys = [bytes(keys[i]) for i in fresh]
            if run_keys and self._append(device, run_keys, [views[i] for i in fresh]):
                stored += fresh
        return stored

    def _append(self, device: int, keys: list[bytes], views: list[memoryview]) -> bool:
        # One append a batch, not slices framed here while a lane thread writes the one
        # before: the lane thread needs the GIL up to its write system call, which the
        # framing holds, so the overlap buys nothing.
        try:
            self._put_lane.submit_sized(sum(v.nbytes for v in views),
                                        self.logs[device].append_blocks, keys, views).result()
        except (CapacityError, StorageError) as exc:
            log.warning("KV blocks not stored on %s: %s", self.devices[device], exc)
            return False
        return True

    def delete_many(self, keys: Sequence[bytes]) -> list[bool]:
        held = [False] * len(keys)
        for segment_log in self.logs:  # every copy goes, not only the first
            for i, key in enumerate(keys):
                held[i] = segment_log.delete(key) or held[i]
        return held

    # -- reads -------------------------------------------------------------------------------
    def get_many(self, keys: Sequence[bytes]) -> list[Block | None]:
        out: list[Block | None] = [None] * len(keys)
        for device, segment_log in enumerate(self.logs):
            todo = [i for i, v in enumerate(out) if v is None]
            locations = self._locate_many(segment_log, [bytes(keys[i]) for i in todo])
            if not any(locations):
                continue
            pieces = cut_locations(locations, self._readers)
            # The last piece on the caller's thread when the lane has room for it (no
            # hop, no future: a one-block get is one pread here), the others queued.
            futures = [(r, self._read_range(device, r)) for r in pieces[:-1]]
            last = pieces[-1]
            here = self._read_lane.call_inline(last.nbytes, read_piece, segment_log, last,
                                               ahead_ok=len(futures))
            if here is None:
                futures.append((last, self._read_range(device, last)))
            for piece, fut in futures:
                try:
                    run = fut.result()
                except StaleLocationError:
                    continue  # compacted meanwhile: the next get finds the new location
                outcome = verify_members(run, piece)
                for position, value in outcome.values.items():
                    out[todo[position]] = value  # a view into the run: no copy
                drop_damaged(segment_log, piece, outcome)
            if here is not None:  # checked and damage dropped by read_piece
                for position, value in here.value.values.items():
                    out[todo[position]] = value
        return out

    def read_into(self, keys: Sequence[bytes], dests: Sequence[torch.Tensor]) -> list[bool]:
        """Fill ``dests[i]`` with block ``keys[i]`` straight from the devices; which
        were filled. The read is planned here (``plan_read``: each key located on the first
        device that holds it, the records coalesced into pieces) and each piece handed
        to the read lane as soon as it is cut. Every piece but the last is queued (they
        run on the lane's threads meanwhile), the last one runs on the caller's thread
        when the lane has room for it; each is read and checked by ``scatter_piece``."""
        done = [False] * len(keys)
        if not keys:
            return done
        targets = TensorTargets(dests)  # made piece by piece, on the threads reading them
        futures: list[Future[PieceOutcome]] = []
        held: tuple[SegmentLog, Piece] | None = None
        here = None
        try:
            for segment_log, piece in self.plan_read([bytes(k) for k in keys]):
                if held is not None:
                    futures.append(self._read_lane.submit_sized(
                        held[1].nbytes, scatter_piece, held[0], held[1], targets))
                held = (segment_log, piece)
            if held is None:
                return done
            segment_log, last = held
            here = self._read_lane.call_inline(last.nbytes, scatter_piece, segment_log,
                                               last, targets, ahead_ok=len(futures))
            if here is None:
                futures.append(self._read_lane.submit_sized(last.nbytes, scatter_piece,
                                                            segment_log, last, targets))
        except BaseException:
            _wait(futures)  # no read may still write into the targets once this returns
            raise
        outcomes = _results(futures)
        if here is not None:
            outcomes.append(here.value)
        for outcome in outcomes:
            for i in outcome.verified:  # damaged ones: dropped by scatter_piece
                done[i] = True
        targets.copy_back(done)
        return done

    def plan_read(self, keys: list[bytes]) -> Iterator[tuple[SegmentLog, Piece]]:
        """The pieces reading ``keys``, device by device, each key from the first
        device that holds it; a piece's members are positions in ``keys``. A stored
        block of the wrong size (``block_bytes``) is dropped here and not read.

        Up to ``scalar_batch`` keys a device's keys are located and coalesced key by
        key (``Location`` objects: at 1-16 blocks a fraction of the cost of numpy
        calls on arrays of a few elements, most of a small restore's fixed cost); more
        with one vectorised probe of its key directory and ranges cut from numpy
        columns (``coalesce.column_ranges``), no object per key. Both cut the same
        pieces."""
        todo = np.ones(len(keys), bool) if len(keys) > self.scalar_batch else None
        left = list(range(len(keys)))
        for segment_log in self.logs:
            if todo is None:  # a few keys: Locations
                if not left:
                    return
                found = self._locate_many(segment_log, [keys[i] for i in left])
                mine: list[Location | None] = [None] * len(keys)
                for i, loc in zip(left, found, strict=True):
                    mine[i] = loc
                left = [i for i in left if mine[i] is None]
                yield from ((segment_log, p) for p in cut_locations(mine, self._readers))
                continue
            if not todo.any():
                return
            located = segment_log.locate_columns(keys)
            hit = located.found & todo
            if self.block_bytes is not None and hit.any():
                wrong = hit & (located.value_length != self.block_bytes)
                for i in np.flatnonzero(wrong).tolist():
                    _drop_wrong_size(segment_log, keys[i], int(located.value_length[i]),
                                     self.block_bytes)
                hit &= ~wrong
            todo &= ~hit
            positions = np.flatnonzero(hit)
            if len(positions):
                ranges = column_ranges(located, positions)
                pieces = ranges.pieces(piece_bytes_for(ranges.nbytes, self._readers))
                yield from ((segment_log, p) for p in pieces)

    def _read_range(self, device: int, read_range: ReadRange) -> Future[memoryview]:
        """One pread on the read lane; concurrent gets of the same range share it.

        The lane is entered without holding ``_lock``: submitting may wait for the lane's
        in-flight budget, and the reads that free it need ``_lock`` when they finish."""
        ident = (device, read_range.segment_id, read_range.start, read_range.end)
        with self._lock:
            shared = self._inflight.get(ident)
            if shared is not None:
                return shared
            fut: Future[memoryview] = Future()
            self._inflight[ident] = fut

        def read() -> None:
            try:
                run = self.logs[device].read_run(read_range.segment_id, read_range.start,
                                                 read_range.end)
            except BaseException as exc:
                self._drop_inflight(ident)
                fut.set_exception(exc)
            else:
                self._drop_inflight(ident)
                fut.set_result(run)

        try:
            self._read_lane.submit_sized(read_range.nbytes, read)
        except BaseException as exc:
            self._drop_inflight(ident)
            fut.set_exception(exc)
        return fut

    def _drop_inflight(self, ident: tuple[int, int, int, int]) -> None:
        with self._lock:
            self._inflight.pop(ident, None)

    # -- maintenance ---------------------------------------------------------------------------
    def verify(self) -> tuple[int, list[bytes], list[dict[str, Any]]]:
        """Read back every stored block and check it; damaged ones are dropped. Returns
        the blocks read, the keys found damaged, and the records dropped since the last
        verify (``SegmentLog.damage_report``, one dict each, then cleared)."""
        checked = 0
        damaged: list[bytes] = []
        dropped: list[dict[str, Any]] = []
        for device, segment_log in zip(self.devices, self.logs, strict=True):
            for drop in segment_log.damage_report():
                dropped.append({"device": str(device), **dataclasses.asdict(drop)})
            stored = segment_log.keys()  # a snapshot: damaged keys are deleted as we go
            for key in stored:
                try:
                    segment_log.get(key)
                except StaleLocationError:
                    continue  # compacted or evicted meanwhile
                except IntegrityError as exc:
                    log.warning("dropping damaged KV block: %s", exc)
                    segment_log.drop_damaged(key, exc)
                    damaged.append(key)
                checked += 1
            segment_log.clear_damage()
        return checked, damaged, dropped

    def compact(self, min_live_ratio: float,
                run: Callable[[Callable[[], object]], object] | None = None) -> int:
        """Compact sealed segments whose live share fell below ``min_live_ratio``, each
        through ``run`` (e.g. on the compaction lane and waited for) or in the calling
        thread; returns how many were compacted."""
        done = 0
        for segment_log in self.logs:
            for info in segment_log.segments():
                if info.state == "sealed" and should_compact(
                        info.live_bytes, info.file_bytes, min_live_ratio):
                    try:
                        job = _compact_job(segment_log, info.segment_id)
                        if run is None:
                            job()
                        else:
                            run(job)
                    except StaleLocationError:
                        continue  # compacted or evicted meanwhile by another pass
                    done += 1
        return done

    def stats(self) -> list[dict[str, Any]]:
        """Per device: blocks and bytes stored, and ``damaged``: records dropped as
        damaged (by reads or reopen scans) that no verify has reported yet."""
        return [{"device": str(d), "blocks": len(lg), "bytes": lg.total_bytes,
                 "damaged": len(lg.damage_report())}
                for d, lg in zip(self.devices, self.logs, strict=True)]

    def close(self) -> None:
        for segment_log in self.logs:
            segment_log.close()


def _drop_wrong_size(segment_log: SegmentLog, key: bytes, stored: int, size: int) -> None:
    """A stored block of another size than the namespace's: dropped (it reads as a miss)."""
    log.warning("dropping KV block %s from %s: it holds %d bytes, a block of this "
                "namespace is %d", key.hex(), segment_log.folder, stored, size)
    segment_log.delete(key)


def _results(futures: Sequence[Future[PieceOutcome]]) -> list[PieceOutcome]:
    """Each piece's outcome, in order; after every read finished, the first error is
    raised (nothing is claimed done, and no read still writes into the targets)."""
    outcomes: list[PieceOutcome] = []
    error: BaseException | None = None
    for fut in futures:
        try:
            outcomes.append(fut.result())
        except BaseException as exc:
            error = error or exc
    if error is not None:
        raise error
    return outcomes


def _wait(futures: Sequence[Future[PieceOutcome]]) -> None:
    for fut in futures:
        fut.exception()


def _compact_job(segment_log: SegmentLog, segment_id: int) -> Callable[[], object]:
    return lambda: segment_log.compact(segment_id)


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


def _merge_runs(runs: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Adjacent runs bound for the same device as one run (one append per device run:
    with one device, a whole batch is one append)."""
    merged: list[tuple[int, int, int]] = []
    for device, start, stop in runs:
        if merged and merged[-1][0] == device and merged[-1][2] == start:
            merged[-1] = (device, merged[-1][1], stop)
        else:
            merged.append((device, start, stop))
    return merged
