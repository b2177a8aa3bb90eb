"""Chain placement's write share (pure): a home that took more than its share of the
segments placed lately passes new segments on along their own walks, so a hot long
chain (or the many chains behind one home) does not fill one node's cache while the
others stay cold; a cluster that wrote little keeps every chain on its home, and
another client without the writer's counts still finds the segments that left home."""

from __future__ import annotations

import hashlib
import math

import pytest

from isolane.cluster.chain_placement import ChainPlacement
from isolane.cluster.membership import Membership
from isolane.cluster.router import ClusterOptions, ClusterRouter
from isolane.errors import InvalidArgumentError

NODES = [f"http://10.2.0.{i}:7070" for i in range(1, 5)]
HOME = hashlib.blake2b(b"hot chain", digest_size=16).digest()


def _digest(i: int) -> bytes:
    return hashlib.blake2b(f"segment {i}".encode(), digest_size=16).digest()


def _place_chain(chains: ChainPlacement, n: int) -> list[str]:
    idle = dict.fromkeys(NODES, 0.0)
    return [node for i in range(n)
            if (node := chains.place(_digest(i), HOME, idle, 1.0)) is not None]


def test_a_home_past_its_write_share_passes_segments_on() -> None:
    members = Membership(NODES, load_bound=1.25, min_load=1.0)
    home = members.owner(HOME)
    placed = _place_chain(ChainPlacement(members, write_half_life=64), 1000)
    on_home = placed.count(home) / len(placed)
    assert 0.2 < on_home <= 0.4  # about c x 1/N of them, not all: the request load is 0
    assert set(placed) == set(NODES)  # the rest spread along the segments' own walks
    # With no write bound (segments by request load alone) the idle home takes them all.
    unbounded = _place_chain(ChainPlacement(members, write_half_life=math.inf), 1000)
    assert set(unbounded) == {home}


def test_a_cluster_that_wrote_little_keeps_whole_chains_home() -> None:
    members = Membership(NODES, load_bound=1.25, min_load=1.0)
    placed = _place_chain(ChainPlacement(members, write_half_life=4096), 800)
    assert set(placed) == {members.owner(HOME)}  # under the floor: half-life x share


def test_another_client_reads_segments_that_left_home() -> None:
    writer = ClusterRouter(NODES, ClusterOptions(write_half_life=64))
    reader = ClusterRouter(NODES)  # has placed nothing: knows no write counts
    placed = {_digest(i): writer.place(_digest(i), HOME) for i in range(1000)}
    found = sum(node in reader.read_candidates(digest, HOME)
                for digest, node in placed.items())
    assert found == len(placed)
    assert len(set(placed.values())) == len(NODES)  # some did leave home


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), True, "16"])
def test_a_bad_write_half_life_is_refused(bad: object) -> None:
    with pytest.raises(InvalidArgumentError, match="write_half_life"):
        ChainPlacement(Membership(NODES), write_half_life=bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="write_half_life"):
        ClusterOptions(write_half_life=bad)  # type: ignore[arg-type]
