"""How a save's chunks reach the write lane: copied from the caller's tensors into
staging buffers on threads of their own, in plan order, and handed off once staged.

One strategy for sync and async saves; they differ only in its settings:

- a sync save (``hash_chunks=True``, a ``window``) hashes each chunk on the stager
  threads too, so the lane's threads only link or write and their writes stay in
  flight while the next chunks are copied (with copies on the lane's threads, 2 cores
  shared by 4 of them, the device idled for a quarter of the save). A chunk whose
  one-tensor bytes the parent already holds is hashed where it lies and handed off
  with no buffer (no copy). At most ``window`` buffers are out, each until its write
  is done;
- an async save (no hash, no window) only copies: the caller waits for the copies
  alone, the lane hashes. The staging budget bounds its memory and the hand-off hears
  when staging is full (``HandOff.staging_full``), so writes can start and free it.

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
        """Staging has no room for the next chunk: only finished writes free it."""
        ...


class ChunkStager:
    """Stages one save's chunks. ``linkable(chunk, digest)`` (sync saves with a
    parent): whether the parent holds these bytes on the chunk's device."""

    def __init__(self, staging: StagingPool, tensors: Mapping[int, torch.Tensor],
                 failure: SaveFailure, *, hash_chunks: bool, window: int | None,
                 linkable: Callable[[ChunkPlan, str], bool] | None = None,
                 threads: int = STAGE_THREADS) -> None:
        self.staging = staging
        self.tensors = tensors
        self.failure = failure
        self.hash_chunks = hash_chunks
        self.linkable = linkable if hash_chunks else None
        self.threads = threads
        self._slots = threading.Semaphore(window) if window is not None else None

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
                if self.staging.exhausted(chunk.stored_nbytes):
                    to.staging_full()
                try:
                    buffer = self.staging.acquire(chunk.stored_nbytes)
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
