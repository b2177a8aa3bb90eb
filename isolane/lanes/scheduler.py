"""LaneScheduler: one worker pool, byte budget and latency window per device group.

Every I/O job names its kind; ``lane_for`` maps the kind to a lane, and the job runs
only on that lane's threads. A flood of checkpoint chunks therefore queues behind the
write lane's budget and can never occupy a KV worker. Inside a lane, jobs run in
priority order (KV gets before KV puts; ``priority_of``). The governor
(``isolane.lanes.qos``) meters checkpoint writes and background work with token buckets
that the governed lanes' own workers wait on, and sets their rates from the read
lane's p99.

A lane (``isolane.lanes.lane``) also runs small jobs on the caller's thread when it
has free capacity (``Lane.call``), counted and timed like queued ones.

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
from typing import Any, TypeVar

from isolane.config import Config
from isolane.errors import InvalidArgumentError
from isolane.lanes.assignment import LANE_NAMES, JobKind, LaneName, lane_for
from isolane.lanes.forksafe import ForkSafe
from isolane.lanes.host_governor import HostGovernor, LocalState
from isolane.lanes.ioprio import set_thread_io_priority
from isolane.lanes.lane import (
    INLINE_MAX_BYTES,
    STATS_WINDOW_S,
    ByteBudget,
    Inline,
    Lane,
    LaneCounters,
    LaneHandle,
)
from isolane.lanes.metrics import LatencyWindow
from isolane.lanes.plane import HostPlane
from isolane.lanes.plane_format import ROLE_NODE, ROLE_READER, ROLE_WRITER
from isolane.lanes.qos import Clock, Governor, TokenBucket
from isolane.lanes.workers import WorkerPool

T = TypeVar("T")

__all__ = ["INLINE_MAX_BYTES", "STATS_WINDOW_S", "ByteBudget", "Inline", "Lane",
           "LaneCounters", "LaneHandle", "LaneScheduler", "SchedulerRegistry",
           "shared_registry"]


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
                    watch=(JobKind.KV_GET, kv_gets) if name == "read" else None,
                    inline=True, io_priority=qos.io_priorities)
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
