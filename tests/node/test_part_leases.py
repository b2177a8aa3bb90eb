"""The leases of multi-rank saves begun on a node (a fake clock), and the node's gc of
the saves whose lease ran out."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from isolane.config import load_config
from isolane.errors import ConflictError, InvalidArgumentError
from isolane.node.app import build_app
from isolane.node.part_leases import PartLeases
from isolane.node.resources import NODE, Node
from isolane.snapshot.names import ROOT
from tests.support.clock import FakeClock
from tests.support.node import write_node_config


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


def test_gc_on_a_node_removes_an_abandoned_save_and_nothing_live(tmp_path: Path) -> None:
    """An in-process node (aiohttp's test server) whose lease clock the test moves."""
    config = load_config(write_node_config(tmp_path))

    async def run() -> None:
        app = build_app(lambda: Node(config))
        async with TestClient(TestServer(app)) as client:
            clock = FakeClock()
            app[NODE].part_leases = PartLeases(60.0, clock)  # before any save begins

            async def begin(name: str) -> Path:
                answer = await client.post(f"/v1/snapshots/{name}/parts")
                assert answer.status == 201, await answer.text()
                generation = (await answer.json())["generation"]
                return tmp_path / "ckpt" / ROOT / name / generation

            old = await begin("old")
            outside = tmp_path / "outside"
            outside.mkdir()
            (outside / "keep.bin").write_bytes(b"x")
            (old / "rank-00000").symlink_to(outside)  # a link planted in the leftovers
            clock.sleep(59.0)
            new = await begin("new")
            assert (await (await client.post("/v1/snapshots/_gc")).json())[
                "swept_generations"] == []
            clock.sleep(2.0)
            swept = (await (await client.post("/v1/snapshots/_gc")).json())
            assert swept["swept_generations"] == [f"local:old/{old.name}"]
            assert not old.exists() and new.is_dir()
            assert (outside / "keep.bin").read_bytes() == b"x"  # not followed
            late = await client.post(f"/v1/snapshots/old/parts/{old.name}/commit",
                                     json={"world": 1, "dcp": {}, "seconds": 0})
            assert late.status == 409 and "abandoned" in await late.text()
            stats = await (await client.get("/v1/stats")).json()
            assert stats["part_saves"] == {"open": 1, "abandoned": 1, "lease_s": 60.0}

    asyncio.run(run())
