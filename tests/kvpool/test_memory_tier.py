"""The compact memory tier behaves as the dict-and-policy tier it replaced: the same hits,
the same victims, the same bytes, whatever the calls; its arena gives memory back."""

from __future__ import annotations

import random
from collections.abc import Hashable

import pytest

from isolane.errors import InvalidArgumentError
from isolane.kvpool.tiers import value_arena
from isolane.kvpool.tiers.memory import MemoryTier
from isolane.kvpool.tiers.value_arena import ValueArena, slot_bytes
from tests.support.eviction_oracles import EvictionPolicy, make_policy


class ReferenceTier:
    """The memory tier as it was: a dict of bytes and an ``eviction`` policy by key."""

    def __init__(self, budget: int, policy: str) -> None:
        self.budget = budget
        self.policy: EvictionPolicy[Hashable] = make_policy(policy, max(budget, 1))
        self.blocks: dict[bytes, bytes] = {}
        self.evictions = 0

    def get(self, key: bytes) -> bytes | None:
        value = self.blocks.get(key)
        if value is not None:
            self.policy.touch(key)
        return value

    def put(self, key: bytes, value: bytes) -> None:
        if len(value) > self.budget:
            return
        if key in self.blocks:
            self.policy.touch(key)
            return
        over = sum(map(len, self.blocks.values())) + len(value) - self.budget
        if over > 0:
            for victim in self.policy.evict(over):
                assert self.blocks.pop(victim, None) is not None  # type: ignore[call-overload]
                self.evictions += 1
        self.policy.admit(key, len(value))
        self.blocks[key] = value

    def remove(self, key: bytes) -> bool:
        value = self.blocks.pop(key, None)
        if value is not None:
            self.policy.remove(key)
        return value is not None

    def clear(self) -> None:
        for key in list(self.blocks):
            self.policy.remove(key)
        self.blocks.clear()


def _key(rng: random.Random, universe: int) -> bytes:
    i = rng.randrange(universe)
    if i % 7 == 0:
        return b"long-key-" + str(i).encode() * 3  # > 16 bytes
    if i % 11 == 0:
        return str(i).encode()  # short
    return i.to_bytes(16, "little")


@pytest.mark.parametrize("policy", ["s3fifo", "lru"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_same_hits_victims_and_bytes_as_the_reference(policy: str, seed: int,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(value_arena, "CHUNK_BYTES", 512)  # many chunks: moves and unmaps
    rng = random.Random(seed)
    budget = rng.choice([300, 2000, 9000])
    tier, ref = MemoryTier(budget, policy), ReferenceTier(budget, policy)
    sizes = [0, 1, 7, 64, 65, 200, 1000, 5000]
    for step in range(6000):
        op = rng.random()
        key = _key(rng, 400)
        if op < 0.5:
            n = rng.choice(sizes)
            value = bytes([step % 251]) * n
            tier.put(key, memoryview(value) if step % 2 else value)
            ref.put(key, value)
        elif op < 0.9:
            assert tier.get(key) == ref.get(key)
        elif op < 0.99:
            assert tier.remove(key) == ref.remove(key)
        else:
            tier.clear()
            ref.clear()
        assert len(tier) == len(ref.blocks)
        assert tier.nbytes == sum(map(len, ref.blocks.values())) <= budget
        assert tier.stats.evictions == ref.evictions
    keys = list(ref.blocks) + [_key(rng, 400) for _ in range(50)]
    assert tier.contains_many(keys).tolist() == [k in ref.blocks for k in keys]
    assert tier.get_many(keys) == [ref.blocks.get(k) for k in keys]


def test_an_empty_tier_answers_misses_and_counts_them() -> None:
    tier = MemoryTier(1000, "s3fifo")
    assert tier.contains_many([b"a", b"b"]).tolist() == [False, False]
    assert tier.get_many([b"a", b"b"]) == [None, None] and tier.stats.misses == 2
    tier.put(b"a", b"x")
    assert tier.contains_many([b"a", b"b"]).tolist() == [True, False]
    assert tier.get_many([b"a", b"b"]) == [b"x", None] and tier.stats.misses == 3


def test_many_entries_rebuild_the_table_and_keep_every_value() -> None:
    tier = MemoryTier(50_000 * 64, "lru")
    keys = [i.to_bytes(16, "big") for i in range(50_000)]
    for i, k in enumerate(keys):
        tier.put(k, i.to_bytes(8, "little") * 8)
    for _ in range(3):  # deleted marks pile up and are cleared by rebuilds
        for k in keys[:20_000]:
            assert tier.remove(k)
        for i, k in enumerate(keys[:20_000]):
            tier.put(k, i.to_bytes(8, "little") * 8)
    assert len(tier) == 50_000 and tier.entries == 50_000
    assert all(tier.get(k) == i.to_bytes(8, "little") * 8 for i, k in enumerate(keys))


def test_a_got_block_is_a_copy_that_survives_its_slot_being_reused() -> None:
    tier = MemoryTier(128, "lru")
    tier.put(b"a", b"x" * 100)
    got = tier.get(b"a")
    tier.put(b"b", b"y" * 100)  # evicts a; b takes its slot
    assert got == b"x" * 100 and tier.get(b"a") is None and tier.get(b"b") == b"y" * 100


def test_arena_moves_values_out_of_a_sparse_last_chunk_and_unmaps_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(value_arena, "CHUNK_BYTES", 64 * 4)  # 4 slots of 64 bytes a chunk
    arena = ValueArena()
    handles = {i: arena.store(bytes([i]) * 50, i) for i in range(16)}  # 4 chunks
    assert arena.mapped_bytes == 16 * 64
    for i in (0, 1, 2, 4, 5, 6, 8):  # 7 free slots > 1.5 chunks: the last chunk empties
        for owner, moved in arena.free(handles.pop(i)):
            handles[owner] = moved
    assert arena.mapped_bytes == 3 * 64 * 4
    assert all(arena.read(h, 50) == bytes([i]) * 50 for i, h in handles.items())
    for i in list(handles):
        for owner, moved in arena.free(handles.pop(i)):
            handles[owner] = moved
    assert arena.mapped_bytes == 0  # the last value gone: the class is unmapped


def test_slot_sizes_waste_little() -> None:
    assert slot_bytes(0) == 64 and slot_bytes(4096) == 4096 and slot_bytes(65536) == 65536
    for n in [1, 100, 4097, 5000, 70_000, 1 << 20, (1 << 20) + 1]:
        assert n <= slot_bytes(n) <= max(n + 63, n * 1.07)


def _chain(name: str, n: int) -> list[bytes]:
    return [f"{name}{i:02d}".encode() for i in range(n)]


@pytest.mark.parametrize("policy", ["lru", "s3fifo"])
def test_a_chain_put_in_one_call_loses_its_tail_first(policy: str) -> None:
    """A block after a missing one is useless (its attention depends on the missing
    block), so a batch is admitted tail first: under pressure the head, which is useful
    alone, is the last to go (as vLLM frees a request's blocks in reverse order)."""
    tier = MemoryTier(12, policy)
    first = _chain("a", 8)
    tier.put_many(first, [b"x"] * 8)
    tier.put_many(_chain("b", 8), [b"y"] * 8)  # pressure: 4 of the 16 blocks must stay
    held = tier.contains_many(first).tolist()
    assert any(held), held
    assert held == sorted(held, reverse=True), f"a hole in the kept prefix: {held}"


def test_a_chain_read_in_one_call_is_touched_tail_first() -> None:
    tier = MemoryTier(8, "lru")
    first, second = _chain("a", 4), _chain("b", 4)
    tier.put_many(first, [b"x"] * 4)
    tier.put_many(second, [b"y"] * 4)
    assert tier.get_many(first) == [b"x"] * 4  # now the most recent, head last of all
    tier.put_many(_chain("c", 6), [b"z"] * 6)  # evicts 6: all of b, then a's tail
    assert tier.contains_many(first).tolist() == [True, True, False, False]
    assert not tier.contains_many(second).any()


@pytest.mark.parametrize("budget", [0, 1 << 20])
def test_put_many_refuses_keys_and_values_of_different_lengths(budget: int) -> None:
    # a switched-off tier (budget 0) refuses bad input too, not silently
    tier = MemoryTier(budget)
    with pytest.raises(InvalidArgumentError, match="2 keys but 1 values"):
        tier.put_many([b"a", b"b"], [b"x"])
