"""Coalesced KV reads of the segment log, each record checked before it is returned.

A batch of block locations is coalesced (``coalesce.py``) and cut into pieces of a few
MiB; each piece is one read on the caller's thread (a lane thread of the pool):

* ``read_piece``: one ``pread`` of the piece; every member's value is checked in the
  run (``records.verify_record``) and returned as a zero-copy view into it.
* ``scatter_piece``: one ``preadv`` that scatters every record's value straight into
  its destination (the block's slice of the caller's tensor) and its header into a
  small buffer, then checks the record there (xxh3 over the parts). No intermediate
  buffer and no copy: the bytes land where the caller wants them. When the log reads
  the piece with O_DIRECT (``direct_io``: a ``cold`` log's piece that is not in the
  page cache, see ``segment_log``), it is read into a reused page-aligned buffer
  (``BOUNCES``) instead, each record checked there and its value copied out: the
  values do not sit on the page grid O_DIRECT needs, and a cold piece read that way
  is about twice as fast here as through the kernel's read-ahead, copy included. The
  lane thread that reads a piece also checks and copies it: handing the checks to the
  restoring thread was measured no faster (docs/BENCHMARKS.md, KV prompt restores).

This is the one place a batched read checks records: a damaged record is dropped from
the log here (``SegmentLog.drop_damaged``: deleted and added to the damage report) and
reported in ``PieceOutcome.damaged``; callers only forget copies in their other tiers.
A piece whose segment went away meanwhile (compaction, eviction) comes back ``stale``:
locate its keys again. ``verify_members`` is the check alone, for runs read elsewhere
(e.g. downloaded from the capacity tier).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from isolane.kvpool.log.coalesce import Piece
from isolane.kvpool.log.keydir import Location
from isolane.kvpool.log.records import RecordIntegrityError, verify_parts, verify_record
from isolane.kvpool.log.segment_files import StaleLocationError
from isolane.kvpool.log.segment_log import COLD_DIRECT_MIN_BYTES, SegmentLog, direct_span
from isolane.storage.aligned import AlignedBuffer, advise_hugepages, zero_bytes

log = logging.getLogger(__name__)

MiB = 1 << 20
MIN_PIECE_BYTES = MiB  # smaller pieces measured slower on cold reads here
MAX_PIECE_BYTES = 8 * MiB
MIN_CHUNK_BYTES = 4096  # scattering smaller runs costs more in iovecs than a bounce copy
MAX_CHUNKS = 1 << 16
BOUNCE_BYTES = MAX_PIECE_BYTES + 2 * 4096  # the largest piece, widened to pages
BOUNCE_STEP = MiB  # bounce sizes are whole MiB: a few sizes, each reused
BOUNCES_KEPT = 8  # a lane's threads plus callers reading inline


class BouncePool:
    """Page-aligned buffers for O_DIRECT reads that are copied out, in whole MiB up to
    ``BOUNCE_BYTES``, every page touched once when made (fresh pages fault at ~0.5 GB/s
    here) and kept for reuse: at most ``kept`` of them, the largest. Thread-safe."""

    def __init__(self, kept: int = BOUNCES_KEPT, *, huge_pages: bool = True) -> None:
        self._kept = kept
        self._huge = huge_pages
        self._free: list[AlignedBuffer] = []  # by capacity, smallest first
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> AlignedBuffer:
        """A buffer of at least ``nbytes`` (at most ``BOUNCE_BYTES``)."""
        with self._lock:
            for i, buf in enumerate(self._free):
                if buf.capacity >= nbytes:
                    return self._free.pop(i)
        buf = AlignedBuffer(-(-nbytes // BOUNCE_STEP) * BOUNCE_STEP)
        if self._huge:
            advise_hugepages(buf)
        zero_bytes(buf.address, buf.capacity)
        return buf

    def give(self, buf: AlignedBuffer) -> None:
        with self._lock:
            self._free.append(buf)
            self._free.sort(key=lambda b: b.capacity)
            dropped = self._free[:-self._kept] if len(self._free) > self._kept else []
            del self._free[:len(dropped)]
        for old in dropped:
            old.close()


BOUNCES = BouncePool()


def piece_bytes_for(total_bytes: int, readers: int) -> int:
    """Piece size that gives each of ``readers`` threads about two reads in flight,
    about [1 MiB, 8 MiB]: small pieces keep the device queue full on short restores,
    large ones keep the per-read cost low on long ones. The total is cut into a whole
    number of equal pieces (rounded to the nearest count): pieces of exactly the target
    size would leave a small last piece of the few records past a power of two (16
    records of 64 KiB blocks are just over 1 MiB), one job more than the lane has
    threads, read in a second round."""
    target = max(MIN_PIECE_BYTES, min(MAX_PIECE_BYTES, total_bytes // max(1, 2 * readers)))
    count = max(1, round(total_bytes / target))
    while -(-total_bytes // count) > MAX_PIECE_BYTES:
        count += 1
    return target if total_bytes <= target else -(-total_bytes // count)


@dataclass
class PieceOutcome:
    """What one piece read produced, by position in the batch: the members whose record
    checked out (``values``: their values, for ``read_piece``; ``scatter_piece`` wrote
    them into the targets), those found damaged (already dropped from the log), or
    ``stale`` when the segment went away before the read (nothing was read). A file
    shorter than its index raises ``RecordIntegrityError`` from the read itself."""

    verified: list[int] = field(default_factory=list)
    damaged: list[tuple[int, RecordIntegrityError]] = field(default_factory=list)
    stale: bool = False  # the segment went away (compaction, eviction): re-locate
    values: dict[int, memoryview] = field(default_factory=dict)


def verify_members(run: memoryview, piece: Piece) -> PieceOutcome:
    """Check every member of ``piece`` in ``run`` (the bytes ``[piece.start,
    piece.end)`` of its segment, however they were read): the values of those that
    check out, as zero-copy views into ``run``, and the damaged ones (pure: nothing is
    dropped here)."""
    outcome = PieceOutcome()
    for position, loc in piece.members:
        try:
            outcome.values[position] = verify_record(run, piece.start, loc)
        except RecordIntegrityError as exc:
            outcome.damaged.append((position, exc))
        else:
            outcome.verified.append(position)
    return outcome


def read_piece(segment_log: SegmentLog, piece: Piece) -> PieceOutcome:
    """Read ``piece`` with one ``pread`` and check each member's record; damaged ones
    are dropped from ``segment_log`` (see the module docstring)."""
    try:
        run = segment_log.read_run(piece.segment_id, piece.start, piece.end)
    except StaleLocationError:
        return PieceOutcome(stale=True)
    outcome = verify_members(run, piece)
    drop_damaged(segment_log, piece, outcome)
    return outcome


def drop_damaged(segment_log: SegmentLog, piece: Piece, outcome: PieceOutcome) -> None:
    """Drop from ``segment_log`` each record of ``piece`` that ``outcome`` found damaged
    (logged, and named in the log's damage report)."""
    if not outcome.damaged:
        return
    keys = dict(piece.members)
    for position, exc in outcome.damaged:
        log.warning("dropping damaged KV block: %s", exc)
        segment_log.drop_damaged(keys[position].key, exc)


def scatter_piece(segment_log: SegmentLog, piece: Piece,
                  targets: Mapping[int, Sequence[memoryview]]) -> PieceOutcome:
    """Read ``piece`` with one ``preadv`` (per 512 buffers): each member's value into
    ``targets[position]`` (byte views whose lengths sum to the value's length), headers,
    padding and gaps into scratch; then verify each record. A piece the log reads with
    O_DIRECT goes through a bounce buffer instead (see the module docstring). Damaged
    ones are dropped from ``segment_log`` (see the module docstring); a target of a
    damaged or stale member holds garbage."""
    if may_read_direct(segment_log, piece):
        outcome = _scatter_direct(segment_log, piece, targets)
        if outcome is not None:
            return outcome
    return _scatter_buffered(segment_log, piece, targets)


def may_read_direct(segment_log: SegmentLog, piece: Piece) -> bool:
    """Whether ``scatter_piece`` may read ``piece`` O_DIRECT (by its size and the log's
    ``direct_io``; a ``cold`` log still asks the page cache at the read)."""
    mode = segment_log.direct_io
    return (mode != "off" and direct_span(piece.start, piece.end) <= BOUNCE_BYTES
            and (mode != "cold" or piece.nbytes >= COLD_DIRECT_MIN_BYTES))


def _scatter_direct(segment_log: SegmentLog, piece: Piece,
                    targets: Mapping[int, Sequence[memoryview]]) -> PieceOutcome | None:
    """``piece`` read O_DIRECT into a bounce buffer, each record checked there (xxh3,
    without the GIL) and its value copied into its targets; a damaged one's targets are
    left as they were. None when the log found the piece in the page cache: read it
    through the cache then."""
    bounce = BOUNCES.take(direct_span(piece.start, piece.end))
    try:
        try:
            run = segment_log.read_direct(piece.segment_id, piece.start, piece.end,
                                          bounce.view)
        except StaleLocationError:
            return PieceOutcome(stale=True)
        if run is None:
            return None
        for position, loc in piece.members:
            _check_target(targets[position], loc)
        outcome = _copy_out(run, piece, targets)
        del run  # before the bounce goes back for reuse
    finally:
        BOUNCES.give(bounce)
    drop_damaged(segment_log, piece, outcome)
    return outcome


def _scatter_buffered(segment_log: SegmentLog, piece: Piece,
                      targets: Mapping[int, Sequence[memoryview]]) -> PieceOutcome:
    buffers: list[memoryview | bytearray] = []
    checks: list[tuple[int, Location, bytearray, Sequence[memoryview]]] = []
    cursor = piece.start
    for position, loc in piece.members:  # every target checked before the read
        parts = targets[position]  # asked once: the check below reuses it
        _check_target(parts, loc)
        if loc.record_offset > cursor:
            buffers.append(bytearray(loc.record_offset - cursor))  # a gap between records
        head = bytearray(loc.value_offset - loc.record_offset)
        checks.append((position, loc, head, parts))
        buffers.append(head)
        buffers.extend(parts)
        if loc.record_end > loc.value_end:
            buffers.append(bytearray(loc.record_end - loc.value_end))  # alignment padding
        cursor = loc.record_end
    outcome = PieceOutcome()
    try:
        segment_log.read_scatter(piece.segment_id, piece.start, buffers)
    except StaleLocationError:
        outcome.stale = True
        return outcome
    for position, loc, head, parts in checks:
        try:
            verify_parts(head, parts, loc)
        except RecordIntegrityError as exc:
            outcome.damaged.append((position, exc))
        else:
            outcome.verified.append(position)
    drop_damaged(segment_log, piece, outcome)
    return outcome


def _check_target(parts: Sequence[memoryview], loc: Location) -> None:
    held = sum(map(len, parts))
    if held != loc.value_length:
        raise ValueError(f"destination of KV block {loc.key.hex()} holds {held} bytes, "
                         f"the block {loc.value_length}")


def _copy_out(run: memoryview, piece: Piece,
              targets: Mapping[int, Sequence[memoryview]]) -> PieceOutcome:
    outcome = PieceOutcome()
    for position, loc in piece.members:
        try:
            value = verify_record(run, piece.start, loc)
        except RecordIntegrityError as exc:
            outcome.damaged.append((position, exc))
            continue
        at = 0
        for part in targets[position]:  # right after the check: the value is in cache
            part[:] = value[at:at + len(part)]
            at += len(part)
        outcome.verified.append(position)
    return outcome


class TensorTargets(Mapping[int, Sequence[memoryview]]):
    """The byte views of destination tensors, ``targets`` for ``scatter_piece``: made
    when a piece first asks for them (on the lane thread that reads it, so the
    per-block work overlaps the other pieces' reads, not the start of the restore),
    each kept once made. A destination that is not CPU memory, or too fragmented to
    scatter into, gets a bounce tensor; ``copy_back`` copies the done ones into place.
    Each position is read by one piece, so threads never share a position."""

    def __init__(self, dests: Sequence[torch.Tensor]) -> None:
        self._dests = dests
        self._views: dict[int, list[memoryview]] = {}
        self._bases: dict[int, memoryview] = {}  # one view per storage, not one per block
        self._bounce: dict[int, torch.Tensor] = {}
        # Blocks of one tensor at one stride (``api.BlockViews.strided``): each block's
        # views are block 0's moved by its steps, memoryview slices with no torch call.
        # Torch calls from the read lane's threads at once took ~0.25 ms a block here
        # (against ~8 µs on one thread), so these are made without any.
        # Made by the first block asked for (a reading thread, after the first read is
        # issued); threads racing there make the same layout.
        self.strided: tuple[memoryview, tuple[int, ...], int, int] | None = None
        self._uniform: Any = getattr(dests, "strided", None)  # None: per-block views

    def __getitem__(self, position: int) -> list[memoryview]:
        views = self._views.get(position)
        if views is None:
            views = self._views[position] = self._make(position)
        return views

    def _make(self, position: int) -> list[memoryview]:
        uniform = self._uniform
        if self.strided is None and uniform is not None:
            layout = _strided_layout(uniform())
            if layout is None:
                self._uniform = None  # block 0 is not scattered into: per-block views
            self.strided = layout
        if self.strided is not None:
            whole, offsets, chunk, step = self.strided
            at = position * step
            return [whole[at + o:at + o + chunk] for o in offsets]
        dest = self._dests[position]
        base = None
        if dest.device.type == "cpu":
            ptr = dest.untyped_storage().data_ptr()
            base = self._bases.get(ptr)
            if base is None:
                base = self._bases.setdefault(ptr, storage_bytes(dest))
        chunks = tensor_chunks(dest, base)
        if chunks is None:  # not CPU memory, or too fragmented: read, then copy
            bounce = self._bounce[position] = torch.empty(dest.shape, dtype=dest.dtype)
            chunks = tensor_chunks(bounce) or []
        return chunks

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self._dests)))

    def __len__(self) -> int:
        return len(self._dests)

    def copy_back(self, done: Sequence[bool]) -> None:
        """Copy the bounce tensors of the positions ``done`` into their destinations."""
        for position, tensor in self._bounce.items():
            if done[position]:
                self._dests[position].copy_(tensor)


def _strided_layout(uniform: tuple[torch.Tensor, tuple[int, ...], int] | None
                    ) -> tuple[memoryview, tuple[int, ...], int, int] | None:
    """(storage bytes, block 0's chunk offsets in them, bytes a chunk, bytes a block
    step) of ``BlockViews.strided``; None when block 0 is not one ``tensor_chunks``
    scatters into (not CPU memory, too fragmented: per-block targets then)."""
    if uniform is None:
        return None
    tensor, block_shape, step = uniform
    layout = _scatter_layout(tensor, block_shape)
    if layout is None:
        return None
    offsets, chunk = layout
    start = int(tensor.storage_offset()) * tensor.element_size()
    return storage_bytes(tensor), tuple(start + o for o in offsets), chunk, step


def storage_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of the whole storage under CPU tensor ``t``.

    A ctypes array over the storage's memory that holds the storage object (so the
    view keeps the memory alive, as a tensor would): ~0.7 µs, against ~3 µs for a
    uint8 tensor ``set_`` to the storage and its ``numpy()``."""
    storage = t.untyped_storage()
    nbytes = storage.nbytes()
    if not nbytes:
        return memoryview(bytearray())
    raw = (ctypes.c_char * nbytes).from_address(storage.data_ptr())
    raw._isolane_storage = storage  # type: ignore[attr-defined]  # kept alive with it
    return memoryview(raw).cast("B")


def tensor_chunks(t: torch.Tensor, base: memoryview | None = None) -> list[memoryview] | None:
    """Writable byte views of ``t``'s memory, one per contiguous run, in ``t``'s
    row-major element order (the order a ``.contiguous()`` copy stores them); None when
    ``t`` is not on the CPU or its runs are too small or too many to scatter into.
    ``base``: ``storage_bytes`` of ``t`` (or of a tensor sharing its storage), to skip
    building it again for each block of one destination tensor."""
    layout = _scatter_layout(t)
    if layout is None:
        return None
    offsets, chunk = layout
    if base is None:
        base = storage_bytes(t)
    start = t.storage_offset() * t.element_size()
    return [base[start + o:start + o + chunk] for o in offsets]


def _scatter_layout(t: torch.Tensor, shape: tuple[int, ...] | None = None
                    ) -> tuple[tuple[int, ...], int] | None:
    """``chunk_layout`` of ``t``'s memory (``shape``: of ``t``'s memory cut to that
    shape, same strides and offset), or None when it is not plain CPU memory to
    scatter bytes into (another device, empty, or a lazy conjugate or negation)."""
    if not t.is_cpu or t.is_conj() or t.is_neg():
        return None
    shape = tuple(t.shape) if shape is None else shape
    if 0 in shape:
        return None
    return chunk_layout(shape, t.stride(), t.element_size())


@functools.lru_cache(maxsize=64)  # the blocks of one restore share one layout
def chunk_layout(shape: tuple[int, ...], strides: tuple[int, ...],
                 element_size: int) -> tuple[tuple[int, ...], int] | None:
    """(byte offsets of the contiguous runs of a strided view, bytes a run), or None
    when the runs are too small or too many to be worth scattering into (pure)."""
    inner, k = 1, len(shape)
    while k > 0 and (shape[k - 1] == 1 or strides[k - 1] == inner):
        inner *= shape[k - 1]
        k -= 1
    count = math.prod(shape[:k])
    if count > MAX_CHUNKS or (count > 1 and inner * element_size < MIN_CHUNK_BYTES):
        return None
    offsets = [0]
    for dim_size, stride in zip(shape[:k], strides[:k], strict=True):
        step = stride * element_size
        offsets = [o + i * step for o in offsets for i in range(dim_size)]
    return tuple(offsets), inner * element_size
