"""A reused pool of page-aligned staging buffers with a byte budget.

Chunks are copied out of the caller's tensors into these buffers, then written with
O_DIRECT. Buffers are kept for the pool's lifetime because fresh pages cost a fault per
page on first touch (~0.5-2 GB/s here against ~13-19 GB/s for warm ones).

The budget counts the bytes of allocated buffers. ``acquire(n)`` takes the smallest free
buffer that holds ``n`` bytes, else allocates one (sizes rounded up to 2 MiB, so the
same shapes save after save reuse the same buffers), else frees idle buffers that are
too small to make room, else waits for a release (back-pressure instead of exhausting
memory). A request larger than the whole budget is served once nothing else is out.
Thread-safe.
"""

from __future__ import annotations

import threading

from isolane.storage.aligned import AlignedBuffer, advise_hugepages, align_up

_GRANULE = 2 << 20


class StagingPool:
    def __init__(self, slot_bytes: int, budget_bytes: int) -> None:
        self.slot_bytes = slot_bytes  # the largest request expected (one chunk)
        self.budget_bytes = max(budget_bytes, slot_bytes)
        self._free: list[AlignedBuffer] = []
        self._allocated = 0
        self._in_use = 0
        self._cond = threading.Condition()

    def acquire(self, nbytes: int | None = None) -> AlignedBuffer:
        """A buffer of at least ``nbytes`` (default: one slot); may wait for a release."""
        need = align_up(nbytes or self.slot_bytes, _GRANULE)
        with self._cond:
            while True:
                fits = [b for b in self._free if b.capacity >= need]
                if fits:
                    buf = min(fits, key=lambda b: b.capacity)
                    self._free.remove(buf)
                    self._in_use += buf.capacity
                    return buf
                if self._allocated + need <= self.budget_bytes or self._allocated == 0:
                    break
                if self._free:  # idle buffers too small for this request: make room
                    victim = max(self._free, key=lambda b: b.capacity)
                    self._free.remove(victim)
                    self._allocated -= victim.capacity
                    victim.close()
                    continue
                if self._in_use == 0:
                    break
                self._cond.wait()
            self._allocated += need
            self._in_use += need
        try:
            buf = AlignedBuffer(need)
        except BaseException:
            with self._cond:
                self._allocated -= need
                self._in_use -= need
                self._cond.notify_all()
            raise
        advise_hugepages(buf)
        return buf

    def exhausted(self, nbytes: int | None = None) -> bool:
        """True when ``acquire(nbytes)`` would have to wait for a release."""
        need = align_up(nbytes or self.slot_bytes, _GRANULE)
        with self._cond:
            if any(b.capacity >= need for b in self._free):
                return False
            idle = sum(b.capacity for b in self._free)
            return self._allocated - idle + need > self.budget_bytes and self._in_use > 0

    def release(self, buf: AlignedBuffer) -> None:
        with self._cond:
            self._in_use -= buf.capacity
            self._free.append(buf)
            self._cond.notify_all()

    @property
    def allocated_bytes(self) -> int:
        return self._allocated

    def close(self) -> None:
        with self._cond:
            for buf in self._free:
                self._allocated -= buf.capacity
                buf.close()
            self._free.clear()
