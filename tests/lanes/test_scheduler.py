from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from isolane.config import config_from_dict
from isolane.lanes import ByteBudget, JobKind, LaneScheduler, SchedulerRegistry, lane_for


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
