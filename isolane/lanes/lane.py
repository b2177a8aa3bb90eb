"""One lane of the scheduler: its worker pool, byte budget, counters and latency window.

A ``Lane`` runs jobs of its kinds on its ``WorkerPool`` under its ``ByteBudget``
(shared by every lane when the scheduler runs without isolation), governed kinds
metered by its token bucket. ``LaneHandle`` is a lane seen as one job kind.

``Lane.call`` runs a small job and returns its result. It runs on the caller's thread
when the lane has free capacity (nothing queued, fewer jobs running than threads, room
in the budget): no hop to a worker and back, yet counted as a job of the lane like any
other (in-flight count and bytes, its latency window and so the host plane's read
histogram, which listens to the read lane's KV-get window) and run at the lane's I/O
priority (``ioprio.enter_io_priority``). Otherwise it queues as ``run`` does and the
caller waits. The KV pool's small gets go this way (``kvpool/tiers/disk.py``).

Thread-safe and fork-safe (see ``isolane.lanes.scheduler``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from typing import Any, Generic, ParamSpec, TypeVar

from isolane.lanes.assignment import DEFAULT_KIND, JobKind, LaneName, is_governed, priority_of
from isolane.lanes.forksafe import ForkSafe
from isolane.lanes.ioprio import enter_io_priority, leave_io_priority
from isolane.lanes.metrics import LatencyWindow
from isolane.lanes.qos import Clock, TokenBucket
from isolane.lanes.workers import WorkerPool
from isolane.storage.pacing import paced_by

P = ParamSpec("P")
T = TypeVar("T")

STATS_WINDOW_S = 10.0
INLINE_MAX_BYTES = 4 << 20  # jobs up to this size may run on the caller's thread (a restore piece)


class ByteBudget(ForkSafe):
    """Blocks ``acquire`` while in-flight bytes would exceed the limit.

    A single job larger than the whole budget still runs once nothing else is in flight,
    so an oversized chunk makes slow progress instead of deadlocking.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0
        self._waiting = 0  # threads in acquire's wait: release notifies only them
        # try_acquire/release take the lock itself: a Condition's ``with`` is a Python call.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        super().__init__()

    def _after_fork_in_child(self) -> None:
        self.in_flight = 0  # the parent's jobs do not run here
        self._waiting = 0
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)

    def acquire(self, nbytes: int) -> None:
        with self._cond:
            while self.in_flight and self.in_flight + nbytes > self.limit:
                self._waiting += 1
                try:
                    self._cond.wait()
                finally:
                    self._waiting -= 1
            self.in_flight += nbytes

    def try_acquire(self, nbytes: int) -> bool:
        """``acquire`` if that would not wait; False (nothing taken) otherwise."""
        with self._lock:
            if self.in_flight and self.in_flight + nbytes > self.limit:
                return False
            self.in_flight += nbytes
            return True

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.in_flight -= nbytes
            if self._waiting:  # notify_all is ~1 µs of Python even with no one waiting
                self._cond.notify_all()


class Inline(Generic[T]):
    """The result of a job that ran on the caller's thread (``Lane.call_inline``)."""

    __slots__ = ("value",)

    def __init__(self, value: T) -> None:
        self.value = value


@dataclass
class LaneCounters:
    ops: int = 0  # jobs finished without error
    bytes: int = 0  # their sizes
    queued: int = 0  # submitted and not finished (waiting or running)
    failed: int = 0
    waiting: int = 0  # submitted and not started: the queue depth
    in_flight_bytes: int = 0
    throttled_s: float = 0.0  # time workers slept in the governor's bucket


class Lane(ForkSafe):
    """One lane: jobs run on ``pool`` under ``budget`` (both shared by every lane when
    the scheduler runs without isolation), metered by ``bucket`` when governed.

    ``submit``/``submit_sized`` on the lane itself run jobs as the lane's default kind;
    ``LaneScheduler.lane(kind)`` returns a handle that submits as that kind.
    """

    def __init__(self, name: LaneName, pool: WorkerPool, budget: ByteBudget, *,
                 bucket: TokenBucket | None = None, clock: Clock = time.monotonic,
                 window_s: float = STATS_WINDOW_S,
                 watch: tuple[JobKind, LatencyWindow] | None = None,
                 on_submit: Callable[[], None] | None = None,
                 inline: bool = False, io_priority: bool = False) -> None:
        """``inline``: ``call`` may run small jobs on the caller's thread (see the
        module docstring); ``io_priority``: at this lane's I/O priority."""
        self.name = name
        self.inline = inline
        self.io_priority = io_priority
        self.pool = pool
        self.budget = budget
        self.bucket = bucket
        self.clock = clock
        self.window = LatencyWindow(window_s)  # every job of the lane
        # ``watch``: (kind, window) also recording that kind alone. The governor's
        # signal is KV gets, not the puts that share their lane.
        self.watch = watch
        self.counters = LaneCounters()
        self.on_submit = on_submit  # the governor starts its thread on the first job
        self._lock = threading.Lock()
        super().__init__()

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()
        self.counters = LaneCounters(ops=self.counters.ops, bytes=self.counters.bytes,
                                     failed=self.counters.failed)

    @property
    def threads(self) -> int:
        return self.pool.threads

    def submit(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        return self.run(DEFAULT_KIND[self.name], 0, fn, *args, **kwargs)

    def submit_sized(
        self, nbytes: int, fn: Callable[..., T], *args: Any, **kwargs: Any
    ) -> Future[T]:
        """Queue ``fn``; blocks the caller while the lane's in-flight bytes are spent."""
        return self.run(DEFAULT_KIND[self.name], nbytes, fn, *args, **kwargs)

    def run(self, kind: JobKind, nbytes: int, fn: Callable[..., T], *args: Any,
            **kwargs: Any) -> Future[T]:
        """Queue ``fn(*args, **kwargs)`` as a job of ``kind`` moving ``nbytes``.

        Blocks the caller while the in-flight budget is spent; never blocks it on the
        governor (governed jobs wait for tokens in a worker of their own lane).
        """
        started = self.clock()
        if self.on_submit is not None:
            self.on_submit()
        budget = self.budget
        budget.acquire(nbytes)
        with self._lock:
            self.counters.queued += 1
            self.counters.waiting += 1
            self.counters.in_flight_bytes += nbytes
        future: Future[T] = Future()
        bucket = self.bucket if is_governed(kind) else None

        def job() -> None:
            with self._lock:
                self.counters.waiting -= 1
            if not future.set_running_or_notify_cancel():
                self._finish(kind, budget, nbytes, started, ok=None)
                return
            try:
                if bucket is None:
                    result = fn(*args, **kwargs)
                else:  # the job's own writes pace themselves in slices (storage.pacing)
                    with paced_by(bucket, nbytes) as waited:
                        result = fn(*args, **kwargs)
                    if waited[0]:
                        with self._lock:
                            self.counters.throttled_s += waited[0]
            except BaseException as exc:
                self._finish(kind, budget, nbytes, started, ok=False)
                future.set_exception(exc)
            else:
                # Counted before the caller can see the result, so stats() after
                # result() includes this job.
                self._finish(kind, budget, nbytes, started, ok=True)
                future.set_result(result)

        try:
            self.pool.submit(priority_of(kind), job)
        except BaseException:
            with self._lock:
                self.counters.waiting -= 1
            self._finish(kind, budget, nbytes, started, ok=None)
            raise
        return future

    def call(self, kind: JobKind, nbytes: int, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` as a job of ``kind`` moving ``nbytes``, and its result: on the
        caller's thread when the lane has free capacity (``call_inline``), else queued
        (``run``) and waited for. Its exception propagates either way."""
        done = self.call_inline(kind, nbytes, fn, *args)
        if done is not None:
            return done.value
        return self.run(kind, nbytes, fn, *args).result()

    def call_inline(self, kind: JobKind, nbytes: int, fn: Callable[..., T], *args: Any,
                    ahead_ok: int = 0) -> Inline[T] | None:
        """Run ``fn(*args)`` on the caller's thread as a job of ``kind`` if the lane has
        free capacity: inline allowed (isolated lanes only), ``kind`` not governed,
        ``nbytes`` at most ``INLINE_MAX_BYTES``, nothing waiting in the queue, fewer
        jobs submitted and not finished than the lane has threads (inline ones count)
        and room in the budget. Counted and timed like a queued job, at the lane's I/O
        priority. None when it did not run (the caller queues it: ``run``).

        ``ahead_ok``: jobs the caller itself has just queued for the same request (the
        other pieces of one read); up to that many waiting jobs do not stop it, as
        they are not someone else's work it would overtake. They still count as
        submitted, so the lane never runs more jobs than its threads this way."""
        if not self.inline or nbytes > INLINE_MAX_BYTES or is_governed(kind):
            return None
        started = self.clock()
        budget = self.budget
        with self._lock:
            counters = self.counters
            if (counters.waiting > ahead_ok or counters.queued >= self.pool.threads
                    or not budget.try_acquire(nbytes)):
                return None
            counters.queued += 1
            counters.in_flight_bytes += nbytes
        if self.on_submit is not None:
            self.on_submit()
        own = enter_io_priority(self.name) if self.io_priority else None
        try:
            result = fn(*args)
        except BaseException:
            leave_io_priority(own)
            self._finish(kind, budget, nbytes, started, ok=False)
            raise
        leave_io_priority(own)
        self._finish(kind, budget, nbytes, started, ok=True)
        return Inline(result)

    def _finish(self, kind: JobKind, budget: ByteBudget, nbytes: int, started: float,
                ok: bool | None) -> None:
        """``ok``: True done, False failed, None never ran (cancelled)."""
        now = self.clock()
        if ok is not None:
            watch = self.watch
            self.window.record(now - started, nbytes if ok else 0, now,
                               watch[1] if watch is not None and kind is watch[0] else None)
        with self._lock:
            counters = self.counters
            counters.queued -= 1
            counters.in_flight_bytes -= nbytes
            if ok:
                counters.ops += 1
                counters.bytes += nbytes
            elif ok is False:
                counters.failed += 1
        budget.release(nbytes)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            counters = asdict(self.counters)
        recent = self.window.summary(self.clock())
        waiting = counters.pop("waiting")
        return {
            "threads": self.pool.threads, "ops": counters["ops"], "bytes": counters["bytes"],
            "queued": counters["queued"], "failed": counters["failed"],
            "in_flight_bytes": counters["in_flight_bytes"], "inflight_limit": self.budget.limit,
            "queue_depth": waiting, "running": counters["queued"] - waiting,
            "throttled_s": round(counters["throttled_s"], 3),
            "rate_limit_bytes_per_s": None if self.bucket is None or self.bucket.rate is None
            else round(self.bucket.rate),
            "latency_ms": recent.latency_ms(), "bytes_per_s": round(recent.bytes_per_s),
            "window_s": self.window.window_s,
            **({f"{self.watch[0].value}_latency_ms":
                self.watch[1].summary(self.clock()).latency_ms()} if self.watch else {}),
        }

    def close(self) -> None:
        """Wait for queued jobs and end this lane's threads (they restart on demand)."""
        self.pool.close()


class LaneHandle:
    """A lane seen as one job kind: what ``LaneScheduler.lane(kind)`` returns.

    Same ``submit``/``submit_sized`` as ``Lane``; jobs get the kind's priority and,
    for governed kinds, wait for the governor's tokens.
    """

    __slots__ = ("kind", "lane")

    def __init__(self, lane: Lane, kind: JobKind) -> None:
        self.lane = lane
        self.kind = kind

    # What callers read of a Lane: its name, size and budget.
    @property
    def name(self) -> LaneName:
        return self.lane.name

    @property
    def threads(self) -> int:
        return self.lane.threads

    @property
    def budget(self) -> ByteBudget:
        return self.lane.budget

    @property
    def counters(self) -> LaneCounters:
        return self.lane.counters

    def submit(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        return self.lane.run(self.kind, 0, fn, *args, **kwargs)

    def submit_sized(
        self, nbytes: int, fn: Callable[..., T], *args: Any, **kwargs: Any
    ) -> Future[T]:
        """Queue ``fn``; blocks the caller while the lane's in-flight bytes are spent."""
        return self.lane.run(self.kind, nbytes, fn, *args, **kwargs)

    def call(self, nbytes: int, fn: Callable[..., T], *args: Any) -> T:
        """``Lane.call`` as this kind: inline when the lane has room, else queued."""
        return self.lane.call(self.kind, nbytes, fn, *args)

    def call_inline(self, nbytes: int, fn: Callable[..., T], *args: Any, ahead_ok: int = 0
                    ) -> Inline[T] | None:
        """``Lane.call_inline`` as this kind: None when it did not run."""
        return self.lane.call_inline(self.kind, nbytes, fn, *args, ahead_ok=ahead_ok)
