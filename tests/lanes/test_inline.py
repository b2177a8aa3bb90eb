"""Inline lane calls (``Lane.call``): a small job runs on the caller's thread when the
lane has free capacity, counted like a queued job (in-flight count and bytes, the
latency window, the host plane's read histogram) at the lane's I/O priority; a full
lane (all threads busy, a queue, or no room in the budget) queues it instead."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from isolane.config import config_from_dict
from isolane.errors import InvalidArgumentError
from isolane.lanes import JobKind, LaneScheduler
from isolane.lanes.host_governor import HostGovernor
from isolane.lanes.ioprio import IOPRIO_CLASS_BE, thread_io_priority
from isolane.lanes.lane import INLINE_MAX_BYTES


def _config(tmp_path: Path, **qos: object) -> Any:
    return config_from_dict({
        "home": str(tmp_path / "home"),
        "device_groups": {
            "ckpt": {"role": "write", "devices": [str(tmp_path / "w")], "threads": 2},
            "kv": {"role": "read", "devices": [str(tmp_path / "r")], "threads": 2,
                   "inflight_bytes": "4MiB"}},
        "qos": {"governor": True, "read_p99_slo_ms": 5, **qos}})


@pytest.fixture
def scheduler(tmp_path: Path) -> Iterator[LaneScheduler]:
    s = LaneScheduler(_config(tmp_path))
    yield s
    s.close()


def test_an_inline_call_runs_on_the_callers_thread_counted_as_a_read(
        scheduler: LaneScheduler) -> None:
    lane = scheduler.lane(JobKind.KV_GET)
    seen: dict[str, Any] = {}

    def job() -> int:
        seen["thread"] = threading.current_thread().name
        seen["stats"] = scheduler.stats()["read"]
        seen["budget"] = lane.budget.in_flight
        return 7

    assert lane.call(4096, job) == 7
    assert seen["thread"] == threading.current_thread().name  # no hop to a worker
    during = seen["stats"]
    assert (during["queued"], during["running"], during["queue_depth"]) == (1, 1, 0)
    assert during["in_flight_bytes"] == 4096 and seen["budget"] == 4096
    after = scheduler.stats()["read"]
    assert (after["ops"], after["bytes"], after["queued"], after["in_flight_bytes"]) == (
        1, 4096, 0, 0)
    assert lane.budget.in_flight == 0
    assert after["latency_ms"]["count"] == 1  # the lane's window
    assert after["kv_get_latency_ms"]["count"] == 1  # the governor's signal
    governor = scheduler.governor
    assert isinstance(governor, HostGovernor)
    assert governor.epochs.total == 1  # what this process publishes on the host plane
    assert int(sum(int(c.sum()) for c in governor.epochs.snapshot()[1])) == 1


def test_an_inline_failure_is_counted_released_and_raised(scheduler: LaneScheduler) -> None:
    lane = scheduler.lane(JobKind.KV_GET)

    def broken() -> None:
        raise InvalidArgumentError("bad read")

    with pytest.raises(InvalidArgumentError, match="bad read"):
        lane.call(1024, broken)
    stats = scheduler.stats()["read"]
    assert (stats["failed"], stats["ops"], stats["queued"], stats["in_flight_bytes"]) == (
        1, 0, 0, 0)
    assert lane.budget.in_flight == 0


def test_a_lane_with_every_thread_busy_queues_the_call(scheduler: LaneScheduler) -> None:
    lane = scheduler.lane(JobKind.KV_GET)
    release = threading.Event()
    busy = [lane.submit_sized(1, release.wait) for _ in range(2)]  # both read threads
    while scheduler.stats()["read"]["running"] < 2:
        threading.Event().wait(0.001)
    assert lane.call_inline(4096, threading.current_thread) is None
    assert scheduler.stats()["read"]["ops"] == 0  # it did not run

    got: list[str] = []
    caller = threading.Thread(target=lambda: got.append(
        lane.call(4096, lambda: threading.current_thread().name)))
    caller.start()
    while scheduler.stats()["read"]["queue_depth"] < 1:  # queued behind the busy ones
        threading.Event().wait(0.001)
    release.set()
    caller.join(timeout=10)
    for fut in busy:
        fut.result(timeout=10)
    assert got and got[0].startswith("isolane-read")  # ran on a worker, not the caller


def test_a_queue_or_a_spent_budget_sends_the_call_to_the_queue(
        scheduler: LaneScheduler) -> None:
    lane = scheduler.lane(JobKind.KV_GET)
    release = threading.Event()
    first = lane.submit_sized(4 << 20, release.wait)  # the whole 4 MiB budget
    while scheduler.stats()["read"]["running"] < 1:
        threading.Event().wait(0.001)
    assert lane.call_inline(4096, int) is None  # one thread free, but no budget
    release.set()
    first.result(timeout=10)

    gate = threading.Event()
    blockers = [lane.submit_sized(1, gate.wait) for _ in range(3)]  # one waits in the queue
    while scheduler.stats()["read"]["queue_depth"] < 1:
        threading.Event().wait(0.001)
    assert lane.call_inline(1, int) is None  # a queue: jobs ahead of it come first
    gate.set()
    for fut in blockers:
        fut.result(timeout=10)
    done = lane.call_inline(1, int)  # free again
    assert done is not None and done.value == 0


def test_large_governed_or_unisolated_jobs_never_run_inline(tmp_path: Path,
                                                            scheduler: LaneScheduler) -> None:
    me = threading.current_thread().name
    read = scheduler.lane(JobKind.KV_GET)
    assert read.call_inline(INLINE_MAX_BYTES + 1, int) is None
    write = scheduler.lane(JobKind.CHECKPOINT_WRITE)  # governed: waits for tokens
    assert write.call_inline(1, int) is None
    assert write.call(1, lambda: threading.current_thread().name).startswith("isolane-write")
    shared = LaneScheduler(_config(tmp_path / "shared"), isolation=False)
    try:
        lane = shared.lane(JobKind.KV_GET)
        assert lane.call_inline(1, int) is None
        assert lane.call(1, lambda: threading.current_thread().name) != me
    finally:
        shared.close()


@pytest.mark.skipif(not sys.platform.startswith("linux") or thread_io_priority() is None,
                    reason="per-thread I/O priorities are a Linux feature")
def test_an_inline_call_runs_at_the_read_lanes_io_priority(scheduler: LaneScheduler) -> None:
    lane = scheduler.lane(JobKind.KV_GET)
    worker = lane.submit(thread_io_priority).result()  # what a read-lane thread has
    own = thread_io_priority()
    assert own != worker  # the caller's thread has the process's default
    assert lane.call(1, thread_io_priority) == worker
    assert thread_io_priority() == own  # the caller's own priority is back
    write = scheduler.lane(JobKind.CHECKPOINT_WRITE).submit(thread_io_priority).result()
    assert write == (IOPRIO_CLASS_BE, 7) and worker != write
