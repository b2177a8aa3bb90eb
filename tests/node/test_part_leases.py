"""The leases of multi-rank saves begun on a node (no I/O: a fake clock)."""

from __future__ import annotations

import pytest

from isolane.errors import ConflictError, InvalidArgumentError
from isolane.node.part_leases import PartLeases
from tests.support.clock import FakeClock


def test_a_save_untouched_for_its_lease_is_handed_out_once() -> None:
    clock = FakeClock()
    leases = PartLeases(10.0, clock)
    leases.grant("a", "g1")
    leases.grant("b", "g2")
    clock.sleep(9.0)
    with leases.hold("b", "g2"):  # a part of b: renewed when it ends
        pass
    assert leases.expired() == []
    clock.sleep(2.0)
    assert leases.expired() == [("a", "g1")]
    assert leases.expired() == []
    assert leases.to_dict() == {"open": 1, "abandoned": 1, "lease_s": 10.0}
    with pytest.raises(ConflictError, match=r"abandoned past node\.part_save_lease_s"), \
            leases.hold("a", "g1"):
        pass


def test_a_request_in_flight_keeps_its_save_however_long_it_takes() -> None:
    clock = FakeClock()
    leases = PartLeases(10.0, clock)
    leases.grant("a", "g1")
    with leases.hold("a", "g1"):
        clock.sleep(100.0)
        assert leases.expired() == []
    clock.sleep(9.0)
    assert leases.expired() == []
    clock.sleep(2.0)
    assert leases.expired() == [("a", "g1")]


def test_ended_and_unknown_saves_hold_no_lease() -> None:
    leases = PartLeases(1800.0)
    leases.grant("a", "g1")
    leases.end("a", "g1")
    for name, generation in (("a", "g1"), ("never", "g0")):
        with pytest.raises(ConflictError, match="not a save in progress"), \
                leases.hold(name, generation):
            pass
    assert leases.sweep_period_s == 60.0 and PartLeases(4.0).sweep_period_s == 1.0
    with pytest.raises(InvalidArgumentError, match="positive"):
        PartLeases(0.0)
