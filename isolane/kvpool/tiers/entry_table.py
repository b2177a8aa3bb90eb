"""The memory tier's entries: key -> entry id, per-entry fields in flat arrays, FIFO/LRU
queues as linked lists of ids, values in a ``ValueArena``. No Python object per entry.

An entry id indexes every field array (``array`` module: compact, fast scalar access):

    field    type   bytes  meaning
    keys     bytes  16     the key, zero padded (keys of <= 16 bytes; block keys are 16)
    klen     u8     1      key length; 255: a longer key, kept in ``_long`` (an object each)
    size     u64    8      value bytes (a ghost: its size when it was evicted)
    loc      i64    8      the value's ``ValueArena`` handle, -1 for none (ghost, free id)
    prev     i32    4      neighbours in the entry's queue (-1: none)
    next     i32    4
    queue    i8     1      0 none (free id), 1..3 the queue it is in (the policy's meaning)
    freq     i8     1      hits counted by the policy
    table    i32    4/load entry id per slot (-1 empty, -2 deleted), linear probing

That is 47 bytes an entry plus 5.7-8 bytes of table (rebuilt at a load of 0.7 to 0.5),
plus the value's slot. The table's home slot is Python's ``hash`` of the key (SipHash,
seeded per process: crafted keys cannot build long probe chains). A rebuild (growth, or
deleted slots piling up) rehashes every key: ~0.5 us a key, amortised over the inserts.

The queues (``push``/``unlink``/``pop_head``) keep their length and the bytes of their
entries. Policies (``memory_policy.py``) decide what moves where; the table only stores.

Not thread-safe: ``MemoryTier`` serialises every call under its lock.
"""

from __future__ import annotations

from array import array

from isolane.kvpool.tiers.value_arena import ValueArena

__all__ = ["QUEUES", "EntryTable"]

QUEUES = 4
"""Queue numbers 1..3 are the policy's; 0 means "in none"."""
_KEY = 16
_LONG = 255
_EMPTY, _DELETED = -1, -2
_MIN_TABLE = 1024


class EntryTable:
    """Entries by key (layout and costs: module docstring)."""

    def __init__(self) -> None:
        self._keys = bytearray()
        self._klen = array("B")
        self._long: dict[int, bytes] = {}
        self.size = array("Q")
        self.loc = array("q")
        self.prev = array("i")
        self.next = array("i")
        self.queue = array("b")
        self.freq = array("b")
        self._free_ids = array("i")
        self._table = array("i", [_EMPTY]) * _MIN_TABLE
        self._count = 0  # keys in the table
        self._used = 0  # slots not empty (keys and deleted marks)
        self.arena = ValueArena()
        self.head = [-1] * QUEUES
        self.tail = [-1] * QUEUES
        self.qlen = [0] * QUEUES
        self.qbytes = [0] * QUEUES

    # -- keys --------------------------------------------------------------------------
    def find(self, key: bytes) -> int:
        """The entry id of ``key``, -1 if it has none."""
        table, mask = self._table, len(self._table) - 1
        i = hash(key) & mask
        while True:
            e = table[i]
            if e == _EMPTY:
                return -1
            if e >= 0 and self._matches(e, key):
                return e
            i = (i + 1) & mask

    def add(self, key: bytes) -> int:
        """A new entry for ``key`` (not in the table), in no queue, with no value."""
        if (self._used + 1) * 10 > len(self._table) * 7:
            self._rebuild(self._count + 1)
        e = self._new_id()
        o = _KEY * e
        if len(key) <= _KEY:
            self._keys[o:o + len(key)] = key
            self._klen[e] = len(key)
        else:
            self._klen[e] = _LONG
            self._long[e] = key
        table, mask = self._table, len(self._table) - 1
        i = hash(key) & mask
        while table[i] >= 0:  # a deleted mark is reused
            i = (i + 1) & mask
        if table[i] == _EMPTY:
            self._used += 1
        table[i] = e
        self._count += 1
        return e

    def discard(self, e: int) -> None:
        """Forget entry ``e`` (out of its queue, value freed first): its key and id go."""
        key = self.key_of(e)
        table, mask = self._table, len(self._table) - 1
        i = hash(key) & mask
        while table[i] != e:
            i = (i + 1) & mask
        table[i] = _DELETED
        self._count -= 1
        self._long.pop(e, None)
        self._keys[_KEY * e:_KEY * e + _KEY] = bytes(_KEY)
        self._klen[e] = 0
        self._free_ids.append(e)

    def key_of(self, e: int) -> bytes:
        n = self._klen[e]
        if n == _LONG:
            return self._long[e]
        return bytes(self._keys[_KEY * e:_KEY * e + n])

    def _matches(self, e: int, key: bytes) -> bool:
        n = self._klen[e]
        if n == _LONG:
            return self._long.get(e) == key
        return n == len(key) and self._keys[_KEY * e:_KEY * e + n] == key

    def _new_id(self) -> int:
        if self._free_ids:
            e = self._free_ids.pop()
            self.size[e] = 0
            self.loc[e] = -1
            self.prev[e] = self.next[e] = -1
            self.freq[e] = 0
            return e
        e = len(self._klen)
        self._keys.extend(bytes(_KEY))
        self._klen.append(0)
        self.size.append(0)
        self.loc.append(-1)
        self.prev.append(-1)
        self.next.append(-1)
        self.queue.append(0)
        self.freq.append(0)
        return e

    def _rebuild(self, keys: int) -> None:
        size = _MIN_TABLE
        while keys * 2 > size:
            size *= 2
        table, mask = array("i", [_EMPTY]) * size, size - 1
        free = set(self._free_ids)
        for e in range(len(self._klen)):
            if e not in free:
                i = hash(self.key_of(e)) & mask
                while table[i] != _EMPTY:
                    i = (i + 1) & mask
                table[i] = e
        self._table, self._used = table, self._count

    # -- values ------------------------------------------------------------------------
    def set_value(self, e: int, value: bytes | bytearray | memoryview) -> None:
        """Store ``value`` as ``e``'s (``e`` has none)."""
        self.size[e] = len(value)
        self.loc[e] = self.arena.store(value, e)

    def value(self, e: int) -> bytes:
        return self.arena.read(self.loc[e], self.size[e])

    def drop_value(self, e: int) -> None:
        """Free ``e``'s value (its size stays: a ghost remembers it)."""
        handle, self.loc[e] = self.loc[e], -1
        for owner, moved in self.arena.free(handle):
            self.loc[owner] = moved

    # -- queues ------------------------------------------------------------------------
    def push(self, q: int, e: int) -> None:
        """Append ``e`` (in no queue) at the tail of queue ``q``."""
        tail = self.tail[q]
        self.prev[e], self.next[e] = tail, -1
        if tail < 0:
            self.head[q] = e
        else:
            self.next[tail] = e
        self.tail[q] = e
        self.queue[e] = q
        self.qlen[q] += 1
        self.qbytes[q] += self.size[e]

    def unlink(self, e: int) -> None:
        """Take ``e`` out of its queue (it stays an entry)."""
        q, p, n = self.queue[e], self.prev[e], self.next[e]
        if p < 0:
            self.head[q] = n
        else:
            self.next[p] = n
        if n < 0:
            self.tail[q] = p
        else:
            self.prev[n] = p
        self.prev[e] = self.next[e] = -1
        self.qlen[q] -= 1
        self.qbytes[q] -= self.size[e]
        self.queue[e] = 0

    def pop_head(self, q: int) -> int:
        """Unlink and return the oldest entry of queue ``q`` (which must not be empty)."""
        e = self.head[q]
        self.unlink(e)
        return e

    def members(self, q: int) -> list[int]:
        """Entry ids of queue ``q``, oldest first."""
        out, e = [], self.head[q]
        while e >= 0:
            out.append(e)
            e = self.next[e]
        return out

    @property
    def entries(self) -> int:
        """Entries in the table (resident values and ghosts)."""
        return self._count
