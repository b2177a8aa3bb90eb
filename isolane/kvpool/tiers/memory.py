"""The KV pool's memory tier: block bytes under a byte budget, evicted by a policy.

The policy (``isolane.kvpool.tiers.eviction``; S3-FIFO by default, measured against LRU
on the Mooncake trace in docs/BENCHMARKS.md) decides what goes; this class only holds
bytes (a ``tiers.base.WritableTier``). Thread-safe. Values are immutable ``bytes`` so
readers never see a torn block.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from isolane.kvpool.tiers.base import Block, WritableTier
from isolane.kvpool.tiers.eviction import make_policy


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
        self._policy = make_policy(policy, max(budget_bytes, 1))
        self._blocks: dict[bytes, bytes] = {}
        self._nbytes = 0
        self._lock = threading.Lock()
        self.stats = TierStats()

    def get(self, key: bytes) -> bytes | None:
        with self._lock:
            value = self._blocks.get(key)
            if value is None:
                self.stats.misses += 1
                return None
            self._policy.touch(key)
            self.stats.hits += 1
            return value

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._blocks

    def contains_many(self, keys: Sequence[bytes]) -> npt.NDArray[np.bool_]:
        with self._lock:
            blocks = self._blocks
            return np.fromiter((k in blocks for k in keys), bool, len(keys))

    def get_many(self, keys: Sequence[bytes]) -> list[Block | None]:
        return [self.get(k) for k in keys]

    def put_many(self, keys: Sequence[bytes], values: Sequence[Block]) -> int:
        """``put`` each (nothing when the budget is 0); returns how many were offered
        within the budget (admitted, or held already)."""
        if not self.budget_bytes:
            return 0
        for key, value in zip(keys, values, strict=True):
            self.put(key, value)
        return sum(1 for v in values if len(v) <= self.budget_bytes)

    def delete_many(self, keys: Sequence[bytes]) -> list[bool]:
        return [self.remove(k) for k in keys]

    def put(self, key: bytes, value: bytes | memoryview) -> None:
        """Insert a copy (a block larger than the whole budget is not kept)."""
        size = len(value)
        if size > self.budget_bytes:
            return
        if not isinstance(value, bytes):
            value = bytes(value)  # own the bytes: a view would pin its whole range read
        with self._lock:
            if key in self._blocks:
                self._policy.touch(key)
                return
            over = self._nbytes + size - self.budget_bytes
            if over > 0:
                for victim in self._policy.evict(over):
                    dropped = self._blocks.pop(victim, None)  # type: ignore[call-overload]
                    if dropped is not None:
                        self._nbytes -= len(dropped)
                        self.stats.evictions += 1
            self._policy.admit(key, size)
            self._blocks[key] = value
            self._nbytes += size
            self.stats.inserts += 1

    def remove(self, key: bytes) -> bool:
        """Drop ``key``; whether it was held."""
        with self._lock:
            value = self._blocks.pop(key, None)
            if value is not None:
                self._nbytes -= len(value)
                self._policy.remove(key)
            return value is not None

    def clear(self) -> None:
        with self._lock:
            for key in list(self._blocks):
                self._policy.remove(key)
            self._blocks.clear()
            self._nbytes = 0

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def __len__(self) -> int:
        return len(self._blocks)
