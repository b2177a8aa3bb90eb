"""The host law remembers the limit it last cut from (CUBIC's W_max): a rate a cut left
below it climbs back on reads that hold the SLO, in steps sized from the distance to
the SLO (io.latency-like), up to a plateau near it; from there on the plain law. A real plane
file, the governor stepped on a test clock."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

from isolane.lanes import LaneScheduler
from isolane.lanes.control import PLATEAU, RECOVER_GAIN, TargetController
from isolane.lanes.host_governor import HostGovernor
from tests.lanes.host_steps import SLO, cut_to_a_limit, governed_host, period
from tests.support.clock import FakeClock


@pytest.fixture(autouse=True)
def recovery_law(monkeypatch: pytest.MonkeyPatch) -> None:
    """The recovery law is off by default (it lost the benchmark's A/B); on here."""
    monkeypatch.setattr(TargetController, "remembers_cuts", True)


@pytest.fixture
def governed(tmp_path: Path) -> Iterator[tuple[LaneScheduler, HostGovernor, FakeClock]]:
    yield from governed_host(tmp_path, 30_000.0)


def law(governor: HostGovernor) -> TargetController:
    assert isinstance(governor.write, TargetController)
    return governor.write


def rates_over(scheduler: LaneScheduler, governor: HostGovernor, clock: FakeClock,
               read_s: float, seconds: float) -> list[float]:
    out = []
    for _ in range(round(seconds / 0.1)):
        period(scheduler, governor, clock, read_s)
        assert governor.write.rate is not None
        out.append(governor.write.rate)
    return out


def test_a_rate_cut_below_the_limit_it_failed_at_climbs_back_in_the_hold_band(
        governed: tuple[LaneScheduler, HostGovernor, FakeClock]) -> None:
    """Reads at 0.95x the SLO (inside the 0.9-1x band, where session 6's law held
    wherever a cut had left it) at half the limit the reads last failed at: the law
    grows back toward that limit, in seconds, and stops short of it."""
    scheduler, governor, clock = governed
    rate = cut_to_a_limit(scheduler, governor, clock)
    cut_from = law(governor).cut_from
    assert cut_from is not None and cut_from == pytest.approx(2 * rate)  # cut by half
    rates = rates_over(scheduler, governor, clock, 0.95 * SLO, 8.0)
    assert max(rates) <= PLATEAU * cut_from * 1.0001  # no probing from the band
    assert rates[-1] >= 0.75 * cut_from, [round(r / 2**20) for r in rates[::10]]
    grown = governor.write.decisions[-1]
    assert grown.reason.startswith("increase") and "recovering" in grown.reason
    # every step waited for a second of reads at its rate (the growth evidence)
    ups = [d.at_s for d in governor.write.decisions if d.reason.startswith("increase")]
    assert all(b - a >= 1.0 for a, b in itertools.pairwise(ups))


def test_session_6s_law_holds_where_the_cut_left_it(
        governed: tuple[LaneScheduler, HostGovernor, FakeClock],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The A/B peer (``remembers_cuts`` False, the benchmark's session-6 row): the same
    reads leave the rate at the cut."""
    monkeypatch.setattr(TargetController, "remembers_cuts", False)
    scheduler, governor, clock = governed
    rate = cut_to_a_limit(scheduler, governor, clock)
    assert law(governor).cut_from is None
    rates = rates_over(scheduler, governor, clock, 0.95 * SLO, 8.0)
    assert set(rates) == {rate} and "holding" in governor.write.state


def test_recovery_steps_are_sized_from_the_distance_to_the_slo(
        governed: tuple[LaneScheduler, HostGovernor, FakeClock]) -> None:
    """Far under the SLO a step closes RECOVER_GAIN of the way to the plateau; at
    0.95x, (1 - 0.95) / (1 - 0.9) = half that (p99s from 4 % log buckets)."""
    scheduler, governor, clock = governed
    rate = cut_to_a_limit(scheduler, governor, clock)
    cut_from = law(governor).cut_from
    assert cut_from is not None
    plateau = PLATEAU * cut_from
    while governor.write.rate == rate:
        period(scheduler, governor, clock, 0.2 * SLO)
    fast = governor.write.rate
    assert fast == pytest.approx(rate + RECOVER_GAIN * (plateau - rate), rel=1e-6)
    while governor.write.rate == fast:
        period(scheduler, governor, clock, 0.95 * SLO)
    slow = governor.write.rate
    assert slow is not None
    share = (slow - fast) / (RECOVER_GAIN * (plateau - fast))
    assert 0.2 < share < 0.6, share


def test_recovery_stops_at_the_plateau_then_the_plain_law_grows_on(
        governed: tuple[LaneScheduler, HostGovernor, FakeClock]) -> None:
    scheduler, governor, clock = governed
    cut_to_a_limit(scheduler, governor, clock)
    cut_from = law(governor).cut_from
    assert cut_from is not None
    rates_over(scheduler, governor, clock, 0.2 * SLO, 20.0)
    steps = [(d.old_rate, d.new_rate) for d in governor.write.decisions
             if d.reason.startswith("increase")]
    assert steps and all(old is not None and new is not None for old, new in steps)
    at_plateau = [new for _old, new in steps if new == pytest.approx(PLATEAU * cut_from)]
    assert at_plateau, "recovery stops at the plateau"
    past = [new / old for old, new in steps  # type: ignore[operator]
            if old >= PLATEAU * cut_from * 0.999]
    # from the plateau on, the plain law's step far under the SLO: +25 %
    assert past and all(g == pytest.approx(1.25) for g in past)
    assert not law(governor).recovering and law(governor).grows_below < 1


def test_a_cut_while_recovering_lowers_the_remembered_limit_by_its_factor(
        governed: tuple[LaneScheduler, HostGovernor, FakeClock]) -> None:
    scheduler, governor, clock = governed
    rate = cut_to_a_limit(scheduler, governor, clock)
    cut_from = law(governor).cut_from
    assert cut_from is not None
    while governor.write.rate == rate:
        period(scheduler, governor, clock, 0.2 * SLO)
    grown = governor.write.rate
    assert grown is not None and grown < PLATEAU * cut_from
    cuts = governor.write.cuts
    while governor.write.cuts == cuts:  # just over the SLO: a small cut
        period(scheduler, governor, clock, 1.1 * SLO)
    factor = governor.write.rate / grown  # type: ignore[operator]
    assert 0.8 < factor < 0.97
    assert law(governor).cut_from == pytest.approx(max(grown, cut_from * factor))
    assert law(governor).cut_from < cut_from  # type: ignore[operator]
