"""Steps of host life for the governor's law tests: a real plane file, the scheduler's
write bucket and a test clock moved 0.1 s a step (shared by test_host_law and
test_host_memory)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from isolane.config import config_from_dict
from isolane.lanes import LaneScheduler
from isolane.lanes.host_governor import HostGovernor
from tests.support.clock import FakeClock

SLO = 0.005  # the read p99 SLO of a governed host (seconds)


def governed_host(tmp_path: Path, start: float
                  ) -> Iterator[tuple[LaneScheduler, HostGovernor, FakeClock]]:
    """A scheduler with one write and one read group on a real plane file under
    ``tmp_path``, its governor stepped on a test clock starting at ``start``; closed
    after the test (use as the body of a fixture: ``yield from``)."""
    config = config_from_dict({
        "home": str(tmp_path / "home"),
        "device_groups": {"w": {"role": "write", "devices": [str(tmp_path / "w")]},
                          "r": {"role": "read", "devices": [str(tmp_path / "r")]}},
        "qos": {"read_p99_slo_ms": SLO * 1e3, "write_bandwidth_min": "16MiB",
                "read_p99_window_s": 1.0, "governor_period_s": 0.1}})
    clock = FakeClock(start)
    scheduler = LaneScheduler(config, clock=clock)
    governor = scheduler.governor
    assert isinstance(governor, HostGovernor)
    try:
        yield scheduler, governor, clock
    finally:
        scheduler.close()


def period(scheduler: LaneScheduler, governor: HostGovernor, clock: FakeClock,
           read_s: float, reads: int = 400) -> None:
    """0.1 s of host life: ``reads`` KV gets of ``read_s`` each, writes using the
    whole limit, then one governor step."""
    for i in range(reads):
        governor.read.record(read_s, 4096, clock.now + 0.1 * i / reads)
    write = scheduler.lanes["write"].bucket
    assert write is not None
    write.consumed_bytes += int((write.rate or 1 << 30) * 0.1)
    clock.now += 0.1
    governor.step()


def cut_to_a_limit(scheduler: LaneScheduler, governor: HostGovernor,
                   clock: FakeClock) -> float:
    """Slow reads (30 ms: far over the SLO) until the second cut; stops right after it,
    so every read the test records later is taken at the new limit."""
    for _ in range(40):
        period(scheduler, governor, clock, 0.03)
        if governor.write.cuts >= 2:
            break
    rate = governor.write.rate
    assert rate is not None and governor.write.cuts == 2
    return rate
