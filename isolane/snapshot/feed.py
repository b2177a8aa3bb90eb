"""A save whose chunk bytes arrive from elsewhere (a storage node's upload stream).

``SnapshotStore.begin_save`` plans the save from tensor shapes alone and starts it
like any other (``isolane.snapshot.transaction``: same begin, writer and commit); the
producer then hands it each chunk as it arrives, in any order: ``put`` (a staging
buffer holding the chunk's bytes as stored, plus the hash the sender computed) or
``link`` (a hash the parent snapshot holds: hard-linked, no bytes). The writer hashes
every put chunk as it writes it and refuses one whose hash differs (damaged in
transit); ``commit`` ends the feed and returns once the manifest is written,
``abort`` ends it with an error and commits nothing. A chunk never put or linked also
fails the save: a snapshot is all of its chunks or nothing.

Order of calls: ``acquire`` -> fill -> ``put`` (or ``link``), for every chunk of
``plan``, then exactly one of ``commit`` / ``abort``. ``put``/``link`` raise the
writer's error once it has failed (a disk full), so a producer stops at once.
Thread-safe: the producer may call from any one thread; the writer consumes in its own.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from isolane.errors import IsolaneError
from isolane.snapshot.plan import ChunkPlan, SavePlan
from isolane.snapshot.staging import StagingPool
from isolane.storage.aligned import AlignedBuffer


@dataclass(frozen=True)
class UploadPlan:
    """What ``SnapshotStore.plan_upload`` answers: the chunks a save would write, the
    parent chunk hashes it can link, and that parent (``{"name", "generation"}``)."""

    plan: SavePlan
    parent_hashes: frozenset[str]
    parent: dict[str, str] | None


@dataclass(frozen=True)
class FedChunk:
    chunk: ChunkPlan
    staged: AlignedBuffer | None  # None: link by ``digest`` from the parent
    digest: str


class ChunkFeed:
    """The queue from a producer to the writer's driver (iterate to consume)."""

    def __init__(self, staging: StagingPool) -> None:
        self._staging = staging
        self._items: deque[FedChunk | None] = deque()
        self._cond = threading.Condition()
        self._failed: BaseException | None = None  # the producer's abort
        self._stopped: BaseException | None = None  # the writer stopped consuming

    def put(self, item: FedChunk | None) -> None:
        with self._cond:
            if self._stopped is not None:
                if item is not None and item.staged is not None:
                    self._staging.release(item.staged)
                raise self._stopped
            self._items.append(item)
            self._cond.notify_all()

    def fail(self, reason: BaseException) -> None:
        with self._cond:
            self._failed = reason
            self._cond.notify_all()

    def stop(self, reason: BaseException) -> None:
        """The writer takes nothing more: queued buffers go back to staging."""
        with self._cond:
            self._stopped = reason
            while self._items:
                item = self._items.popleft()
                if item is not None and item.staged is not None:
                    self._staging.release(item.staged)
            self._cond.notify_all()

    def __iter__(self) -> Iterator[FedChunk]:
        while True:
            with self._cond:
                while not self._items and self._failed is None:
                    self._cond.wait()
                if self._failed is not None:
                    raise self._failed
                item = self._items.popleft()
            if item is None:
                return
            yield item


class FedSave:
    """One save fed chunk by chunk; see the module docstring."""

    def __init__(self, name: str, plan: SavePlan, parent_hashes: frozenset[str],
                 feed: ChunkFeed, staging: StagingPool, finish: Future[Any], *,
                 plan_reused: bool = False) -> None:
        self.name = name
        self.plan = plan
        self.plan_reused = plan_reused  # the plan given to ``begin_save`` was followed
        self.parent_hashes = parent_hashes  # hashes ``link`` can use
        self._feed = feed
        self._staging = staging
        self._finish = finish
        self._ended = False

    def acquire(self, nbytes: int) -> AlignedBuffer:
        """A staging buffer for one chunk (waits while the writer catches up)."""
        return self._staging.acquire(nbytes)

    def release(self, buf: AlignedBuffer) -> None:
        """Give back a buffer that will not be ``put`` (the stream broke off)."""
        self._staging.release(buf)

    def put(self, index: int, staged: AlignedBuffer, digest: str) -> None:
        """Chunk ``index`` of the plan: its stored bytes in ``staged`` (the save
        owns the buffer from here, also when this raises)."""
        self._feed.put(FedChunk(self.plan.chunks[index], staged, digest))

    def link(self, index: int, digest: str) -> None:
        if digest not in self.parent_hashes:
            raise IsolaneError(f"chunk {self.plan.chunks[index].key} of '{self.name}' was sent "
                               f"as a link to {digest}, which its parent does not hold; "
                               "send its bytes")
        self._feed.put(FedChunk(self.plan.chunks[index], None, digest))

    def commit(self) -> Future[Any]:
        """End the feed; the future holds the ``SnapshotInfo`` once committed."""
        self._ended = True
        self._feed.put(None)
        return self._finish

    def abort(self, reason: BaseException) -> Future[Any]:
        """End the feed with ``reason``: nothing is committed, the generation removed."""
        if not self._ended:
            self._ended = True
            self._feed.fail(reason)
        return self._finish

    @property
    def future(self) -> Future[Any]:
        return self._finish
