"""Warm start: the host's last settled write limit outlives the plane file, so the
first governor of the next run starts from it instead of unlimited, and still cuts at
once when reads are slow. Real plane files, governors stepped on a test clock."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from isolane.config import config_from_dict
from isolane.lanes import LaneScheduler
from isolane.lanes.host_governor import HostGovernor
from isolane.lanes.memory import (
    FILE_BYTES,
    MEMORY_MAX_AGE_S,
    Settled,
    memory_path,
    pack,
    recall,
    unpack,
)
from isolane.lanes.plane import plane_path
from tests.lanes.host_steps import cut_to_a_limit, period
from tests.support.clock import FakeClock

MiB = 1 << 20
SLO = 0.005



def make_config(tmp_path: Path, slo_s: float = SLO) -> Any:
    return config_from_dict({
        "home": str(tmp_path / "home"),
        "device_groups": {"w": {"role": "write", "devices": [str(tmp_path / "w")]},
                          "r": {"role": "read", "devices": [str(tmp_path / "r")]}},
        "qos": {"read_p99_slo_ms": slo_s * 1e3, "write_bandwidth_min": "16MiB",
                "read_p99_window_s": 1.0, "governor_period_s": 0.1}})


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(30_000.0)


def start(config: Any, clock: FakeClock) -> tuple[LaneScheduler, HostGovernor]:
    scheduler = LaneScheduler(config, clock=clock)
    governor = scheduler.governor
    assert isinstance(governor, HostGovernor)
    return scheduler, governor


def settle(scheduler: LaneScheduler, governor: HostGovernor, clock: FakeClock) -> float:
    """Cut from unlimited on slow reads, then hold the SLO at that limit for 2 s
    (the reads sit at 0.95x the SLO: the law holds there, in the band regime, and the
    limit is settled)."""
    rate = cut_to_a_limit(scheduler, governor, clock)
    for _ in range(20):
        period(scheduler, governor, clock, 0.95 * SLO)
    assert governor.write.rate == rate
    return rate


@pytest.fixture
def planes(tmp_path: Path) -> Iterator[Path]:
    yield Path(os.environ["ISOLANE_PLANE_DIR"])


def test_the_next_governor_starts_from_the_settled_limit_and_still_cuts(
        tmp_path: Path, clock: FakeClock, planes: Path) -> None:
    config = make_config(tmp_path)
    scheduler, governor = start(config, clock)
    try:
        settled = settle(scheduler, governor, clock)
    finally:
        scheduler.close()
    # the plane went with its last member; the settled limit stayed beside it
    path = plane_path(config)
    assert not path.exists()
    memory = memory_path(path)
    assert memory.stat().st_size == FILE_BYTES and memory.stat().st_mode & 0o777 == 0o600

    # the next run: a fresh process's governor on a fresh plane
    scheduler, governor = start(config, clock)
    try:
        governor.step()
        assert governor.write.rate == settled and governor.warm_start == settled
        assert scheduler.lanes["write"].bucket.rate == settled  # type: ignore[union-attr]
        assert governor.stats()["host"]["warm_start_bytes_per_s"] == round(settled)
        assert governor.write.decisions[-1].reason.startswith("warm start")
        # slow reads cut it within a window, as from any limit
        started = clock.now
        while governor.write.rate == settled:
            period(scheduler, governor, clock, 0.03)
            assert clock.now - started <= 1.0, "the warm limit was never cut"
        assert governor.write.rate is not None and governor.write.rate < settled
    finally:
        scheduler.close()


def test_a_limit_settled_under_a_looser_slo_or_long_ago_is_not_used(
        tmp_path: Path, clock: FakeClock, planes: Path) -> None:
    config = make_config(tmp_path)
    digest_path = plane_path(config)
    scheduler, governor = start(config, clock)
    try:
        settle(scheduler, governor, clock)
        digest = governor.plane.digest
    finally:
        scheduler.close()
    found = recall(digest_path, digest, slo_s=SLO, now_s=time.time())
    assert found is not None
    # a tighter SLO now: the limit may be over it; start as without a memory
    assert recall(digest_path, digest, slo_s=SLO / 2, now_s=time.time()) is None
    assert recall(digest_path, digest, slo_s=SLO,
                  now_s=time.time() + MEMORY_MAX_AGE_S + 1) is None
    scheduler, governor = start(make_config(tmp_path, SLO / 2), clock)
    try:
        governor.step()
        assert governor.write.rate is None and governor.warm_start is None
    finally:
        scheduler.close()


def test_no_memory_from_a_limit_that_never_held_the_slo(
        tmp_path: Path, clock: FakeClock, planes: Path) -> None:
    config = make_config(tmp_path)
    scheduler, governor = start(config, clock)
    try:
        for _ in range(60):  # always over the SLO: cut after cut, nothing settles
            period(scheduler, governor, clock, 0.03)
    finally:
        scheduler.close()
    assert governor.write.cuts >= 2
    assert not memory_path(plane_path(config)).exists()


def test_a_damaged_or_foreign_memory_is_ignored_with_one_warning(
        tmp_path: Path, clock: FakeClock, planes: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    config = make_config(tmp_path)
    path = plane_path(config)
    path.parent.mkdir(parents=True, exist_ok=True)
    memory = memory_path(path)
    good = Settled(200 * MiB, None, SLO, time.time())
    scheduler, governor = start(config, clock)
    digest = governor.plane.digest
    scheduler.close()
    raw = pack(digest, good)
    assert isinstance(unpack(raw, digest), Settled)
    cases = {
        "checksum mismatch": raw[:20] + bytes([raw[20] ^ 1]) + raw[21:],
        "bytes, expected": raw[:-3],
        "another host config": pack(b"x" * 16, good),
        "format version": _with_version(raw, 2),
    }
    for why, data in cases.items():
        memory.write_bytes(data)
        memory.chmod(0o600)
        assert isinstance(unpack(data, digest), str)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            scheduler, governor = start(config, clock)
            try:
                governor.step()
                governor.step()
                assert governor.write.rate is None, why  # the law's own start
            finally:
                scheduler.close()
        warned = [r.getMessage() for r in caplog.records if "memory" in r.getMessage()]
        assert len(warned) == 1 and why in warned[0], (why, warned)
    # writable by others: not trusted either
    memory.write_bytes(raw)
    memory.chmod(0o666)
    assert recall(path, digest, slo_s=SLO, now_s=time.time()) is None
    memory.chmod(0o600)
    assert recall(path, digest, slo_s=SLO, now_s=time.time()) == good


def _with_version(raw: bytes, version: int) -> bytes:
    import struct
    import zlib
    body = bytearray(raw[:-4])
    struct.pack_into("<I", body, 8, version)
    return bytes(body) + struct.pack("<I", zlib.crc32(bytes(body)))



def test_a_limit_grown_from_on_good_reads_is_remembered(
        tmp_path: Path, clock: FakeClock, planes: Path) -> None:
    """Far under the SLO the law grows every 0.5 s: the rate it grew from held the
    SLO on the same evidence, so it is remembered though it never held for 1 s."""
    config = make_config(tmp_path)
    scheduler, governor = start(config, clock)
    try:
        rate = cut_to_a_limit(scheduler, governor, clock)
        while governor.write.increases == 0:
            period(scheduler, governor, clock, 0.3 * SLO)
        digest = governor.plane.digest
    finally:
        scheduler.close()
    found = recall(plane_path(config), digest, slo_s=SLO, now_s=time.time())
    assert found is not None and found.limit == rate
