"""Chain-affine placement (pure): every segment of a chain carries its chain's home
digest, an idle cluster puts a whole chain on its home node (so one lost node of N costs
about 1/N of the cached prefix blocks), a loaded home spills segments along their own
walks, and a join moves whole chains."""

from __future__ import annotations

import hashlib

import pytest

from isolane.cluster.chain_segments import plan_segments, segment_digest
from isolane.cluster.membership import plan_moves
from isolane.cluster.rendezvous import PLACEMENTS, make_placement
from isolane.cluster.ring import HashRing, prefix_digest
from isolane.cluster.router import ClusterOptions, ClusterRouter

S = 4
BLOCKS = 32


def _key(*parts: object) -> bytes:
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()


def _chain(c: int, n: int = BLOCKS) -> list[bytes]:
    return [_key("chain", c, b) for b in range(n)]


def _nodes(n: int) -> list[str]:
    return [f"http://10.1.0.{i}:7070" for i in range(1, n + 1)]


def _home(keys: list[bytes]) -> bytes:
    return segment_digest(prefix_digest(keys), 0)  # FORMATS.md, "KV chain segments"


def test_every_segment_carries_its_chains_home_digest() -> None:
    for c in range(50):
        keys = _chain(c, 1 + c)
        segs = plan_segments(keys, S)
        assert {s.home for s in segs} == {segs[0].digest} == {_home(keys)}
        if len(keys) > 6:  # a later part, named with the chain's leading keys: same home
            assert {s.home for s in plan_segments(keys[6:], S, chain=keys[:6])} \
                == {_home(keys)}
        assert len({s.digest for s in segs}) == len(segs)  # each still has its own digest


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_an_idle_cluster_puts_a_whole_chain_on_its_home_node(placement: str) -> None:
    nodes = _nodes(4)
    router = ClusterRouter(nodes, ClusterOptions(segment_blocks=S, placement=placement))
    other = ClusterRouter(list(reversed(nodes)),
                          ClusterOptions(segment_blocks=S, placement=placement))
    ring = make_placement(placement, nodes)
    homes = set()
    for c in range(100):
        keys = _chain(c)
        home = ring.owner(_home(keys))
        homes.add(home)
        for seg in router.segments(keys):
            assert router.place(seg.digest, seg.home) == home
            assert other.read_candidates(seg.digest, seg.home)[0] == home  # no coordination
        assert router.owner(keys) == home
    assert homes == set(nodes)  # chains spread over the nodes, each on one


def test_a_loaded_home_spills_segments_along_their_own_walks() -> None:
    nodes = _nodes(4)
    router = ClusterRouter(nodes, ClusterOptions(segment_blocks=S))
    keys = _chain(7)
    segs = router.segments(keys)
    home = HashRing(nodes).owner(segs[0].home)
    router.observe(home, {"inflight": {"requests": 40}, "lanes": {"read": {"p99": 10}}})
    spilled = [router.place(s.digest, s.home) for s in segs]
    assert home not in spilled and len(set(spilled)) > 1  # spread, not piled on a neighbour
    for seg, node in zip(segs, spilled, strict=True):
        # Another client with the same loads reads the home first, then finds the spill.
        fresh = ClusterRouter(nodes, ClusterOptions(segment_blocks=S))
        fresh.observe(home, {"inflight": {"requests": 40}, "lanes": {"read": {"p99": 10}}})
        candidates = fresh.read_candidates(seg.digest, seg.home)
        assert candidates[0] == home and node in candidates


def _served_share(owners: list[list[str]], nodes: list[str]) -> float:
    """Mean over which node dies of the prefix blocks still served, over those before
    (``owners``: per chain, the node of each of its segments of S blocks)."""
    before = sum(len(o) * S for o in owners) * len(nodes)
    after = 0
    for dead in nodes:
        for chain in owners:
            after += S * next((i for i, node in enumerate(chain) if node == dead), len(chain))
    return after / before


@pytest.mark.parametrize("n", [3, 4, 8])
def test_one_lost_node_of_n_costs_about_one_nth_of_the_cached_prefixes(n: int) -> None:
    nodes = _nodes(n)
    ring = HashRing(nodes)
    router = ClusterRouter(nodes, ClusterOptions(segment_blocks=S))
    chains = [router.segments(_chain(c)) for c in range(400)]
    affine = [[router.place(s.digest, s.home) for s in segs] for segs in chains]
    assert _served_share(affine, nodes) >= 0.9 * (n - 1) / n
    # Segments on their own digests' owners (version 2) missed it: a prefix ends at its
    # first segment on the dead node.
    own = [[ring.owner(s.digest) for s in segs] for segs in chains]
    assert _served_share(own, nodes) < 0.75 * (n - 1) / n


def test_a_join_moves_whole_chains_about_one_nth_of_them() -> None:
    old = HashRing(_nodes(8))
    new = old.with_node("http://10.1.9.9:7070")
    chains = [plan_segments(_chain(c, 40), S) for c in range(600)]
    homes = [segs[0].home for segs in chains]  # what nodes record every segment under
    moved = {d for ds in plan_moves(old, new, homes).values() for d in ds}
    assert 0.6 / 9 < len(moved) / len(homes) < 1.5 / 9
    for segs in chains:  # a chain moves with all its segments, or stays
        assert len({s.home in moved for s in segs}) == 1
