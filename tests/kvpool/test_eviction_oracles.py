"""The keyed oracle policies (tests/support/eviction_oracles.py) behave as documented."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from isolane.errors import InvalidArgumentError
from tests.support.eviction_oracles import (
    POLICIES,
    EvictionPolicy,
    LRUPolicy,
    S3FIFOPolicy,
    make_policy,
)

NAMES = list(POLICIES)

keys = st.integers(0, 24)
ops = st.lists(st.one_of(
    st.tuples(st.just("put"), keys, st.integers(0, 40)),
    st.tuples(st.just("get"), keys),
    st.tuples(st.just("remove"), keys),
    st.tuples(st.just("evict"), st.integers(-5, 120)),
), max_size=80)


class Tier:
    """A memory tier as the KV pool will drive a policy: evict, then admit."""

    def __init__(self, policy: EvictionPolicy[Hashable], budget: int) -> None:
        self.policy = policy
        self.budget = budget
        self.sizes: dict[Hashable, int] = {}

    def put(self, key: Hashable, nbytes: int) -> None:
        if nbytes > self.budget:
            return  # the tier refuses blocks bigger than its budget
        if key in self.policy:
            self.policy.admit(key, nbytes)  # resize: counts as a hit
            self.sizes[key] = nbytes
            self.make_room(0)
        else:
            self.make_room(nbytes)
            self.policy.admit(key, nbytes)
            self.sizes[key] = nbytes
        assert self.policy.nbytes <= self.budget

    def get(self, key: Hashable) -> bool:
        hit = key in self.policy
        if hit:
            self.policy.touch(key)
        return hit

    def make_room(self, nbytes: int) -> None:
        need = self.policy.nbytes + nbytes - self.budget
        if need > 0:
            self.check_evict(need)
            assert self.policy.nbytes + nbytes <= self.budget

    def check_evict(self, need: int) -> list[Hashable]:
        before = dict(self.sizes)
        victims = self.policy.evict(need)
        assert len(set(victims)) == len(victims)
        assert all(v in before for v in victims), "victims must have been resident"
        freed = sum(before[v] for v in victims)
        if need <= 0:
            assert victims == []
        elif sum(before.values()) >= need:
            assert freed >= need  # enough, whenever enough is resident
        else:
            assert set(victims) == set(before)  # else everything
        for v in victims:
            assert v not in self.policy
            del self.sizes[v]
        return victims

    def check(self) -> None:
        assert len(self.policy) == len(self.sizes)
        assert self.policy.nbytes == sum(self.sizes.values())
        assert all(k in self.policy for k in self.sizes)
        assert not any(k in self.policy for k in range(25) if k not in self.sizes)


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=120, deadline=None)
@given(steps=ops, budget=st.integers(1, 150))
def test_invariants_hold_under_any_call_sequence(name: str, steps: list[tuple[Any, ...]],
                                                  budget: int) -> None:
    tier = Tier(make_policy(name, budget), budget)
    for step in steps:
        if step[0] == "put":
            tier.put(step[1], step[2])
        elif step[0] == "get":
            hit = tier.get(step[1])
            assert hit == (step[1] in tier.sizes)
        elif step[0] == "remove":
            tier.policy.remove(step[1])  # unknown keys are harmless
            tier.sizes.pop(step[1], None)
        else:
            tier.check_evict(step[1])
        tier.check()
        assert tier.policy.nbytes <= budget


@pytest.mark.parametrize("name", NAMES)
def test_unknown_keys_are_harmless(name: str) -> None:
    policy = make_policy(name, 10)
    policy.touch("nope")
    policy.remove("nope")
    assert policy.evict(5) == [] and len(policy) == 0 and policy.nbytes == 0
    policy.admit("a", 3)
    policy.remove("b")
    policy.touch("c")
    assert "a" in policy and "c" not in policy and policy.nbytes == 3
    assert policy.evict(0) == [] and policy.evict(-1) == []


@pytest.mark.parametrize("name", NAMES)
def test_readmitting_a_resident_key_resizes_it(name: str) -> None:
    policy = make_policy(name, 100)
    policy.admit(b"k" * 16, 10)
    policy.admit(b"k" * 16, 25)
    assert len(policy) == 1 and policy.nbytes == 25
    assert policy.evict(1) == [b"k" * 16] and policy.nbytes == 0


@pytest.mark.parametrize("name", NAMES)
def test_zero_byte_entries_are_evicted_too(name: str) -> None:
    policy = make_policy(name, 10)
    for k in range(3):
        policy.admit(k, 0)
    policy.admit(9, 4)
    assert sorted(policy.evict(100)) == [0, 1, 2, 9] and len(policy) == 0


def hot_then_scan(policy: EvictionPolicy[Hashable], capacity: int, hot: list[str]
                  ) -> list[str]:
    """Hot keys used four times each, then a one-time scan of 3x the capacity."""
    tier = Tier(policy, capacity)
    for _ in range(4):
        for key in hot:
            if not tier.get(key):
                tier.put(key, 1)
    for i in range(3 * capacity):
        tier.put(f"scan-{i}", 1)
    return [k for k in hot if k in policy]


def test_a_one_time_scan_does_not_flush_frequent_keys() -> None:
    hot = [f"hot-{i}" for i in range(20)]
    assert hot_then_scan(S3FIFOPolicy(100), 100, hot) == hot


def test_lru_is_flushed_by_the_same_scan() -> None:
    hot = [f"hot-{i}" for i in range(20)]
    assert hot_then_scan(LRUPolicy(), 100, hot) == []


def test_lru_evicts_least_recently_used_first() -> None:
    policy: LRUPolicy[str] = LRUPolicy()
    for k, size in [("a", 2), ("b", 3), ("c", 4)]:
        policy.admit(k, size)
    policy.touch("a")
    assert policy.evict(3) == ["b"]
    assert policy.evict(5) == ["c", "a"]


def test_s3fifo_ghost_hit_goes_straight_to_main() -> None:
    policy: S3FIFOPolicy[str] = S3FIFOPolicy(100)
    tier = Tier(policy, 100)  # type: ignore[arg-type]
    tier.put("returning", 1)
    for i in range(100):  # pushes 'returning' out of small, unused: into the ghost
        tier.put(f"fill-{i}", 1)
    assert "returning" not in policy
    tier.put("returning", 1)  # remembered: admitted to main
    tier.put("newcomer", 1)  # not remembered: admitted to small
    for i in range(300):
        tier.put(f"scan-{i}", 1)
    assert "returning" in policy
    assert "newcomer" not in policy


def test_s3fifo_frequency_decides_main_evictions() -> None:
    policy: S3FIFOPolicy[str] = S3FIFOPolicy(10, small_ratio=0.1)
    for k in ("a", "b", "c"):
        policy.admit(k, 1)
        policy.touch(k)  # used once in small: all move to main, counters cleared
    policy.admit("x", 1)
    assert policy.evict(1) == ["x"]  # small's unused key goes first (small >= its share)
    for _ in range(3):
        policy.touch("a")  # a is used in main; b and c are not
    assert policy.evict(2) == ["b", "c"]  # a is reinserted, its counter spent by one
    assert "a" in policy
    assert policy.evict(1) == ["a"]


def test_make_policy_knows_the_names_and_refuses_others() -> None:
    assert isinstance(make_policy("lru", 10), LRUPolicy)
    assert isinstance(make_policy("S3FIFO", 10), S3FIFOPolicy)
    with pytest.raises(InvalidArgumentError, match=r"unknown eviction policy 'arc'.*lru"):
        make_policy("arc", 10)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("capacity", [0, -1, 1.5, True])
def test_bad_capacity_is_refused(name: str, capacity: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="capacity_bytes"):
        make_policy(name, capacity)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("nbytes", [-1, 1.0, None])
def test_bad_sizes_are_refused(name: str, nbytes: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="nbytes"):
        make_policy(name, 10).admit("k", nbytes)


def test_bad_ratios_are_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="small_ratio"):
        S3FIFOPolicy(10, small_ratio=1.0)
