"""Keyed object versions of the memory tier's eviction policies (pure: no I/O, no locks).

The product's policies are the compact ones of ``isolane.kvpool.tiers.memory_policy``
(state in the memory tier's ``EntryTable``, no object per entry). These make exactly the
same choices, one Python object per key, and serve as:

- the oracle the compact policies are tested against (``tests/kvpool``);
- the keyed cache the trace simulations of ``benchmarks/`` run (``bench_kv_eviction``,
  ``bench_routing``), which weigh blocks by size without storing their bytes.

The calls, serialised by the caller:

- ``admit(key, nbytes)`` after storing a new block (re-admitting a resident key
  updates its size and counts as a hit);
- ``touch(key)`` on every hit (ignored for keys that are not resident);
- ``remove(key)`` when a block is deleted for another reason (harmless if unknown);
- ``evict(need_bytes)`` before storing ``need_bytes`` more than the budget allows: it
  returns victims whose sizes add up to at least ``need_bytes`` (or every resident key
  when that is not enough) and forgets them.

- ``LRUPolicy``: least recently used first.
- ``S3FIFOPolicy`` (Yang et al., "FIFO queues are all you need for cache eviction",
  SOSP'23): a small FIFO (~10 % of the bytes) that new keys enter, a main FIFO, and a
  ghost FIFO of keys recently evicted from the small one. Hits bump a counter capped at
  3. The small FIFO's oldest key moves to main if it was hit (counter cleared), else it
  is evicted into the ghost; a ghost key that comes back goes straight to main. Main's
  oldest key is reinserted with its counter decremented while that is > 0, else
  evicted. One-time scans pass through the small FIFO without disturbing main.

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


# -- factory -----------------------------------------------------------------------------
POLICIES: dict[str, Callable[[int], EvictionPolicy[Hashable]]] = {
    "lru": LRUPolicy,
    "s3fifo": S3FIFOPolicy,
}
"""Policy names for config files and ``make_policy``."""


def make_policy(name: str, capacity_bytes: int) -> EvictionPolicy[Hashable]:
    """The policy called ``name`` (``lru``, ``s3fifo``) for a tier whose
    budget is ``capacity_bytes``."""
    factory = POLICIES.get(name.strip().lower()) if isinstance(name, str) else None
    if factory is None:
        raise InvalidArgumentError(
            f"unknown eviction policy {name!r}; choose one of {', '.join(POLICIES)}")
    return factory(capacity_bytes)
