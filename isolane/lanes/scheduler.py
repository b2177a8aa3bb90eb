"""LaneScheduler: one worker pool, byte budget and latency window per device group.

Every I/O job names its kind; ``lane_for`` maps the kind to a lane, and the job runs
only on that lane's threads. A flood of checkpoint chunks therefore queues behind the
write lane's budget and can never occupy a KV worker. Inside a lane, jobs run in
priority order (KV gets before KV puts; ``priority_of``). The governor
(``isolane.lanes.qos``) meters checkpoint writes and background work with token buckets
that the governed lanes' own workers wait on, and sets their rates from the read
lane's p99.

Per lane the scheduler counts ops, bytes, failures, queue depth and in-flight bytes,
and keeps submit-to-completion latencies (queueing included: what the caller
experiences) over a sliding window; ``stats()`` reports them with the governor's
state.

Thread-safe. Fork-safe: a forked child (DataLoader workers) rebuilds locks and starts
fresh threads on its first submit instead of waiting on the parent's.
"""

from __future__ import annotations

import functools
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from typing import Any, ParamSpec, TypeVar

from isolane.config import Config
from isolane.errors import InvalidArgumentError
from isolane.lanes.assignment import (
    DEFAULT_KIND,
    LANE_NAMES,
    JobKind,
    LaneName,
    is_governed,
    lane_for,
    priority_of,
)
from isolane.lanes.forksafe import ForkSafe
from isolane.lanes.host_governor import HostGovernor, LocalState
from isolane.lanes.ioprio import set_thread_io_priority
from isolane.lanes.metrics import LatencyWindow
from isolane.lanes.plane import HostPlane
from isolane.lanes.plane_format import ROLE_NODE, ROLE_READER, ROLE_WRITER
from isolane.lanes.qos import Clock, Governor, TokenBucket
from isolane.lanes.workers import WorkerPool
from isolane.storage.pacing import paced_by

P = ParamSpec("P")
T = TypeVar("T")

STATS_WINDOW_S = 10.0


class ByteBudget(ForkSafe):
    """Blocks ``acquire`` while in-flight bytes would exceed the limit.

    A single job larger than the whole budget still runs once nothing else is in flight,
    so an oversized chunk makes slow progress instead of deadlocking.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0
        self._cond = threading.Condition()
        super().__init__()

    def _after_fork_in_child(self) -> None:
        self.in_flight = 0  # the parent's jobs do not run here
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
                 on_submit: Callable[[], None] | None = None) -> None:
        self.name = name
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

    def _finish(self, kind: JobKind, budget: ByteBudget, nbytes: int, started: float,
                ok: bool | None) -> None:
        """``ok``: True done, False failed, None never ran (cancelled)."""
        now = self.clock()
        if ok is not None:
            self.window.record(now - started, nbytes if ok else 0, now)
            if self.watch is not None and kind is self.watch[0]:
                self.watch[1].record(now - started, nbytes if ok else 0, now)
        with self._lock:
            self.counters.queued -= 1
            self.counters.in_flight_bytes -= nbytes
            if ok:
                self.counters.ops += 1
                self.counters.bytes += nbytes
            elif ok is False:
                self.counters.failed += 1
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


class LaneScheduler:
    """The lanes of one host: ``write`` (checkpoints), ``read`` (KV), ``background``.

    ``config``: threads and in-flight budgets come from the write, read and capacity
    groups (defaults 4 / 512 MiB, 4 / 256 MiB, 2 / 256 MiB when a group is absent),
    governor settings from ``config.qos``.

    ``isolation`` (default True): each lane has its own threads and budget. False is
    the baseline without isolation: every job kind shares one FIFO pool (as many
    threads as the three lanes together) and one budget (their sum), with no
    priorities and no governor; per-lane counters and latencies are still kept.

    ``governor`` (default: ``config.qos.governor``): run the AIMD governor. Without it
    the write lane keeps only the static cap ``qos.write_bandwidth_max`` (if any) and
    the background lane is unmetered.

    ``clock``: the time source of latencies and the governor (tests pass a fake one).

    ``host_plane`` (default True, and ``config.qos.host_plane``): the governor joins
    the config's host lane plane (``isolane.lanes.plane``), judging the SLO on every
    process's KV reads and sharing the host write rate with every process's writes;
    False (or no write access to the plane's folder) keeps it to this process.
    ``node``: this scheduler serves an ``isolane serve`` node (its role on the plane).
    """

    LANES = LANE_NAMES

    def __init__(self, config: Config, *, isolation: bool = True,
                 governor: bool | None = None, clock: Clock = time.monotonic,
                 host_plane: bool = True, node: bool = False) -> None:
        if governor and not isolation:
            raise InvalidArgumentError("governor=True needs isolation=True: without "
                                       "isolation there are no separate lanes to govern")
        self.config = config
        self.isolation = isolation
        qos = config.qos
        window_s = max(STATS_WINDOW_S, qos.read_p99_window_s)
        write, read, capacity = (config.group(r) for r in ("write", "read", "capacity"))
        sizes: dict[LaneName, tuple[int, int]] = {
            "write": (write.threads, write.inflight_bytes) if write else (4, 512 << 20),
            "read": (read.threads, read.inflight_bytes) if read else (4, 256 << 20),
            "background": ((capacity.threads, capacity.inflight_bytes) if capacity
                           else (2, 256 << 20)),
        }
        use_governor = isolation and (qos.governor if governor is None else governor)
        buckets: dict[LaneName, TokenBucket] = {}
        if use_governor:
            buckets = {"write": TokenBucket(None, clock=clock),
                       "background": TokenBucket(None, clock=clock)}
        elif isolation and qos.write_bandwidth_max is not None:
            buckets = {"write": TokenBucket(qos.write_bandwidth_max, clock=clock)}
        kv_gets = LatencyWindow(window_s)
        self.lanes: dict[LaneName, Lane] = {}
        if isolation:
            for name, (threads, inflight) in sizes.items():
                self.lanes[name] = Lane(
                    name, WorkerPool(f"isolane-{name}", threads, on_start=(
                        functools.partial(set_thread_io_priority, name)
                        if qos.io_priorities else None)), ByteBudget(inflight),
                    bucket=buckets.get(name), clock=clock, window_s=window_s,
                    watch=(JobKind.KV_GET, kv_gets) if name == "read" else None)
        else:
            pool = WorkerPool("isolane-shared", sum(t for t, _ in sizes.values()),
                              ordered=False)
            budget = ByteBudget(sum(b for _, b in sizes.values()))
            for name in sizes:
                self.lanes[name] = Lane(name, pool, budget, clock=clock, window_s=window_s)
        self.governor: Governor | None = None
        self.node = node
        if use_governor:
            plane = HostPlane.open(config) if qos.host_plane and host_plane else None
            if plane is not None:
                self.governor = HostGovernor(qos, kv_gets, buckets["write"],
                                             buckets["background"], plane=plane,
                                             local=self._local_state, clock=clock)
            else:
                self.governor = Governor(qos, kv_gets, buckets["write"],
                                         buckets["background"], clock=clock)
            for lane in self.lanes.values():  # the first job starts the control thread
                lane.on_submit = self.governor.ensure_running
        self._handles = {kind: LaneHandle(self.lanes[lane_for(kind)], kind) for kind in JobKind}

    def _local_state(self) -> LocalState:
        """This process's roles, lane sizes and governed demand, for the host plane."""
        read, write, background = (self.lanes[n] for n in ("read", "write", "background"))
        roles = ((ROLE_READER if read.counters.ops or read.counters.queued else 0)
                 | (ROLE_WRITER if write.counters.ops or write.counters.queued else 0)
                 | (ROLE_NODE if self.node else 0))
        return LocalState(roles, (read.threads, write.threads, background.threads),
                          write.counters.in_flight_bytes, background.counters.in_flight_bytes)

    def lane(self, kind: JobKind) -> LaneHandle:
        """Where jobs of ``kind`` go: its lane, submitting with the kind's priority."""
        return self._handles[kind]

    def lane_named(self, name: str) -> Lane:
        """The lane called ``name``; InvalidArgumentError names the valid ones."""
        if name not in self.lanes:
            raise InvalidArgumentError(f"unknown lane {name!r}; lanes: {', '.join(self.LANES)}")
        return self.lanes[name]

    def submit(self, kind: JobKind, nbytes: int, fn: Callable[..., T], *args: Any) -> Future[T]:
        return self.lane(kind).submit_sized(nbytes, fn, *args)

    def stats(self) -> dict[str, Any]:
        """JSON-able: each lane's counters and window latencies (the read lane also
        ``kv_get_latency_ms``, what the governor watches), ``governor`` (its settings,
        current rates and recent decisions) and ``isolation``."""
        out: dict[str, Any] = {name: lane.stats() for name, lane in self.lanes.items()}
        qos = self.config.qos
        governor: dict[str, Any] = {
            "enabled": self.governor is not None,
            "slo_ms": qos.read_p99_slo_ms,
            "window_s": qos.read_p99_window_s,
            "period_s": qos.governor_period_s,
        }
        if self.governor is not None:
            governor.update(self.governor.stats())
        else:
            write_bucket = self.lanes["write"].bucket
            governor.update({
                "write_rate_bytes_per_s": None if write_bucket is None else write_bucket.rate,
                "background_rate_bytes_per_s": None, "cap_bytes_per_s":
                qos.write_bandwidth_max if self.isolation else None, "decisions": []})
        out["governor"] = governor
        out["isolation"] = self.isolation
        return out

    def join_host(self) -> None:
        """Start the governor now rather than on the first job, so this process is on
        the host plane at once (a node is listed before its first request)."""
        if self.governor is not None:
            self.governor.ensure_running()

    def host_view(self) -> dict[str, Any]:
        """Every process on this host config as the plane shows it (see
        ``isolane.lanes.host_view``); ``available`` False without a plane."""
        from isolane.lanes.host_view import read_host_view, view_of

        if isinstance(self.governor, HostGovernor):
            return view_of(self.governor.plane, self.config.qos.read_p99_window_s)
        return read_host_view(self.config)

    def close(self) -> None:
        """Stop the governor, wait for queued jobs and end the threads. Reusable: a
        later submit starts them again."""
        if self.governor is not None:
            self.governor.stop()
        for lane in self.lanes.values():
            lane.close()


class SchedulerRegistry(ForkSafe):
    """Hands out one LaneScheduler per host config within a process (weakly held).

    Opened on the same config, a SnapshotStore and a KVPool share one scheduler, so the
    governor sees both lanes. Each registry is an explicit object; ``shared_registry``
    is the process default that the public constructors use.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_key: weakref.WeakValueDictionary[tuple[Any, ...], LaneScheduler] = (
            weakref.WeakValueDictionary())
        super().__init__()

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()

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
