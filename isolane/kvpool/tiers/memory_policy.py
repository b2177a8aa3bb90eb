"""Eviction policies over the memory tier's ``EntryTable``: entry ids in linked queues,
no object per entry.

Two policies, chosen by ``kvpool.policy``:

- ``CompactS3FIFO`` (the default; Yang et al., "FIFO queues are all you need for cache
  eviction", SOSP'23): small (queue 1, ~10 % of the bytes) that new entries enter, main
  (2), and ghost (3: entries without a value, recently evicted from small, so a key
  coming back finds it by the same probe and goes straight to main). A hit bumps
  ``freq`` (capped at 3); small's oldest entry moves to main if it was hit, else it is
  evicted into the ghost; main's oldest is reinserted with one use spent while it has
  any, else evicted. One-time scans pass through small without disturbing main.
- ``CompactLRU``: queue 1, oldest at the head, a hit moves an entry to the tail.

On the Mooncake conversation trace (``benchmarks/bench_kv_eviction.py``) S3-FIFO wins
with room for 0.5-2 % of the unique blocks (shared prefixes are frequent), LRU from 5 %
on (a conversation's next turn returns after the small FIFO has moved on): a real
choice, so both stay. W-TinyLFU fell far behind both and was removed. Keyed object
versions of both (``tests/support/eviction_oracles.py``) are the oracle they are tested
against: the same victims in the same order for the same calls.

The calls, under the tier's lock: ``admit(e, value)`` for an entry that is not resident
(new, or a ghost) after ``evict`` made room; ``touch(e)`` on a hit; ``remove(e)`` to drop
an entry (resident or ghost); ``evict(need_bytes)`` frees values (and forgets entries) until
``need_bytes`` are freed or nothing is resident, returning how many values went.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from isolane.errors import InvalidArgumentError
from isolane.kvpool.tiers.entry_table import EntryTable

__all__ = ["POLICIES", "CompactLRU", "CompactS3FIFO", "TablePolicy", "make_table_policy"]

POLICIES = ("s3fifo", "lru")
"""Policy names for ``kvpool.policy`` and ``make_table_policy``."""

Value = bytes | bytearray | memoryview


class TablePolicy(ABC):
    """A policy whose state lives in an ``EntryTable`` (call order: module docstring)."""

    RESIDENT: tuple[int, ...] = (1,)

    def __init__(self, table: EntryTable) -> None:
        self.table = table

    def resident(self, e: int) -> bool:
        return self.table.queue[e] in self.RESIDENT

    @abstractmethod
    def admit(self, e: int, value: Value) -> None:
        """Give the non-resident entry ``e`` its value and make it resident."""

    @abstractmethod
    def touch(self, e: int) -> None:
        """A hit on the resident entry ``e``."""

    @abstractmethod
    def evict(self, need_bytes: int) -> int:
        """Free values totalling at least ``need_bytes`` (or all); how many went."""

    def remove(self, e: int) -> None:
        """Forget entry ``e`` (resident: its value too)."""
        t = self.table
        if t.queue[e]:
            if self.resident(e):
                t.drop_value(e)
            t.unlink(e)
        t.discard(e)

    def clear(self) -> None:
        """Forget every resident entry (ghosts stay, as a policy ``remove`` would)."""
        for q in self.RESIDENT:
            for e in self.table.members(q):
                self.remove(e)

    def __len__(self) -> int:
        return sum(self.table.qlen[q] for q in self.RESIDENT)

    @property
    def nbytes(self) -> int:
        return sum(self.table.qbytes[q] for q in self.RESIDENT)


class CompactLRU(TablePolicy):
    """Least recently admitted or touched entry first, over queue 1."""

    def admit(self, e: int, value: Value) -> None:
        self.table.set_value(e, value)
        self.table.push(1, e)

    def touch(self, e: int) -> None:
        self.table.unlink(e)
        self.table.push(1, e)

    def evict(self, need_bytes: int) -> int:
        t, freed, victims = self.table, 0, 0
        while freed < need_bytes and t.qlen[1]:
            e = t.pop_head(1)
            freed += t.size[e]
            t.drop_value(e)
            t.discard(e)
            victims += 1
        return victims


_SMALL, _MAIN, _GHOST = 1, 2, 3


class CompactS3FIFO(TablePolicy):
    """S3-FIFO over small (1), main (2) and ghost (3) queues (module docstring)."""

    RESIDENT = (_SMALL, _MAIN)
    MAX_FREQ = 3

    def __init__(self, table: EntryTable, capacity_bytes: int, *,
                 small_ratio: float = 0.1) -> None:
        super().__init__(table)
        if not 0 < small_ratio < 1:
            raise InvalidArgumentError(f"small_ratio must lie in (0, 1), got {small_ratio!r}")
        self._small_target = max(1, int(capacity_bytes * small_ratio))
        self._ghost_limit = max(1, capacity_bytes - self._small_target)

    def admit(self, e: int, value: Value) -> None:
        t = self.table
        ghost = t.queue[e] == _GHOST
        if ghost:
            t.unlink(e)  # with its size when evicted
        t.set_value(e, value)
        t.freq[e] = 0
        t.push(_MAIN if ghost else _SMALL, e)

    def touch(self, e: int) -> None:
        if self.table.freq[e] < self.MAX_FREQ:
            self.table.freq[e] += 1

    def evict(self, need_bytes: int) -> int:
        t, freed, victims = self.table, 0, 0
        qlen, qbytes, freq = t.qlen, t.qbytes, t.freq
        while freed < need_bytes and (qlen[_SMALL] or qlen[_MAIN]):
            if qlen[_SMALL] and (qbytes[_SMALL] >= self._small_target or not qlen[_MAIN]):
                e = t.pop_head(_SMALL)
                if freq[e] > 0:  # used while in small: promote, counter cleared
                    freq[e] = 0
                    t.push(_MAIN, e)
                    continue
                size = t.size[e]
                t.drop_value(e)
                t.push(_GHOST, e)
                while qbytes[_GHOST] > self._ghost_limit and qlen[_GHOST]:
                    t.discard(t.pop_head(_GHOST))
            else:
                e = t.pop_head(_MAIN)
                if freq[e] > 0:  # reinsert, one use spent
                    freq[e] -= 1
                    t.push(_MAIN, e)
                    continue
                size = t.size[e]
                t.drop_value(e)
                t.discard(e)
            freed += size
            victims += 1
        return victims


def make_table_policy(name: str, table: EntryTable, capacity_bytes: int) -> TablePolicy:
    """The policy ``name`` (``POLICIES``) over ``table``, for a tier whose budget is
    ``capacity_bytes``."""
    key = name.strip().lower() if isinstance(name, str) else None
    if key not in POLICIES:
        raise InvalidArgumentError(
            f"unknown eviction policy {name!r}; choose one of {', '.join(POLICIES)}")
    if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) \
            or capacity_bytes < 1:
        raise InvalidArgumentError(
            f"capacity_bytes must be a whole number of bytes >= 1 (the memory tier's "
            f"budget, kv memory_budget), got {capacity_bytes!r}")
    if key == "s3fifo":
        return CompactS3FIFO(table, capacity_bytes)
    return CompactLRU(table)
