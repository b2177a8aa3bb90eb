"""Restore and verify: read chunks on the write lane, check every hash.

Big tensors are read straight into their final memory, one request per chunk, chunks
in parallel on the lane's threads (several in flight), each chunk hashed by the thread
that read it while the others wait on the device:

- plain loads give every big tensor page-aligned anonymous memory of its own
  (``MappedRegion``), so that local stores read it with O_DIRECT: the device writes
  into the tensor, no page cache pages are allocated, filled and copied from. A fresh
  page still costs a fault (~1.9 GB/s from one thread on the VMs measured, whatever
  the page size), so a pre-fault thread (``PREFAULT_THREADS``) walks the chunks in read
  order ahead of the readers (``MADV_POPULATE_WRITE``) and the faults overlap the reads;
- ``into`` targets are filled in place through reused staging buffers (read with
  O_DIRECT, hashed, then copied by ``memmove``: ~10 GB/s on warm memory, off the
  device's critical path while the other lane threads' reads are in flight), never
  through the page cache, and aligned targets too: the pool's buffers are huge-page
  backed, so their reads reach the device as 4 MiB requests, where a read into a
  target's 4 KiB pages goes out in ~0.5-1 MiB pieces (``storage.aligned``). A damaged
  chunk is reported before any of its bytes reach the target;
- ``mmap`` maps the chunk files (``MappedRegion.map_file``) after asking the kernel
  to read them ahead (``POSIX_FADV_WILLNEED``), so the mapping threads find the pages
  in the page cache instead of waiting for each readahead window.

Packed small tensors are read by whole pack when every tensor of the pack is wanted,
else by their own byte range; either way each byte handed back has been checked
against its xxh3-128 hash.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, wait
from typing import Any

import torch

from isolane.errors import IntegrityError
from isolane.lanes.scheduler import LaneHandle
from isolane.snapshot.chunks import chunk_hash, tensor_view
from isolane.snapshot.dtypes import as_bytes, dtype_from_name
from isolane.snapshot.manifest import ChunkRecord, Manifest, TensorRecord
from isolane.snapshot.sharding import ChunkSlice
from isolane.snapshot.staging import StagingPool
from isolane.storage.aligned import buffer_address, copy_bytes
from isolane.storage.base import BlobStore, ByteRange
from isolane.storage.mapped import PAGE, MappedRegion

Progress = Callable[[int, int], None]
# Tensors at least this big get page-aligned memory of their own on a plain load (and a
# pre-faulted, O_DIRECT read); smaller ones come from torch's allocator.
REGION_MIN_BYTES = 1 << 20
# Chunks at least this big are read through a staging buffer into an into= target (any),
# or into a misaligned one on a plain load.
BOUNCE_MIN_BYTES = 1 << 20
# Threads faulting a plain load's fresh memory in ahead of the reads. Alone, two fault
# ~3.4 GB/s against ~1.9 GB/s for one on the 2-core VM measured, but a plain load with
# two took 0.90 s against 0.74 s with one (bench_snapshot, same run): the second
# faulting thread takes the core the readers and the hashing need.
PREFAULT_THREADS = 1


def empty_tensor(record: TensorRecord) -> torch.Tensor:
    """Uninitialised CPU tensor for a record.

    Plain ``torch.empty``: huge-page advice made first touch faster on an idle machine
    but stalled for seconds in synchronous compaction once the page cache had filled
    memory (THP defrag 'madvise'), so restores do without it."""
    return torch.empty(record.shape, dtype=dtype_from_name(record.dtype))


def fresh_tensor(record: TensorRecord) -> tuple[torch.Tensor, MappedRegion | None]:
    """Uninitialised CPU tensor for a record, and the region behind it when it is big
    enough for page-aligned memory of its own (O_DIRECT reads straight into it). The
    region is unmapped when the last tensor viewing it is gone."""
    return fresh_memory(record.dtype, record.shape)


def fresh_memory(dtype_name: str, shape: tuple[int, ...]
                 ) -> tuple[torch.Tensor, MappedRegion | None]:
    """``fresh_tensor`` by dtype name and shape."""
    dtype = dtype_from_name(dtype_name)
    nbytes = dtype.itemsize
    for dim in shape:
        nbytes *= dim
    if nbytes < REGION_MIN_BYTES:
        return torch.empty(shape, dtype=dtype), None
    region = MappedRegion(nbytes)
    raw = torch.frombuffer(region.buffer(), dtype=torch.uint8)
    return _retype(raw, dtype).view(shape), region


def _retype(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bool:
        return raw.view(torch.bool)
    if dtype.is_complex:
        real = torch.float32 if dtype == torch.complex64 else torch.float64
        return torch.view_as_complex(raw.view(real).view(-1, 2))
    return raw.view(dtype)


class SnapshotReader:
    """Reads on ``lane``; ``staging`` (optional) lends the bounce buffers for targets
    that O_DIRECT cannot fill in place. Thread-safe; every call waits for its jobs."""

    def __init__(self, stores: Sequence[BlobStore], lane: LaneHandle,
                 staging: StagingPool | None = None) -> None:
        self.stores = stores
        self.lane = lane
        self.staging = staging

    def read(self, manifest: Manifest, prefix: str, ids: set[int],
             progress: Progress | None = None, *, mmap: bool = False,
             into: Mapping[int, torch.Tensor] | None = None) -> dict[int, torch.Tensor]:
        """Tensors by id. ``into`` maps ids to contiguous CPU tensors of the right
        dtype and shape that are filled in place. With ``mmap`` (local stores only),
        other big tensors whose chunks start on page boundaries are backed by private
        mappings of the chunk files."""
        into = into or {}
        records = {t.id: t for t in manifest.tensors if t.id in ids}
        chunks_of: dict[int, list[ChunkRecord]] = defaultdict(list)
        for chunk in manifest.chunks:
            if chunk.tensor is not None and chunk.tensor in records:
                chunks_of[chunk.tensor].append(chunk)
        out: dict[int, torch.Tensor] = {}
        jobs: list[tuple[int, Callable[[], None]]] = []
        fault: list[tuple[MappedRegion, int, int]] = []  # ahead of the reads, in order
        for tid, rec in records.items():
            region = (self._region(prefix, rec, chunks_of[tid])
                      if mmap and tid not in into else None)
            if tid in into:
                out[tid] = into[tid]
                reader = self._read_target
            elif region is None:
                out[tid], fresh = fresh_tensor(rec)
                reader = self._read_chunk
                if fresh is not None:
                    fault.extend((fresh, c.offset, c.nbytes) for c in chunks_of[tid])
            else:
                out[tid] = _retype(torch.frombuffer(region.buffer(), dtype=torch.uint8),
                                   dtype_from_name(rec.dtype)).view(rec.shape)
                reader = _bind_region(self._map_chunk, region)
            raw_bytes = as_bytes(out[tid])
            for chunk in chunks_of[tid]:
                jobs.append((chunk.nbytes, _bind(reader, prefix, chunk, rec, raw_bytes)))
        raw = {tid: as_bytes(t) for tid, t in out.items()}
        chunks_by_key = {c.key: c for c in manifest.chunks}
        packs: dict[str, list[TensorRecord]] = defaultdict(list)
        for rec in records.values():
            if rec.pack is not None:
                packs[rec.pack.array].append(rec)
        members: dict[str, int] = defaultdict(int)
        for t in manifest.tensors:
            if t.pack is not None:
                members[t.pack.array] += 1
        for array, recs in packs.items():
            chunk = chunks_by_key[f"{array}/c.0"]
            if len(recs) == members[array]:
                jobs.append((chunk.stored, _bind(self._read_pack, prefix, chunk, recs, raw)))
            else:
                for rec in recs:
                    jobs.append((rec.pack.nbytes if rec.pack else 0,
                                 _bind(self._read_packed, prefix, chunk, rec, raw[rec.id])))
        with prefaulted(fault, PREFAULT_THREADS):
            self._run(jobs, progress)
        return out

    def read_slices(self, prefix: str, slices: Sequence[ChunkSlice], out: torch.Tensor,
                    what: str, progress: Progress | None = None) -> None:
        """Fill the uint8 tensor ``out`` from parts of chunks; each chunk is read whole,
        because its hash covers all of it, and checked before any byte is copied."""
        def copy(piece: ChunkSlice) -> None:
            data = self._read_verified(prefix, piece.chunk, f"{what} (chunk {piece.chunk.key})")
            src = torch.frombuffer(data, dtype=torch.uint8)[piece.start:piece.stop]
            out[piece.dst_offset:piece.dst_offset + piece.stop - piece.start].copy_(src)

        self._run([(p.chunk.stored, _bind(copy, p)) for p in slices], progress)

    def verify(self, manifest: Manifest, prefix: str, progress: Progress | None = None
               ) -> None:
        """Read every stored chunk and check its size and hash; IntegrityError names it."""
        names = _chunk_owners(manifest)
        jobs = [(c.stored, _bind(self._verify_chunk, prefix, c, names[c.key]))
                for c in manifest.chunks]
        self._run(jobs, progress)

    # -- jobs ------------------------------------------------------------------------------
    def _run(self, jobs: list[tuple[int, Callable[[], None]]], progress: Progress | None
             ) -> None:
        total = sum(n for n, _ in jobs)
        done = 0
        futures: list[Future[None]] = []
        try:
            for nbytes, job in jobs:
                futures.append(self.lane.submit_sized(nbytes, job))
                if progress is not None:
                    for f in list(futures):
                        if f.done():
                            f.result()
            for fut, (nbytes, _job) in zip(futures, jobs, strict=True):
                fut.result()
                done += nbytes
                if progress is not None:
                    progress(done, total)
        finally:
            wait(futures)

    def _region(self, prefix: str, rec: TensorRecord, chunks: list[ChunkRecord]
                ) -> MappedRegion | None:
        if not chunks or any(c.offset % PAGE for c in chunks):
            return None
        if any(self.stores[c.device].local_path(f"{prefix}/{c.key}") is None for c in chunks):
            return None
        return MappedRegion(sum(c.nbytes for c in chunks))

    def _map_chunk(self, region: MappedRegion, prefix: str, chunk: ChunkRecord,
                   rec: TensorRecord, raw: torch.Tensor) -> None:
        path = self.stores[chunk.device].local_path(f"{prefix}/{chunk.key}")
        what = _what(rec, chunk)
        try:
            _read_ahead(path or "")
            region.map_file(path or "", chunk.offset, chunk.nbytes)
        except FileNotFoundError:
            raise IntegrityError(what, "chunk file is missing") from None
        except EOFError as exc:
            raise IntegrityError(what, f"chunk file is truncated: {exc}") from None
        view = tensor_view(raw[chunk.offset:chunk.offset + chunk.nbytes])
        if chunk_hash(view, chunk.stored - chunk.nbytes) != chunk.hash:
            raise IntegrityError(what, "content hash mismatch")

    def _read_chunk(self, prefix: str, chunk: ChunkRecord, rec: TensorRecord,
                    raw: torch.Tensor) -> None:
        """A chunk into ``raw`` (a plain load's memory): O_DIRECT in place when aligned,
        else through a staging buffer."""
        dst = raw[chunk.offset:chunk.offset + chunk.nbytes]
        align = self.stores[chunk.device].direct_read_align
        if align is None or buffer_address(tensor_view(dst)) % align == 0:
            self._read_straight(prefix, chunk, rec, dst)
        else:
            self._read_target(prefix, chunk, rec, raw)

    def _read_target(self, prefix: str, chunk: ChunkRecord, rec: TensorRecord,
                     raw: torch.Tensor) -> None:
        """A chunk into ``raw`` (an into= target) through a staging buffer when the store
        reads O_DIRECT and the chunk is big enough; else in place."""
        dst = raw[chunk.offset:chunk.offset + chunk.nbytes]
        store = self.stores[chunk.device]
        if (store.direct_read_align is None or self.staging is None
                or chunk.nbytes < BOUNCE_MIN_BYTES):
            self._read_straight(prefix, chunk, rec, dst)
            return
        bounce = self.staging.acquire(chunk.nbytes)
        try:
            self._fill_checked(store, prefix, chunk, bounce.view[:chunk.nbytes],
                               _what(rec, chunk))
            # memmove, not copy_: copy_ from several lane threads at once starts an
            # OpenMP team in each, which oversubscribes the cores
            copy_bytes(dst.data_ptr(), bounce.address, chunk.nbytes)
        finally:
            self.staging.release(bounce)

    def _read_straight(self, prefix: str, chunk: ChunkRecord, rec: TensorRecord,
                       dst: torch.Tensor) -> None:
        self._fill_checked(self.stores[chunk.device], prefix, chunk, tensor_view(dst),
                           _what(rec, chunk))

    @staticmethod
    def _fill_checked(store: BlobStore, prefix: str, chunk: ChunkRecord, view: memoryview,
                      what: str) -> None:
        try:
            store.read_into(f"{prefix}/{chunk.key}", view)
        except EOFError as exc:
            raise IntegrityError(what, f"chunk file is truncated: {exc}") from None
        except FileNotFoundError:
            raise IntegrityError(what, "chunk file is missing") from None
        if chunk_hash(view, chunk.stored - chunk.nbytes) != chunk.hash:
            raise IntegrityError(what, "content hash mismatch")

    def _read_pack(self, prefix: str, chunk: ChunkRecord, recs: list[TensorRecord],
                   raw: Mapping[int, torch.Tensor]) -> None:
        data = self._read_verified(prefix, chunk, ", ".join(f"'{r.key}'" for r in recs[:3]))
        for rec in recs:
            assert rec.pack is not None
            if rec.pack.nbytes:
                src = torch.frombuffer(data, dtype=torch.uint8, count=rec.pack.nbytes,
                                       offset=rec.pack.offset)
                raw[rec.id].copy_(src)

    def _read_packed(self, prefix: str, chunk: ChunkRecord, rec: TensorRecord,
                     raw: torch.Tensor) -> None:
        assert rec.pack is not None
        if not rec.pack.nbytes:
            return
        try:
            data = self.stores[chunk.device].read(
                f"{prefix}/{chunk.key}",
                ByteRange(rec.pack.offset, rec.pack.offset + rec.pack.nbytes))
        except FileNotFoundError:
            raise IntegrityError(f"tensor '{rec.key}'", f"pack {chunk.key} is missing") from None
        if len(data) != rec.pack.nbytes or chunk_hash(memoryview(data)) != rec.pack.hash:
            raise IntegrityError(f"tensor '{rec.key}'", f"content hash mismatch in {chunk.key}")
        raw.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def _read_verified(self, prefix: str, chunk: ChunkRecord, what: str) -> bytearray:
        try:
            data = bytearray(self.stores[chunk.device].read(f"{prefix}/{chunk.key}"))
        except FileNotFoundError:
            raise IntegrityError(what, f"chunk file {chunk.key} is missing") from None
        if len(data) != chunk.stored:
            raise IntegrityError(what, f"chunk {chunk.key} holds {len(data)} bytes, "
                                 f"expected {chunk.stored}")
        if chunk_hash(memoryview(data)) != chunk.hash:
            raise IntegrityError(what, f"content hash mismatch in {chunk.key}")
        return data

    def _verify_chunk(self, prefix: str, chunk: ChunkRecord, what: str) -> None:
        self._read_verified(prefix, chunk, what)


@contextlib.contextmanager
def prefaulted(parts: Sequence[tuple[MappedRegion, int, int]], threads: int = 1) -> Any:
    """Fault in the parts of fresh regions in ``threads`` threads of their own
    (thread k takes parts k, k + threads, ...; plain loads use ``PREFAULT_THREADS``), in the
    order the reads need them, while the block runs; stops early when the block ends (a
    failed read) and waits for the threads before returning."""
    if not parts:
        yield
        return
    stop = threading.Event()

    def run(first: int, step: int) -> None:
        for region, offset, length in parts[first::step]:
            if stop.is_set() or not region.populate(offset, length):
                return  # done early, or no MADV_POPULATE_WRITE: reads fault instead

    count = max(1, min(threads, len(parts)))
    workers = [threading.Thread(target=run, args=(k, count), name="isolane-prefault",
                                daemon=True) for k in range(count)]
    for worker in workers:
        worker.start()
    try:
        yield
    finally:
        stop.set()
        for worker in workers:
            worker.join()


def _read_ahead(path: str) -> None:
    """Start reading the whole file into the page cache (async readahead)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # map_file reports the missing file
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
    finally:
        os.close(fd)


def _what(rec: TensorRecord, chunk: ChunkRecord) -> str:
    return f"tensor '{rec.key}' (chunk {chunk.key})"


def _bind(fn: Callable[..., None], *args: object) -> Callable[[], None]:
    return lambda: fn(*args)


def _bind_region(fn: Callable[..., None], region: MappedRegion) -> Callable[..., None]:
    return lambda *args: fn(region, *args)


def _chunk_owners(manifest: Manifest) -> dict[str, str]:
    names: dict[str, list[str]] = defaultdict(list)
    for chunk in manifest.chunks:
        if chunk.tensor is not None:
            names[chunk.key].append(next(t.key for t in manifest.tensors if t.id == chunk.tensor))
    for t in manifest.tensors:
        if t.pack is not None:
            names[f"{t.pack.array}/c.0"].append(t.key)
    return {c.key: "tensor " + ", ".join(f"'{k}'" for k in names[c.key][:3]) +
            (" ..." if len(names[c.key]) > 3 else "") + f" (chunk {c.key})"
            for c in manifest.chunks}
