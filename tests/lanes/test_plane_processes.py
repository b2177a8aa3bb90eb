"""The host lane plane with real processes: one process's slow KV reads cut another
process's checkpoint writes; writers share the host rate fairly; a killed member's
share comes back to the others; a forked child joins as itself; the CLI lists every
member. Members are ``tests/lanes/plane_member.py`` processes on one config."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from isolane.cli.main import cli
from isolane.config import load_config
from isolane.lanes.host_view import read_host_view

MiB = 1 << 20
REPO = Path(__file__).resolve().parents[2]
CAP = 1 << 30
FLOOR = 24 * MiB


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "host.yaml"
    path.write_text(yaml.safe_dump({
        "home": str(tmp_path / "home"),
        "device_groups": {"ckpt": {"role": "write", "devices": [str(tmp_path / "w")],
                                   "threads": 2},
                          "kv": {"role": "read", "devices": [str(tmp_path / "r")],
                                 "threads": 4}},
        "qos": {"read_p99_slo_ms": 5, "write_bandwidth_max": CAP,
                "write_bandwidth_min": FLOOR, "read_p99_window_s": 0.5,
                "governor_period_s": 0.05}}))
    return path


class Members:
    """Member processes of one test; all killed at the end."""

    def __init__(self, config: Path, tmp: Path) -> None:
        self.config, self.tmp = config, tmp
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, role: str, seconds: float, name: str, *extra: str) -> tuple[
            subprocess.Popen[bytes], Path]:
        out = self.tmp / f"{name}.jsonl"
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        proc = subprocess.Popen([sys.executable, "-m", "tests.lanes.plane_member",
                                 str(self.config), role, str(seconds), str(out), *extra],
                                cwd=REPO, env=env)
        self.procs.append(proc)
        wait_for(lambda: any(r.get("ready") for r in lines(out)), 20, f"{name} to join")
        return proc, out

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


@pytest.fixture
def members(config_file: Path, tmp_path: Path) -> Iterator[Members]:
    m = Members(config_file, tmp_path)
    yield m
    m.close()


def lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.endswith("}"):  # not a line being written
            out.append(json.loads(line))
    return out


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> float:
    t0 = time.monotonic()
    while not condition():
        assert time.monotonic() - t0 < timeout_s, f"timed out waiting for {what}"
        time.sleep(0.02)
    return time.monotonic() - t0


def last(path: Path) -> dict[str, Any]:
    return lines(path)[-1]


def bytes_between(path: Path, t0: float, t1: float) -> float:
    rows = [r for r in lines(path) if t0 <= r["t"] <= t1]
    return rows[-1]["done"] - rows[0]["done"]


def test_a_readers_slow_reads_cut_another_processes_writes_and_give_them_back(
        members: Members) -> None:
    _writer, wout = members.start("writer", 12, "writer")
    wait_for(lambda: last(wout)["rate"] == CAP, 5, "the writer at its cap")
    reader, rout = members.start("reader", 2.5, "reader", "--read-ms", "20")
    started = next(r["t"] for r in lines(rout) if r.get("ready"))
    wait_for(lambda: (last(wout)["rate"] or CAP) < CAP, 3, "a cut")
    cut_at = next(r["t"] for r in lines(wout) if r["t"] > started and r["rate"] < CAP)
    assert cut_at - started < 1.0  # the writer never saw a read: the host plane did
    wait_for(lambda: last(wout)["rate"] <= CAP / 4, 5, "deeper cuts")
    reader.wait(timeout=20)
    gone = time.monotonic()
    wait_for(lambda: last(wout)["rate"] == CAP, 6, "the bandwidth back")
    assert time.monotonic() - gone < 6
    assert any(d["reason"].startswith("cut: read p99")
               for row in lines(wout) for d in row["host"]["decisions"])


def test_three_writer_processes_share_the_floor_and_the_rate_fairly(
        members: Members) -> None:
    outs = [members.start("writer", 14, f"w{i}")[1] for i in range(3)]
    members.start("reader", 14, "reader", "--read-ms", "30")
    wait_for(lambda: all(last(o)["rate"] is not None and last(o)["rate"] <= FLOOR / 3 * 1.01
                         for o in outs), 10, "the host rate at its floor, split in three")
    t0 = time.monotonic()
    time.sleep(3.0)
    t1 = time.monotonic()
    done = [bytes_between(o, t0, t1) for o in outs]
    mean = sum(done) / 3
    assert all(abs(d - mean) <= 0.2 * mean for d in done), done
    total_rate = sum(done) / (t1 - t0)
    assert 0.8 * FLOOR <= total_rate <= 1.3 * FLOOR  # the floor holds for the host


def test_a_killed_members_share_and_slot_come_back_within_a_second(
        members: Members, config_file: Path) -> None:
    _a, aout = members.start("writer", 14, "a")
    b, bout = members.start("writer", 14, "b")
    members.start("reader", 14, "reader", "--read-ms", "30")
    wait_for(lambda: last(aout)["rate"] is not None
             and last(aout)["rate"] <= FLOOR / 2 * 1.01, 10, "the floor split in two")
    slot_b = next(r["slot"] for r in lines(bout) if r.get("ready"))
    b.send_signal(signal.SIGKILL)  # mid-write: its tokens and rate must not stick
    b.wait()
    killed = time.monotonic()
    wait_for(lambda: last(aout)["rate"] >= FLOOR * 0.99, 3, "a's share to grow")
    assert time.monotonic() - killed < 1.5
    view = read_host_view(load_config(config_file))
    assert b.pid not in [m["pid"] for m in view["members"]]
    _c, cout = members.start("writer", 3, "c")  # a newcomer takes the dead slot
    assert next(r["slot"] for r in lines(cout) if r.get("ready")) == slot_b


def test_a_forked_child_joins_as_itself_and_never_touches_its_parents_slot(
        members: Members, config_file: Path) -> None:
    parent, out = members.start("forker", 4, "forker")
    parent_slot = next(r["slot"] for r in lines(out) if r.get("ready"))
    wait_for(lambda: any(r.get("ready") and r["pid"] != parent.pid for r in lines(out)), 10,
             "the child to join")
    child = next(r for r in lines(out) if r.get("ready") and r["pid"] != parent.pid)
    assert child["slot"] is not None and child["slot"] != parent_slot
    view = read_host_view(load_config(config_file))
    by_slot = {m["slot"]: m["pid"] for m in view["members"]}
    assert by_slot.get(parent_slot) == parent.pid  # checksum intact, still the parent's
    parent.wait(timeout=20)
    assert parent.returncode == 0


def test_lanes_stats_lists_every_member_of_the_host(members: Members,
                                                    config_file: Path) -> None:
    w, _ = members.start("writer", 10, "writer")
    r, _ = members.start("reader", 10, "reader", "--read-ms", "2")
    time.sleep(0.6)
    runner = CliRunner()
    result = runner.invoke(cli, ["--config", str(config_file), "lanes", "stats", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    pids = {m["pid"]: m for m in data["host"]["members"]}
    assert {w.pid, r.pid} <= set(pids)
    assert "writer" in pids[w.pid]["roles"] and "reader" in pids[r.pid]["roles"]
    assert data["host"]["read_latency_ms"]["count"] > 0
    text = runner.invoke(cli, ["--config", str(config_file), "lanes", "stats"])
    assert text.exit_code == 0, text.output
    assert str(w.pid) in text.output and str(r.pid) in text.output
    assert "host read" in text.output
