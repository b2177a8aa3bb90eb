"""A reused pool of page-aligned staging buffers with a byte budget.

Chunks are copied out of the caller's tensors into these buffers, then written with
O_DIRECT. Buffers are kept for the pool's lifetime because fresh pages cost a fault per
page on first touch; ``acquire`` blocks while the budget is spent (back-pressure
instead of exhausting memory). Thread-safe.
"""

from __future__ import annotations

import threading

from isolane.storage.aligned import AlignedBuffer, advise_hugepages


class StagingPool:
    def __init__(self, slot_bytes: int, budget_bytes: int) -> None:
        self.slot_bytes = slot_bytes
        self.max_slots = max(1, budget_bytes // slot_bytes)
        self._free: list[AlignedBuffer] = []
        self._allocated = 0
        self._in_use = 0
        self._cond = threading.Condition()

    def acquire(self, limit_slots: int | None = None) -> AlignedBuffer:
        """A buffer of ``slot_bytes``; waits while ``limit_slots`` (or the budget) are out."""
        limit = min(self.max_slots, limit_slots or self.max_slots)
        with self._cond:
            while self._in_use >= limit:
                self._cond.wait()
            self._in_use += 1
            if self._free:
                return self._free.pop()
            self._allocated += 1
        try:
            buf = AlignedBuffer(self.slot_bytes)
        except BaseException:
            with self._cond:
                self._in_use -= 1
                self._allocated -= 1
                self._cond.notify_all()
            raise
        advise_hugepages(buf)
        return buf

    def exhausted(self) -> bool:
        """True when ``acquire`` would wait for a release."""
        with self._cond:
            return self._in_use >= self.max_slots

    def release(self, buf: AlignedBuffer) -> None:
        with self._cond:
            self._in_use -= 1
            self._free.append(buf)
            self._cond.notify_all()

    @property
    def allocated_bytes(self) -> int:
        return self._allocated * self.slot_bytes

    def close(self) -> None:
        with self._cond:
            for buf in self._free:
                buf.close()
            self._allocated -= len(self._free)
            self._free.clear()
