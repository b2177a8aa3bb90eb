"""Job latencies and bytes over a sliding window (pure: callers pass the time).

Latencies are kept in log-linear bins, as HdrHistogram does: whole microseconds,
``2**SUB_BITS`` bins per power of two, so a reported percentile is within 1/32 (3%) of
the true value; 1 µs to 100 s takes under 900 bins, and a slot stores only the bins it
saw. The window is a ring of slots ``slot_s`` long; recording goes into the slot of
the current time, resetting it first if it still holds an older interval, so
``record`` is O(1) and memory is bounded whatever the rate.

Thread-safe: one lock per window, held for a dict increment on record and for the
merge of at most ``window_s / slot_s`` slots on a query.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from isolane.errors import InvalidArgumentError
from isolane.lanes.forksafe import ForkSafe

SUB_BITS = 5
SUB = 1 << SUB_BITS
MAX_US = 100_000_000  # 100 s: anything slower is counted as 100 s


def bin_of(us: int) -> int:
    """The bin of a latency in whole microseconds (values below 32 µs are exact)."""
    us = min(max(us, 0), MAX_US)
    if us < SUB:
        return us
    shift = us.bit_length() - 1 - SUB_BITS
    return ((shift + 1) << SUB_BITS) + (us >> shift) - SUB


def bin_bounds(index: int) -> tuple[int, int]:
    """The lowest and highest microsecond value that falls into bin ``index``."""
    if index < SUB:
        return index, index
    shift = (index >> SUB_BITS) - 1
    low = ((index & (SUB - 1)) + SUB) << shift
    return low, low + (1 << shift) - 1


def percentile_us(bins: dict[int, int], q: float) -> int:
    """The ``q``-quantile (0 < q <= 1) of binned values, as its bin's upper bound."""
    total = sum(bins.values())
    if not total:
        raise InvalidArgumentError("percentile of an empty histogram")
    rank = max(1, math.ceil(q * total))
    seen = 0
    for index in sorted(bins):
        seen += bins[index]
        if seen >= rank:
            return bin_bounds(index)[1]
    return bin_bounds(max(bins))[1]  # unreachable: seen reaches total


@dataclass
class _Slot:
    interval: int = -1  # which slot_s-long interval of the clock this slot holds
    bins: dict[int, int] = field(default_factory=dict)
    count: int = 0
    nbytes: int = 0
    min_us: int = MAX_US
    max_us: int = 0


@dataclass(frozen=True)
class WindowSummary:
    """What a window saw: ``count`` jobs moving ``nbytes`` over ``span_s`` seconds."""

    count: int
    nbytes: int
    span_s: float
    p50_s: float | None
    p99_s: float | None
    p999_s: float | None

    @property
    def bytes_per_s(self) -> float:
        return self.nbytes / self.span_s if self.span_s > 0 else 0.0

    def latency_ms(self) -> dict[str, float | int | None]:
        """JSON-able percentiles in milliseconds (None when the window is empty)."""
        def ms(seconds: float | None) -> float | None:
            return None if seconds is None else round(seconds * 1e3, 3)
        return {"p50": ms(self.p50_s), "p99": ms(self.p99_s), "p999": ms(self.p999_s),
                "count": self.count}


class LatencyWindow(ForkSafe):
    """Latency percentiles and byte counts over the last ``window_s`` seconds."""

    def __init__(self, window_s: float = 10.0, slot_s: float = 0.1) -> None:
        if slot_s <= 0 or window_s < slot_s:
            raise InvalidArgumentError(
                f"LatencyWindow needs 0 < slot_s <= window_s, got slot_s={slot_s}, "
                f"window_s={window_s}")
        self.window_s = window_s
        self.slot_s = slot_s
        self._slots = [_Slot() for _ in range(max(1, round(window_s / slot_s)))]
        # Called with each record's (seconds, nbytes, now), e.g. the host plane's
        # epoch histograms; they must be quick and must not raise.
        self.listeners: list[Callable[[float, int, float], None]] = []
        self._lock = threading.Lock()
        super().__init__()

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()

    def record(self, seconds: float, nbytes: int, now: float,
               also: LatencyWindow | None = None) -> None:
        """One finished job that took ``seconds`` and moved ``nbytes``, at time ``now``;
        ``also``: a second window that records the same job (its bin worked out once)."""
        us = int(seconds * 1e6)
        us = 0 if us < 0 else MAX_US if us > MAX_US else us  # no min/max calls: hot path
        index = us if us < SUB else bin_of(us)
        self._add(us, index, nbytes, now)
        for listener in self.listeners:
            listener(seconds, nbytes, now)
        if also is not None:
            also._add(us, index, nbytes, now)
            for listener in also.listeners:
                listener(seconds, nbytes, now)

    def _add(self, us: int, index: int, nbytes: int, now: float) -> None:
        interval = int(now // self.slot_s)
        slots = self._slots
        with self._lock:
            slot = slots[interval % len(slots)]
            if slot.interval != interval:
                slot.interval, slot.bins, slot.count, slot.nbytes = interval, {}, 0, 0
                slot.min_us, slot.max_us = MAX_US, 0
            bins = slot.bins
            bins[index] = bins.get(index, 0) + 1
            slot.count += 1
            slot.nbytes += nbytes
            if us < slot.min_us:
                slot.min_us = us
            if us > slot.max_us:
                slot.max_us = us

    def summary(self, now: float, since: float | None = None) -> WindowSummary:
        """Jobs recorded in slots that start at or after ``since`` (default: the whole
        window) and are not older than the window."""
        current = int(now // self.slot_s)
        first = current - len(self._slots) + 1
        if since is not None:
            first = max(first, math.ceil(since / self.slot_s - 1e-9))
        bins: dict[int, int] = {}
        count = nbytes = 0
        low, high = MAX_US, 0
        with self._lock:
            for slot in self._slots:
                if not first <= slot.interval <= current or not slot.count:
                    continue
                for index, n in slot.bins.items():
                    bins[index] = bins.get(index, 0) + n
                count += slot.count
                nbytes += slot.nbytes
                low, high = min(low, slot.min_us), max(high, slot.max_us)
        span_s = max(0.0, now - first * self.slot_s)

        def quantile(q: float) -> float | None:
            if not count:
                return None
            # The bin's upper bound, but never outside what was actually seen.
            return min(max(percentile_us(bins, q), low), high) / 1e6

        return WindowSummary(count, nbytes, span_s, quantile(0.5), quantile(0.99),
                             quantile(0.999))
