"""Execute a SavePlan: stage, hash, link-or-write chunks on the write lane, then commit.

Order of a save (each step finishes before the next starts; an async save copies its
tensors into staging meanwhile, from the start):

1. ``_writing.json`` marker on device 0 (``catalog.mark_writing``: tells GC a live
   writer owns this generation);
2. zarr metadata for groups and arrays (buffered, fsynced in step 4);
3. every chunk: hashed (xxh3-128) and either hard-linked / server-side-copied from the
   parent snapshot when the parent holds the same bytes on the same device, or copied
   into an aligned staging buffer and written (O_DIRECT, not yet fsynced:
   ``DEFER_CHUNK_FSYNC``); links and writes run on the write lane's threads, the copies
   and hashes of a sync save on stager threads ahead of them (``STAGE_AHEAD``);
4. fsync of chunk files, metadata files and every folder written, on every device
   (several at a time, so the journal commits them in batches);
5. the manifest ``isolane.json``, written atomically by ``SaveRequest.commit`` under the
   name's commit lock: the commit point;
6. removal of the marker.

A failure anywhere before step 5 leaves an uncommitted generation that readers never
see; the request's ``discard`` (the save transaction's) removes it at once when
possible, GC sweeps what it could not remove.

In async mode the driver copies every chunk into staging before ``staged`` is set, so
the caller may mutate its tensors as soon as ``save_async`` returns; the staging budget
bounds that memory and makes the copy loop wait for writes (back-pressure).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from queue import SimpleQueue

import torch

from isolane.errors import IsolaneError, WireFormatError
from isolane.lanes.scheduler import LaneHandle
from isolane.snapshot.chunks import (
    Hashed,
    contiguous_bytes,
    fill_chunk,
    source_hash,
    stage_ahead,
    staged_hashes,
)
from isolane.snapshot.dtypes import zarr_dtype
from isolane.snapshot.feed import ChunkFeed
from isolane.snapshot.manifest import (
    MANIFEST,
    ChunkRecord,
    Manifest,
    PackRef,
    SnapshotStats,
    TensorRecord,
    zarr_array_meta,
    zarr_group_meta,
)
from isolane.snapshot.marker import mark_writing, unmark_writing
from isolane.snapshot.plan import ChunkPlan, SavePlan, interleave_by_device
from isolane.snapshot.resident import RESIDENT
from isolane.snapshot.staging import StagingPool
from isolane.snapshot.tree import Json, TensorLeaf, dotted_key
from isolane.storage.aligned import AlignedBuffer
from isolane.storage.base import BlobStore

Progress = Callable[[int, int], None]
# Threads that copy an async save's tensors into staging while the caller waits.
COPY_THREADS = 2
# Chunk files are fsynced together in step 4 (the journal commits them in a few
# batches) instead of one by one by the thread that wrote each.
DEFER_CHUNK_FSYNC = True
# A sync save copies and hashes each chunk on STAGE_THREADS threads of its own, ahead of
# the write lane, whose threads then only link or write: their writes stay in flight
# while the next chunks are copied (with copies on the lane's threads, 2 cores shared by
# 4 of them, the device idled for a quarter of the save). At most ``threads of the lane
# + 2 * STAGE_THREADS`` staging buffers per save. False: each lane thread hashes, copies
# and writes its own chunk (the A/B).
STAGE_AHEAD = True
STAGE_THREADS = 2


@dataclass(frozen=True)
class ParentChunk:
    device: int
    key: str
    stored: int


@dataclass(frozen=True)
class SaveRequest:
    name: str
    generation: str
    prefix: str  # "snapshots/<name>/<generation>"
    plan: SavePlan
    tree: Json
    leaves: Sequence[TensorLeaf]
    metadata: dict[str, object]
    parent: dict[str, str] | None
    parent_chunks: Mapping[str, ParentChunk]  # by content hash
    stage_all: bool  # async: copy everything before returning
    # Chunk key -> hash for chunks known unchanged without reading them
    # (change_detection="version"); only listed when the parent can link them.
    known_hashes: Mapping[str, str] = field(default_factory=dict)
    # A rank of a multi-rank save writes its partial manifest here instead; rank 0
    # commits the merged one.
    manifest_key: str = MANIFEST
    # Chunks arrive from a producer instead of ``leaves`` (whose tensors then only give
    # dtypes and shapes): ``isolane.snapshot.feed``.
    feed: ChunkFeed | None = None
    # The commit step (``Catalog.commit``: checks the name under its lock, writes the
    # manifest); None writes ``manifest_key`` as it is (a rank's part).
    commit: Callable[[Manifest], Manifest] | None = None
    # Removes what a failed save wrote (``SaveTransaction.discard``), before the job's
    # future reports the failure.
    discard: Callable[[], None] | None = None


@dataclass(frozen=True)
class ChunkResult:
    record: ChunkRecord
    piece_hashes: dict[int, str]  # tensor id -> hash of its bytes, for packed tensors


# The driver's submit(chunk, staged, expected=None, hashed=None): queues the chunk's
# job on the write lane; None once the save failed (the buffer went back to staging).
Submit = Callable[..., "Future[ChunkResult] | None"]


def _record(chunk: ChunkPlan, digest: str, *, linked: bool) -> ChunkRecord:
    piece = chunk.pieces[0]
    if chunk.is_pack:
        return ChunkRecord(key=chunk.key, device=chunk.device, stored=chunk.stored_nbytes,
                           hash=digest, nbytes=chunk.stored_nbytes, linked=linked)
    return ChunkRecord(key=chunk.key, device=chunk.device, stored=chunk.stored_nbytes,
                       hash=digest, tensor=piece.tensor_id, offset=piece.src_offset,
                       nbytes=piece.nbytes, linked=linked)


class SaveJob:
    """One save in flight. ``staged`` is set once the caller's tensors may change."""

    def __init__(self) -> None:
        self.staged = threading.Event()
        self.future: Future[Manifest] = Future()


class SnapshotWriter:
    def __init__(
        self, stores: Sequence[BlobStore], lane: LaneHandle, staging: StagingPool
    ) -> None:
        self.stores = stores
        self.lane = lane
        self.staging = staging

    def start(self, request: SaveRequest, progress: Progress | None = None) -> SaveJob:
        job = SaveJob()
        # Resident threads, not a fresh one per save: see isolane.snapshot.resident.
        RESIDENT.submit(self._drive, request, job, progress, what=f"save of {request.name}")
        return job

    # -- driver ---------------------------------------------------------------------------
    def _drive(self, req: SaveRequest, job: SaveJob, progress: Progress | None) -> None:
        started = time.perf_counter()
        try:
            manifest = self._save(req, job, progress, started)
        except BaseException as exc:
            job.staged.set()
            if req.discard is not None:
                req.discard()
            job.future.set_exception(exc)
        else:
            job.future.set_result(manifest)

    def _save(self, req: SaveRequest, job: SaveJob, progress: Progress | None,
              started: float) -> Manifest:
        primary = self.stores[0]
        meta_files: dict[int, list[str]] = {}

        def prepare() -> None:  # steps 1 and 2, before any chunk file is written
            mark_writing(primary, req.prefix)
            meta_files.update(self._write_zarr_metadata(req))

        # An async save of local tensors leaves steps 1 and 2 to the feeder thread, so
        # the caller does not wait for their fsyncs; every other save does them here.
        staging_copies = req.stage_all and req.feed is None
        if not staging_copies:
            prepare()
        tensors = {leaf.id: contiguous_bytes(leaf.tensor) for leaf in req.leaves}
        total = sum(c.data_nbytes for c in req.plan.chunks)
        futures: list[Future[ChunkResult]] = []
        done_bytes = 0
        lock = threading.Lock()

        def report(fut: Future[ChunkResult]) -> None:
            nonlocal done_bytes
            if progress is not None and not fut.cancelled() and not fut.exception():
                with lock:  # one call at a time, so callbacks need no locking of their own
                    done_bytes += fut.result().record.nbytes
                    progress(min(done_bytes, total), total)

        failed = threading.Event()

        def submit(chunk: ChunkPlan, staged: AlignedBuffer | None,
                   expected: str | None = None, hashed: Hashed | None = None
                   ) -> Future[ChunkResult] | None:
            if failed.is_set():
                if staged is not None:
                    self.staging.release(staged)
                return None
            fut = self.lane.submit_sized(chunk.stored_nbytes, self._chunk_job, req, chunk,
                                         tensors, staged, expected, hashed)
            fut.add_done_callback(lambda f: _flag_failure(f, failed, req.feed))
            fut.add_done_callback(report)
            futures.append(fut)
            return fut

        # Async: copies must not wait for the write lane's in-flight budget, only for
        # staging memory, so a second thread feeds the lane while this one copies.
        # Then every chunk reaches the lane through the feeder, after the marker.
        queue: SimpleQueue[tuple[ChunkPlan, AlignedBuffer | None] | None] = SimpleQueue()
        errors: list[BaseException] = []

        # Writes start once everything is staged, or as soon as staging is full: copies
        # then run alone (memory bandwidth and both cores), which is what the caller
        # waits for; total time grows by the copy, ~20 GB/s on warm buffers.
        start_writes = threading.Event()

        def feed_lane() -> None:
            if staging_copies:
                try:
                    prepare()
                except BaseException as exc:
                    errors.append(exc)
                    failed.set()  # the driver stops copying; submit() releases the rest
            start_writes.wait()
            while (item := queue.get()) is not None:
                submit(*item)

        feeder: Future[None] | None = None
        if req.stage_all:
            feeder = RESIDENT.submit(feed_lane, what=f"feed of {req.name}")
        copies: list[ChunkPlan] = []
        if req.feed is not None:
            self._consume(req, req.feed, submit, failed, futures)
        else:
            copies = interleave_by_device(req.plan.chunks, len(self.stores))
        # Async staging copies run on COPY_THREADS threads (memmove, GIL released); this
        # thread takes the buffers in order, so back-pressure works as with one copier.
        copiers = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="isolane-stage") \
            if staging_copies else None

        def stage(chunk: ChunkPlan, staged: AlignedBuffer) -> None:
            try:
                fill_chunk(staged, chunk, tensors)
            except BaseException as exc:
                self.staging.release(staged)
                errors.append(exc)
                failed.set()
                return
            queue.put((chunk, staged))

        ahead = STAGE_AHEAD and not req.stage_all and req.feed is None
        try:
            if ahead:
                for chunk in copies:
                    if chunk.key in req.known_hashes:
                        submit(chunk, None)
                stage_ahead([c for c in copies if c.key not in req.known_hashes], tensors,
                            self.staging, threads=STAGE_THREADS,
                            window=self.lane.threads + 2 * STAGE_THREADS,
                            linkable=(lambda c, d: self._linkable(req, c, d) is not None)
                            if req.parent_chunks else None,
                            submit=lambda c, b, h: submit(c, b, None, h),
                            failed=failed, errors=errors)
                copies = []
            for chunk in copies:
                if failed.is_set():
                    break
                if copiers is None:
                    submit(chunk, None)
                    continue
                if chunk.key in req.known_hashes:
                    queue.put((chunk, None))
                    continue
                if self.staging.exhausted(chunk.stored_nbytes):
                    start_writes.set()
                staged = self.staging.acquire(chunk.stored_nbytes)
                copiers.submit(stage, chunk, staged)
        finally:
            if copiers is not None:
                copiers.shutdown(wait=True)  # every copy done before the caller goes on
            job.staged.set()
            start_writes.set()
            if feeder is not None:
                queue.put(None)
                feeder.result()
        wait(futures)
        if errors:
            raise errors[0]
        for fut in futures:
            if fut.exception() is not None:
                raise fut.exception()  # type: ignore[misc]
        results = [f.result() for f in futures]
        order = {c.key: i for i, c in enumerate(req.plan.chunks)}
        records = sorted((r.record for r in results), key=lambda r: order[r.key])
        piece_hashes = {tid: h for r in results for tid, h in r.piece_hashes.items()}
        written: dict[int, list[str]] = {}
        if DEFER_CHUNK_FSYNC:
            for record in records:
                if not record.linked:
                    written.setdefault(record.device, []).append(f"{req.prefix}/{record.key}")
        self._sync(req, meta_files, written)
        logical = sum(t.numel() for t in tensors.values())
        manifest = self._manifest(req, records, piece_hashes, logical,
                                  time.perf_counter() - started)
        if req.commit is not None:
            manifest = req.commit(manifest)
        else:
            primary.write_atomic(f"{req.prefix}/{req.manifest_key}", manifest.to_json())
        unmark_writing(primary, req.prefix)
        return manifest

    def _consume(self, req: SaveRequest, feed: ChunkFeed,
                 submit: Submit,
                 failed: threading.Event, futures: list[Future[ChunkResult]]) -> None:
        """Submit every chunk the producer feeds; all of the plan's, each once."""
        expected = {c.key for c in req.plan.chunks}
        seen: set[str] = set()
        try:
            for item in feed:
                key = item.chunk.key
                if key in seen or key not in expected:
                    if item.staged is not None:
                        self.staging.release(item.staged)
                    raise WireFormatError(f"chunk {key} of '{req.name}' was sent twice or "
                                          "is not in the plan; nothing was committed")
                seen.add(key)
                submit(item.chunk, item.staged, item.digest)
                if failed.is_set():
                    break
            if not failed.is_set() and seen != expected:
                missing = sorted(expected - seen)
                raise WireFormatError(f"{len(missing)} chunk(s) of '{req.name}' never came "
                                      f"(first {missing[0]}); nothing was committed")
        except BaseException as exc:
            feed.stop(exc)
            wait(futures)  # no chunk job may still write when the generation is removed
            raise
        feed.stop(IsolaneError(f"the save of '{req.name}' takes no more chunks"))

    def _write_zarr_metadata(self, req: SaveRequest) -> dict[int, list[str]]:
        """Group and array zarr.json on every device that holds chunks (and device 0)."""
        devices = {0} | {c.device for c in req.plan.chunks}
        written: dict[int, list[str]] = {}
        arrays = {a.path: a for a in req.plan.arrays}
        for device in sorted(devices):
            store = self.stores[device]
            keys = [f"{req.prefix}/zarr.json"]
            store.write(keys[0], zarr_group_meta({"isolane": {"manifest": MANIFEST}}),
                        durable=False)
            for group in req.plan.groups:
                key = f"{req.prefix}/{group}/zarr.json"
                store.write(key, zarr_group_meta(), durable=False)
                keys.append(key)
            for path, array in arrays.items():
                dtype = zarr_dtype(getattr(torch, array.torch_dtype))
                key = f"{req.prefix}/{path}/zarr.json"
                store.write(key, zarr_array_meta(array, dtype), durable=False)
                keys.append(key)
            written[device] = keys
        return written

    def _chunk_job(
        self, req: SaveRequest, chunk: ChunkPlan, tensors: Mapping[int, torch.Tensor],
        staged: AlignedBuffer | None, expected: str | None = None,
        hashed: Hashed | None = None,
    ) -> ChunkResult:
        key = f"{req.prefix}/{chunk.key}"
        try:
            if req.feed is not None:
                return self._fed_chunk_job(req, chunk, key, staged, expected)
            if hashed is not None:  # staged ahead: copied (unless linkable) and hashed
                digest, pieces = hashed
                if self._link(req, chunk, key, digest):
                    return ChunkResult(_record(chunk, digest, linked=True), pieces)
                if staged is not None:
                    self.stores[chunk.device].write(key, staged.view,
                                                    length=chunk.stored_nbytes,
                                                    durable=not DEFER_CHUNK_FSYNC)
                    return ChunkResult(_record(chunk, digest, linked=False), pieces)
            known = req.known_hashes.get(chunk.key)
            if known is not None and self._link(req, chunk, key, known):
                return ChunkResult(_record(chunk, known, linked=True), {})
            if staged is None and req.parent_chunks:
                # Sync save: the caller's tensors are stable, so hash them where they
                # lie and skip the staging copy for chunks the parent already has.
                digest_here = source_hash(chunk, tensors)
                if digest_here is not None and self._link(req, chunk, key, digest_here):
                    return ChunkResult(_record(chunk, digest_here, linked=True), {})
            if staged is None:
                staged = self.staging.acquire(chunk.stored_nbytes)
                fill_chunk(staged, chunk, tensors)
            digest, pieces = staged_hashes(staged.view, chunk)
            if self._link(req, chunk, key, digest):
                return ChunkResult(_record(chunk, digest, linked=True), pieces)
            self.stores[chunk.device].write(key, staged.view, length=chunk.stored_nbytes,
                                            durable=not DEFER_CHUNK_FSYNC)
            return ChunkResult(_record(chunk, digest, linked=False), pieces)
        finally:
            if staged is not None:
                self.staging.release(staged)

    def _fed_chunk_job(self, req: SaveRequest, chunk: ChunkPlan, key: str,
                       staged: AlignedBuffer | None, expected: str | None) -> ChunkResult:
        """A chunk from a feed: link it by the sender's hash, or hash what arrived,
        check it against the sender's hash and write it."""
        if staged is None:
            if chunk.is_pack or expected is None or not self._link(req, chunk, key, expected):
                raise IsolaneError(f"chunk {chunk.key} of '{req.name}' cannot be linked: the "
                                   "parent holds no such bytes on its device; save again")
            return ChunkResult(_record(chunk, expected, linked=True), {})
        digest, pieces = staged_hashes(staged.view, chunk)
        if expected is not None and digest != expected:
            raise WireFormatError(f"chunk {chunk.key} of '{req.name}' arrived damaged (hash "
                                  f"{digest}, the sender's {expected}); nothing was committed")
        if self._link(req, chunk, key, digest):
            return ChunkResult(_record(chunk, digest, linked=True), pieces)
        self.stores[chunk.device].write(key, staged.view, length=chunk.stored_nbytes)
        return ChunkResult(_record(chunk, digest, linked=False), pieces)

    def _linkable(self, req: SaveRequest, chunk: ChunkPlan, digest: str) -> ParentChunk | None:
        parent = req.parent_chunks.get(digest)
        if parent is None or parent.device != chunk.device or parent.stored != chunk.stored_nbytes:
            return None
        return parent

    def _link(self, req: SaveRequest, chunk: ChunkPlan, key: str, digest: str) -> bool:
        """Reuse the parent's copy of these bytes when it sits on the same device."""
        parent = self._linkable(req, chunk, digest)
        if parent is None:
            return False
        self.stores[chunk.device].copy(parent.key, key)
        return True

    def _sync(self, req: SaveRequest, meta_files: Mapping[int, list[str]],
              chunk_files: Mapping[int, list[str]]) -> None:
        folders: dict[int, set[str]] = {d: {req.prefix} for d in meta_files}
        for chunk in req.plan.chunks:
            folders.setdefault(chunk.device, {req.prefix}).add(f"{req.prefix}/{chunk.array}")
        for device, prefixes in folders.items():
            for key in meta_files.get(device, []):
                prefixes.add(key.rsplit("/", 1)[0])
            self.stores[device].sync(sorted(prefixes), files=[
                *meta_files.get(device, []), *chunk_files.get(device, [])])

    def _manifest(self, req: SaveRequest, records: list[ChunkRecord],
                  piece_hashes: Mapping[int, str], logical: int, seconds: float) -> Manifest:
        tensor_records = []
        for leaf in req.leaves:
            slot = req.plan.packed.get(leaf.id)
            pack = None
            if slot is not None:
                pack = PackRef(slot.array, slot.offset, slot.nbytes, piece_hashes[leaf.id])
            tensor_records.append(TensorRecord(
                id=leaf.id, key=dotted_key(leaf.path),
                dtype=str(leaf.tensor.dtype).removeprefix("torch."),
                shape=tuple(leaf.tensor.shape), array=req.plan.array_of.get(leaf.id),
                pack=pack))
        stored = sum(r.stored for r in records)
        linked = sum(r.stored for r in records if r.linked)
        return Manifest(
            name=req.name, generation=req.generation, committed_at=time.time(),
            tree=req.tree, tensors=tuple(tensor_records), chunks=tuple(records),
            devices=tuple(s.url for s in self.stores),
            stats=SnapshotStats(
                logical_bytes=logical,
                stored_bytes=stored, written_bytes=stored - linked, linked_bytes=linked,
                seconds=seconds),
            metadata=req.metadata, parent=req.parent)


def _flag_failure(fut: Future[ChunkResult], failed: threading.Event,
                  feed: ChunkFeed | None) -> None:
    exc = fut.exception()
    if exc is not None:
        failed.set()
        if feed is not None:  # the producer hears of it on its next chunk
            feed.stop(exc)

