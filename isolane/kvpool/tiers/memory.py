"""The KV pool's memory tier: block bytes under a byte budget, evicted by a policy.

The policy (``isolane.kvpool.tiers.memory_policy``; S3-FIFO by default, measured
against LRU on the Mooncake trace in docs/BENCHMARKS.md) decides what goes; this class
only holds bytes (a ``tiers.base.WritableTier``). Thread-safe.

Compact at scale (no Python object per entry): keys, sizes and the policy's queues live
in an ``entry_table.EntryTable`` (flat arrays, an open-addressing table), the values in a
``value_arena.ValueArena`` (fixed-size slots in anonymous mappings), the S3-FIFO and LRU
queues in ``memory_policy``. About 50
bytes an entry beyond the value's slot (``benchmarks/bench_kv_memtier.py``). A get returns
a copy (``bytes``), so readers never see a torn block when the slot is reused.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from isolane.errors import InvalidArgumentError
from isolane.kvpool.tiers.base import Block, WritableTier
from isolane.kvpool.tiers.entry_table import EntryTable
from isolane.kvpool.tiers.memory_policy import make_table_policy


@dataclass
class TierStats:
    hits: int = 0
    misses: int = 0
    inserts: int = 0
    evictions: int = 0


class MemoryTier(WritableTier):
    name = "memory"

    def __init__(self, budget_bytes: int, policy: str = "s3fifo") -> None:
        self.budget_bytes = budget_bytes
        self.policy_name = policy
        self._table = EntryTable()
        self._policy = make_table_policy(policy, self._table, max(budget_bytes, 1))
        self._lock = threading.Lock()
        self.stats = TierStats()

    def get(self, key: bytes) -> bytes | None:
        with self._lock:
            return self._get(key)

    def _get(self, key: bytes) -> bytes | None:
        e = self._table.find(key)
        if e < 0 or not self._policy.resident(e):
            self.stats.misses += 1
            return None
        self._policy.touch(e)
        self.stats.hits += 1
        return self._table.value(e)

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, bytes):
            return False
        with self._lock:
            e = self._table.find(key)
            return e >= 0 and self._policy.resident(e)

    def contains_many(self, keys: Sequence[bytes]) -> npt.NDArray[np.bool_]:
        """~0.5 us a key (one probe each); nothing to probe when the tier is empty."""
        with self._lock:
            if not len(self._policy):
                return np.zeros(len(keys), bool)
            find, resident = self._table.find, self._policy.resident
            return np.fromiter(((e := find(k)) >= 0 and resident(e) for k in keys), bool,
                               len(keys))

    def get_many(self, keys: Sequence[bytes]) -> list[Block | None]:
        """Each key's bytes or None; hits are touched tail first (see ``put_many``)."""
        with self._lock:
            if not len(self._policy):
                self.stats.misses += len(keys)
                return [None] * len(keys)
            out: list[Block | None] = [self._get(k) for k in reversed(keys)]
            out.reverse()
            return out

    def put_many(self, keys: Sequence[bytes], values: Sequence[Block]) -> int:
        """``put`` each (nothing when the budget is 0); returns how many were offered
        within the budget (admitted, or held already).

        Tail first: a batch is a chain's blocks in order, and a block after a missing
        one is useless, so the head is admitted (or touched) last and is the last to be
        evicted, as vLLM frees a request's blocks in reverse order (measured in
        ``benchmarks/bench_routing.py``, "Cache touch order")."""
        if len(keys) != len(values):
            raise InvalidArgumentError(
                f"put_many got {len(keys)} keys but {len(values)} values: pass one value "
                "a key; nothing was stored")
        if not self.budget_bytes:
            return 0
        with self._lock:
            for key, value in zip(reversed(keys), reversed(values), strict=True):
                self._put(key, value)
        return sum(1 for v in values if len(v) <= self.budget_bytes)

    def delete_many(self, keys: Sequence[bytes]) -> list[bool]:
        return [self.remove(k) for k in keys]

    def put(self, key: bytes, value: bytes | memoryview) -> None:
        """Insert a copy (a block larger than the whole budget is not kept)."""
        with self._lock:
            self._put(key, value)

    def _put(self, key: bytes, value: bytes | memoryview) -> None:
        size = len(value) if isinstance(value, bytes) else memoryview(value).nbytes
        if size > self.budget_bytes:
            return
        table, policy = self._table, self._policy
        e = table.find(key)
        if e >= 0 and policy.resident(e):
            policy.touch(e)
            return
        over = policy.nbytes + size - self.budget_bytes
        if over > 0:
            self.stats.evictions += policy.evict(over)
            e = table.find(key)  # the eviction may have forgotten its ghost
        policy.admit(table.add(key) if e < 0 else e, value)
        self.stats.inserts += 1

    def remove(self, key: bytes) -> bool:
        """Drop ``key``; whether it was held."""
        with self._lock:
            e = self._table.find(key)
            if e < 0:
                return False
            held = self._policy.resident(e)
            if held:
                self._policy.remove(e)  # a key that is only a ghost stays remembered
            return held

    def clear(self) -> None:
        with self._lock:
            self._policy.clear()

    @property
    def nbytes(self) -> int:
        return self._policy.nbytes

    @property
    def entries(self) -> int:
        """Entries held, ghosts (keys remembered without a value) included."""
        return self._table.entries

    def __len__(self) -> int:
        return len(self._policy)
