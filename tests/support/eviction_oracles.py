"""Eviction policies for the KV pool's memory tier (pure: no I/O, no locks).

A policy only decides *which* resident keys to drop; the tier owns the bytes and the
budget. The tier's calls, under its own lock (policies are not thread-safe):

- ``admit(key, nbytes)`` after storing a new block (re-admitting a resident key
  updates its size and counts as a hit);
- ``touch(key)`` on every hit (ignored for keys that are not resident);
- ``remove(key)`` when a block is deleted for another reason (harmless if unknown);
- ``evict(need_bytes)`` before storing ``need_bytes`` more than the budget allows: it
  returns victims whose sizes add up to at least ``need_bytes`` (or every resident key
  when that is not enough) and forgets them; the tier then drops or demotes them.

Sizes are bytes, so blocks of different sizes are weighed fairly. Policies:

- ``LRUPolicy``: least recently used first; the baseline.
- ``S3FIFOPolicy`` (Yang et al., "FIFO queues are all you need for cache eviction",
  SOSP'23): a small FIFO (~10 % of the bytes) that new keys enter, a main FIFO, and a
  ghost FIFO of keys recently evicted from the small one. Hits bump a counter capped at
  3. The small FIFO's oldest key moves to main if it was hit (counter cleared), else it
  is evicted into the ghost; a ghost key that comes back goes straight to main. Main's
  oldest key is reinserted with its counter decremented while that is > 0, else
  evicted. One-time scans pass through the small FIFO without disturbing main.
- ``WTinyLFUPolicy`` (Einziger et al., "TinyLFU", ACM ToS 2017; as in Caffeine): an LRU
  window (~1 %) in front of a segmented LRU main (probation 20 % / protected 80 %);
  a key leaving the window enters main only if it was used more often than main's
  next victim (ties keep the incumbent). Frequencies are exact counts capped at 15 and
  halved every ``10 x resident keys`` accesses (TinyLFU's aging); a count-min sketch
  would only save memory, at the price of over-estimates. The window is fixed (no
  hill climbing as in Caffeine), which hurts recency-heavy workloads.

Measured on the Mooncake conversation trace (``benchmarks/bench_kv_eviction.py``,
``docs/BENCHMARKS.md``): with room for 0.5-2 % of the unique blocks, W-TinyLFU and
S3-FIFO beat LRU (a conversation's shared prefixes are frequent); from 5 % on, LRU wins
(a conversation's next turn returns after the small FIFO / window has moved on), and
W-TinyLFU falls far behind (stale counts keep newcomers out).

``make_policy(name, capacity_bytes)`` builds one by name (``POLICIES``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from isolane.errors import InvalidArgumentError

K = TypeVar("K", bound=Hashable)


def _check_nbytes(nbytes: int, name: str = "nbytes") -> None:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise InvalidArgumentError(f"{name} must be a whole number of bytes >= 0, got {nbytes!r}")


def _check_capacity(capacity_bytes: int) -> None:
    if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) \
            or capacity_bytes < 1:
        raise InvalidArgumentError(
            f"capacity_bytes must be a whole number of bytes >= 1 (the memory tier's budget, "
            f"kv memory_budget), got {capacity_bytes!r}")


class EvictionPolicy(ABC, Generic[K]):
    """Chooses victims among resident keys; see the module docstring for the call order.

    Not thread-safe: the caller serialises every call. All methods are O(1) amortised
    except ``evict``, which is O(victims + reinsertions).
    """

    @abstractmethod
    def admit(self, key: K, nbytes: int) -> None:
        """Make ``key`` resident with size ``nbytes``; an already resident key is resized
        and counted as a hit. Does not evict: call ``evict`` first to stay in budget."""

    @abstractmethod
    def touch(self, key: K) -> None:
        """Record a hit on ``key``; a key that is not resident is ignored."""

    @abstractmethod
    def remove(self, key: K) -> None:
        """Forget ``key`` (resident or remembered); unknown keys are ignored."""

    @abstractmethod
    def evict(self, need_bytes: int) -> list[K]:
        """Choose and forget victims totalling at least ``need_bytes`` (everything if the
        resident keys hold less); ``need_bytes <= 0`` evicts nothing."""

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is resident (ghost entries do not count)."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of resident keys."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Total size of the resident keys."""


# -- LRU ---------------------------------------------------------------------------------
class LRUPolicy(EvictionPolicy[K]):
    """Least recently admitted or touched key first."""

    def __init__(self, capacity_bytes: int | None = None) -> None:
        if capacity_bytes is not None:
            _check_capacity(capacity_bytes)  # unused: accepted so every policy builds alike
        self._sizes: OrderedDict[K, int] = OrderedDict()  # oldest first
        self._nbytes = 0

    def admit(self, key: K, nbytes: int) -> None:
        _check_nbytes(nbytes)
        old = self._sizes.pop(key, None)
        if old is not None:
            self._nbytes -= old
        self._sizes[key] = nbytes
        self._nbytes += nbytes

    def touch(self, key: K) -> None:
        if key in self._sizes:
            self._sizes.move_to_end(key)

    def remove(self, key: K) -> None:
        old = self._sizes.pop(key, None)
        if old is not None:
            self._nbytes -= old

    def evict(self, need_bytes: int) -> list[K]:
        victims: list[K] = []
        freed = 0
        while freed < need_bytes and self._sizes:
            key, size = self._sizes.popitem(last=False)
            victims.append(key)
            freed += size
        self._nbytes -= freed
        return victims

    def __contains__(self, key: object) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    @property
    def nbytes(self) -> int:
        return self._nbytes


# -- S3-FIFO -----------------------------------------------------------------------------
class _Entry:
    __slots__ = ("freq", "nbytes")

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.freq = 0


class S3FIFOPolicy(EvictionPolicy[K]):
    """S3-FIFO over bytes: small FIFO (``small_ratio`` of ``capacity_bytes``), main FIFO,
    and a ghost FIFO of keys (no data) holding up to main's share of bytes.

    ``capacity_bytes`` is the budget the tier evicts to; it sets the small FIFO's share
    and the ghost's length, nothing else (the tier still decides when to evict).
    """

    MAX_FREQ = 3

    def __init__(self, capacity_bytes: int, *, small_ratio: float = 0.1) -> None:
        _check_capacity(capacity_bytes)
        if not 0 < small_ratio < 1:
            raise InvalidArgumentError(f"small_ratio must lie in (0, 1), got {small_ratio!r}")
        self._small_target = max(1, int(capacity_bytes * small_ratio))
        self._ghost_limit = max(1, capacity_bytes - self._small_target)
        self._small: OrderedDict[K, _Entry] = OrderedDict()  # oldest first
        self._main: OrderedDict[K, _Entry] = OrderedDict()
        self._ghost: OrderedDict[K, int] = OrderedDict()  # key -> its size when evicted
        self._small_bytes = 0
        self._main_bytes = 0
        self._ghost_bytes = 0

    def admit(self, key: K, nbytes: int) -> None:
        _check_nbytes(nbytes)
        entry = self._small.get(key)
        if entry is not None:
            self._small_bytes += nbytes - entry.nbytes
        elif (entry := self._main.get(key)) is not None:
            self._main_bytes += nbytes - entry.nbytes
        if entry is not None:
            entry.nbytes = nbytes
            entry.freq = min(entry.freq + 1, self.MAX_FREQ)
            return
        if self._forget_ghost(key):
            self._main[key] = _Entry(nbytes)
            self._main_bytes += nbytes
        else:
            self._small[key] = _Entry(nbytes)
            self._small_bytes += nbytes

    def touch(self, key: K) -> None:
        entry = self._small.get(key) or self._main.get(key)
        if entry is not None and entry.freq < self.MAX_FREQ:
            entry.freq += 1

    def remove(self, key: K) -> None:
        entry = self._small.pop(key, None)
        if entry is not None:
            self._small_bytes -= entry.nbytes
        elif (entry := self._main.pop(key, None)) is not None:
            self._main_bytes -= entry.nbytes
        self._forget_ghost(key)

    def evict(self, need_bytes: int) -> list[K]:
        victims: list[K] = []
        freed = 0
        while freed < need_bytes and (self._small or self._main):
            if self._small and (self._small_bytes >= self._small_target or not self._main):
                key, entry = self._small.popitem(last=False)
                self._small_bytes -= entry.nbytes
                if entry.freq > 0:  # used while in small: promote, counter cleared
                    entry.freq = 0
                    self._main[key] = entry
                    self._main_bytes += entry.nbytes
                    continue
                self._remember_ghost(key, entry.nbytes)
            else:
                key, entry = self._main.popitem(last=False)
                if entry.freq > 0:  # reinsert, one use spent
                    entry.freq -= 1
                    self._main[key] = entry
                    continue
                self._main_bytes -= entry.nbytes
            victims.append(key)
            freed += entry.nbytes
        return victims

    def _remember_ghost(self, key: K, nbytes: int) -> None:
        self._ghost[key] = nbytes
        self._ghost_bytes += nbytes
        while self._ghost_bytes > self._ghost_limit and self._ghost:
            _, size = self._ghost.popitem(last=False)
            self._ghost_bytes -= size

    def _forget_ghost(self, key: K) -> bool:
        size = self._ghost.pop(key, None)
        if size is None:
            return False
        self._ghost_bytes -= size
        return True

    def __contains__(self, key: object) -> bool:
        return key in self._small or key in self._main

    def __len__(self) -> int:
        return len(self._small) + len(self._main)

    @property
    def nbytes(self) -> int:
        return self._small_bytes + self._main_bytes


# -- W-TinyLFU ---------------------------------------------------------------------------
class WTinyLFUPolicy(EvictionPolicy[K]):
    """W-TinyLFU over bytes: LRU window (``window_ratio``), then segmented LRU main
    (probation, and protected up to ``protected_ratio`` of main) behind a frequency
    filter; ``capacity_bytes`` sets the shares, the tier still decides when to evict."""

    MAX_FREQ = 15

    def __init__(self, capacity_bytes: int, *, window_ratio: float = 0.01,
                 protected_ratio: float = 0.8) -> None:
        _check_capacity(capacity_bytes)
        if not 0 < window_ratio < 1 or not 0 < protected_ratio < 1:
            raise InvalidArgumentError("window_ratio and protected_ratio must lie in (0, 1), "
                                       f"got {window_ratio!r} and {protected_ratio!r}")
        self._window_target = max(1, int(capacity_bytes * window_ratio))
        self._main_target = max(1, capacity_bytes - self._window_target)
        self._protected_target = max(1, int(self._main_target * protected_ratio))
        self._window: OrderedDict[K, int] = OrderedDict()  # LRU first; key -> nbytes
        self._probation: OrderedDict[K, int] = OrderedDict()
        self._protected: OrderedDict[K, int] = OrderedDict()
        self._window_bytes = 0
        self._probation_bytes = 0
        self._protected_bytes = 0
        self._freq: dict[K, int] = {}
        self._accesses = 0
        self._peak_len = 0

    # frequency filter
    def _record(self, key: K) -> None:
        count = self._freq.get(key, 0)
        if count < self.MAX_FREQ:
            self._freq[key] = count + 1
        self._accesses += 1
        self._peak_len = max(self._peak_len, len(self))
        if self._accesses >= 10 * max(16, self._peak_len):  # age: halve every count
            self._accesses = 0
            self._freq = {k: c >> 1 for k, c in self._freq.items() if c > 1}

    def admit(self, key: K, nbytes: int) -> None:
        _check_nbytes(nbytes)
        if key in self:
            self._resize(key, nbytes)
            self.touch(key)
            return
        self._record(key)
        self._window[key] = nbytes
        self._window_bytes += nbytes
        # While main has room (warming up), the window's overflow moves there freely.
        while self._window_bytes > self._window_target and self._window:
            old, size = next(iter(self._window.items()))
            if self._main_bytes + size > self._main_target:
                break
            self._window_to_probation(old)

    def touch(self, key: K) -> None:
        if key in self._window:
            self._window.move_to_end(key)
        elif key in self._probation:
            size = self._probation.pop(key)
            self._probation_bytes -= size
            self._protected[key] = size
            self._protected_bytes += size
            while self._protected_bytes > self._protected_target and len(self._protected) > 1:
                old, old_size = self._protected.popitem(last=False)
                self._protected_bytes -= old_size
                self._probation[old] = old_size
                self._probation_bytes += old_size
        elif key in self._protected:
            self._protected.move_to_end(key)
        else:
            return
        self._record(key)

    def remove(self, key: K) -> None:
        self._pop(key)
        self._freq.pop(key, None)

    def evict(self, need_bytes: int) -> list[K]:
        victims: list[K] = []
        freed = 0
        while freed < need_bytes and len(self):
            main_victim = self._main_victim()
            if not self._window or main_victim is None:  # one side only: plain LRU
                victim = main_victim if main_victim is not None else next(iter(self._window))
            else:
                # The window's oldest key is the candidate the next admit pushes out: it
                # enters main freely while main has room, else only if it was used more
                # often than main's victim (ties keep the incumbent).
                candidate, size = next(iter(self._window.items()))
                if self._main_bytes + size <= self._main_target:
                    self._window_to_probation(candidate)
                    continue
                if self._freq.get(candidate, 0) > self._freq.get(main_victim, 0):
                    victim = main_victim
                    self._window_to_probation(candidate)
                else:
                    victim = candidate
            victims.append(victim)
            freed += self._pop(victim) or 0
        return victims

    def _pop(self, key: K) -> int | None:
        """Take ``key`` out of its queue; its size, or None if it is not resident."""
        for queue in (self._window, self._probation, self._protected):
            size = queue.pop(key, None)
            if size is not None:
                self._add_bytes(queue, -size)
                return size
        return None

    @property
    def _main_bytes(self) -> int:
        return self._probation_bytes + self._protected_bytes

    def _main_victim(self) -> K | None:
        for queue in (self._probation, self._protected):
            if queue:
                return next(iter(queue))
        return None

    def _window_to_probation(self, key: K) -> None:
        size = self._window.pop(key)
        self._window_bytes -= size
        self._probation[key] = size
        self._probation_bytes += size

    def _resize(self, key: K, nbytes: int) -> None:
        for queue in (self._window, self._probation, self._protected):
            if key in queue:
                self._add_bytes(queue, nbytes - queue[key])
                queue[key] = nbytes
                return

    def _add_bytes(self, queue: OrderedDict[K, int], delta: int) -> None:
        if queue is self._window:
            self._window_bytes += delta
        elif queue is self._probation:
            self._probation_bytes += delta
        else:
            self._protected_bytes += delta

    def __contains__(self, key: object) -> bool:
        return key in self._window or key in self._probation or key in self._protected

    def __len__(self) -> int:
        return len(self._window) + len(self._probation) + len(self._protected)

    @property
    def nbytes(self) -> int:
        return self._window_bytes + self._main_bytes


# -- factory -----------------------------------------------------------------------------
POLICIES: dict[str, Callable[[int], EvictionPolicy[Hashable]]] = {
    "lru": LRUPolicy,
    "s3fifo": S3FIFOPolicy,
    "wtinylfu": WTinyLFUPolicy,
}
"""Policy names for config files and ``make_policy``."""


def make_policy(name: str, capacity_bytes: int) -> EvictionPolicy[Hashable]:
    """The policy called ``name`` (``lru``, ``s3fifo``, ``wtinylfu``) for a tier whose
    budget is ``capacity_bytes``."""
    factory = POLICIES.get(name.strip().lower()) if isinstance(name, str) else None
    if factory is None:
        raise InvalidArgumentError(
            f"unknown eviction policy {name!r}; choose one of {', '.join(POLICIES)}")
    return factory(capacity_bytes)
