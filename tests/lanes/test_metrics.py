"""Log-binned latency windows: bin bounds, percentile accuracy, expiry (fake time)."""

from __future__ import annotations

import math
import random
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from isolane.errors import InvalidArgumentError
from isolane.lanes.metrics import MAX_US, SUB_BITS, LatencyWindow, bin_bounds, bin_of


@given(st.integers(min_value=0, max_value=MAX_US))
def test_every_value_lies_within_its_bins_bounds(us: int) -> None:
    low, high = bin_bounds(bin_of(us))
    assert low <= us <= high
    assert high - low <= max(0, us >> SUB_BITS)  # within 1/32 of the value


def test_bins_are_contiguous_and_ordered() -> None:
    previous_high = -1
    for index in range(bin_of(MAX_US) + 1):
        low, high = bin_bounds(index)
        assert low == previous_high + 1
        previous_high = high


def test_percentiles_are_within_bin_precision_of_the_exact_ones() -> None:
    rng = random.Random(1)
    values = [rng.lognormvariate(math.log(2e-3), 1.0) for _ in range(20_000)]
    window = LatencyWindow(window_s=10.0)
    for v in values:
        window.record(v, 4096, now=100.0)
    summary = window.summary(now=100.05)
    ordered = sorted(values)
    for q, got in ((0.5, summary.p50_s), (0.99, summary.p99_s), (0.999, summary.p999_s)):
        exact = ordered[math.ceil(q * len(ordered)) - 1]
        assert got is not None and abs(got - exact) <= exact / 32 + 1e-6, (q, got, exact)
    assert summary.count == 20_000 and summary.nbytes == 20_000 * 4096


def test_small_samples_report_what_was_seen() -> None:
    window = LatencyWindow()
    window.record(0.0123, 0, now=5.0)
    summary = window.summary(now=5.0)
    assert summary.p50_s == summary.p99_s == summary.p999_s == pytest.approx(0.0123, abs=1e-6)
    assert window.summary(now=5.0).latency_ms()["p99"] == pytest.approx(12.3, abs=1e-3)


def test_old_samples_leave_the_window() -> None:
    window = LatencyWindow(window_s=1.0, slot_s=0.1)
    window.record(0.5, 1000, now=10.0)
    assert window.summary(now=10.5).count == 1
    assert window.summary(now=11.2).count == 0  # older than the window
    assert window.summary(now=11.2).p99_s is None
    window.record(0.001, 10, now=20.0)  # lands in the same ring slot: reset first
    summary = window.summary(now=20.0)
    assert summary.count == 1 and summary.p99_s == pytest.approx(0.001, abs=1e-6)


def test_since_excludes_earlier_slots_and_bytes_per_second_uses_the_span() -> None:
    window = LatencyWindow(window_s=10.0, slot_s=0.1)
    window.record(0.2, 1 << 20, now=50.0)
    window.record(0.002, 1 << 20, now=50.55)
    recent = window.summary(now=50.6, since=50.5)
    assert recent.count == 1 and recent.p99_s == pytest.approx(0.002, abs=1e-5)
    everything = window.summary(now=50.6)
    assert everything.count == 2
    assert everything.bytes_per_s == pytest.approx((2 << 20) / everything.span_s)


def test_concurrent_records_are_all_counted() -> None:
    window = LatencyWindow()

    def hammer() -> None:
        for _ in range(5000):
            window.record(0.001, 1, now=1.0)

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert window.summary(now=1.0).count == 20_000


@pytest.mark.parametrize("seconds", [-1.0, 0.0, 5e-6, 3e-3, 2.5, 1e6])
def test_a_job_recorded_in_two_windows_at_once_counts_as_recording_it_in_each(
        seconds: float) -> None:
    heard: list[tuple[str, float, int, float]] = []
    pair = [LatencyWindow(window_s=10.0), LatencyWindow(window_s=1.0, slot_s=0.5)]
    alone = [LatencyWindow(window_s=10.0), LatencyWindow(window_s=1.0, slot_s=0.5)]
    pair[0].listeners.append(lambda s, n, t: heard.append(("lane", s, n, t)))
    pair[1].listeners.append(lambda s, n, t: heard.append(("gets", s, n, t)))
    pair[0].record(seconds, 4096, 100.0, also=pair[1])
    for window in alone:
        window.record(seconds, 4096, 100.0)
    for both, one in zip(pair, alone, strict=True):
        assert both.summary(100.2) == one.summary(100.2)
    assert heard == [("lane", seconds, 4096, 100.0), ("gets", seconds, 4096, 100.0)]


def test_bad_window_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="slot_s"):
        LatencyWindow(window_s=0.05, slot_s=0.1)
