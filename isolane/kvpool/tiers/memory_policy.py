"""Eviction policies over the memory tier's ``EntryTable``: entry ids in linked queues,
no object per entry.

``CompactS3FIFO`` and ``CompactLRU`` make exactly the choices of ``eviction.S3FIFOPolicy``
and ``eviction.LRUPolicy`` (the same victims in the same order for the same calls; tested
against them), with their state in the table's arrays: LRU is queue 1 (oldest at the
head, a hit moves an entry to the tail); S3-FIFO is small (1), main (2) and ghost (3) with
the hit counter in ``freq``. A ghost is an entry without a value, so a key coming back
finds it by the same probe. ``ObjectPolicy`` runs any ``eviction`` policy (W-TinyLFU)
keyed by entry id: compact storage, but that policy's own per-key objects.

The calls, under the tier's lock: ``admit(e, value)`` for an entry that is not resident
(new, or a ghost) after ``evict`` made room; ``touch(e)`` on a hit; ``remove(e)`` to drop
an entry (resident or ghost); ``evict(need_bytes)`` frees values (and forgets entries) until
``need_bytes`` are freed or nothing is resident, returning how many values went.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from isolane.errors import InvalidArgumentError
from isolane.kvpool.tiers.entry_table import EntryTable
from isolane.kvpool.tiers.eviction import EvictionPolicy, make_policy

__all__ = ["CompactLRU", "CompactS3FIFO", "ObjectPolicy", "TablePolicy", "make_table_policy"]

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
    """``eviction.LRUPolicy`` over queue 1."""

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
    """``eviction.S3FIFOPolicy`` over small (1), main (2) and ghost (3) queues."""

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


class ObjectPolicy(TablePolicy):
    """Any ``eviction`` policy keyed by the key bytes (W-TinyLFU remembers the counts of
    keys no longer resident, so entry ids, which are reused, cannot stand for them);
    queue 1 only marks residency."""

    def __init__(self, table: EntryTable, policy: EvictionPolicy[bytes]) -> None:
        super().__init__(table)
        self._policy = policy

    def admit(self, e: int, value: Value) -> None:
        self.table.set_value(e, value)
        self.table.push(1, e)
        self._policy.admit(self.table.key_of(e), self.table.size[e])

    def touch(self, e: int) -> None:
        self._policy.touch(self.table.key_of(e))

    def remove(self, e: int) -> None:
        self._policy.remove(self.table.key_of(e))
        super().remove(e)

    def evict(self, need_bytes: int) -> int:
        victims = self._policy.evict(need_bytes)
        for key in victims:
            super().remove(self.table.find(key))
        return len(victims)


def make_table_policy(name: str, table: EntryTable, capacity_bytes: int) -> TablePolicy:
    """The policy ``name`` (``eviction.POLICIES``) over ``table``: compact for ``s3fifo``
    and ``lru``, ``ObjectPolicy`` for the others."""
    policy = make_policy(name, capacity_bytes)  # checks the name and the capacity
    key = name.strip().lower()
    if key == "s3fifo":
        return CompactS3FIFO(table, capacity_bytes)
    if key == "lru":
        return CompactLRU(table)
    return ObjectPolicy(table, policy)  # type: ignore[arg-type]
