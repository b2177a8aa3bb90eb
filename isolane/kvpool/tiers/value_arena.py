"""The memory tier's value bytes: fixed-size slots in anonymous mappings, no object per value.

A value of ``n`` bytes goes into the slot class of ``slot_bytes(n)``: ``n`` rounded up to
64 bytes up to 4 KiB, beyond that to 1/32 of its power of two (at most ~6 % unused; KV
blocks are powers of two or near them and waste nothing). A class keeps chunks of
``CHUNK_BYTES`` (or of one slot, when a slot is larger) as anonymous ``mmap``s: a page
costs RSS only once written, and an unmapped chunk goes back to the OS at once (no
malloc arena keeps it). Free slots are a stack per class (``array``, 4 bytes a slot).

Giving memory back: when a class holds more than 1.5 chunks of free slots, the values in
its last chunk move into free slots of the others and the chunk is unmapped; a class whose
last value is freed is unmapped whole. So a class keeps at most ~1.5 chunks beyond its
values, and a workload that moves from one block size to another does not keep both.
``free`` returns the moves (owner, new handle) so the caller can update its handles.

A handle is ``class_id << 32 | slot``. ``read`` returns a copy (``bytes``): a slot is
reused once its value is freed, so a view handed out would tear.

Not thread-safe: ``MemoryTier`` serialises every call under its lock.
"""

from __future__ import annotations

import mmap
from array import array

__all__ = ["CHUNK_BYTES", "ValueArena", "slot_bytes"]

CHUNK_BYTES = 32 << 20
_SLOT_MASK = (1 << 32) - 1


def slot_bytes(nbytes: int) -> int:
    """The slot size that holds a value of ``nbytes`` (>= 64)."""
    if nbytes <= 4096:
        return max(64, (nbytes + 63) & ~63)
    step = 1 << ((nbytes - 1).bit_length() - 5)  # 1/32 of the next power of two
    return (nbytes + step - 1) // step * step


class _SlotClass:
    __slots__ = ("chunks", "free", "live", "owner", "per_chunk", "slot")

    def __init__(self, slot: int) -> None:
        self.slot = slot
        self.per_chunk = max(1, CHUNK_BYTES // slot)
        self.chunks: list[mmap.mmap] = []
        self.owner = array("i")  # slot -> owner id, -1 when free
        self.free = array("i")  # stack of free slots, the lowest on top
        self.live = 0

    def grow(self) -> None:
        first = len(self.chunks) * self.per_chunk
        self.chunks.append(mmap.mmap(-1, self.per_chunk * self.slot))
        self.owner.extend(array("i", [-1]) * self.per_chunk)
        self.free.extend(range(first + self.per_chunk - 1, first - 1, -1))

    def close(self) -> None:
        for chunk in self.chunks:
            chunk.close()
        self.chunks.clear()


class ValueArena:
    """Values in fixed-size slots (layout and when memory goes back: module docstring)."""

    def __init__(self) -> None:
        self._classes: list[_SlotClass | None] = []
        self._by_slot: dict[int, int] = {}  # slot size -> class id

    def store(self, value: bytes | bytearray | memoryview, owner: int) -> int:
        """Copy ``value`` into a free slot recorded as ``owner``'s; its handle."""
        view = memoryview(value).cast("B")
        size = slot_bytes(len(view))
        cid = self._by_slot.get(size)
        if cid is None:
            cid = self._new_class(size)
        cls = self._classes[cid]
        if cls is None:  # unreachable: _by_slot only names live classes
            raise RuntimeError(f"slot class {cid} is gone")
        if not cls.free:
            cls.grow()
        slot = cls.free.pop()
        chunk, index = divmod(slot, cls.per_chunk)
        start = index * cls.slot
        cls.chunks[chunk][start:start + len(view)] = view
        cls.owner[slot] = owner
        cls.live += 1
        return cid << 32 | slot

    def read(self, handle: int, nbytes: int) -> bytes:
        """A copy of the first ``nbytes`` of the slot ``handle``."""
        cls, slot = self._slot(handle)
        chunk, index = divmod(slot, cls.per_chunk)
        start = index * cls.slot
        return cls.chunks[chunk][start:start + nbytes]

    def free(self, handle: int) -> list[tuple[int, int]]:
        """Free the slot ``handle``; the (owner, new handle) of values that moved."""
        cls, slot = self._slot(handle)
        cls.owner[slot] = -1
        cls.live -= 1
        cid = handle >> 32
        if not cls.live:
            cls.close()
            self._classes[cid] = None
            del self._by_slot[cls.slot]
            return []
        cls.free.append(slot)
        moves: list[tuple[int, int]] = []
        while len(cls.chunks) > 1 and 2 * len(cls.free) > 3 * cls.per_chunk:
            moves.extend(self._drop_last_chunk(cid, cls))
        return moves

    def _drop_last_chunk(self, cid: int, cls: _SlotClass) -> list[tuple[int, int]]:
        first = (len(cls.chunks) - 1) * cls.per_chunk
        targets = sorted((s for s in cls.free if s < first), reverse=True)
        last = cls.chunks[-1]
        moves = []
        for index in range(cls.per_chunk):
            owner = cls.owner[first + index]
            if owner < 0:
                continue
            dest = targets.pop()  # enough: > 1.5 chunks free, at most one in the last
            chunk, dest_index = divmod(dest, cls.per_chunk)
            start, dstart = index * cls.slot, dest_index * cls.slot
            cls.chunks[chunk][dstart:dstart + cls.slot] = last[start:start + cls.slot]
            cls.owner[dest] = owner
            moves.append((owner, cid << 32 | dest))
        last.close()
        cls.chunks.pop()
        del cls.owner[first:]
        cls.free = array("i", targets)  # still in descending order: lowest on top
        return moves

    def _new_class(self, size: int) -> int:
        cls = _SlotClass(size)
        try:
            cid = self._classes.index(None)
            self._classes[cid] = cls
        except ValueError:
            cid = len(self._classes)
            self._classes.append(cls)
        self._by_slot[size] = cid
        return cid

    def _slot(self, handle: int) -> tuple[_SlotClass, int]:
        cls = self._classes[handle >> 32]
        if cls is None:
            raise RuntimeError(f"value handle {handle:#x} names a freed slot class")
        return cls, handle & _SLOT_MASK

    def clear(self) -> None:
        for cls in self._classes:
            if cls is not None:
                cls.close()
        self._classes.clear()
        self._by_slot.clear()

    @property
    def mapped_bytes(self) -> int:
        """Bytes of the chunks mapped (written pages of them are RSS)."""
        return sum(len(c.chunks) * c.per_chunk * c.slot for c in self._classes if c)
