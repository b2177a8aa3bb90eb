from __future__ import annotations

import gc
import os
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest

from isolane.config import config_from_dict
from isolane.errors import InvalidArgumentError
from isolane.lanes import ByteBudget, JobKind, LaneScheduler, SchedulerRegistry, lane_for
from tests.support.clock import FakeClock


def _config(tmp_path: Path):  # type: ignore[no-untyped-def]
    return config_from_dict({"device_groups": {
        "ckpt": {"role": "write", "devices": [str(tmp_path / "w")], "threads": 2,
                 "inflight_bytes": "4MiB"},
        "kv": {"role": "read", "devices": [str(tmp_path / "r")], "threads": 3},
    }})


def test_job_kinds_map_to_their_lanes() -> None:
    assert lane_for(JobKind.CHECKPOINT_WRITE) == "write"
    assert lane_for(JobKind.CHECKPOINT_READ) == "write"
    assert lane_for(JobKind.KV_GET) == "read"
    assert lane_for(JobKind.KV_PUT) == "read"
    for kind in (JobKind.MIRROR, JobKind.DEMOTE, JobKind.COMPACT, JobKind.MIGRATE):
        assert lane_for(kind) == "background"


def test_checkpoint_jobs_run_only_on_write_lane_threads(tmp_path: Path) -> None:
    scheduler = LaneScheduler(_config(tmp_path))
    names = [scheduler.submit(JobKind.CHECKPOINT_WRITE, 1, lambda: threading.current_thread().name)
             .result() for _ in range(8)]
    kv = scheduler.submit(JobKind.KV_GET, 1, lambda: threading.current_thread().name).result()
    assert all(n.startswith("isolane-write") for n in names)
    assert kv.startswith("isolane-read")
    scheduler.close()


def test_flooded_write_lane_does_not_block_reads(tmp_path: Path) -> None:
    scheduler = LaneScheduler(_config(tmp_path))
    release = threading.Event()
    blocked = [scheduler.submit(JobKind.CHECKPOINT_WRITE, 1 << 20, release.wait)
               for _ in range(2)]  # both write threads now stuck
    started = time.perf_counter()
    assert scheduler.submit(JobKind.KV_GET, 4096, lambda: 42).result(timeout=5) == 42
    assert time.perf_counter() - started < 1.0
    assert scheduler.stats()["write"]["queued"] == 2
    release.set()
    for fut in blocked:
        fut.result()
    scheduler.close()


def test_byte_budget_applies_back_pressure() -> None:
    budget = ByteBudget(10)
    budget.acquire(6)
    acquired = threading.Event()

    def second() -> None:
        budget.acquire(6)
        acquired.set()

    thread = threading.Thread(target=second)
    thread.start()
    assert not acquired.wait(0.2)
    budget.release(6)
    assert acquired.wait(2)
    thread.join()
    budget.release(6)
    budget.acquire(100)  # larger than the whole limit: runs once nothing is in flight
    assert budget.in_flight == 100


def test_registry_shares_one_scheduler_per_config(tmp_path: Path) -> None:
    registry = SchedulerRegistry()
    a = registry.get(_config(tmp_path))
    b = registry.get(_config(tmp_path))
    other = registry.get(config_from_dict({"device_groups": {
        "x": {"role": "write", "devices": [str(tmp_path / "other")]}}}))
    assert a is b
    assert other is not a


def test_lane_recreates_threads_after_fork(tmp_path: Path) -> None:
    scheduler = LaneScheduler(_config(tmp_path))
    assert scheduler.submit(JobKind.CHECKPOINT_WRITE, 1, lambda: 1).result() == 1
    pid = os.fork()
    if pid == 0:  # child: the parent's worker threads do not exist here
        try:
            ok = scheduler.submit(JobKind.CHECKPOINT_WRITE, 1, lambda: 7).result(timeout=10)
            os._exit(0 if ok == 7 else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    scheduler.close()


# -- priorities, isolation modes, faults -------------------------------------------------

@pytest.fixture
def stalled() -> Iterator[threading.Event]:
    """What stalled jobs wait on; set at teardown, so a failing test cannot leave a
    worker hanging (the process would wait for it at exit)."""
    event = threading.Event()
    yield event
    event.set()


def _one_thread_config(tmp_path: Path, **qos: object):  # type: ignore[no-untyped-def]
    return config_from_dict({"device_groups": {
        "ckpt": {"role": "write", "devices": [str(tmp_path / "w")], "threads": 2,
                 "inflight_bytes": "4MiB"},
        "kv": {"role": "read", "devices": [str(tmp_path / "r")], "threads": 1},
    }, "qos": qos})


def test_kv_gets_run_before_kv_puts_queued_earlier(tmp_path: Path,
                                                    stalled: threading.Event) -> None:
    scheduler = LaneScheduler(_one_thread_config(tmp_path))
    started, release = threading.Event(), stalled
    order: list[str] = []

    def block() -> None:
        started.set()
        release.wait()

    blocker = scheduler.submit(JobKind.KV_GET, 0, block)  # holds the one read worker
    assert started.wait(5)
    puts = [scheduler.lane(JobKind.KV_PUT).submit(order.append, f"put{i}") for i in range(3)]
    get = scheduler.lane(JobKind.KV_GET).submit(order.append, "get")
    assert scheduler.stats()["read"]["queue_depth"] == 4
    assert scheduler.stats()["read"]["running"] == 1
    release.set()
    for fut in [blocker, *puts, get]:
        fut.result(timeout=5)
    assert order == ["get", "put0", "put1", "put2"]
    scheduler.close()


def test_stalled_write_device_does_not_block_reads(tmp_path: Path,
                                                   stalled: threading.Event) -> None:
    """Every write worker hangs and the write budget is spent, so even a submitter of
    writes is stuck; KV reads still complete, with the governor running."""
    scheduler = LaneScheduler(_config(tmp_path))
    assert scheduler.governor is not None
    writes = scheduler.lane(JobKind.CHECKPOINT_WRITE)
    hung = [writes.submit_sized(2 << 20, stalled.wait) for _ in range(2)]  # 4 MiB budget
    submitter = threading.Thread(target=lambda: writes.submit_sized(1 << 20, lambda: None))
    submitter.start()
    submitter.join(0.2)
    assert submitter.is_alive()  # blocked on the write lane's budget
    reads = [scheduler.lane(JobKind.KV_GET).submit_sized(4096, lambda i=i: i)
             for i in range(50)]
    assert [f.result(timeout=5) for f in reads] == list(range(50))
    stats = scheduler.stats()
    assert stats["write"]["running"] == 2 and stats["write"]["in_flight_bytes"] == 4 << 20
    assert stats["read"]["ops"] == 50 and stats["read"]["latency_ms"]["count"] == 50
    assert scheduler.governor.running
    stalled.set()
    submitter.join(5)
    for fut in hung:
        fut.result(timeout=5)
    scheduler.close()
    assert not scheduler.governor.running


def test_without_isolation_a_stalled_write_blocks_reads(tmp_path: Path,
                                                        stalled: threading.Event) -> None:
    """The baseline mode: one FIFO pool for every kind, no governor."""
    scheduler = LaneScheduler(_config(tmp_path), isolation=False)
    assert scheduler.governor is None and scheduler.stats()["isolation"] is False
    threads = scheduler.lanes["write"].threads
    assert threads == 2 + 3 + 2  # write + read + background lanes together
    hung = [scheduler.submit(JobKind.CHECKPOINT_WRITE, 1, stalled.wait) for _ in range(threads)]
    read = scheduler.submit(JobKind.KV_GET, 4096, lambda: "late")
    time.sleep(0.3)
    assert not read.done()  # every shared worker is stuck behind the writes
    stalled.set()
    assert read.result(timeout=5) == "late"
    for fut in hung:
        fut.result(timeout=5)
    stats = scheduler.stats()
    assert stats["read"]["ops"] == 1 and stats["write"]["ops"] == threads
    assert stats["read"]["latency_ms"]["p99"] >= 250  # it waited behind the writes
    scheduler.close()


def test_governor_needs_isolation(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="governor=True needs isolation"):
        LaneScheduler(_config(tmp_path), isolation=False, governor=True)


def test_unknown_lane_name_lists_the_valid_ones(tmp_path: Path) -> None:
    scheduler = LaneScheduler(_config(tmp_path))
    assert scheduler.lane_named("read") is scheduler.lanes["read"]
    with pytest.raises(InvalidArgumentError, match="unknown lane 'reads'; lanes: write, "
                                                   "read, background"):
        scheduler.lane_named("reads")


def test_failures_and_latencies_are_counted(tmp_path: Path) -> None:
    scheduler = LaneScheduler(_config(tmp_path), governor=False)

    def boom() -> None:
        raise OSError("device gone")

    with pytest.raises(OSError, match="device gone"):
        scheduler.submit(JobKind.CHECKPOINT_WRITE, 100, boom).result()
    scheduler.submit(JobKind.CHECKPOINT_WRITE, 1 << 20, time.sleep, 0.02).result()
    write = scheduler.stats()["write"]
    assert write["failed"] == 1 and write["ops"] == 1 and write["bytes"] == 1 << 20
    assert write["queued"] == 0 and write["in_flight_bytes"] == 0
    assert write["latency_ms"]["count"] == 2
    assert 20 <= write["latency_ms"]["p999"] < 1000
    assert scheduler.stats()["governor"]["enabled"] is False
    scheduler.close()


def test_static_cap_meters_checkpoint_writes_but_not_restores(tmp_path: Path) -> None:
    scheduler = LaneScheduler(_one_thread_config(
        tmp_path, write_bandwidth_max="100MiB", write_bandwidth_min="10MiB"), governor=False)
    assert scheduler.stats()["write"]["rate_limit_bytes_per_s"] == 100 << 20
    t0 = time.perf_counter()
    for _ in range(4):  # 64 MiB: the 32 MiB burst, then 32 MiB at 100 MiB/s
        scheduler.lane(JobKind.CHECKPOINT_READ).submit_sized(16 << 20, lambda: None).result()
    restores_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(4):
        scheduler.lane(JobKind.CHECKPOINT_WRITE).submit_sized(16 << 20, lambda: None).result()
    writes_s = time.perf_counter() - t0
    assert restores_s < 0.1 and 0.28 < writes_s < 1.5
    assert scheduler.stats()["write"]["throttled_s"] == pytest.approx(0.32, abs=0.05)
    scheduler.close()


def test_governor_thread_does_not_keep_its_scheduler_alive(tmp_path: Path) -> None:
    scheduler = LaneScheduler(_config(tmp_path))
    assert scheduler.submit(JobKind.KV_GET, 1, lambda: 1).result() == 1
    governor = scheduler.governor
    assert governor is not None and governor.running
    thread = governor._thread
    ref = weakref.ref(scheduler)
    del scheduler, governor
    gc.collect()
    assert ref() is None
    assert thread is not None
    thread.join(2)
    assert not thread.is_alive()


def test_forked_child_runs_jobs_and_its_own_governor(tmp_path: Path,
                                                     stalled: threading.Event) -> None:
    scheduler = LaneScheduler(_config(tmp_path))
    hung = scheduler.submit(JobKind.CHECKPOINT_WRITE, 1 << 20, stalled.wait)  # mid-job
    pid = os.fork()
    if pid == 0:
        try:
            ok = scheduler.submit(JobKind.CHECKPOINT_WRITE, 1, lambda: 7).result(timeout=10)
            time.sleep(0.3)
            governor = scheduler.stats()["governor"]
            os._exit(0 if ok == 7 and governor["running"] and governor["steps"] > 0 else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    stalled.set()
    hung.result(timeout=5)
    scheduler.close()



def test_governor_watches_kv_gets_not_kv_puts(tmp_path: Path) -> None:
    clock = FakeClock()

    def slow() -> None:  # a job that takes 50 ms of the scheduler's clock
        clock.now += 0.05

    scheduler = LaneScheduler(_one_thread_config(  # period 10 s: only our steps count
        tmp_path, write_bandwidth_max="1GiB", write_bandwidth_min="10MiB",
        read_p99_window_s=10, governor_period_s=10), clock=clock)
    governor = scheduler.governor
    assert governor is not None
    governor.step()
    scheduler.lane(JobKind.CHECKPOINT_WRITE).submit_sized(16 << 20, lambda: None).result()
    for _ in range(3):
        scheduler.lane(JobKind.KV_PUT).submit(slow).result()
    clock.now += 0.1
    governor.step()
    read = scheduler.stats()["read"]
    assert read["latency_ms"]["p99"] == pytest.approx(50, rel=0.04)  # the lane saw them
    assert read["kv_get_latency_ms"]["count"] == 0
    assert governor.write.cuts == 0 and governor.read_p99_s is None
    scheduler.lane(JobKind.KV_GET).submit(slow).result()
    clock.now += 0.1
    governor.step()
    assert governor.write.cuts == 1
    assert scheduler.stats()["governor"]["read_p99_ms"] == pytest.approx(50, rel=0.04)
    scheduler.close()


def test_a_budget_release_wakes_a_waiting_acquire() -> None:
    """``release`` notifies only when some ``acquire`` waits: one that waits is woken."""
    budget = ByteBudget(10)
    budget.acquire(8)
    got = threading.Event()
    waiter = threading.Thread(target=lambda: (budget.acquire(5), got.set()))
    waiter.start()
    while not budget._waiting:  # the waiter is in its wait
        threading.Event().wait(0.001)
    budget.release(1)  # 7 + 5 still too many: it waits on
    assert not got.wait(0.05)
    budget.release(7)
    assert got.wait(2)
    waiter.join()
    assert budget.in_flight == 5 and budget._waiting == 0
