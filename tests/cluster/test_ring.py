from __future__ import annotations

import bisect
import hashlib
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from isolane.cluster.ring import (
    BoundedLoadRouter,
    HashRing,
    device_for,
    prefix_digest,
    route_blocks,
)
from isolane.errors import InvalidArgumentError
from isolane.kvpool.keys import KVNamespace, block_keys

REPO = Path(__file__).resolve().parents[2]
NODES = [f"http://10.0.0.{i}:7070" for i in range(8)]


def digests(n: int, seed: int = 0) -> list[bytes]:
    return [hashlib.blake2b(f"{seed}/{i}".encode(), digest_size=16).digest() for i in range(n)]


KEYS = digests(20_000)


# -- the ring layout -----------------------------------------------------------------------
def naive_owner(nodes: dict[str, float], vnodes: int, digest: bytes) -> str:
    """The owner as docs/FORMATS.md specifies it, without the ring's code."""
    points = sorted((xxhash.xxh3_64_intdigest(f"{n}#{i}".encode()), n)
                    for n, w in nodes.items() for i in range(max(1, round(vnodes * w))))
    pos = xxhash.xxh3_64_intdigest(digest)
    i = bisect.bisect_left([p for p, _ in points], pos)
    return points[i % len(points)][1]


def test_owner_follows_the_documented_layout() -> None:
    weights = {"a": 1.0, "b": 2.0, "c": 0.5}
    ring = HashRing(weights, vnodes=16, weights=weights)
    for digest in KEYS[:300]:
        assert ring.owner(digest) == naive_owner(weights, 16, digest)
    # The test vector of docs/FORMATS.md ("KV routing ring").
    assert xxhash.xxh3_64_intdigest(b"node-a#0") == 0x42D3010AC73D0427
    vector = HashRing(["node-a", "node-b", "node-c"], vnodes=4)
    key = bytes(range(16))
    assert f"{xxhash.xxh3_64_intdigest(key):016x}" == "8355e3a6f61770db"
    assert vector.owner(key) == "node-c"
    assert vector.successors(key, 3) == ["node-c", "node-b", "node-a"]


def test_owners_are_the_same_in_a_process_with_another_hash_seed() -> None:
    sample = KEYS[:200]
    script = (
        "import json, sys\n"
        "from isolane.cluster.ring import HashRing, device_for\n"
        "ring = HashRing(json.loads(sys.argv[1]))\n"
        "keys = [bytes.fromhex(k) for k in json.loads(sys.argv[2])]\n"
        "print(json.dumps([[ring.successors(k, 3), device_for(k, 4)] for k in keys]))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "4242"}
    out = subprocess.run(
        [sys.executable, "-c", script, json.dumps(NODES), json.dumps([k.hex() for k in sample])],
        capture_output=True, text=True, check=True, cwd=REPO, env=env, timeout=60)
    ring = HashRing(NODES)
    ours = [[ring.successors(k, 3), device_for(k, 4)] for k in sample]
    assert json.loads(out.stdout) == ours
    assert len({tuple(s) for s, _ in ours}) > 8  # the sample really spans the ring


def test_node_order_does_not_matter_and_shares_add_up() -> None:
    a, b = HashRing(NODES), HashRing(list(reversed(NODES)))
    assert a == b
    assert [a.owner(k) for k in KEYS[:500]] == [b.owner(k) for k in KEYS[:500]]
    shares = a.shares()
    assert math.isclose(sum(shares.values()), 1.0)
    owned = {n: 0 for n in NODES}
    for k in KEYS:
        owned[a.owner(k)] += 1
    for node in NODES:  # sampled ownership agrees with the arcs
        assert abs(owned[node] / len(KEYS) - shares[node]) < 0.015


def test_weights_scale_a_nodes_share() -> None:
    ring = HashRing(NODES, weights={NODES[0]: 3.0})
    shares = ring.shares()
    others = sum(shares[n] for n in NODES[1:]) / 7
    assert 2.4 < shares[NODES[0]] / others < 3.6


@settings(max_examples=12, deadline=None)
@given(n=st.integers(2, 24), new=st.text("abcdefgh", min_size=1, max_size=6))
def test_a_join_moves_only_keys_to_the_new_node_about_one_nth(n: int, new: str) -> None:
    old = HashRing([f"n{i}" for i in range(n)], vnodes=128)
    grown = old.with_node(new)
    moved = [k for k in KEYS[:4000] if old.owner(k) != grown.owner(k)]
    assert all(grown.owner(k) == new for k in moved)
    assert all(grown.owner(k) != new for k in KEYS[:4000] if k not in set(moved))
    # 128 points: a node's share varies by ~9 %; sampling 4000 keys adds a little.
    assert 0.6 < len(moved) / 4000 * (n + 1) < 1.5


@settings(max_examples=12, deadline=None)
@given(n=st.integers(2, 24), gone=st.integers(0, 23))
def test_a_leave_moves_only_the_leaving_nodes_keys(n: int, gone: int) -> None:
    old = HashRing([f"n{i}" for i in range(n)], vnodes=128)
    node = f"n{gone % n}"
    shrunk = old.without_node(node)
    moved = [k for k in KEYS[:4000] if old.owner(k) != shrunk.owner(k)]
    assert moved == [k for k in KEYS[:4000] if old.owner(k) == node]
    assert 0.6 < len(moved) / 4000 * n < 1.5
    # ... and each goes where the old ring's walk continues (its first replica).
    assert all(shrunk.owner(k) == old.successors(k, 2)[1] for k in moved)


def test_successors_are_distinct_start_at_the_owner_and_skip() -> None:
    ring = HashRing(NODES)
    for k in KEYS[:200]:
        walk = ring.successors(k, 20)
        assert walk[0] == ring.owner(k)
        assert sorted(walk) == sorted(NODES)  # capped at the ring's size, all distinct
        assert ring.successors(k, 3) == walk[:3]
        skip = {walk[0], walk[2]}
        assert ring.successors(k, 3, skip=skip) == [walk[1], *walk[3:5]]
    assert ring.successors(KEYS[0], 0) == []


def test_bad_rings_are_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="at least one node"):
        HashRing([])
    with pytest.raises(InvalidArgumentError, match="distinct"):
        HashRing(["a", "b", "a"])
    with pytest.raises(InvalidArgumentError, match="weight of node 'a'"):
        HashRing(["a"], weights={"a": 0})
    with pytest.raises(InvalidArgumentError, match="not in the ring"):
        HashRing(["a"], weights={"b": 1.0})
    with pytest.raises(InvalidArgumentError, match="not in the ring"):
        HashRing(["a"]).without_node("b")
    with pytest.raises(InvalidArgumentError, match="at least one node"):
        HashRing(["a"]).without_node("a")


# -- prefix digests and devices ------------------------------------------------------------
NS = KVNamespace(model="m", dtype="bfloat16", layout="test")


def test_a_chain_routes_by_its_kth_key_so_longer_prompts_stay_on_the_same_node() -> None:
    ring = HashRing(NODES)
    tokens = list(range(4 * 40))
    keys = block_keys(tokens, 4, NS)
    assert prefix_digest(keys, 1) == keys[0]
    assert prefix_digest(keys, 3) == keys[2]
    assert prefix_digest(keys[:2], 3) == keys[1]  # shorter than k: its last key
    assert {route_blocks(ring, keys[:n], 3) for n in range(3, 41)} == {ring.owner(keys[2])}
    # Prompts sharing only their first block go to different nodes with k=2, not k=1.
    others = [block_keys([0, 1, 2, 3, *range(100 + 4 * i, 104 + 4 * i)], 4, NS)
              for i in range(50)]
    assert len({route_blocks(ring, ks, 1) for ks in others}) == 1
    assert len({route_blocks(ring, ks, 2) for ks in others}) == len(NODES)
    with pytest.raises(InvalidArgumentError, match="at least one block key"):
        prefix_digest([])
    with pytest.raises(InvalidArgumentError, match="k"):
        prefix_digest(keys, 0)


def test_device_for_spreads_evenly_and_a_new_device_only_takes_keys() -> None:
    four = [device_for(k, 4) for k in KEYS]
    counts = [four.count(d) for d in range(4)]
    assert min(counts) > 0.23 * len(KEYS) and max(counts) < 0.27 * len(KEYS)
    five = [device_for(k, 5) for k in KEYS]
    assert all(b == a or b == 4 for a, b in zip(four, five, strict=True))
    assert 0.17 < five.count(4) / len(KEYS) < 0.23
    # Independent of the node choice: the keys of one node still use every device.
    ring = HashRing(NODES)
    mine = [d for k, d in zip(KEYS, four, strict=True) if ring.owner(k) == NODES[0]]
    assert set(mine) == {0, 1, 2, 3}
    assert device_for(KEYS[0], 1) == 0
    with pytest.raises(InvalidArgumentError):
        device_for(KEYS[0], 0)


# -- bounded loads ---------------------------------------------------------------------------
@pytest.mark.parametrize("same_digest", [True, False])
def test_bounded_loads_never_pass_ceil_c_times_the_average(same_digest: bool) -> None:
    ring = HashRing(NODES)
    router = BoundedLoadRouter(ring, c=1.25)
    loads = dict.fromkeys(NODES, 0)
    rng = random.Random(7)
    for m in range(1, 3001):
        # Worst case: every placement wants the same node; else Zipf-ish hot keys.
        digest = KEYS[0] if same_digest else KEYS[min(int(rng.paretovariate(1.0)), 999)]
        node = router.place(digest, loads)
        assert node is not None
        loads[node] += 1
        assert max(loads.values()) <= math.ceil(1.25 * m / len(NODES))
    assert sum(loads.values()) == 3000


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), max_cost=st.integers(1, 40))
def test_bounded_loads_with_varied_costs_stay_within_c_times_the_average(
        seed: int, max_cost: int) -> None:
    router = BoundedLoadRouter(HashRing(NODES), c=1.25)
    loads = dict.fromkeys(NODES, 0.0)
    rng = random.Random(seed)
    for _ in range(2000):
        cost = float(rng.randint(1, max_cost))
        node = router.place(KEYS[min(int(rng.paretovariate(0.8)), 99)], loads, cost)
        assert node is not None
        loads[node] += cost
    # Past the cold start (a few costs a node) no load passes c x the average.
    assert max(loads.values()) <= 1.25 * sum(loads.values()) / len(NODES) + 1e-9


def test_bounded_loads_keep_the_owner_until_it_is_over_and_then_walk_on() -> None:
    ring = HashRing(NODES)
    router = BoundedLoadRouter(ring, c=1.25)
    key = KEYS[1]
    walk = ring.successors(key, 4)
    loads = dict.fromkeys(NODES, 10.0)
    assert router.place(key, loads) == walk[0]
    loads[walk[0]] = 11.0  # 11 + 1 <= 1.25 * (70 + 11 + 1) / 8 = 12.8: fits
    assert router.place(key, loads) == walk[0]
    loads[walk[0]] = 12.0  # 12 + 1 > 1.25 * 83 / 8 = 12.97: over, the next node
    assert router.place(key, loads) == walk[1]
    loads[walk[1]] = 40.0  # the average rises: 13 <= 1.25 * 113 / 8 = 17.7
    assert router.place(key, loads) == walk[0]
    loads[walk[0]] = 40.0  # 41 > 1.25 * 141 / 8 = 22.0 for both: the third node
    assert router.place(key, loads) == walk[2]
    # prefer: kept while it stays within its bound, else the walk decides.
    assert router.place(key, loads, prefer=walk[3]) == walk[3]
    assert router.place(key, loads, prefer=walk[1]) == walk[2]
    assert router.place(key, loads, prefer="not-a-node") == walk[2]
    assert router.place(key, loads, skip={walk[3]}, prefer=walk[3]) == walk[2]
    assert router.place(key, loads, skip={walk[0], walk[2]}) not in {walk[0], walk[1], walk[2]}
    assert router.place(key, loads, skip=set(NODES)) is None


def test_bounded_loads_weigh_the_average_by_node_weight() -> None:
    ring = HashRing(["big", "small"], weights={"big": 3.0, "small": 1.0})
    router = BoundedLoadRouter(ring, c=1.0)
    loads = {"big": 0.0, "small": 0.0}
    for _ in range(400):
        node = router.place(KEYS[2], loads)
        assert node is not None
        loads[node] += 1
    assert loads == {"big": 300.0, "small": 100.0}


def test_bounded_loads_keep_a_cold_start_and_light_loads_on_the_owners() -> None:
    router = BoundedLoadRouter(HashRing(NODES), c=1.25)
    loads = dict.fromkeys(NODES, 0.0)
    # No node can take a cost this large within its bound: the first one below it does.
    owner = router.ring.owner(KEYS[0])
    assert router.place(KEYS[0], loads, cost=1000.0) == owner
    loads[owner] = 1000.0  # now the owner is over: 1000 >= 1.25 * 2000 / 8
    assert router.place(KEYS[0], loads, cost=1000.0) == router.ring.successors(KEYS[0], 2)[1]
    # min_load: loads below it never count as over, so light traffic keeps locality.
    light = BoundedLoadRouter(router.ring, c=1.25, min_load=2000.0)
    assert light.place(KEYS[0], loads, cost=1000.0) == owner
    assert light.fits(owner, loads, cost=1000.0)
    assert not light.fits(owner, loads, cost=1001.0)
    with pytest.raises(InvalidArgumentError, match="cost"):
        router.place(KEYS[3], {}, cost=0)
    with pytest.raises(InvalidArgumentError, match="load_bound"):
        BoundedLoadRouter(HashRing(["a"]), c=0.9)
    with pytest.raises(InvalidArgumentError, match="min_load"):
        BoundedLoadRouter(HashRing(["a"]), min_load=-1)
