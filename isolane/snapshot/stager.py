"""How a save's chunks reach the write lane: copied from the caller's tensors into
staging buffers on threads of their own, in plan order, and handed off once staged.

One strategy for sync and async saves; they differ only in its settings:

- a sync save (``hash_chunks=True``, ``stage_whole=False``) hashes each chunk on the
  stager threads too, so the lane's threads only link or write and their writes stay in
  flight while the next chunks are copied (with copies on the lane's threads, 2 cores
  shared by 4 of them, the device idled for a quarter of the save). A chunk whose
  one-tensor bytes the parent already holds is hashed where it lies and handed off
  with no buffer (no copy). At most ``window`` chunks are out, each until its write is
  done;
- an async save (no hash, ``stage_whole=True``) only copies: the caller waits for the
  copies alone, the lane hashes. It takes as many warm (already mapped) buffers as
  the pool holds, up to the staging budget; once none is left for the next chunk it
  tells the hand-off (``HandOff.staging_full``, so writes start and free buffers) and
  maps fresh memory only while fewer than ``window`` of its buffers are out, like a
  sync save: a fresh page costs a fault (slower than the disk here), a buffer a write
  gave back costs nothing. So the caller never waits longer than a sync save of the
  same state would, and the memory stays within the budget.

A failure anywhere goes to the save's ``SaveFailure``, which stops the staging.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import torch

from isolane.snapshot.chunks import Hashed, fill_chunk, source_hash, staged_hashes
from isolane.snapshot.plan import ChunkPlan
from isolane.snapshot.staging import StagingPool
from isolane.storage.aligned import AlignedBuffer

# Threads that copy (and, for a sync save, hash) a save's chunks into staging: memmove
# and xxh3 release the GIL, and two keep both cores busy next to the lane's writes.
STAGE_THREADS = 2


class SaveFailure:
    """The first error of one save, seen by every thread working on it. Thread-safe."""

    def __init__(self) -> None:
        self._stopped = threading.Event()
        self._errors: list[BaseException] = []
        self._lock = threading.Lock()

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    def fail(self, exc: BaseException) -> None:
        with self._lock:
            self._errors.append(exc)
        self._stopped.set()

    def stop(self) -> None:
        """Stop the save's work without an error of its own (a chunk job failed: its
        future carries the error)."""
        self._stopped.set()

    def raise_first(self) -> None:
        with self._lock:
            first = self._errors[0] if self._errors else None
        if first is not None:
            raise first


class HandOff(Protocol):
    """Where staged chunks go: the write lane, or a queue in front of it."""

    def hand_off(self, chunk: ChunkPlan, buffer: AlignedBuffer | None,
                 hashed: Hashed | None) -> Future[Any] | None:
        """Take ``chunk`` (and ownership of ``buffer``); the future of its write job,
        or None when it is not (yet) a job. ``buffer`` None: the chunk is linked by
        ``hashed``'s digest, no bytes."""
        ...

    def staging_full(self) -> None:
        """No warm buffer is left for the next chunk: it waits for a write to free one
        (or maps fresh memory within the window)."""
        ...


class SaveBuffers:
    """One save's share of the staging pool: the buffers it has out (acquired, not yet
    released), so that it can wait for its own writes rather than map more memory.
    Thread-safe."""

    def __init__(self, pool: StagingPool) -> None:
        self.pool = pool
        self._out: set[int] = set()
        self._lock = threading.Lock()

    @property
    def out(self) -> int:
        return len(self._out)

    def acquire_warm(self, nbytes: int) -> AlignedBuffer | None:
        buffer = self.pool.acquire_warm(nbytes)
        if buffer is not None:
            self._add(buffer)
        return buffer

    def acquire(self, nbytes: int, *, may_map: Callable[[], bool] | None = None
                ) -> AlignedBuffer:
        buffer = self.pool.acquire(nbytes, may_map=may_map)
        self._add(buffer)
        return buffer

    def release(self, buffer: AlignedBuffer) -> None:
        """Give ``buffer`` back (also one this save got from elsewhere, e.g. a feed)."""
        with self._lock:
            self._out.discard(id(buffer))
        self.pool.release(buffer)

    def _add(self, buffer: AlignedBuffer) -> None:
        with self._lock:
            self._out.add(id(buffer))


class ChunkStager:
    """Stages one save's chunks. ``linkable(chunk, digest)`` (sync saves with a
    parent): whether the parent holds these bytes on the chunk's device."""

    def __init__(self, staging: SaveBuffers, tensors: Mapping[int, torch.Tensor],
                 failure: SaveFailure, *, hash_chunks: bool, window: int,
                 stage_whole: bool,
                 linkable: Callable[[ChunkPlan, str], bool] | None = None,
                 threads: int = STAGE_THREADS) -> None:
        self.staging = staging
        self.tensors = tensors
        self.failure = failure
        self.hash_chunks = hash_chunks
        self.linkable = linkable if hash_chunks else None
        self.threads = threads
        self._slots = None if stage_whole else threading.Semaphore(window)
        self._may_map = (lambda: staging.out < window) if stage_whole else None

    def run(self, chunks: Sequence[ChunkPlan], to: HandOff) -> None:
        """Stage ``chunks`` in order; returns once every one was handed off or dropped
        (after a failure) and no copy is running."""
        # No prefill of extra buffers here: a second prefill thread next to the store's
        # delayed a process's first write (0.63-0.69 s against 0.29-0.34 s).
        with ThreadPoolExecutor(self.threads, thread_name_prefix="isolane-stage") as pool:
            for chunk in chunks:
                self._take_slot()
                if self.failure.stopped:
                    self._give_slot()
                    break
                try:
                    buffer = self.staging.acquire_warm(chunk.stored_nbytes)
                    if buffer is None:
                        to.staging_full()
                        buffer = self.staging.acquire(chunk.stored_nbytes,
                                                      may_map=self._may_map)
                except BaseException as exc:  # out of memory: the chunks already out finish
                    self._give_slot()
                    self.failure.fail(exc)
                    break
                pool.submit(self._stage, chunk, buffer, to)

    def _stage(self, chunk: ChunkPlan, buffer: AlignedBuffer, to: HandOff) -> None:
        kept: AlignedBuffer | None = buffer
        hashed: Hashed | None = None
        try:
            if self.failure.stopped:
                raise _Dropped
            digest = source_hash(chunk, self.tensors) if self.linkable is not None else None
            if digest is not None and self.linkable is not None \
                    and self.linkable(chunk, digest):
                self.staging.release(buffer)
                kept, hashed = None, (digest, {})
            else:
                fill_chunk(buffer, chunk, self.tensors)
                if digest is not None:
                    hashed = (digest, {})
                elif self.hash_chunks:
                    hashed = staged_hashes(buffer.view, chunk)
        except BaseException as exc:
            if kept is not None:
                self.staging.release(kept)
            self._give_slot()
            if not isinstance(exc, _Dropped):
                self.failure.fail(exc)
            return
        try:
            job = to.hand_off(chunk, kept, hashed)
        except BaseException as exc:  # the lane refused it (e.g. shut down under the save)
            if kept is not None:
                self.staging.release(kept)
            self._give_slot()  # else run() waits for a slot that never comes
            self.failure.fail(exc)
            return
        if job is None:
            self._give_slot()
        else:
            job.add_done_callback(lambda _job: self._give_slot())

    def _take_slot(self) -> None:
        if self._slots is not None:
            self._slots.acquire()

    def _give_slot(self) -> None:
        if self._slots is not None:
            self._slots.release()


class _Dropped(Exception):
    """A chunk staged after the save failed: dropped, not an error of its own."""
