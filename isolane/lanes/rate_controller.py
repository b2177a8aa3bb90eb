"""The bookkeeping of a governed rate (pure; not thread-safe).

``RateController`` holds one rate (``None``: unlimited), its floor, static cap and
ceiling (what flowed before the first cut), the counters and the recent decisions, and
the two moves every law makes: a cut (``_cut``: from the limit or from what flowed,
never below the floor, remembering the ceiling on the first cut from unlimited) and a
step up (``_grow``: up to the cap, or with no cap past the ceiling back to unlimited).
The control law (``control.TargetController``) decides only how far and when
(``update``).
"""

from __future__ import annotations

from collections import deque

from isolane.errors import InvalidArgumentError
from isolane.lanes.decisions import DECISIONS_KEPT, Decision


class RateController:
    """One governed rate and its bookkeeping; subclasses implement ``update``."""

    def __init__(self, *, slo_s: float, floor: float, cap: float | None,
                 decrease_factor: float = 0.5, name: str = "write") -> None:
        if not slo_s > 0:
            raise InvalidArgumentError(f"slo_s must be positive, got {slo_s}")
        if not floor > 0:
            raise InvalidArgumentError(f"floor must be positive bytes per second, got {floor}")
        if cap is not None and cap < floor:
            raise InvalidArgumentError(f"floor ({floor:.0f} B/s) is above cap ({cap:.0f} B/s); "
                                       "lower the floor or raise the cap")
        if not 0 < decrease_factor < 1:
            raise InvalidArgumentError(
                f"decrease_factor must be between 0 and 1, got {decrease_factor}")
        self.name = name
        self.slo_s = slo_s
        self.floor = floor
        self.cap = cap
        self.decrease_factor = decrease_factor
        self.rate: float | None = cap
        self.ceiling: float | None = cap
        self.cuts = 0
        self.increases = 0
        self.state = "unlimited" if cap is None else "at cap"
        self.decisions: deque[Decision] = deque(maxlen=DECISIONS_KEPT)

    @property
    def at_ceiling(self) -> bool:
        """Back where it started: unlimited, at the static cap, or (held limited while
        reads flow) at the ceiling."""
        return self.rate is None or (self.cap is not None and self.rate >= self.cap) or (
            self.ceiling is not None and self.rate >= self.ceiling)

    def update(self, read_p99_s: float | None, now: float, measured_bytes_per_s: float,
               *, may_increase: bool = True) -> float | None:
        """One control step; returns the new rate."""
        raise NotImplementedError

    def start_from(self, now: float, limit: float, ceiling: float | None, why: str) -> None:
        """Start at ``limit`` (clamped to the floor and the cap) instead of where the
        law starts (unlimited, or the cap): a warm start (``isolane.lanes.memory``)."""
        new = max(self.floor, limit if self.cap is None else min(self.cap, limit))
        if ceiling is not None and self.cap is None:
            self.ceiling = max(ceiling, new)
        if new != self.rate:
            self._change(now, None, new, f"warm start: {why}")

    def _cannot_grow(self, may_increase: bool) -> bool:
        """True (with the state set) when the rate is unlimited or must wait."""
        if self.rate is None or not may_increase:
            self.state = "unlimited" if self.rate is None else "waiting for higher priority"
            return True
        return False

    def _cut(self, p99: float, now: float, measured: float, *, factor: float,
             base: float | None = None, note: str = "") -> float | None:
        """Cut to ``factor`` x ``base`` (default: the limit; from unlimited: what flowed,
        remembered as the ceiling), never below the floor. Nothing governed flowing is
        not what slows the reads: no cut then."""
        over = f"read p99 {p99 * 1e3:.2f} ms > SLO {self.slo_s * 1e3:g} ms"
        if measured <= 0:
            self.state = f"{over}, but no {self.name} traffic to cut"
            return self.rate
        if self.rate is None:
            self.ceiling = max(measured, self.floor)
            base = measured
        elif base is None:
            base = self.rate
        new = max(self.floor, base * factor)
        if self.rate is not None and new >= self.rate:
            self.state = f"{over}, at floor"
            return self.rate
        self._change(now, p99, new, f"cut: {over}{note}")
        self.cuts += 1
        return self.rate

    def _grow(self, p99: float | None, now: float, candidate: float, why: str, *,
              may_unlimit: bool = True) -> float | None:
        """Raise the (limited) rate to ``candidate``: at most the cap; with no cap,
        past the ceiling the limit would not bind and the rate is unlimited again
        (unless ``may_unlimit`` is False: it then stays a limit, past the ceiling)."""
        new: float | None = candidate
        if self.cap is not None:
            new = min(self.cap, candidate)
        elif may_unlimit and self.ceiling is not None and candidate >= self.ceiling:
            new = None
        if new == self.rate:
            self.state = "at cap"
            return self.rate
        self._change(now, p99, new, f"increase: {why}")
        self.increases += 1
        return self.rate

    def _change(self, now: float, p99: float | None, new: float | None, reason: str) -> None:
        self.decisions.append(Decision(now, self.name, p99, self.rate, new, reason))
        self.rate = new
        self.state = reason
