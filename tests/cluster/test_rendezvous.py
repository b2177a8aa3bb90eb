"""Rendezvous (highest-random-weight) placement of segment digests: the
``cluster.placement: rendezvous`` alternative to the ring (``isolane.cluster.rendezvous``).
The layout is pinned (docs/FORMATS.md, "KV routing rendezvous"): every client and
process computes the same owners; a join moves only what the new node wins, a leave
only what the gone node held; bounded loads walk down a digest's scores."""

from __future__ import annotations

import hashlib
import math
import subprocess
import sys
from pathlib import Path

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from isolane.cluster.membership import Membership, plan_moves
from isolane.cluster.rendezvous import PLACEMENTS, RendezvousNodes, make_placement
from isolane.cluster.ring import BoundedLoadRouter, HashRing
from isolane.cluster.router import ClusterOptions, ClusterRouter
from isolane.config import config_from_dict
from isolane.errors import ConfigError, InvalidArgumentError

NODES = [f"http://10.0.0.{i}:7070" for i in range(8)]
KEYS = [hashlib.blake2b(str(i).encode(), digest_size=16).digest() for i in range(4000)]
REPO = Path(__file__).resolve().parents[2]


def _mix64(z: int) -> int:  # the splitmix64 finaliser, as FORMATS.md writes it
    m = (1 << 64) - 1
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def _score(digest: bytes, node: str) -> int:
    return _mix64(xxhash.xxh3_64_intdigest(digest) ^ xxhash.xxh3_64_intdigest(node.encode()))


def test_the_owner_is_the_highest_score_and_the_walk_goes_down_the_scores() -> None:
    nodes = RendezvousNodes(NODES)
    for key in KEYS[:300]:
        ranked = sorted(NODES, key=lambda n, key=key: (-_score(key, n), n))
        assert nodes.owner(key) == ranked[0]
        assert list(nodes.walk(key)) == ranked
        assert list(nodes.walk(key, skip={ranked[0], ranked[3]})) == [
            n for n in ranked if n not in (ranked[0], ranked[3])]
        assert nodes.successors(key, 3) == ranked[:3]


def test_owners_are_the_same_in_another_process_and_whatever_the_listed_order() -> None:
    code = ("import hashlib, sys\n"
            "from isolane.cluster.rendezvous import RendezvousNodes\n"
            f"nodes = RendezvousNodes({list(reversed(NODES))!r}, weights={{{NODES[2]!r}: 2.0}})\n"
            "for i in range(500):\n"
            "    k = hashlib.blake2b(str(i).encode(), digest_size=16).digest()\n"
            "    print(nodes.owner(k))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=REPO, env={"PYTHONPATH": str(REPO),
                                                    "PYTHONHASHSEED": "123"}).stdout.split()
    here = RendezvousNodes(NODES, weights={NODES[2]: 2.0})
    assert out == [here.owner(k) for k in KEYS[:500]]
    assert len(set(out)) == len(NODES)


def test_the_layout_is_pinned() -> None:
    """Known owners (docs/FORMATS.md): a change of the score moves stored segments."""
    names = ["http://a:7070", "http://b:7070", "http://c:7070"]
    digests = [bytes([i]) * 16 for i in range(12)]
    nodes = RendezvousNodes(names)
    got = [nodes.owner(d) for d in digests]
    assert got == [min(names, key=lambda n, d=d: (-_score(d, n), n)) for d in digests]
    assert got == [f"http://{x}:7070" for x in "cbccbcbcbbbb"], got
    weighted = RendezvousNodes(names, weights={names[0]: 2.0})
    assert [weighted.owner(d) for d in digests] == [
        f"http://{x}:7070" for x in "cbacbcbcbabb"]


def test_a_join_moves_only_what_the_new_node_wins_and_a_leave_only_what_it_held() -> None:
    old = RendezvousNodes(NODES)
    new = old.with_node("http://10.0.1.1:7070")
    moves = plan_moves(old, new, KEYS)
    assert set(moves) <= {(n, "http://10.0.1.1:7070") for n in NODES}
    moved = sum(len(v) for v in moves.values())
    assert abs(moved / len(KEYS) * 9 - 1) < 0.2  # about the ideal 1 / 9
    gone = NODES[3]
    smaller = old.without_node(gone)
    moves = plan_moves(old, smaller, KEYS)
    assert {a for a, _ in moves} == {gone}
    assert sum(len(v) for v in moves.values()) == sum(old.owner(k) == gone for k in KEYS)


def test_weights_scale_a_nodes_share() -> None:
    nodes = RendezvousNodes(NODES[:4], weights={NODES[0]: 2.0})
    share = sum(nodes.owner(k) == NODES[0] for k in KEYS) / len(KEYS)
    assert abs(share - 2 / 5) < 0.04
    assert nodes.total_weight() == 5.0 and nodes.total_weight({NODES[0]}) == 3.0
    # changing one weight moves keys only to (or from) that node
    lighter = nodes.with_node(NODES[0], 1.0)
    assert all(a == NODES[0] for a, _ in plan_moves(nodes, lighter, KEYS))


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 12), joined=st.integers(0, 11))
def test_a_join_never_moves_a_key_between_two_old_nodes(n: int, joined: int) -> None:
    names = [f"n{i}" for i in range(n)]
    old = RendezvousNodes(names)
    new = old.with_node(f"x{joined}")
    for k in KEYS[:200]:
        assert new.owner(k) in (old.owner(k), f"x{joined}")


def test_bounded_loads_pass_a_segment_down_its_own_scores() -> None:
    nodes = RendezvousNodes(NODES)
    router = BoundedLoadRouter(nodes, 1.25)
    key = KEYS[0]
    ranked = list(nodes.walk(key))
    loads = dict.fromkeys(NODES, 10.0)
    loads[ranked[0]] = 100.0  # the owner is over its bound: the second-best takes it
    assert router.place(key, loads) == ranked[1]


def test_nodes_are_checked_as_the_ring_checks_them() -> None:
    with pytest.raises(InvalidArgumentError, match="at least one node"):
        RendezvousNodes([])
    with pytest.raises(InvalidArgumentError, match="distinct"):
        RendezvousNodes(["a", "a"])
    with pytest.raises(InvalidArgumentError, match="weight of node"):
        RendezvousNodes(["a"], weights={"a": 0.0})
    with pytest.raises(InvalidArgumentError, match="not in the ring"):
        RendezvousNodes(["a", "b"]).without_node("c")
    assert RendezvousNodes(["b", "a"]) == RendezvousNodes(["a", "b"])
    assert RendezvousNodes(["a"]) != RendezvousNodes(["a"], weights={"a": 2.0})
    assert math.isclose(RendezvousNodes(["a", "b"]).weight("a"), 1.0)


def test_membership_and_the_cluster_router_place_with_the_chosen_placement() -> None:
    assert PLACEMENTS == ("ring", "rendezvous")
    assert isinstance(make_placement("ring", NODES), HashRing)
    members = Membership(NODES, placement="rendezvous")
    nodes = RendezvousNodes(NODES)
    assert isinstance(members.ring, RendezvousNodes)
    assert all(members.owner(k) == nodes.owner(k) for k in KEYS[:200])
    old = members.join("http://10.0.1.1:7070")
    assert isinstance(old, RendezvousNodes) and isinstance(members.ring, RendezvousNodes)
    moved = next(k for k in KEYS if members.ring.owner(k) != old.owner(k))
    # while the move is pending, a read tries the new owner, then the old one
    assert members.read_candidates(moved) == [members.ring.owner(moved), old.owner(moved)]
    router = ClusterRouter(NODES, ClusterOptions(placement="rendezvous", slow_s=30.0))
    assert isinstance(router.ring, RendezvousNodes)
    assert all(router.place(k) == nodes.owner(k) for k in KEYS[:200])  # idle: owners
    assert router.describe()["placement"] == "rendezvous"
    with pytest.raises(InvalidArgumentError, match="placement must be one of"):
        ClusterOptions(placement="hrw")
    with pytest.raises(InvalidArgumentError, match="placement must be one of"):
        Membership(NODES, placement="mod-n")


def test_the_config_option_is_checked_and_reaches_the_client_options() -> None:
    base = {"device_groups": {"kv": {"role": "read", "devices": ["/tmp/x"]}}}
    assert config_from_dict(base).cluster.placement == "ring"
    config = config_from_dict({**base, "cluster": {"placement": "rendezvous"}})
    assert config.cluster.placement == "rendezvous"
    with pytest.raises(ConfigError, match=r"cluster\.placement.*'ring' .* or 'rendezvous' .*'hrw'"):
        config_from_dict({**base, "cluster": {"placement": "hrw"}})
    options = ClusterOptions.from_config(config.cluster)
    assert (options.placement, options.segment_blocks) == ("rendezvous", 4)
