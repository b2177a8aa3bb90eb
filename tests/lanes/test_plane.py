"""The host lane plane file: created tight, checked on open, rebuilt (with one warning)
when garbage, truncated, of another version or another config, never trusted; a
folder without write access leaves per-process lanes, said once; dead members'
slots are reused, so many short-lived processes never fill it; clock steps do not
stall the host governor."""

from __future__ import annotations

import logging
import os
import stat
import struct
import subprocess
import time
import zlib
from pathlib import Path

import pytest

from isolane.config import Config, config_from_dict
from isolane.lanes import JobKind, LaneScheduler
from isolane.lanes.histogram import empty
from isolane.lanes.host_governor import HostGovernor
from isolane.lanes.plane import PLANE_DIR_ENV, HostPlane, config_digest, plane_path
from isolane.lanes.plane_format import (
    FILE_BYTES,
    HEADER,
    MAGIC,
    SLOT_BYTES,
    SLOTS,
    VERSION,
    Header,
    SlotRecord,
    fresh_file,
)
from isolane.lanes.qos import Governor
from tests.support.clock import FakeClock


def make_config(tmp_path: Path, **qos: object) -> Config:
    return config_from_dict({
        "home": str(tmp_path / "home"),
        "device_groups": {"w": {"role": "write", "devices": [str(tmp_path / "w")]},
                          "r": {"role": "read", "devices": [str(tmp_path / "r")]}},
        "qos": {"read_p99_slo_ms": 5, "write_bandwidth_max": "1GiB",
                "write_bandwidth_min": "16MiB", **qos}})


@pytest.fixture
def config(tmp_path: Path) -> Config:
    return make_config(tmp_path)


def rebuilt_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "rebuilt it" in r.getMessage()]


def test_a_new_plane_is_private_and_carries_its_magic_version_and_config(
        config: Config) -> None:
    plane = HostPlane.open(config)
    assert plane is not None
    try:
        info = os.stat(plane.path)
        assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_size == FILE_BYTES
        head = plane.path.read_bytes()[:HEADER.size]
        fields = HEADER.unpack(head)
        assert fields[0] == MAGIC and fields[1] == VERSION and fields[3] == SLOTS
        assert fields[8] == config_digest(config)
    finally:
        plane.close()


@pytest.mark.parametrize("damage", ["garbage", "truncated", "version", "other config",
                                    "flipped header byte", "symlink"])
def test_an_untrustworthy_plane_file_is_rebuilt_with_one_warning(
        config: Config, tmp_path: Path, damage: str,
        caplog: pytest.LogCaptureFixture) -> None:
    path = plane_path(config)
    path.parent.mkdir(parents=True, exist_ok=True)
    target = tmp_path / "precious"
    if damage == "garbage":
        path.write_bytes(os.urandom(FILE_BYTES))
    elif damage == "truncated":
        path.write_bytes(fresh_file(Header(config_digest(config), time.time())))
        os.truncate(path, FILE_BYTES // 3)
    elif damage == "version":
        other = HEADER.pack(MAGIC, VERSION + 1, HEADER.size + 4, SLOTS, SLOT_BYTES, 16,
                            384, 100000, config_digest(config), time.time())
        data = bytearray(FILE_BYTES)
        data[:HEADER.size + 4] = other + struct.pack("<I", zlib.crc32(other))
        path.write_bytes(bytes(data))
    elif damage == "other config":
        other_config = make_config(tmp_path / "elsewhere")
        path.write_bytes(fresh_file(Header(config_digest(other_config), time.time())))
    elif damage == "flipped header byte":
        data = bytearray(fresh_file(Header(config_digest(config), time.time())))
        data[20] ^= 0xFF
        path.write_bytes(bytes(data))
    elif damage == "symlink":
        target.write_bytes(b"not yours")
        path.symlink_to(target)
    os.chmod(path, 0o600, follow_symlinks=False) if damage != "symlink" else None
    caplog.set_level(logging.WARNING, logger="isolane.lanes.plane")
    plane = HostPlane.open(config)
    assert plane is not None
    try:
        assert len(rebuilt_warnings(caplog)) == 1
        assert plane.join(time.monotonic()) == 0  # every slot free again
        assert not path.is_symlink() and path.stat().st_size == FILE_BYTES
        if damage == "symlink":
            assert target.read_bytes() == b"not yours"  # replaced the link, not its target
        again = HostPlane.open(config)  # the rebuilt file is trusted: no second warning
        assert again is not None
        again.close()
        assert len(rebuilt_warnings(caplog)) == 1
    finally:
        plane.close()


def test_a_plane_damaged_under_its_members_is_rebuilt_and_they_rejoin(
        config: Config, caplog: pytest.LogCaptureFixture) -> None:
    plane = HostPlane.open(config)
    assert plane is not None
    try:
        now = time.monotonic()
        assert plane.join(now) == 0
        with open(plane.path, "r+b") as f:  # someone scribbles over the live file
            f.write(b"\0" * 64)
        caplog.set_level(logging.WARNING, logger="isolane.lanes.plane")
        assert plane.check() is True  # rebuilt: the slot must be claimed again
        assert plane.slot is None and len(rebuilt_warnings(caplog)) == 1
        assert plane.join(now) == 0
        assert plane.check() is False
        assert [m.pid for m in plane.members(now)] == [os.getpid()]
    finally:
        plane.close()


def test_a_torn_or_flipped_slot_is_not_trusted() -> None:
    record = SlotRecord(state=1, pid=1234, start_ticks=99, generation=3, heartbeat_s=5.0,
                        roles=3, threads=(8, 4, 2), write_demand=1 << 20, write_bps=2e8,
                        write_limit=None, background_limit=1e7, kv_gets=42,
                        epochs=[(7, 2)], bins=[empty()])
    record.bins[0][100] = 2
    data = record.pack()
    back = SlotRecord.unpack(data)
    assert back is not None and back.pid == 1234 and back.write_limit is None
    assert back.background_limit == 1e7 and back.epochs[0] == (7, 2)
    assert int(back.bins[0][100]) == 2
    flipped = bytearray(data)
    flipped[200] ^= 1
    assert SlotRecord.unpack(bytes(flipped)) is None


def immutable(folder: Path, on: bool) -> None:
    """A folder even root cannot write into (chattr +i), or chmod 0500 for others."""
    if os.geteuid() == 0:
        subprocess.run(["chattr", "+i" if on else "-i", str(folder)], check=True)
    else:
        folder.chmod(0o500 if on else 0o700)


def test_without_write_access_a_process_runs_per_process_lanes_and_says_so_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    monkeypatch.setenv(PLANE_DIR_ENV, str(locked))
    config = make_config(tmp_path)
    caplog.set_level(logging.WARNING, logger="isolane.lanes.plane")
    immutable(locked, True)
    try:
        first, second = LaneScheduler(config), LaneScheduler(config)
        try:
            assert type(first.governor) is Governor and type(second.governor) is Governor
            said = [r for r in caplog.records if "per-process lanes" in r.getMessage()]
            assert len(said) == 1 and str(locked) in said[0].getMessage()
            # ... and the lanes and the governor still work, on this process's reads.
            first.lane(JobKind.KV_GET).submit(time.sleep, 0.01).result()
            first.governor.step()
            assert first.stats()["governor"]["read_p99_ms"] is not None
        finally:
            first.close()
            second.close()
    finally:
        immutable(locked, False)
    assert list(locked.iterdir()) == []


def test_many_short_lived_processes_never_fill_the_plane(config: Config) -> None:
    plane = HostPlane.open(config)
    assert plane is not None
    try:
        for _ in range(4 * SLOTS):  # each joins and dies without leaving (as if killed)
            pid = os.fork()
            if pid == 0:
                child = HostPlane.open(config)
                os._exit(0 if child is not None and child.join(time.monotonic()) is not None
                         else 1)
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0
        assert plane.join(time.monotonic()) is not None
        assert [m.pid for m in plane.members(time.monotonic())] == [os.getpid()]
    finally:
        plane.close()
    assert not plane.path.exists()  # the last member out removed the file


def test_cli_calls_in_a_loop_leave_no_member_behind(tmp_path: Path) -> None:
    import sys

    import yaml

    config_file = tmp_path / "host.yaml"
    config_file.write_text(yaml.safe_dump({"home": str(tmp_path / "home")}))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    for i in range(3):  # a save joins the plane as a writer and leaves at exit
        src = tmp_path / f"w{i}.pt"
        subprocess.run([sys.executable, "-c", "import torch,sys; torch.save("
                        "{'w': torch.ones(1024)}, sys.argv[1])", str(src)], check=True)
        subprocess.run([sys.executable, "-m", "isolane.cli.main", "--config",
                        str(config_file), "save", str(src), f"step-{i}"], check=True,
                       env=env, capture_output=True)
    config = config_from_dict({"home": str(tmp_path / "home")})
    plane = HostPlane.open(config)
    assert plane is not None
    try:
        assert plane.members(time.monotonic()) == []
    finally:
        plane.close()



def test_a_clock_stepping_backwards_does_not_stall_the_host_governor(tmp_path: Path) -> None:
    config = make_config(tmp_path, read_p99_window_s=0.5, governor_period_s=0.1)
    clock = FakeClock(10_000.0)
    scheduler = LaneScheduler(config, clock=clock)
    governor = scheduler.governor
    assert isinstance(governor, HostGovernor)
    write = scheduler.lanes["write"].bucket
    assert write is not None
    try:
        def slow_period() -> None:
            for _ in range(20):
                governor.read.record(0.03, 4096, clock.now)  # 30 ms KV gets
            write.consumed_bytes += 50 << 20  # and writes flowing
            clock.now += 0.1
            governor.step()

        for _ in range(6):
            slow_period()
        cut_once = governor.write.cuts
        assert cut_once >= 1 and write.rate is not None and write.rate < 1 << 30
        clock.now -= 3600.0  # the clock steps back an hour
        for _ in range(12):
            slow_period()
        assert governor.write.cuts > cut_once  # still deciding on fresh evidence
    finally:
        scheduler.close()


def test_an_oversized_governor_block_drops_its_oldest_decisions(config: Config) -> None:
    plane = HostPlane.open(config)
    assert plane is not None
    try:
        decisions = [{"at_s": float(i), "reason": "x" * 200} for i in range(40)]
        plane.write_governor({"pid": 1, "decisions": decisions})
        block = plane.read_governor()
        assert block is not None and block["pid"] == 1
        kept = block["decisions"]
        assert 0 < len(kept) < 40 and kept[-1]["at_s"] == 39.0  # the newest stay
    finally:
        plane.close()
