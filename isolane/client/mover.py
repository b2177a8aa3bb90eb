"""ChainMover: a cluster client's background copies of KV chain segments between nodes.

The unit is the chain segment (``kvpool.chain_segments``): every put carries its
segment's digest, a node's chain index lists its segments under those digests, and
ownership is the ring owner of the segment digest. So a join or leave moves only the
segments whose owner changed (~1/N of them), never a whole chain because one segment
of it moved.

**Rebalancing** after a join or leave, done one job at a time by one thread and paced
by one token bucket (``bytes_per_s``; the receiving node paces it again on its
background lane, since the blocks are sent with ``?move=1``): each node of the previous
ring lists its segments (``GET /v1/kv/{ns}/chains``); each segment that the node owned
on the previous ring and does not own on the new one, and every segment of a node that
leaves (some it may hold without owning them), is read there, put on its new owner and
then deleted from the old node, in slices of ``slice_blocks`` blocks. Every
block is therefore on the old node, the new one or both at any moment, and a reader
that tries the old owner first and the new one next (``ClusterRouter.read_candidates``)
never misses a block that is stored. Once every rebalance queued is done, ``on_done``
runs (the router stops falling back to previous rings).

The I/O is the caller's (``MoverIO``), so the order of operations is tested with
real nodes through the client and the pacing without them. Thread-safe; ``close``
drops what is still queued and waits for the job in progress.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from isolane.cluster.ring import NodePlacement
from isolane.errors import IsolaneError
from isolane.lanes.forksafe import ForkSafe
from isolane.lanes.qos import TokenBucket
from isolane.wire.chain_list import Chain

log = logging.getLogger(__name__)


class MoverIO(Protocol):
    """What the mover needs from a client; a node that cannot be reached is reported
    (None, False), never raised."""

    def slice_blocks(self) -> int:
        """Blocks moved per request."""
        ...

    def fetch(self, node: str, keys: Sequence[bytes]) -> list[bytes | None]: ...

    def store(self, node: str, digest: bytes, keys: Sequence[bytes],
              values: Sequence[bytes]) -> bool: ...

    def delete(self, node: str, keys: Sequence[bytes]) -> None: ...

    def list_chains(self, node: str) -> list[Chain] | None: ...


@dataclass(frozen=True)
class MoveJob:
    """Move the segment ``digest`` (``keys``) from ``source`` to ``target``: copy it
    there slice by slice, deleting each slice from ``source`` once ``target`` holds it."""

    digest: bytes
    keys: tuple[bytes, ...]
    source: str
    target: str


@dataclass(frozen=True)
class RebalanceJob:
    old: NodePlacement
    new: NodePlacement


@dataclass
class MoverStats:
    chains_moved: int = 0  # segments moved by rebalancing
    bytes_sent: int = 0
    failures: int = 0  # moves given up (a node unavailable)
    rebalances: int = 0
    errors: list[str] = field(default_factory=list)


class ChainMover(ForkSafe):
    """See the module docstring. ``bytes_per_s``: None for no limit."""

    def __init__(self, io: MoverIO, *, bytes_per_s: float | None = 128 << 20,
                 on_done: Callable[[], None] = lambda: None) -> None:
        self.io = io
        self.bucket = TokenBucket(bytes_per_s, burst_bytes=8 << 20)
        self.on_done = on_done
        self.stats = MoverStats()
        self._jobs: deque[RebalanceJob] = deque()
        self._rebalances = 0  # queued or running
        self._busy = False
        self._closed = False
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        super().__init__()

    def _after_fork_in_child(self) -> None:
        """The parent's queue and thread are not the child's."""
        self._cond = threading.Condition()
        self._jobs.clear()
        self._rebalances = 0
        self._busy = False
        self._thread = None

    # -- submitting -----------------------------------------------------------------------
    def rebalance(self, old: NodePlacement, new: NodePlacement) -> None:
        """Queue the moves from ``old`` to ``new``; ``on_done`` runs once no rebalance
        is left."""
        with self._cond:
            if self._closed:
                return
            self._rebalances += 1
            self._push(RebalanceJob(old, new))

    def _push(self, job: RebalanceJob) -> None:
        self._jobs.append(job)
        if self._thread is None or not self._thread.is_alive() or self._pid != os.getpid():
            self._pid = os.getpid()  # a forked child starts its own thread
            self._thread = threading.Thread(target=self._run, name="isolane-kv-mover",
                                            daemon=True)
            self._thread.start()
        self._cond.notify_all()

    @property
    def rebalancing(self) -> bool:
        with self._cond:
            return self._rebalances > 0

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait until nothing is queued or running; returns whether that happened."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._jobs and not self._busy, timeout_s)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._jobs.clear()
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    # -- the worker -----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._jobs or self._closed)
                if self._closed:
                    self._busy = False
                    self._cond.notify_all()
                    return
                job = self._jobs.popleft()
                self._busy = True
            try:
                self._rebalance(job)
            except (IsolaneError, OSError) as exc:  # a bug in the peers' answers, logged
                log.warning("KV mover: %s failed: %s", type(job).__name__, exc)
                self.stats.errors.append(str(exc))
                del self.stats.errors[:-8]
            finally:
                done = False
                with self._cond:
                    self._rebalances -= 1
                    done = self._rebalances == 0 and not self._closed
                if done:
                    self.on_done()
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _rebalance(self, job: RebalanceJob) -> None:
        self.stats.rebalances += 1
        for node in job.old.nodes:
            if self._closed:
                return
            chains = self.io.list_chains(node)
            if chains is None:
                log.warning("KV mover: %s did not list its chains; they stay there and read "
                            "as misses once the move is complete", node)
                self.stats.failures += 1
                continue
            leaving = node not in job.new.nodes
            for digest, keys in chains:
                if self._closed:
                    return
                target = job.new.owner(digest)
                if target == node or (job.old.owner(digest) != node and not leaving):
                    # kept; or not this node's on the ring (a writer passed it on, or did
                    # not know its owner) and read where it is: it moves only when this
                    # node leaves, or it would be left behind there
                    continue
                if self._move(MoveJob(digest, tuple(keys), node, target)):
                    self.stats.chains_moved += 1

    def _move(self, job: MoveJob) -> bool:
        """Copy, then delete, slice by slice; False when the target failed."""
        step = max(1, self.io.slice_blocks())
        for start in range(0, len(job.keys), step):
            keys = job.keys[start:start + step]
            values = self.io.fetch(job.source, keys)
            found = [(k, v) for k, v in zip(keys, values, strict=True) if v is not None]
            if not found:
                continue
            nbytes = sum(len(v) for _, v in found)
            self.bucket.consume(nbytes)
            if not self.io.store(job.target, job.digest, [k for k, _ in found],
                                 [v for _, v in found]):
                self.stats.failures += 1
                return False
            self.stats.bytes_sent += nbytes
            self.io.delete(job.source, [k for k, _ in found])
        return True
