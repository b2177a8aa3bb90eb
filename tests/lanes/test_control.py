"""The latency-target law, fair shares and the plane's mergeable histograms (pure)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from isolane.lanes.control import (
    CUT_EVIDENCE,
    GROW_EVIDENCE,
    GROW_GAIN,
    HOLD_BELOW,
    TargetController,
    adopt_state,
    enough_evidence,
    export_state,
    fair_shares,
)
from isolane.lanes.epochs import EpochHistograms, merge_epochs
from isolane.lanes.histogram import BINS, MAX_US, bucket_bounds, bucket_of, empty, quantile_us
from isolane.lanes.plane_format import SlotRecord

MiB = 1 << 20


def controller(cap: float | None = None) -> TargetController:
    return TargetController(slo_s=0.005, floor=10 * MiB, cap=cap)


def test_cuts_are_proportional_to_the_excess_and_hold_near_the_slo() -> None:
    c = controller()
    assert c.update(0.0052, 1.0, 400 * MiB) == pytest.approx(400 * MiB * (1 - 0.04))
    assert c.ceiling == 400 * MiB  # what flowed before the first cut
    rate = c.rate
    assert c.update(0.00475, 2.0, 300 * MiB) == rate  # 0.95x SLO: the operating point
    assert c.state.startswith("holding")
    # far over: halve the limit (not the 300 MiB/s that flowed: a dip between writes)
    assert c.update(0.05, 3.0, 300 * MiB) == pytest.approx(rate / 2)
    for t in range(40):
        c.update(0.0005, 4.0 + t, 1e12)  # far under: grow a step...
    # ... past the ceiling, but a limit while reads flow (no unlimited burst at them)
    assert c.rate is not None and c.rate > 400 * MiB and c.at_ceiling
    c.update(None, 50.0, 1e12)  # the read lane idle: unlimited again
    assert c.rate is None
    assert c.cuts == 2 and c.increases > 0


def test_the_floor_and_the_cap_hold() -> None:
    c = controller(cap=200 * MiB)
    for t in range(20):
        c.update(0.1, float(t), 500 * MiB)
    assert c.rate == 10 * MiB and "at floor" in c.state
    for t in range(40):
        c.update(None, 100.0 + t, 500 * MiB)  # no reads: no evidence of interference
    assert c.rate == 200 * MiB


def test_no_governed_traffic_means_nothing_to_cut() -> None:
    c = controller()
    assert c.update(0.02, 1.0, 0) is None and "no write traffic" in c.state


def test_state_hands_over_and_ignores_garbage() -> None:
    a, b = controller(cap=500 * MiB), controller(cap=500 * MiB)
    a.update(0.02, 1.0, 400 * MiB)
    adopt_state(b, export_state(a))
    assert b.rate == a.rate and b.cuts == 1
    adopt_state(b, {"rate": -5, "cuts": "many", "ceiling": "x"})
    assert b.rate == a.rate and b.cuts == 1
    adopt_state(b, {"rate": 1e15})
    assert b.rate == 500 * MiB  # clamped to the cap
    adopt_state(b, ["not", "a", "dict"])


def test_growth_just_under_the_band_is_proportional_to_the_distance() -> None:
    """Under the hold band the step is GROW_GAIN x (HOLD_BELOW - r) of the limit: a few
    percent just under it (the law approaches its operating point slowly rather than
    overshooting into the tail), and the band itself holds."""
    c = controller(cap=1000 * MiB)
    c.rate = 100 * MiB
    c.update(0.00445, 1.0, 100 * MiB)  # 0.89x the SLO
    assert c.rate == pytest.approx(100 * MiB * (1 + GROW_GAIN * (HOLD_BELOW - 0.89)))
    c.update(0.0046, 2.0, 100 * MiB)  # 0.92x: in the band, holds
    assert c.rate == pytest.approx(100 * MiB * (1 + GROW_GAIN * (HOLD_BELOW - 0.89)))
    assert c.state.startswith("holding")


def test_fair_shares_split_between_writers_with_demand() -> None:
    assert fair_shares(300.0, {0: True, 1: True, 2: True}) == {0: 100.0, 1: 100.0, 2: 100.0}
    assert fair_shares(300.0, {0: True, 1: False}) == {0: 300.0, 1: 150.0}
    assert fair_shares(None, {0: True}) == {0: None}


@given(st.integers(min_value=0, max_value=MAX_US))
def test_every_latency_falls_inside_its_bucket(us: int) -> None:
    low, high = bucket_bounds(bucket_of(us))
    assert low <= us <= high
    assert high - low <= max(1, low // 16)
    assert 0 <= bucket_of(us) < BINS


def test_quantiles_interpolate_inside_a_bucket_and_merge_across_members() -> None:
    counts = empty()
    for us in range(1000, 2000):
        counts[bucket_of(us)] += 1
    p50 = quantile_us(counts, 0.5)
    assert p50 is not None and abs(p50 - 1500) < 40
    assert quantile_us(empty(), 0.99) is None
    a, b = EpochHistograms(), EpochHistograms()
    for i in range(100):
        a.record(0.001, 0, 10.05)  # epoch 100
        b.record(0.010 if i < 5 else 0.001, 0, 10.15)  # epoch 101
    records = []
    for h in (a, b):
        epochs, bins = h.snapshot()
        records.append(SlotRecord(epochs=epochs, bins=bins))
    merged = merge_epochs(records, 100, 101)
    assert int(merged.sum()) == 200
    p99 = quantile_us(merged, 0.99)
    assert p99 is not None and p99 > 9000  # b's slow 2.5 % shows in the host p99
    assert int(merge_epochs(records, 101, 101).sum()) == 100
    assert merged.dtype == np.uint32


def test_a_tail_over_the_slo_cuts_on_little_evidence_but_growth_waits_for_more() -> None:
    slo, window = 0.005, 1.0
    # over the SLO: 500 samples are enough to cut; fewer wait (unless a window passed)
    assert enough_evidence(0.009, slo, CUT_EVIDENCE, CUT_EVIDENCE, 0.2, window)
    assert not enough_evidence(0.009, slo, CUT_EVIDENCE - 1, 600, 0.2, window)
    assert enough_evidence(0.009, slo, 50, 50, window, window)
    # under it: 500 samples are not enough to grow; 2000 are, or two windows
    assert not enough_evidence(0.002, slo, CUT_EVIDENCE, CUT_EVIDENCE, 0.2, window)
    assert enough_evidence(0.002, slo, GROW_EVIDENCE, GROW_EVIDENCE, 0.9, window)
    assert not enough_evidence(0.002, slo, 900, 900, 1.5, window)
    assert enough_evidence(0.002, slo, 900, 900, 2.0, window)
    # idle read lane: judge (grow); reads but none since the change: wait
    assert enough_evidence(None, slo, 0, 0, 0.1, window)
    assert not enough_evidence(None, slo, 0, 300, 0.1, window)


def test_growth_on_a_measured_p99_is_gentler_than_on_an_idle_read_lane() -> None:
    c = controller(cap=1000 * MiB)
    c.rate = 100 * MiB
    c.update(0.004, 1.0, 100 * MiB)  # 0.8x SLO: +2 x (0.9 - 0.8) = +20 %
    assert c.rate == pytest.approx(120 * MiB)
    c.update(0.0001, 1.5, 120 * MiB)  # far under the SLO: at most +25 %
    assert c.rate == pytest.approx(120 * 1.25 * MiB)
    c.update(0.0043, 2.0, 150 * MiB)  # 0.86x: +8 %, gentler than idle ...
    assert c.rate == pytest.approx(120 * 1.25 * 1.08 * MiB)
    c.update(None, 2.5, 162 * MiB)  # ... no reads at all: +25 %
    assert c.rate == pytest.approx(120 * 1.25 * 1.08 * 1.25 * MiB)


def test_an_unused_limit_does_not_grow_between_saves() -> None:
    c = controller()
    c.update(0.02, 1.0, 400 * MiB)  # cut
    rate = c.rate
    assert rate is not None
    for t in range(20):
        c.update(0.0005, 2.0 + t, 0.2 * rate)  # reads fast, writes idle
    assert c.rate == rate and "uses 20% of the limit" in c.state
    c.update(0.0005, 30.0, rate)  # a save again: it binds, so it may grow
    assert c.rate is not None and c.rate > rate
