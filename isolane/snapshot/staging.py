"""A reused pool of page-aligned staging buffers with a byte budget.

Chunks are copied out of the caller's tensors into these buffers, then written with
O_DIRECT. Buffers are kept for the pool's lifetime because fresh pages cost a fault per
page on first touch (~0.5-2 GB/s here against ~13-19 GB/s for warm ones), and past it:

- ``prefill(count)`` faults ``count`` slot-sized buffers in on a background thread
  (``MADV_POPULATE_WRITE``), so that the first save of a store opened a while before
  copies into warm memory (``SnapshotStore`` asks for one per write-lane thread when a
  save starts, never at open: a store that only lists, verifies, deletes or loads maps
  no staging); ``acquire`` waits for a buffer being prefilled rather than fault a fresh
  one;
- ``prefill_sizes(sizes)`` does the same for a save's chunk sizes, within the budget
  (an async save asks once staged, so the next one finds its buffers warm);
- ``close()`` hands its idle buffers to a process-wide cache of warm buffers (at most
  ``KEEP_WARM_BYTES``), and a later pool of the same process takes buffers of the same
  size from there before it maps fresh memory (a new store per checkpoint folder, or
  a store reopened, starts warm).

The budget counts the bytes of allocated buffers. ``acquire(n)`` takes the smallest free
buffer that holds ``n`` bytes, else allocates one (sizes rounded up to 2 MiB, so the
same shapes save after save reuse the same buffers), else frees idle buffers that are
too small to make room, else waits for a release (back-pressure instead of exhausting
memory); ``may_map`` lets a caller wait for its own buffers instead of mapping fresh
ones, and ``acquire_warm`` never maps or waits for a release. A request larger than the
whole budget is served once nothing else is out.
Thread-safe.
"""

from __future__ import annotations

import logging
import os
import threading
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

from isolane.storage.aligned import AlignedBuffer, advise_hugepages, align_up
from isolane.storage.mapped import populate_write

log = logging.getLogger(__name__)

_GRANULE = 2 << 20
# Warm buffers the process keeps after their pool closed, for its next pool.
KEEP_WARM_BYTES = 256 << 20


class _WarmCache:
    """Idle warm buffers of closed pools, by exact capacity (process-wide)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._buffers: list[AlignedBuffer] = []
        self._lock = threading.Lock()

    def take(self, capacity: int) -> AlignedBuffer | None:
        with self._lock:
            for i, buf in enumerate(self._buffers):
                if buf.capacity == capacity:
                    return self._buffers.pop(i)
        return None

    def keep(self, buf: AlignedBuffer) -> bool:
        """Keep ``buf`` if there is room; False: the caller closes it."""
        with self._lock:
            if sum(b.capacity for b in self._buffers) + buf.capacity > self.limit:
                return False
            self._buffers.append(buf)
            return True

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(b.capacity for b in self._buffers)

    def clear(self) -> None:
        """Close every kept buffer."""
        with self._lock:
            buffers, self._buffers = self._buffers, []
        for buf in buffers:
            buf.close()

    def forget(self) -> None:
        """After fork, in the child: drop the parent's buffers without touching them."""
        self._buffers = []
        self._lock = threading.Lock()


WARM = _WarmCache(KEEP_WARM_BYTES)
os.register_at_fork(after_in_child=WARM.forget)


def _fresh(capacity: int, *, populate: bool) -> AlignedBuffer:
    """A warm buffer of the cache, else a fresh one (faulted in now if ``populate``)."""
    buf = WARM.take(capacity)
    if buf is not None:
        return buf
    buf = AlignedBuffer(capacity)
    advise_hugepages(buf)
    if populate and not populate_write(buf.address, buf.capacity):
        np.frombuffer(buf.view, dtype=np.uint8)[::4096] = 0  # no MADV_POPULATE_WRITE
    return buf


class StagingPool:
    def __init__(self, slot_bytes: int, budget_bytes: int) -> None:
        self.slot_bytes = slot_bytes  # the largest request expected (one chunk)
        self.budget_bytes = max(budget_bytes, slot_bytes)
        self._free: list[AlignedBuffer] = []
        self._allocated = 0
        self._in_use = 0
        self._capacities: Counter[int] = Counter()  # every allocated buffer's, by size
        self._prefilling: Counter[int] = Counter()  # reserved by prefill, not yet in _free
        self._closed = False
        self._prefillers: list[threading.Thread] = []
        self.acquired = 0  # buffers handed out by acquire() so far
        self.peak_allocated_bytes = 0  # the most ever allocated at once
        self._cond = threading.Condition()

    def acquire(self, nbytes: int | None = None, *,
                may_map: Callable[[], bool] | None = None) -> AlignedBuffer:
        """A buffer of at least ``nbytes`` (default: one slot); may wait for a release.
        ``may_map``: whether fresh memory may be mapped now; when it says no, a release
        is awaited instead (a caller that has its own buffers out, soon back)."""
        need = align_up(nbytes or self.slot_bytes, _GRANULE)
        with self._cond:
            while True:
                buf = self._take_free(need)
                if buf is not None:
                    return buf
                if self._prefilling_fits(need):
                    self._cond.wait()  # a warm one is on its way: faster than a fresh one
                    continue
                if may_map is not None and not may_map():
                    self._cond.wait()
                    continue
                if self._allocated + need <= self.budget_bytes or self._allocated == 0:
                    break
                if self._free:  # idle buffers too small for this request: make room
                    victim = max(self._free, key=lambda b: b.capacity)
                    self._free.remove(victim)
                    self._forget(victim.capacity)
                    victim.close()
                    continue
                if self._in_use == 0:
                    break
                self._cond.wait()
            self._allocated += need
            self._capacities[need] += 1
            self._in_use += need
            self.acquired += 1
            self.peak_allocated_bytes = max(self.peak_allocated_bytes, self._allocated)
        try:
            return _fresh(need, populate=False)
        except BaseException:
            with self._cond:
                self._forget(need)
                self._in_use -= need
                self._cond.notify_all()
            raise

    def acquire_warm(self, nbytes: int) -> AlignedBuffer | None:
        """A buffer of at least ``nbytes`` already mapped (idle, or being prefilled:
        waits for it), else None without waiting for a release or mapping memory."""
        need = align_up(nbytes, _GRANULE)
        with self._cond:
            while True:
                buf = self._take_free(need)
                if buf is not None or not self._prefilling_fits(need):
                    return buf
                self._cond.wait()

    def _take_free(self, need: int) -> AlignedBuffer | None:
        fits = [b for b in self._free if b.capacity >= need]
        if not fits:
            return None
        buf = min(fits, key=lambda b: b.capacity)
        self._free.remove(buf)
        self._in_use += buf.capacity
        self.acquired += 1
        return buf

    def _prefilling_fits(self, need: int) -> bool:
        return any(capacity >= need for capacity in self._prefilling)

    def _forget(self, capacity: int) -> None:
        """A buffer of ``capacity`` is no longer allocated (closed or never mapped)."""
        self._allocated -= capacity
        self._capacities[capacity] -= 1
        if not self._capacities[capacity]:
            del self._capacities[capacity]

    @property
    def _slot_capacity(self) -> int:
        return align_up(self.slot_bytes, _GRANULE)

    def prefill(self, count: int) -> threading.Thread | None:
        """Fault ``count`` slot-sized buffers in on a background thread (as many as the
        budget allows next to what is allocated); the thread, or None with nothing to
        do. Off the critical path of the first save; ``close`` waits for it."""
        return self.prefill_sizes([self.slot_bytes] * count)

    def prefill_sizes(self, sizes: Sequence[int]) -> threading.Thread | None:
        """Fault in, on a background thread, a buffer for each of ``sizes`` that no
        allocated buffer already serves, largest first, while the budget has room; the
        thread, or None with nothing to do. An async save asks for its chunks' sizes
        once they are staged, so that the next save of the same state finds them warm."""
        with self._cond:
            if self._closed:
                return None
            spare = sorted(self._capacities.elements())
            missing: list[int] = []
            for need in sorted((align_up(n, _GRANULE) for n in sizes), reverse=True):
                at = bisect_left(spare, need)  # the smallest allocated buffer that serves
                if at < len(spare):
                    del spare[at]
                elif self._allocated + sum(missing) + need <= self.budget_bytes:
                    missing.append(need)
            if not missing:
                return None
            for need in missing:
                self._allocated += need
                self._capacities[need] += 1
                self._prefilling[need] += 1
            self.peak_allocated_bytes = max(self.peak_allocated_bytes, self._allocated)
            thread = threading.Thread(target=self._prefill, args=(missing,),
                                      name="isolane-staging-prefill", daemon=True)
            self._prefillers = [t for t in self._prefillers if t.is_alive()] + [thread]
        thread.start()
        return thread

    def _prefill(self, sizes: list[int]) -> None:
        for i, need in enumerate(sizes):
            try:
                buf = _fresh(need, populate=True)
            except OSError as exc:  # out of memory: acquire() maps what it needs later
                log.warning("could not prefill a %d-byte staging buffer (%s); saves fault "
                            "their staging memory in as they go", need, exc)
                with self._cond:
                    for left in sizes[i:]:
                        self._forget(left)
                        self._prefilling[left] -= 1
                    self._prefilling = +self._prefilling
                    self._cond.notify_all()
                return
            with self._cond:
                self._prefilling[need] -= 1
                self._prefilling = +self._prefilling
                self._free.append(buf)
                self._cond.notify_all()

    def release(self, buf: AlignedBuffer) -> None:
        with self._cond:
            self._in_use -= buf.capacity
            self._free.append(buf)
            self._cond.notify_all()

    @property
    def allocated_bytes(self) -> int:
        return self._allocated

    @property
    def in_use_bytes(self) -> int:
        """The capacity of the buffers acquired and not yet released."""
        return self._in_use

    @property
    def slot_capacity(self) -> int:
        """What one slot-sized request takes out of the budget."""
        return self._slot_capacity

    def try_acquire(self, nbytes: int, *, keep_free: int = 0) -> AlignedBuffer | None:
        """A buffer of at least ``nbytes`` if the buffers out would then leave
        ``keep_free`` bytes of the budget to others, else None (never waits)."""
        need = align_up(nbytes, _GRANULE)
        with self._cond:
            if self._in_use + need + keep_free > self.budget_bytes:
                return None
        return self.acquire(need)

    def close(self) -> None:
        """Hand the idle buffers to the process's warm cache (``WARM``), close the rest.
        Waits for a running prefill first."""
        with self._cond:
            self._closed = True
            prefillers = list(self._prefillers)
        for prefiller in prefillers:
            if prefiller is not threading.current_thread():
                prefiller.join()
        with self._cond:
            for buf in self._free:
                self._forget(buf.capacity)
                if not WARM.keep(buf):
                    buf.close()
            self._free.clear()
