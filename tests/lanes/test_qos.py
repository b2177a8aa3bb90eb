"""Token bucket and governor steps, driven by a fake clock."""

from __future__ import annotations

from dataclasses import replace

import pytest

from isolane.config import QosConfig
from isolane.errors import InvalidArgumentError
from isolane.lanes.metrics import LatencyWindow
from isolane.lanes.qos import Governor, TokenBucket
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


# -- Governor ----------------------------------------------------------------------------

def governor(clock: FakeClock, **qos: object) -> tuple[Governor, LatencyWindow, TokenBucket,
                                                      TokenBucket]:
    """A per-process governor (its law's steps: test_control.py)."""
    settings = replace(QosConfig(read_p99_slo_ms=5.0, write_bandwidth_min=10 * MiB,
                                 read_p99_window_s=1.0), **qos)
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
    cut_at = clock.now
    for _ in range(5):  # the old slow sample is still in the window, no new ones
        write.reserve(20 * MiB)
        tick(gov, clock)
    assert write.rate == pytest.approx(200 * MiB) and gov.write.cuts == 1
    read.record(0.020, 4096, clock.now)  # fresh evidence: it cuts again once its few
    while gov.write.cuts < 2 and clock.now < cut_at + 3:  # samples span a window
        write.reserve(20 * MiB)
        tick(gov, clock)
    assert write.rate == pytest.approx(100 * MiB) and gov.write.cuts == 2
    assert clock.now >= cut_at + gov.qos.read_p99_window_s


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
    # The reads stop, the writes go on. After the window empties there is no evidence:
    # rates grow back, writes first; background only once writes are unlimited again.
    held = background.rate
    rates: list[float | None] = []
    for _ in range(200):
        write.reserve(100 * MiB)
        background.reserve(10 * MiB)
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
