"""The governor in a running scheduler: slow reads cut checkpoint writes within a
second; an idle read lane gives the bandwidth back. Real threads, real clock."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from isolane.config import config_from_dict
from isolane.lanes import JobKind, LaneScheduler

MiB = 1 << 20


@pytest.fixture
def scheduler(tmp_path: Path) -> Iterator[LaneScheduler]:
    config = config_from_dict({"device_groups": {
        "ckpt": {"role": "write", "devices": [str(tmp_path / "w")], "threads": 2},
        "kv": {"role": "read", "devices": [str(tmp_path / "r")], "threads": 2},
    }, "qos": {"read_p99_slo_ms": 5, "write_bandwidth_max": "1GiB",
               "write_bandwidth_min": "16MiB",
               "read_p99_window_s": 0.5, "governor_period_s": 0.05}})
    scheduler = LaneScheduler(config)
    yield scheduler
    scheduler.close()


def loop(stop: threading.Event, body: Callable[[], object]) -> threading.Thread:
    def run() -> None:
        while not stop.is_set():
            body()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def write_rate(scheduler: LaneScheduler) -> float | None:
    rate: float | None = scheduler.stats()["governor"]["write_rate_bytes_per_s"]
    return rate


def wait_for(condition: Callable[[], bool], timeout_s: float) -> float:
    """Seconds until ``condition`` held; fails after ``timeout_s``."""
    t0 = time.monotonic()
    while not condition():
        assert time.monotonic() - t0 < timeout_s, "condition not met in time"
        time.sleep(0.02)
    return time.monotonic() - t0


def test_slow_reads_cut_writes_then_idle_reads_give_them_back(
        scheduler: LaneScheduler) -> None:
    cap = 1 << 30
    writes = scheduler.lane(JobKind.CHECKPOINT_WRITE)
    reads = scheduler.lane(JobKind.KV_GET)
    stop_writes, stop_reads = threading.Event(), threading.Event()
    writer: threading.Thread | None = None
    try:
        writer = loop(stop_writes, lambda: writes.submit_sized(4 * MiB, lambda: None).result())
        assert write_rate(scheduler) == cap
        # Reads slower than the 5 ms SLO (as if the writes were crowding their disk).
        reader = loop(stop_reads, lambda: reads.submit_sized(4096, time.sleep, 0.02).result())
        cut_after_s = wait_for(lambda: (write_rate(scheduler) or cap) < cap, timeout_s=1.0)
        wait_for(lambda: (write_rate(scheduler) or cap) <= cap / 4, timeout_s=3.0)
        governor = scheduler.stats()["governor"]
        assert governor["read_p99_ms"] >= 20 and governor["cuts"] >= 2
        assert governor["decisions"][0]["reason"].startswith("cut: read p99")
        assert cut_after_s < 1.0
        stop_reads.set()
        reader.join(5)
        low = write_rate(scheduler)
        assert low is not None and low >= 16 * MiB  # never below the floor
        # Idle read lane: no evidence of interference, so the rate climbs back.
        wait_for(lambda: (write_rate(scheduler) or 0) > low, timeout_s=3.0)
        assert scheduler.stats()["governor"]["decisions"][-1]["reason"].startswith(
            "increase: read lane idle")
        assert scheduler.stats()["write"]["throttled_s"] > 0  # the writes did slow down
    finally:
        stop_reads.set()
        stop_writes.set()
        if writer is not None:
            writer.join(5)
