"""Token bucket, AIMD controller and governor steps, driven by a fake clock."""

from __future__ import annotations

from dataclasses import replace

import pytest

from isolane.config import QosConfig
from isolane.errors import InvalidArgumentError
from isolane.lanes.metrics import LatencyWindow
from isolane.lanes.qos import AimdController, Governor, TokenBucket
from tests.support.clock import FakeClock

MiB = 1 << 20



# -- TokenBucket -------------------------------------------------------------------------

def test_bucket_paces_to_its_rate_after_the_burst() -> None:
    clock = FakeClock()
    bucket = TokenBucket(100 * MiB, burst_bytes=10 * MiB, clock=clock, sleep=clock.sleep)
    start = clock.now
    assert bucket.consume(10 * MiB) == 0  # the burst passes at once
    for _ in range(10):
        bucket.consume(10 * MiB)
    assert clock.now - start == pytest.approx(1.0)  # 100 MiB more at 100 MiB/s
    assert bucket.consumed_bytes == 110 * MiB and bucket.waited_s == pytest.approx(1.0)


def test_chunk_larger_than_the_burst_passes_and_leaves_debt() -> None:
    clock = FakeClock()
    bucket = TokenBucket(100 * MiB, burst_bytes=16 * MiB, clock=clock, sleep=clock.sleep)
    assert bucket.reserve(64 * MiB) == pytest.approx(0.48)  # 48 MiB of debt
    assert bucket.reserve(16 * MiB) == pytest.approx(0.64)  # waits behind that debt


def test_unlimited_bucket_never_waits_and_tokens_refill_only_to_the_burst() -> None:
    clock = FakeClock()
    bucket = TokenBucket(None, burst_bytes=MiB, clock=clock, sleep=clock.sleep)
    assert bucket.reserve(1 << 40) == 0 and bucket.rate is None
    bucket.set_rate(MiB)
    clock.now += 100  # idle for long: still only one burst of credit
    assert bucket.reserve(MiB) == 0
    assert bucket.reserve(MiB) == pytest.approx(1.0)


@pytest.mark.parametrize("rate", [0, -5.0])
def test_bucket_refuses_non_positive_rates(rate: float) -> None:
    with pytest.raises(InvalidArgumentError, match="rate_bytes_per_s must be positive"):
        TokenBucket(rate)
    with pytest.raises(InvalidArgumentError, match="rate_bytes_per_s"):
        TokenBucket(None).set_rate(rate)


# -- AimdController ----------------------------------------------------------------------

def controller(**changes: object) -> AimdController:
    settings: dict[str, object] = {"slo_s": 0.005, "floor": 100.0, "cap": 1000.0,
                                   "increase_step": 50.0}
    settings.update(changes)
    return AimdController(**settings)  # type: ignore[arg-type]


def test_over_slo_cuts_multiplicatively_down_to_the_floor() -> None:
    aimd = controller()
    assert aimd.rate == 1000.0
    rates = [aimd.update(0.010, now=t, measured_bytes_per_s=2000.0) for t in range(5)]
    assert rates == [500.0, 250.0, 125.0, 100.0, 100.0]  # never below the floor
    assert aimd.cuts == 4 and "at floor" in aimd.state
    assert [d.new_rate for d in aimd.decisions] == [500.0, 250.0, 125.0, 100.0]
    assert aimd.decisions[0].reason.startswith("cut: read p99 10.00 ms > SLO 5 ms")


def test_under_slo_or_idle_adds_back_up_to_the_cap() -> None:
    aimd = controller()
    aimd.update(0.010, now=0, measured_bytes_per_s=1000.0)
    assert aimd.rate == 500.0
    assert aimd.update(0.001, now=1, measured_bytes_per_s=0.0) == 550.0
    # No read samples at all: no evidence of interference, so it grows back too.
    assert aimd.update(None, now=2, measured_bytes_per_s=0.0) == 600.0
    assert aimd.decisions[-1].reason == "increase: read lane idle"
    for t in range(3, 20):
        aimd.update(None, now=t, measured_bytes_per_s=0.0)
    assert aimd.rate == 1000.0 and aimd.at_ceiling and aimd.state == "at cap"


def test_without_a_cap_the_first_cut_starts_from_measured_throughput() -> None:
    aimd = controller(cap=None)
    assert aimd.rate is None and aimd.at_ceiling
    assert aimd.update(0.010, now=0, measured_bytes_per_s=800.0) == 400.0
    assert aimd.ceiling == 800.0
    rates = [aimd.update(None, now=t, measured_bytes_per_s=0.0) for t in range(1, 10)]
    # 450 ... 750, then past the 800 that flowed before the cut: unlimited again.
    assert rates[:7] == [450.0, 500.0, 550.0, 600.0, 650.0, 700.0, 750.0]
    assert rates[7] is None and aimd.decisions[-1].new_rate is None


def test_over_slo_without_governed_traffic_does_not_cut() -> None:
    aimd = controller(cap=None)
    assert aimd.update(0.050, now=0, measured_bytes_per_s=0.0) is None
    assert aimd.cuts == 0 and "no write traffic to cut" in aimd.state


def test_may_increase_false_holds_the_rate() -> None:
    aimd = controller()
    aimd.update(0.010, now=0, measured_bytes_per_s=1000.0)
    assert aimd.update(None, now=1, measured_bytes_per_s=0.0, may_increase=False) == 500.0


@pytest.mark.parametrize(("changes", "needle"), [
    ({"slo_s": 0.0}, "slo_s must be positive"),
    ({"slo_s": -1.0}, "slo_s must be positive"),
    ({"floor": 2000.0}, "above cap"),
    ({"floor": 0.0}, "floor must be positive"),
    ({"increase_step": 0.0}, "increase_step"),
    ({"decrease_factor": 1.0}, "decrease_factor"),
])
def test_controller_refuses_bad_settings(changes: dict[str, float], needle: str) -> None:
    with pytest.raises(InvalidArgumentError, match=needle):
        controller(**changes)


# -- Governor ----------------------------------------------------------------------------

def governor(clock: FakeClock, **qos: object) -> tuple[Governor, LatencyWindow, TokenBucket,
                                                      TokenBucket]:
    """A per-process governor under the AIMD law (the target law: test_control.py)."""
    settings = replace(QosConfig(read_p99_slo_ms=5.0, write_bandwidth_min=10 * MiB,
                                 read_p99_window_s=1.0, write_bandwidth_step=10 * MiB,
                                 control="aimd"), **qos)
    read = LatencyWindow(10.0)
    write = TokenBucket(None, clock=clock, sleep=clock.sleep)
    background = TokenBucket(None, clock=clock, sleep=clock.sleep)
    return Governor(settings, read, write, background, clock=clock), read, write, background


def tick(gov: Governor, clock: FakeClock, seconds: float = 0.1) -> None:
    clock.now += seconds
    gov.step()


def test_slow_reads_cut_write_and_background_with_background_harder() -> None:
    clock = FakeClock()
    gov, read, write, background = governor(clock, write_bandwidth_max=400 * MiB)
    assert write.rate == 400 * MiB and background.rate is None
    gov.step()
    for _ in range(5):  # writes flow at the cap, background at 100 MiB/s
        write.reserve(40 * MiB)
        background.reserve(10 * MiB)
        read.record(0.020, 4096, clock.now)  # 20 ms reads: over the 5 ms SLO
        tick(gov, clock)
    assert write.rate is not None and write.rate < 400 * MiB
    assert background.rate is not None
    assert background.rate / (100 * MiB) < write.rate / (400 * MiB)  # cut harder
    stats = gov.stats()
    assert stats["read_p99_ms"] == pytest.approx(20.0, rel=0.04)
    assert stats["cuts"] >= 2 and stats["decisions"][0]["reason"].startswith("cut")
    assert stats["write_rate_bytes_per_s"] == round(write.rate)


def test_a_cut_waits_for_fresh_read_samples_before_cutting_again() -> None:
    clock = FakeClock()
    gov, read, write, _ = governor(clock, write_bandwidth_max=400 * MiB)
    gov.step()
    write.reserve(40 * MiB)
    read.record(0.020, 4096, clock.now)
    tick(gov, clock)
    assert write.rate == pytest.approx(200 * MiB)
    for _ in range(5):  # the old slow sample is still in the window, no new ones
        write.reserve(20 * MiB)
        tick(gov, clock)
    assert write.rate == pytest.approx(200 * MiB) and gov.write.cuts == 1
    read.record(0.020, 4096, clock.now)  # fresh evidence: the next step cuts again
    write.reserve(20 * MiB)
    tick(gov, clock)
    assert write.rate == pytest.approx(100 * MiB) and gov.write.cuts == 2


def test_idle_read_lane_gives_writes_their_full_speed_back() -> None:
    clock = FakeClock()
    gov, read, write, background = governor(clock)  # no cap: starts unlimited
    gov.step()
    for _ in range(3):
        write.reserve(100 * MiB)
        background.reserve(10 * MiB)
        read.record(0.050, 4096, clock.now)
        tick(gov, clock)
    assert write.rate is not None and background.rate is not None
    # The reads stop. After the window empties there is no evidence: rates grow back,
    # writes first; background only once writes are unlimited again.
    held = background.rate
    rates: list[float | None] = []
    for _ in range(200):
        tick(gov, clock)
        rates.append(write.rate)
        if write.rate is not None:
            assert background.rate == held
    assert write.rate is None and background.rate is None
    finite = [r for r in rates if r is not None]
    assert finite == sorted(finite)  # only ever increased
    assert gov.stats()["decisions"][-1]["reason"] == "increase: read lane idle"


def test_fast_reads_never_throttle() -> None:
    clock = FakeClock()
    gov, read, write, _ = governor(clock)
    for _ in range(20):
        write.reserve(100 * MiB)
        read.record(0.001, 4096, clock.now)
        tick(gov, clock)
    assert write.rate is None and gov.stats()["cuts"] == 0


def test_no_reads_at_all_never_throttles_writes() -> None:
    clock = FakeClock()
    gov, _read, write, background = governor(clock)
    for _ in range(50):
        write.reserve(200 * MiB)
        background.reserve(50 * MiB)
        tick(gov, clock)
    assert write.rate is None and background.rate is None
    assert gov.stats()["decisions"] == [] and gov.stats()["read_p99_ms"] is None
