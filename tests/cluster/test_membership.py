from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from isolane.cluster.membership import Membership, plan_moves
from isolane.cluster.ring import HashRing
from isolane.config import ClusterConfig
from isolane.errors import InvalidArgumentError

NODES = [f"http://10.0.0.{i}:7070" for i in range(6)]
KEYS = [hashlib.blake2b(str(i).encode(), digest_size=16).digest() for i in range(3000)]


@settings(max_examples=30, deadline=None)
@given(down=st.sets(st.sampled_from(NODES)))
def test_a_down_node_is_never_returned(down: set[str]) -> None:
    members = Membership(NODES)
    for node in down:
        members.mark_down(node)
    loads = dict.fromkeys(NODES, 0.0)
    for key in KEYS[:200]:
        owner = members.owner(key)
        candidates = members.read_candidates(key)
        placed = members.place(key, loads)
        if down == set(NODES):  # everything down: misses, not errors
            assert owner is None and candidates == [] and placed is None
            continue
        # The chain goes to the first live node of its walk (its replica's node).
        assert owner == members.ring.successors(key, 1, skip=down)[0]
        assert candidates == [owner]
        assert placed is not None and placed not in down
        loads[placed] += 1


def test_health_probes_take_a_node_down_after_fail_after_failures_and_up_on_success() -> None:
    members = Membership(NODES, fail_after=3)
    node = NODES[2]
    assert [members.observe(node, ok=False) for _ in range(3)] == [True, True, False]
    assert node in members.down and not members.is_up(node)
    assert members.observe(node, ok=True)
    assert members.is_up(node) and not members.down
    assert members.observe(node, ok=False)  # the count restarted after the success
    with pytest.raises(InvalidArgumentError, match="not a cluster member"):
        members.observe("http://elsewhere:1", ok=False)


def test_plan_moves_lists_exactly_the_chains_whose_owner_changed() -> None:
    old = HashRing(NODES)
    new = old.with_node("http://10.0.0.9:7070")
    plan = plan_moves(old, new, KEYS)
    changed = [k for k in KEYS if old.owner(k) != new.owner(k)]
    assert sorted(k for ks in plan.values() for k in ks) == sorted(changed)
    for (src, dst), keys in plan.items():
        assert dst == "http://10.0.0.9:7070"
        assert all(old.owner(k) == src and new.owner(k) == dst for k in keys)
    assert 0.08 < len(changed) / len(KEYS) < 0.22  # ~1/7
    assert plan_moves(old, old, KEYS) == {}


def test_reads_fall_back_to_the_previous_owner_until_the_move_completes() -> None:
    members = Membership(NODES)
    new = "http://10.0.0.9:7070"
    old_ring = members.join(new)
    assert members.previous == (old_ring,)
    moved = [k for k in KEYS if old_ring.owner(k) != members.ring.owner(k)]
    stayed = [k for k in KEYS if old_ring.owner(k) == members.ring.owner(k)]
    assert moved and stayed
    for key in moved[:50]:
        assert members.read_candidates(key) == [new, old_ring.owner(key)]
        assert members.owner(key) == new  # writes go to the new owner at once
    for key in stayed[:50]:
        assert members.read_candidates(key) == [old_ring.owner(key)]
    members.mark_down(old_ring.owner(moved[0]))
    assert members.read_candidates(moved[0]) == [new]  # a down fallback is skipped
    members.complete_move()
    assert members.previous == ()
    assert all(members.read_candidates(k) == [new] for k in moved[:50])


def test_a_leaving_node_serves_its_chains_until_the_move_completes_and_changes_stack() -> None:
    members = Membership(NODES)
    leaving = NODES[0]
    first = members.leave(leaving)
    theirs = [k for k in KEYS if first.owner(k) == leaving]
    assert all(members.read_candidates(k) == [members.ring.owner(k), leaving]
               for k in theirs)
    second = members.join("http://10.0.0.9:7070")  # a second change while moving
    assert members.previous == (second, first)
    for key in theirs:
        expected = list(dict.fromkeys([members.ring.owner(key), second.owner(key), leaving]))
        assert members.read_candidates(key) == expected
    members.mark_down(leaving)  # still known while the move is pending
    members.complete_move()
    assert leaving not in members.down
    with pytest.raises(InvalidArgumentError, match="not a cluster member"):
        members.mark_down(leaving)


def test_membership_from_the_cluster_config() -> None:
    cluster = ClusterConfig(nodes=tuple(NODES[:3]), load_bound=1.5)
    members = Membership.from_config(cluster)
    assert members.ring.nodes == tuple(sorted(NODES[:3]))
    loads = {NODES[0]: 0.0, NODES[1]: 0.0, NODES[2]: 0.0}
    for _ in range(300):  # all on one chain: the bound (1.5) caps every node
        node = members.place(KEYS[0], loads)
        assert node is not None
        loads[node] += 1
    assert max(loads.values()) <= 150
    with pytest.raises(InvalidArgumentError, match="fail_after"):
        Membership(NODES, fail_after=0)


def test_min_load_keeps_chains_home_and_prefer_keeps_them_where_they_went() -> None:
    members = Membership(NODES, min_load=1.0)
    key = KEYS[0]
    owner = members.ring.owner(key)
    light = dict.fromkeys(NODES, 0.0) | {owner: 0.5}  # over c x mean, under min_load
    assert members.place(key, light, 0.01) == owner
    heavy = dict.fromkeys(NODES, 0.0) | {owner: 5.0}
    elsewhere = members.place(key, heavy, 0.01)
    assert elsewhere is not None and elsewhere != owner
    other = next(n for n in NODES if n not in (owner, elsewhere))
    assert members.place(key, heavy, 0.01, prefer=other) == other  # within its bound: kept
    members.join("http://10.0.0.9:7070")
    new_owner = members.ring.owner(key)
    assert members.place(key, {new_owner: 0.5}, 0.01) == new_owner  # min_load survives
    assert set(members.members) == set(NODES) | {"http://10.0.0.9:7070"}
    assert members.is_known("http://10.0.0.9:7070") and not members.is_known("http://x:1")
