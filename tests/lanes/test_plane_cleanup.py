"""Nothing of a host lane plane stays in its folder once no process uses it: the last
member to leave removes the plane file and its lock; a plane whose last member was
SIGKILLed is removed by a later process that opens a plane in the same folder. The
removal never races a process joining at that moment (many processes joining and
leaving at once always find each other in the one current file) and never follows
a link. Members are real ``tests/lanes/plane_member.py`` processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from isolane.config import Config, config_from_dict
from isolane.lanes.plane import PLANE_DIR_ENV, HostPlane, plane_path

REPO = Path(__file__).resolve().parents[2]


def write_config(tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "home": str(tmp_path / name / "home"),
        "device_groups": {"ckpt": {"role": "write", "devices": [str(tmp_path / name / "w")]},
                          "kv": {"role": "read", "devices": [str(tmp_path / name / "r")]}},
        "qos": {"read_p99_slo_ms": 5, "write_bandwidth_max": "1GiB",
                "write_bandwidth_min": "16MiB", "governor_period_s": 0.05}}))
    return path


def start(config: Path, seconds: float, out: Path, planes: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(REPO), PLANE_DIR_ENV: str(planes)}
    return subprocess.Popen([sys.executable, "-m", "tests.lanes.plane_member", str(config),
                             "writer", str(seconds), str(out)], cwd=REPO, env=env)


def wait_ready(out: Path, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if out.exists() and '"ready"' in out.read_text():
            return
        if proc.poll() is not None:
            raise AssertionError(f"member exited with {proc.returncode} before joining")
        time.sleep(0.02)
    raise AssertionError("member did not join within 30 s")


@pytest.fixture
def planes(tmp_path: Path) -> Path:
    folder = tmp_path / "planes"
    folder.mkdir()
    return folder


def test_the_last_member_to_leave_removes_the_plane_and_its_lock(
        tmp_path: Path, planes: Path) -> None:
    config = write_config(tmp_path, "host")
    first = start(config, 0.5, tmp_path / "a.jsonl", planes)
    second = start(config, 2.0, tmp_path / "b.jsonl", planes)
    wait_ready(tmp_path / "a.jsonl", first)
    wait_ready(tmp_path / "b.jsonl", second)
    assert first.wait(30) == 0
    names = sorted(os.listdir(planes))
    assert len(names) == 2 and names[1] == names[0] + ".lock"  # the other one is still in
    assert second.wait(30) == 0
    assert os.listdir(planes) == []


@pytest.mark.parametrize("later", ["same config", "another config"])
def test_a_plane_whose_last_member_was_killed_is_removed_by_a_later_process(
        tmp_path: Path, planes: Path, later: str) -> None:
    config = write_config(tmp_path, "host")
    victim = start(config, 60, tmp_path / "victim.jsonl", planes)
    wait_ready(tmp_path / "victim.jsonl", victim)
    victim.send_signal(signal.SIGKILL)
    victim.wait(30)
    assert len(os.listdir(planes)) == 2  # the plane and its lock, abandoned
    other = config if later == "same config" else write_config(tmp_path, "other")
    assert start(other, 0.3, tmp_path / "later.jsonl", planes).wait(30) == 0
    assert os.listdir(planes) == []


def make_config(tmp_path: Path) -> Config:
    return config_from_dict({
        "home": str(tmp_path / "home"),
        "device_groups": {"w": {"role": "write", "devices": [str(tmp_path / "w")]}},
        "qos": {"plane_dir": str(tmp_path / "planes")}})


def test_an_observer_that_never_joins_leaves_no_file_behind(
        tmp_path: Path, planes: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PLANE_DIR_ENV, raising=False)
    plane = HostPlane.open(make_config(tmp_path))
    assert plane is not None
    plane.close()
    assert os.listdir(planes) == []


def test_cleanup_never_follows_a_link_nor_touches_foreign_files(
        tmp_path: Path, planes: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PLANE_DIR_ENV, raising=False)
    outside = tmp_path / "precious"
    outside.write_bytes(b"keep me")
    uid = os.geteuid()
    link = planes / f"isolane-lanes-{uid}-{'ab' * 10}.plane"
    link.symlink_to(outside)
    lock_link = planes / f"isolane-lanes-{uid}-{'cd' * 10}.plane.lock"
    lock_link.symlink_to(outside)
    foreign = planes / "someone-elses.plane"
    foreign.write_bytes(b"x")
    plane = HostPlane.open(make_config(tmp_path))
    assert plane is not None
    plane.close()
    assert outside.read_bytes() == b"keep me"
    assert sorted(os.listdir(planes)) == sorted([link.name, lock_link.name, foreign.name])


JOINER = """
import os, sys, time
from pathlib import Path
from isolane.config import config_from_dict
from isolane.lanes.plane import HostPlane
from isolane.lanes.plane_format import SLOT_HEAD, slot_offset
tmp = Path(sys.argv[1])
config = config_from_dict({"home": str(tmp / "home"),
    "device_groups": {"w": {"role": "write", "devices": [str(tmp / "w")]}},
    "qos": {"plane_dir": str(tmp / "planes")}})
bad = 0
for _ in range(int(sys.argv[2])):
    plane = HostPlane.open(config)
    assert plane is not None
    slot = plane.join(time.monotonic())
    # While we are a member, nobody may remove or replace the file we joined.
    try:
        ino = os.stat(plane.path, follow_symlinks=False).st_ino
    except FileNotFoundError:
        ino = -1
    mine = SLOT_HEAD.unpack_from(plane.read_bytes(slot_offset(slot), SLOT_HEAD.size))[1]
    if ino != plane._ino or mine != os.getpid():
        bad += 1
    plane.close()
print(bad)
"""


def test_joiners_and_the_last_member_out_never_race(tmp_path: Path, planes: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != PLANE_DIR_ENV}
    env["PYTHONPATH"] = str(REPO)
    procs = [subprocess.Popen([sys.executable, "-c", JOINER, str(tmp_path), "150"],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(4)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * 4
    assert [int(o.strip()) for o in outs] == [0] * 4
    assert os.listdir(planes) == []
    assert not plane_path(make_config(tmp_path)).exists()
