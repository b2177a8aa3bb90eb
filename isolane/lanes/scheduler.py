"""LaneScheduler: one worker pool and in-flight byte budget per device group.

Every I/O job names its kind; ``lane_for`` maps the kind to a lane, and the job runs
only on that lane's threads. A flood of checkpoint chunks therefore queues behind the
write lane's budget and can never occupy a KV worker.

Thread-safe. Fork-safe: a lane notices it runs in a forked child (DataLoader workers)
and builds fresh threads there instead of using the parent's dead ones.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

from isolane.config import Config
from isolane.lanes.assignment import JobKind, LaneName, lane_for

P = ParamSpec("P")
T = TypeVar("T")


class ByteBudget:
    """Blocks ``acquire`` while in-flight bytes would exceed the limit.

    A single job larger than the whole budget still runs once nothing else is in flight,
    so an oversized chunk makes slow progress instead of deadlocking.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0
        self._cond = threading.Condition()

    def acquire(self, nbytes: int) -> None:
        with self._cond:
            while self.in_flight and self.in_flight + nbytes > self.limit:
                self._cond.wait()
            self.in_flight += nbytes

    def release(self, nbytes: int) -> None:
        with self._cond:
            self.in_flight -= nbytes
            self._cond.notify_all()


@dataclass
class LaneCounters:
    ops: int = 0
    bytes: int = 0
    queued: int = 0
    failed: int = 0


class Lane:
    def __init__(self, name: LaneName, threads: int, inflight_bytes: int) -> None:
        self.name = name
        self.threads = threads
        self.budget = ByteBudget(inflight_bytes)
        self.counters = LaneCounters()
        self._pid = os.getpid()
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def _pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None or self._pid != os.getpid():
                if self._pid != os.getpid():
                    self.budget = ByteBudget(self.budget.limit)
                    self._pid = os.getpid()
                self._executor = ThreadPoolExecutor(
                    self.threads, thread_name_prefix=f"isolane-{self.name}")
            return self._executor

    def submit(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        return self.submit_sized(0, fn, *args, **kwargs)

    def submit_sized(
        self, nbytes: int, fn: Callable[..., T], *args: Any, **kwargs: Any
    ) -> Future[T]:
        """Queue ``fn``; blocks the caller while the lane's in-flight bytes are spent."""
        pool = self._pool()
        budget = self.budget
        budget.acquire(nbytes)
        self.counters.queued += 1

        def run() -> T:
            try:
                result = fn(*args, **kwargs)
            except BaseException:
                self.counters.failed += 1
                raise
            finally:
                budget.release(nbytes)
                self.counters.queued -= 1
            self.counters.ops += 1
            self.counters.bytes += nbytes
            return result

        try:
            return pool.submit(run)
        except BaseException:
            budget.release(nbytes)
            self.counters.queued -= 1
            raise

    def close(self) -> None:
        with self._lock:
            if self._executor is not None and self._pid == os.getpid():
                self._executor.shutdown(wait=True)
            self._executor = None


class LaneScheduler:
    """The lanes of one host: ``write`` (checkpoints), ``read`` (KV), ``background``."""

    def __init__(self, config: Config) -> None:
        write = config.group("write")
        read = config.group("read")
        capacity = config.group("capacity")
        self.config = config
        self.lanes: dict[LaneName, Lane] = {
            "write": Lane("write", write.threads if write else 4,
                          write.inflight_bytes if write else 512 << 20),
            "read": Lane("read", read.threads if read else 4,
                         read.inflight_bytes if read else 256 << 20),
            "background": Lane("background", capacity.threads if capacity else 2,
                               capacity.inflight_bytes if capacity else 256 << 20),
        }

    def lane(self, kind: JobKind) -> Lane:
        return self.lanes[lane_for(kind)]

    def submit(self, kind: JobKind, nbytes: int, fn: Callable[..., T], *args: Any) -> Future[T]:
        return self.lane(kind).submit_sized(nbytes, fn, *args)

    def stats(self) -> dict[str, dict[str, int]]:
        return {
            name: {"threads": lane.threads, "ops": lane.counters.ops,
                   "bytes": lane.counters.bytes, "queued": lane.counters.queued,
                   "failed": lane.counters.failed, "in_flight_bytes": lane.budget.in_flight,
                   "inflight_limit": lane.budget.limit}
            for name, lane in self.lanes.items()
        }

    def close(self) -> None:
        for lane in self.lanes.values():
            lane.close()


class SchedulerRegistry:
    """Hands out one LaneScheduler per host config within a process (weakly held).

    Opened on the same config, a SnapshotStore and a KVPool share one scheduler, so the
    governor sees both lanes. Each registry is an explicit object; ``shared_registry``
    is the process default that the public constructors use.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_key: weakref.WeakValueDictionary[tuple[Any, ...], LaneScheduler] = (
            weakref.WeakValueDictionary())

    @staticmethod
    def key(config: Config) -> tuple[Any, ...]:
        return tuple(sorted((g.name, g.role, g.devices) for g in config.device_groups.values()))

    def get(self, config: Config) -> LaneScheduler:
        with self._lock:
            key = self.key(config)
            scheduler = self._by_key.get(key)
            if scheduler is None:
                scheduler = LaneScheduler(config)
                self._by_key[key] = scheduler
            return scheduler


shared_registry = SchedulerRegistry()
