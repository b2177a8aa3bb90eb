"""The memory tier's compact policies make exactly the keyed oracle's choices.

``CompactS3FIFO`` and ``CompactLRU`` keep their state in an ``EntryTable``; the oracle
(``tests/support/eviction_oracles.py``) keeps one object per key. Driven by the same
calls in the order ``MemoryTier`` makes them, both hold the same keys, the same bytes,
and evict the same number of victims at every step.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from isolane.errors import InvalidArgumentError
from isolane.kvpool.tiers.entry_table import EntryTable
from isolane.kvpool.tiers.memory_policy import POLICIES, TablePolicy, make_table_policy
from tests.support.eviction_oracles import EvictionPolicy, make_policy

keys = st.integers(0, 30).map(lambda i: i.to_bytes(16, "little") if i % 5 else b"k%d" % i)
ops = st.lists(st.one_of(
    st.tuples(st.just("put"), keys, st.integers(0, 40)),
    st.tuples(st.just("get"), keys),
    st.tuples(st.just("remove"), keys),
    st.tuples(st.just("evict"), st.integers(-5, 120)),
), max_size=100)


def resident_keys(table: EntryTable, policy: TablePolicy) -> set[bytes]:
    return {table.key_of(e) for q in policy.RESIDENT for e in table.members(q)}


def run_both(name: str, budget: int, steps: list[tuple[Any, ...]]) -> None:
    table = EntryTable()
    compact = make_table_policy(name, table, budget)
    oracle: EvictionPolicy[bytes] = make_policy(name, budget)  # type: ignore[assignment]
    seen: set[bytes] = set()
    for op in steps:
        if op[0] == "put":  # as MemoryTier._put: a hit is a touch, a miss evicts first
            _, key, size = op
            if size > budget:
                continue
            e = table.find(key)
            if e >= 0 and compact.resident(e):
                compact.touch(e)
                oracle.touch(key)
                continue
            over = compact.nbytes + size - budget
            if over > 0:
                assert compact.evict(over) == len(oracle.evict(over))
                e = table.find(key)
            compact.admit(table.add(key) if e < 0 else e, bytes(size))
            oracle.admit(key, size)
        elif op[0] == "get":
            e = table.find(key := op[1])
            if e >= 0 and compact.resident(e):
                compact.touch(e)
                oracle.touch(key)
        elif op[0] == "remove":
            e = table.find(key := op[1])
            if e >= 0 and compact.resident(e):
                compact.remove(e)
                oracle.remove(key)
        else:
            assert compact.evict(op[1]) == len(oracle.evict(op[1]))
        seen.add(op[1]) if op[0] != "evict" else None
        assert resident_keys(table, compact) == {k for k in seen if k in oracle}
        assert len(compact) == len(oracle) and compact.nbytes == oracle.nbytes


@pytest.mark.parametrize("name", POLICIES)
@settings(max_examples=50, deadline=None)
@given(budget=st.integers(1, 100), steps=ops)
def test_compact_policy_matches_the_oracle(name: str, budget: int,
                                           steps: list[tuple[Any, ...]]) -> None:
    run_both(name, budget, steps)


def test_unknown_policies_and_bad_budgets_are_refused() -> None:
    with pytest.raises(InvalidArgumentError, match=r"unknown eviction policy 'wtinylfu'.*s3fifo"):
        make_table_policy("wtinylfu", EntryTable(), 10)
    with pytest.raises(InvalidArgumentError, match="capacity_bytes"):
        make_table_policy("lru", EntryTable(), 0)
    assert type(make_table_policy(" S3FIFO ", EntryTable(), 10)).__name__ == "CompactS3FIFO"
