"""``isolane lanes``: stats of this process's scheduler and the disk isolation check."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from isolane.config import load_config
from isolane.lanes import JobKind
from isolane.lanes.scheduler import shared_registry
from tests.cli.helpers import fails, ok, run


def write_config(tmp_path: Path, read_device: str | None = None, qos: str = "") -> str:
    path = tmp_path / "isolane.yaml"
    path.write_text(
        "device_groups:\n"
        f"  ckpt: {{role: write, devices: [{tmp_path / 'ckpt'}], threads: 3}}\n"
        f"  kv: {{role: read, devices: [{read_device or tmp_path / 'kv'}], threads: 5, "
        "inflight_bytes: 64MiB}\n"
        + (f"qos: {{{qos}}}\n" if qos else ""))
    return str(path)


def test_stats_shows_configured_lanes_and_governor_settings(tmp_path: Path) -> None:
    config = write_config(tmp_path, qos="read_p99_slo_ms: 2, write_bandwidth_max: 1GiB, "
                                        "write_bandwidth_min: 50MiB")
    out = ok(run("--config", config, "lanes", "stats")).stdout
    rows = {line.split()[0]: line.split() for line in out.splitlines()[2:5]}
    assert rows["write"][1] == "3" and rows["read"][1:3] == ["5", "64.0"]
    assert rows["write"][-2:] == ["1.0", "GiB/s"] and rows["read"][-1] == "unlimited"
    assert "read p99 SLO 2 ms" in out and "floor 50.0 MiB/s, cap 1.0 GiB/s" in out
    assert "a fresh CLI shows zeros" in out
    stats = json.loads(ok(run("--config", config, "lanes", "stats", "--json")).stdout)
    assert set(stats) == {"write", "read", "background", "governor", "isolation", "host"}
    assert stats["host"]["available"] and stats["host"]["members"] == []  # nobody runs
    assert stats["read"]["threads"] == 5 and stats["read"]["inflight_limit"] == 64 << 20
    assert stats["read"]["latency_ms"] == {"p50": None, "p99": None, "p999": None,
                                           "count": 0}
    gov = stats["governor"]
    assert gov["enabled"] and gov["slo_ms"] == 2.0 and gov["cap_bytes_per_s"] == 1 << 30
    assert gov["write_rate_bytes_per_s"] == 1 << 30 and gov["floor_bytes_per_s"] == 50 << 20


def test_stats_of_one_lane_and_an_unknown_lane(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    stats = json.loads(ok(run("--config", config, "lanes", "stats", "--lane", "read",
                              "--json")).stdout)
    assert set(stats) == {"read", "governor", "isolation", "host"}
    fails(run("--config", config, "lanes", "stats", "--lane", "reads"), 1,
          "unknown lane 'reads'; lanes: write, read, background")


def test_stats_show_this_process_counters_and_governor_decisions(tmp_path: Path) -> None:
    """In-process (a node embedding the CLI, or this test) the command reports the live
    scheduler: counters, latencies and the governor's cuts."""
    config = write_config(tmp_path, qos="read_p99_slo_ms: 5, write_bandwidth_min: 16MiB")
    scheduler = shared_registry.get(load_config(config))
    writes, reads = scheduler.lane(JobKind.CHECKPOINT_WRITE), scheduler.lane(JobKind.KV_GET)
    stop = threading.Event()

    def flood() -> None:
        while not stop.is_set():
            writes.submit_sized(8 << 20, lambda: None).result()

    writer = threading.Thread(target=flood, daemon=True)
    writer.start()
    try:
        deadline = time.monotonic() + 5
        while scheduler.stats()["governor"]["cuts"] == 0:
            assert time.monotonic() < deadline, scheduler.stats()["governor"]
            reads.submit_sized(4096, time.sleep, 0.02).result()  # over the 5 ms SLO
    finally:
        stop.set()
        writer.join(5)
    stats = json.loads(ok(run("--config", config, "lanes", "stats", "--json")).stdout)
    assert stats["read"]["ops"] > 0 and stats["read"]["latency_ms"]["p99"] >= 20
    assert stats["write"]["bytes"] >= 8 << 20
    assert stats["governor"]["write_rate_bytes_per_s"] is not None  # no longer unlimited
    assert stats["governor"]["decisions"][0]["reason"].startswith("cut: read p99")
    out = ok(run("--config", config, "lanes", "stats")).stdout
    assert "write: unlimited -> " in out and "cut: read p99" in out


def test_check_warns_when_write_and_read_share_a_disk(tmp_path: Path) -> None:
    env = {"ISOLANE_HOME": str(tmp_path / "home")}  # the default: both under one folder
    result = ok(run("lanes", "check", env=env))
    assert "write group 'checkpoint':" in result.stdout
    assert str(tmp_path / "home" / "kv") in result.stdout
    warning = [line for line in result.stdout.splitlines() if line.startswith("WARNING:")]
    assert len(warning) == 1
    assert "write group 'checkpoint' and read group 'kv' share" in warning[0]
    assert "separate disks" in warning[0]
    report = json.loads(ok(run("lanes", "check", "--json", env=env)).stdout)
    assert report["ok"] is False and len(report["warnings"]) == 1
    [pair] = report["shared"]
    assert pair["groups"] == ["checkpoint", "kv"] and pair["isolation_broken"]
    device = report["groups"][0]["devices"][0]
    st = os.stat(tmp_path)
    assert device["st_dev"] == f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    assert device["probed"] == str(tmp_path) and device["mount_point"]


def test_check_passes_for_separate_disks_and_remote_devices(tmp_path: Path) -> None:
    if not os.path.isdir("/dev/shm") or os.stat("/dev/shm").st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("no second filesystem (/dev/shm) to put the read group on")
    config = write_config(tmp_path, read_device="/dev/shm/isolane-test-lanes-kv")
    out = ok(run("--config", config, "lanes", "check")).stdout
    assert "WARNING" not in out and "ok: the write and read groups are on separate disks" in out
    assert json.loads(ok(run("--config", config, "lanes", "check", "--json")).stdout)["ok"]
    remote = ok(run("--store", "s3://bucket/ckpt", "lanes", "check")).stdout
    assert "s3://bucket/ckpt  remote (object storage: no local disk)" in remote
    assert "no write and read group to compare" in remote
