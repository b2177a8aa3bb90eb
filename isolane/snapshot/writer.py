"""Execute a SavePlan: stage, hash, link-or-write chunks on the write lane, then commit.

Order of a save (each step finishes before the next starts; an async save copies its
tensors into staging meanwhile, from the start):

1. ``_writing.json`` marker on device 0 (``marker.mark_writing``: tells GC a live
   writer owns this generation; a rank's part whose generation carries the
   coordinator's marker on this write group needs none, ``SaveRequest.mark``);
2. zarr metadata for groups and arrays (buffered, fsynced in step 4);
3. every chunk: hashed (xxh3-128) and either hard-linked / server-side-copied from the
   parent snapshot when the parent holds the same bytes on the same device, or copied
   into an aligned staging buffer and written (O_DIRECT, not yet fsynced: step 4
   does, so the journal commits them in a few batches instead of one by one; a pack
   is fsynced as soon as written: packs come first in the plan, so their flush runs
   while the big chunks are hashed, linked or written instead of in step 4); links
   and writes run on the write lane's threads, the copies (and a sync save's hashes)
   on stager threads ahead of them (``isolane.snapshot.stager``);
4. fsync of chunk files, metadata files and every folder written, on every device
   (several at a time, so the journal commits them in batches); a rank's part whose
   coordinator runs on this host leaves it to the coordinator's one sync of the write
   group before the manifest (``SaveRequest.sync``);
5. the manifest ``isolane.json``, written atomically by ``SaveRequest.commit`` under the
   name's commit lock: the commit point;
6. removal of the marker.

A failure anywhere before step 5 leaves an uncommitted generation that readers never
see; the request's ``discard`` (the save transaction's) removes it at once when
possible, GC sweeps what it could not remove.

The chunks come from one of two places: the stager (``SnapshotStore.save`` and
``save_async``, DCP's ``write_data``, a rank's part), or a feed (a node's streamed
upload, ``isolane.snapshot.feed``). In async mode the stager copies every chunk into
staging before ``staged`` is set, so the caller may mutate its tensors as soon as
``save_async`` returns; the staging budget bounds that memory and, with fresh memory
mapped only within a sync save's window, makes the copy loop wait for writes
(back-pressure) rather than fault in more pages than a sync save would.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from queue import SimpleQueue

import torch

from isolane.errors import IsolaneError, WireFormatError
from isolane.lanes.scheduler import LaneHandle
from isolane.snapshot.chunks import Hashed, contiguous_bytes, staged_hashes
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
from isolane.snapshot.stager import (
    STAGE_THREADS,
    ChunkStager,
    HandOff,
    SaveBuffers,
    SaveFailure,
)
from isolane.snapshot.staging import StagingPool
from isolane.snapshot.tree import Json, TensorLeaf, dotted_key
from isolane.storage.aligned import AlignedBuffer
from isolane.storage.base import BlobStore

Progress = Callable[[int, int], None]


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
    # Publish the writing marker at ``prefix`` first and remove it last. False: a rank's
    # part inside a generation whose own marker, on this write group, already tells gc
    # that the save is alive (gc judges generations, never parts).
    mark: bool = True
    # Step 4 here. False: a rank's part whose coordinator, a process of this host,
    # makes the whole write group durable before its commit (``commit_parts``).
    sync: bool = True


@dataclass(frozen=True)
class ChunkResult:
    record: ChunkRecord
    piece_hashes: dict[int, str]  # tensor id -> hash of its bytes, for packed tensors


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

    def _drive(self, req: SaveRequest, job: SaveJob, progress: Progress | None) -> None:
        started = time.perf_counter()
        try:
            manifest = _Save(self, req, progress).run(job, started)
        except BaseException as exc:
            job.staged.set()
            if req.discard is not None:
                req.discard()
            job.future.set_exception(exc)
        else:
            job.future.set_result(manifest)


class _Save:
    """One save of ``SnapshotWriter``: its chunks on their way to the write lane (the
    ``HandOff`` its stager or feed gives them to), the jobs they became, the first
    failure and the metadata files to fsync. Lives on the driver thread; its
    ``hand_off`` and the chunk jobs are called from stager and lane threads."""

    def __init__(self, writer: SnapshotWriter, req: SaveRequest, progress: Progress | None
                 ) -> None:
        self.req = req
        self.stores = writer.stores
        self.lane = writer.lane
        self.staging = SaveBuffers(writer.staging)
        self.tensors = {leaf.id: contiguous_bytes(leaf.tensor) for leaf in req.leaves}
        self.failure = SaveFailure()
        self.jobs: list[Future[ChunkResult]] = []
        self.meta_files: dict[int, list[str]] = {}
        self.progress = _ProgressReport(progress, sum(c.data_nbytes for c in req.plan.chunks))

    def run(self, job: SaveJob, started: float) -> Manifest:
        """Every step of the module docstring; the chunks come from a feed, from a sync
        save's stager, or from an async save's stager through ``_HeldWrites``."""
        try:
            if self.req.feed is not None:
                self.prepare()
                self._consume(self.req.feed)
            elif self.req.stage_all:
                self._stage_async(job)
            else:
                self.prepare()
                self._stage_sync()
        finally:
            job.staged.set()
        return self._commit(started)

    def prepare(self) -> None:
        """Steps 1 and 2, before any chunk file is written."""
        if self.req.mark:
            mark_writing(self.stores[0], self.req.prefix)
        self.meta_files.update(self._write_zarr_metadata())

    # -- staging: where the chunks come from ----------------------------------------------
    def _stage_sync(self) -> None:
        chunks = self._known_first()
        linkable = self._can_link if self.req.parent_chunks else None
        ChunkStager(self.staging, self.tensors, self.failure, hash_chunks=True,
                    window=self._window, stage_whole=False, linkable=linkable,
                    ).run(chunks, self)

    def _stage_async(self, job: SaveJob) -> None:
        """Copies must not wait for the write lane's in-flight budget, only for staging
        memory, so ``_HeldWrites`` feeds the lane from a thread of its own. Once staged,
        the pool grows (in the background, within its budget) to the buffers this state
        needs, so that its next save is staged whole in warm memory."""
        held = _HeldWrites(self)
        try:
            chunks = self._known_first(held)
            ChunkStager(self.staging, self.tensors, self.failure, hash_chunks=False,
                        window=self._window, stage_whole=True).run(chunks, held)
        finally:
            job.staged.set()  # every copy done: the caller goes on
            held.close()
        if not self.failure.stopped:
            self.staging.pool.prefill_sizes([c.stored_nbytes for c in chunks])

    @property
    def _window(self) -> int:
        """Buffers a save may have out beyond warm ones: one a lane thread writes, two a
        stager thread fills."""
        return self.lane.threads + 2 * STAGE_THREADS

    def _known_first(self, to: HandOff | None = None) -> list[ChunkPlan]:
        """Hand off the chunks known unchanged (linked, no bytes read); the others, in
        the order the stager copies them."""
        known = self.req.known_hashes
        chunks = interleave_by_device(self.req.plan.chunks, len(self.stores))
        for chunk in chunks:
            if chunk.key in known:
                (to or self).hand_off(chunk, None, (known[chunk.key], {}))
        return [c for c in chunks if c.key not in known]

    def _consume(self, feed: ChunkFeed) -> None:
        """Submit every chunk the producer feeds; all of the plan's, each once."""
        req = self.req
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
                self.hand_off(item.chunk, item.staged, None, item.digest)
                if self.failure.stopped:
                    break
            if not self.failure.stopped and seen != expected:
                missing = sorted(expected - seen)
                raise WireFormatError(f"{len(missing)} chunk(s) of '{req.name}' never came "
                                      f"(first {missing[0]}); nothing was committed")
        except BaseException as exc:
            feed.stop(exc)
            wait(self.jobs)  # no chunk job may still write when the generation is removed
            raise
        feed.stop(IsolaneError(f"the save of '{req.name}' takes no more chunks"))

    # -- the HandOff to the write lane ------------------------------------------------------
    def hand_off(self, chunk: ChunkPlan, buffer: AlignedBuffer | None,
                 hashed: Hashed | None, expected: str | None = None
                 ) -> Future[ChunkResult] | None:
        """Queue the chunk's job on the write lane (which owns ``buffer`` from here);
        None once the save failed (the buffer went back to staging). ``expected``: the
        sender's hash of a fed chunk, checked against its bytes."""
        if self.failure.stopped:
            if buffer is not None:
                self.staging.release(buffer)
            return None
        job = self.lane.submit_sized(chunk.stored_nbytes, self._write_chunk, chunk, buffer,
                                     hashed, expected)
        job.add_done_callback(self._job_done)
        self.jobs.append(job)
        return job

    def staging_full(self) -> None:
        """Nothing to do: chunks go to the lane as they are staged, whose jobs give
        their buffers back as they finish."""

    def _job_done(self, job: Future[ChunkResult]) -> None:
        if job.cancelled():
            self.failure.stop()
            return
        exc = job.exception()
        if exc is None:
            self.progress.add(job.result().record.nbytes)
            return
        self.failure.stop()
        if self.req.feed is not None:  # the producer hears of it on its next chunk
            self.req.feed.stop(exc)

    # -- a chunk job, on the write lane ------------------------------------------------------
    def _write_chunk(self, chunk: ChunkPlan, buffer: AlignedBuffer | None,
                     hashed: Hashed | None, expected: str | None) -> ChunkResult:
        """Link the chunk from the parent when it holds the same bytes on the same
        device, else write it (no fsync but for a pack: step 4 makes it durable).
        Without a buffer the chunk must link, by ``hashed`` or ``expected``."""
        req = self.req
        key = f"{req.prefix}/{chunk.key}"
        try:
            if buffer is None:
                digest = hashed[0] if hashed is not None else expected
                if chunk.is_pack or digest is None or not self._link(chunk, key, digest):
                    raise IsolaneError(f"chunk {chunk.key} of '{req.name}' cannot be linked: "
                                       "the parent holds no such bytes on its device; "
                                       "save again")
                return ChunkResult(_record(chunk, digest, linked=True), {})
            digest, pieces = hashed if hashed is not None else staged_hashes(buffer.view,
                                                                             chunk)
            if expected is not None and digest != expected:
                raise WireFormatError(f"chunk {chunk.key} of '{req.name}' arrived damaged "
                                      f"(hash {digest}, the sender's {expected}); nothing "
                                      "was committed")
            if self._link(chunk, key, digest):
                return ChunkResult(_record(chunk, digest, linked=True), pieces)
            self.stores[chunk.device].write(key, buffer.view, length=chunk.stored_nbytes,
                                            durable=chunk.is_pack)
            return ChunkResult(_record(chunk, digest, linked=False), pieces)
        finally:
            if buffer is not None:
                self.staging.release(buffer)

    def _can_link(self, chunk: ChunkPlan, digest: str) -> bool:
        return self._parent_chunk(chunk, digest) is not None

    def _parent_chunk(self, chunk: ChunkPlan, digest: str) -> ParentChunk | None:
        parent = self.req.parent_chunks.get(digest)
        if parent is None or parent.device != chunk.device or parent.stored != chunk.stored_nbytes:
            return None
        return parent

    def _link(self, chunk: ChunkPlan, key: str, digest: str) -> bool:
        """Reuse the parent's copy of these bytes when it sits on the same device."""
        parent = self._parent_chunk(chunk, digest)
        if parent is None:
            return False
        self.stores[chunk.device].copy(parent.key, key)
        return True

    # -- steps 4 to 6 ------------------------------------------------------------------------
    def _commit(self, started: float) -> Manifest:
        req = self.req
        wait(self.jobs)
        self.failure.raise_first()
        for job in self.jobs:
            exc = job.exception()
            if exc is not None:
                raise exc
        results = [job.result() for job in self.jobs]
        order = {c.key: i for i, c in enumerate(req.plan.chunks)}
        records = sorted((r.record for r in results), key=lambda r: order[r.key])
        piece_hashes = {tid: h for r in results for tid, h in r.piece_hashes.items()}
        written: dict[int, list[str]] = {}
        for record in records:
            if not record.linked:
                written.setdefault(record.device, []).append(f"{req.prefix}/{record.key}")
        if req.sync:
            self._sync(written)
        logical = sum(t.numel() for t in self.tensors.values())
        manifest = self._manifest(records, piece_hashes, logical,
                                  time.perf_counter() - started)
        if req.commit is not None:
            manifest = req.commit(manifest)
        else:
            self.stores[0].write_atomic(f"{req.prefix}/{req.manifest_key}", manifest.to_json())
        if req.mark:
            unmark_writing(self.stores[0], req.prefix)
        return manifest

    def _write_zarr_metadata(self) -> dict[int, list[str]]:
        """Group and array zarr.json on every device that holds chunks (and device 0)."""
        req = self.req
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

    def _sync(self, chunk_files: Mapping[int, list[str]]) -> None:
        """Step 4: chunk files, metadata files and every folder written, on every
        device (several at a time, so the journal commits them in batches)."""
        req, meta_files = self.req, self.meta_files
        folders: dict[int, set[str]] = {d: {req.prefix} for d in meta_files}
        for chunk in req.plan.chunks:
            folders.setdefault(chunk.device, {req.prefix}).add(f"{req.prefix}/{chunk.array}")
        for device, prefixes in folders.items():
            for key in meta_files.get(device, []):
                prefixes.add(key.rsplit("/", 1)[0])
            self.stores[device].sync(sorted(prefixes), files=[
                *meta_files.get(device, []), *chunk_files.get(device, [])])

    def _manifest(self, records: list[ChunkRecord], piece_hashes: Mapping[int, str],
                  logical: int, seconds: float) -> Manifest:
        req = self.req
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



class _HeldWrites:
    """The hand-off of an async save: chunks wait here until every one is staged or no
    warm staging buffer is left for the next, so the copies the caller waits for run
    alone (memory bandwidth and both cores; the total grows by the copy, ~20 GB/s on
    warm buffers); past that point they go to the lane as they come. A thread of its
    own first writes the marker and the metadata (the caller does not wait for their
    fsyncs), then feeds the lane, where a job may wait for the lane's budget."""

    def __init__(self, save: _Save) -> None:
        self._save = save
        self._queue: SimpleQueue[tuple[ChunkPlan, AlignedBuffer | None, Hashed | None]
                                 | None] = SimpleQueue()
        self._open = threading.Event()
        self._feeder = RESIDENT.submit(self._feed, what=f"feed of {save.req.name}")

    def hand_off(self, chunk: ChunkPlan, buffer: AlignedBuffer | None,
                 hashed: Hashed | None) -> None:
        self._queue.put((chunk, buffer, hashed))

    def staging_full(self) -> None:
        self._open.set()

    def close(self) -> None:
        """Let the writes go (no more chunks come) and wait until each is on the lane."""
        self._open.set()
        self._queue.put(None)
        self._feeder.result()

    def _feed(self) -> None:
        try:
            self._save.prepare()
        except BaseException as exc:
            self._save.failure.fail(exc)  # staging stops; hand_off releases the rest
        self._open.wait()
        while (item := self._queue.get()) is not None:
            self._save.hand_off(*item)


class _ProgressReport:
    """``progress(done, total)`` after each chunk, one call at a time, so callbacks
    need no locking of their own."""

    def __init__(self, progress: Progress | None, total: int) -> None:
        self._progress = progress
        self._total = total
        self._done = 0
        self._lock = threading.Lock()

    def add(self, nbytes: int) -> None:
        if self._progress is None:
            return
        with self._lock:
            self._done += nbytes
            self._progress(min(self._done, self._total), self._total)
