"""Spill by cache size (pure): a chain's segments stay on its home node until they start
past ``SPILL_SHARE`` of that node's cache (in blocks); later ones are placed by their
own digests, as chains of their own. A node whose size is unknown keeps chains whole,
and a reader finds segments written under either rule whatever size it knows now."""

from __future__ import annotations

import hashlib
import math

from isolane.cluster.chain_placement import SPILL_SHARE, ChainPlacement, spills
from isolane.cluster.membership import Membership
from isolane.cluster.router import ClusterRouter, cache_blocks_from_stats

NODES = [f"http://10.3.0.{i}:7070" for i in range(1, 9)]
HOME = hashlib.blake2b(b"long chain", digest_size=16).digest()
S = 4
CACHE = 1000  # blocks: segments from position 30 on spill


def _digest(i: int) -> bytes:
    return hashlib.blake2b(f"long segment {i}".encode(), digest_size=16).digest()


def _idle() -> dict[str, float]:
    return dict.fromkeys(NODES, 0.0)


def test_the_rule_spills_from_a_share_of_the_cache() -> None:
    assert SPILL_SHARE == 0.03
    assert not spills(0, 0)  # a chain's head never spills
    assert not spills(28, CACHE) and spills(32, CACHE) and spills(30, CACHE)
    assert not spills(10**9, math.inf)  # unknown or unbounded: whole chains


def test_segments_past_the_share_leave_home_and_are_recorded_by_their_digest() -> None:
    chains = ChainPlacement(Membership(NODES, min_load=10.0), write_half_life=math.inf)
    home = chains.members.owner(HOME)
    assert home is not None
    chains.set_cache_blocks(home, CACHE)
    placed = []
    for i in range(1, 40):
        recorded = chains.home_for(_digest(i), HOME, i * S)
        assert recorded == (_digest(i) if i * S >= 30 else HOME)
        placed.append(chains.place(_digest(i), HOME, _idle(), 1.0, i * S))
    assert set(placed[:7]) == {home}  # starts 4..28: on the home
    spilled = placed[7:]
    assert spilled == [chains.members.owner(_digest(i)) for i in range(8, 40)]
    assert len(set(spilled)) > 4  # spread along their own walks
    # Another node's cache size does not matter: the home's does.
    other = ChainPlacement(Membership(NODES, min_load=10.0), write_half_life=math.inf)
    for node in NODES:
        if node != home:
            other.set_cache_blocks(node, 1)
    assert {other.place(_digest(i), HOME, _idle(), 1.0, i * S) for i in range(1, 40)} \
        == {home}


def test_readers_find_segments_written_under_either_size() -> None:
    small = ClusterRouter(NODES)
    home = small.ring.owner(HOME)
    small.observe(home, {"kv": {"cache_blocks": {"ns": CACHE}}}, "ns")
    unknown = ClusterRouter(NODES)  # not probed yet: keeps chains whole
    for i in range(1, 40):
        start = i * S
        on_small = small.place(_digest(i), HOME, start)
        on_unknown = unknown.place(_digest(i), HOME, start)
        # Fresh readers (no memory of the writes) that know the other size.
        assert on_small in ClusterRouter(NODES).read_candidates(_digest(i), HOME, start)
        reader = ClusterRouter(NODES)
        reader.observe(home, {"kv": {"cache_blocks": {"ns": CACHE}}}, "ns")
        candidates = reader.read_candidates(_digest(i), HOME, start)
        assert on_unknown in candidates
        # The rule's current choice comes first.
        assert candidates[0] == (on_small if start >= 30 else home)
    assert small.describe()["cache_blocks"] == {home: CACHE}


def test_a_node_s_cache_size_is_read_from_its_stats() -> None:
    stats = {"kv": {"namespaces": ["a", "b"], "cache_blocks": {"a": 143}}}
    assert cache_blocks_from_stats(stats, "a") == 143
    assert cache_blocks_from_stats(stats, "b") is None  # not reported: unknown
    assert cache_blocks_from_stats({}, "a") is None  # an older node
    assert cache_blocks_from_stats({"kv": {"cache_blocks": {"a": "x"}}}, "a") is None
    assert cache_blocks_from_stats({"kv": {"cache_blocks": {"a": True}}}, "a") is None
