"""The latency-target control law and fair shares of a host rate (pure).

``TargetController`` steers one rate (checkpoint writes, or background work) so that
the read p99 sits just under the SLO, where the best static cap would put it, instead
of the saw-tooth of AIMD (halve, then creep back: about 3/4 of the best cap on
average, which is why it is the one law). Each control step, given the read p99 of
the samples taken since its last change (``r`` = p99 / SLO) and what the governed
lanes actually moved:

- ``r > 1`` (over the SLO): cut by ``max(0.5, 1 - (r - 1))``: a little when just
  over, by half when far over, from the limit (from what flowed while unlimited),
  never below the floor;
- ``HOLD_BELOW <= r <= 1``: hold: this is the operating point;
- ``r < HOLD_BELOW``: grow by ``1 + min(0.25, 2 (HOLD_BELOW - r))``; no reads at
  all (no evidence of interference): by 25 %; up to the static cap, or with no cap
  until it passes the ceiling (what flowed before the first cut), where the limit no
  longer binds and the rate is unlimited again — only while the read lane is idle:
  with reads flowing it stays a limit (an unlimited save is a burst the reads pay
  for before the next cut); and never while the governed traffic uses less than half
  the limit (between saves): the next save then starts at the operating point, not
  with a burst.

*When* a step may judge, and on which p99, is the other half of the law. Cut fast,
grow slowly, on different evidence:

- per-process governor (``enough_evidence``): a cut on 500 samples since the last
  change, growth only on 2,000 (or two windows), so the rate is not grown on the
  5th-slowest of a few hundred reads while rare device stalls set the tail;
- host governor (``host_judgement``): a cut when the p99 of the reads since the last
  change, in the last window (500 of them), or of all of them (up to
  ``history.HISTORY_S``), is over the SLO; growth only when *every* read since the
  last change, at least GROW_EVIDENCE of them over ``grow_hold_s(r)`` (GROW_HOLD_S
  near the target, down to MIN_GROW_HOLD_S far under it), has a p99 under
  HOLD_BELOW x SLO. One window's p99 (a few thousand reads, a handful of device
  stalls) often reads under the SLO at rates whose long-run p99 is over it (measured:
  docs/BENCHMARKS.md); the p99 of seconds of reads at one rate is that rate's tail.

Samples of the first SETTLE_PERIODS periods after a change are not counted (the
caller leaves them out): they still queued behind writes sent at the old rate, and
counting them cut again and again down to the floor.

Like io.latency and CoDel it acts on a latency target, not on loss, and its steps
shrink as the target is approached; the caller (the governor) supplies the dead time:
it decides only on samples taken after the previous change.

``fair_shares`` splits a host rate between the writers that have demand.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from isolane.lanes.rate_controller import RateController

HOLD_BELOW = 0.9  # the hold band is HOLD_BELOW-1 x SLO (0.8 held 58-70 % of the oracle)
MAX_CUT = 0.5
CUT_GAIN = 1.0
MAX_GROWTH = 0.25  # a step while the read lane is idle (no evidence of interference)
MAX_MEASURED_GROWTH = 0.25  # a step on a measured p99 under HOLD_BELOW x SLO
GROW_GAIN = 2.0
SETTLE_PERIODS = 2  # reads within this many governor periods after a change are left
# out of the next judgement: they queued behind writes sent at the old rate
CUT_EVIDENCE = 500  # KV gets since the last change before a p99 over the SLO cuts
GROW_EVIDENCE = 2000  # ... before a p99 under it lets the rate grow
GROW_WINDOWS = 2.0  # ... or this many read_p99_window_s, whichever comes first
MIN_USE = 0.5  # growth only while the governed traffic uses this much of the limit
GROW_HOLD_S = 1.0  # host law: seconds of reads at one rate before it may grow ...
MIN_GROW_HOLD_S = 0.5  # ... scaled by r / HOLD_BELOW (far under the target: sooner)


def enough_evidence(p99_s: float | None, slo_s: float, count: int, in_window: int,
                    since_change_s: float, window_s: float) -> bool:
    """Whether the target law may judge ``p99_s`` (of ``count`` samples taken since its
    last change, ``since_change_s`` ago; ``in_window`` samples in the last window).

    Asymmetric on purpose: a tail over the SLO is believed on CUT_EVIDENCE samples (a
    cut is safe), a tail under it only on GROW_EVIDENCE or GROW_WINDOWS windows: the
    p99 of a few hundred reads is its 5th-slowest read, and a device stall that hits
    one period in five would otherwise be missed four times and the rate grown into it."""
    if not in_window:
        return True  # the read lane is idle: no reads to wait for
    if not count or p99_s is None:
        return False  # reads exist, none since the last change: wait for its effect
    if p99_s > slo_s:
        return count >= CUT_EVIDENCE or since_change_s >= window_s
    return count >= GROW_EVIDENCE or since_change_s >= GROW_WINDOWS * window_s


@dataclass(frozen=True)
class Evidence:
    """The KV gets a judgement may use: their p99, how many, over how many seconds."""

    p99_s: float | None
    count: int
    span_s: float


def host_judgement(slo_s: float, recent: Evidence, held: Evidence, in_window: int,
                   window_s: float) -> tuple[bool, float | None, str]:
    """Whether the host's target law judges now, on which p99, and why (the state to
    show when it does not). ``recent``: the reads since the last change (settled) in
    the last window; ``held``: all of them, up to ``HISTORY_S``; ``in_window``: every
    read of the last window, before or after the change.

    Cut fast on evidence (either p99 over the SLO, on CUT_EVIDENCE reads or a whole
    window of them: a slow read lane may not do 500 in a window), grow slowly (every read at this
    rate, for GROW_HOLD_S, under HOLD_BELOW x SLO), hold otherwise."""
    if not in_window:
        return True, None, "read lane idle"
    if not recent.count or recent.p99_s is None or held.p99_s is None:
        return False, None, "waiting for reads taken after the last change"
    if recent.p99_s > slo_s and (recent.count >= CUT_EVIDENCE or recent.span_s >= window_s):
        return True, recent.p99_s, "recent p99 over the SLO"
    if held.p99_s > slo_s and (held.count >= CUT_EVIDENCE or held.span_s >= window_s):
        return True, held.p99_s, "held p99 over the SLO"
    if held.p99_s > slo_s:
        return False, None, (f"waiting: p99 {held.p99_s * 1e3:.2f} ms over the SLO on "
                             f"{held.count} reads, a cut needs {CUT_EVIDENCE}")
    if held.p99_s >= HOLD_BELOW * slo_s:
        return True, held.p99_s, "at the operating point"  # the law holds (and says so)
    hold_s = grow_hold_s(held.p99_s / slo_s)
    if held.span_s >= hold_s and held.count >= GROW_EVIDENCE and recent.p99_s <= slo_s:
        return True, held.p99_s, "every read at this rate under the target"
    return False, None, (f"holding: {held.count} reads over {held.span_s:.1f} s at this "
                         f"rate, p99 {held.p99_s * 1e3:.2f} ms; growth waits for "
                         f"{hold_s:.2g} s and {GROW_EVIDENCE} reads")


def grow_hold_s(ratio: float) -> float:
    """Seconds of reads at one rate, p99 at ``ratio`` x SLO, before the host law grows
    it: GROW_HOLD_S near the target (where one window's p99 misleads), less far
    under it (a tail at half the SLO is no near miss), never under MIN_GROW_HOLD_S."""
    return max(MIN_GROW_HOLD_S, GROW_HOLD_S * min(1.0, ratio / HOLD_BELOW))


class TargetController(RateController):
    """One governed rate (``None``: unlimited) under the latency-target law. Not
    thread-safe; the bookkeeping (``rate``, ``cuts``, ``state``, ``decisions``) is
    ``RateController``'s."""

    def __init__(self, *, slo_s: float, floor: float, cap: float | None,
                 decrease_factor: float = 0.5, name: str = "write") -> None:
        super().__init__(slo_s=slo_s, floor=floor, cap=cap,
                         decrease_factor=decrease_factor, name=name)
        # The deepest single cut: 0.5 by default; the background lane passes its square.
        self.max_cut = min(MAX_CUT, decrease_factor)

    def update(self, read_p99_s: float | None, now: float, measured_bytes_per_s: float,
               *, may_increase: bool = True) -> float | None:
        """One control step; returns the new rate (see the module docstring)."""
        ratio = None if read_p99_s is None else read_p99_s / self.slo_s
        if read_p99_s is not None and read_p99_s > self.slo_s:
            factor = max(self.max_cut, 1 - CUT_GAIN * (read_p99_s / self.slo_s - 1))
            # From the limit, not from what flowed: a save between its write phases
            # (staging, fsync, commit) moves less than the limit for a while, and cutting
            # that dip collapsed the rate to the floor in one step.
            return self._cut(read_p99_s, now, measured_bytes_per_s, factor=factor,
                             note=f" (x{factor:.2f})")
        if read_p99_s is not None and read_p99_s >= HOLD_BELOW * self.slo_s:
            self.state = (f"holding: read p99 {read_p99_s * 1e3:.2f} ms within "
                          f"{HOLD_BELOW:g}-1x SLO {self.slo_s * 1e3:g} ms")
            return self.rate
        if self._cannot_grow(may_increase) or self.rate is None:
            return self.rate
        if measured_bytes_per_s < MIN_USE * self.rate:
            # The limit does not bind (between saves, say): growing it would only let
            # the next save start with a burst the reads pay for.
            self.state = (f"holding: {self.name} traffic uses "
                          f"{measured_bytes_per_s / self.rate:.0%} of the limit")
            return self.rate
        growth = (MAX_GROWTH if ratio is None
                  else max(0.0, min(MAX_MEASURED_GROWTH, GROW_GAIN * (HOLD_BELOW - ratio))))
        candidate = self.rate * (1 + growth)
        why = ("read lane idle" if read_p99_s is None
               else f"read p99 {read_p99_s * 1e3:.2f} ms < {HOLD_BELOW:g}x SLO "
                    f"{self.slo_s * 1e3:g} ms")
        if candidate <= self.rate:
            return self.rate
        return self._grow(read_p99_s, now, candidate, why,
                          may_unlimit=read_p99_s is None)


def export_state(c: RateController) -> dict[str, Any]:
    return {"rate": c.rate, "ceiling": c.ceiling, "cuts": c.cuts,
            "increases": c.increases, "state": c.state[:120]}


def adopt_state(c: RateController, data: Any) -> None:
    """Continue from what the previous elected member published (checked: it comes
    from a shared file; anything malformed is ignored)."""
    if not isinstance(data, dict):
        return
    rate, ceiling = data.get("rate"), data.get("ceiling")
    if rate is None or (isinstance(rate, int | float) and rate > 0):
        new = None if rate is None else max(c.floor, float(rate))
        if c.cap is not None:
            new = c.cap if new is None else min(new, c.cap)
        c.rate = new
    if ceiling is None or (isinstance(ceiling, int | float) and ceiling > 0):
        c.ceiling = None if ceiling is None else float(ceiling)
    for name in ("cuts", "increases"):
        value = data.get(name)
        if isinstance(value, int) and value >= 0:
            setattr(c, name, value)
    if isinstance(data.get("state"), str):
        c.state = data["state"][:120]


def fair_shares(total: float | None, demands: dict[int, bool]) -> dict[int, float | None]:
    """Each member's share of a host rate: equal among those with demand (a member
    without demand is offered the share it would get on joining them)."""
    if total is None:
        return {key: None for key in demands}
    wanting = sum(1 for has in demands.values() if has)
    return {key: total / max(1, wanting + (0 if has else 1)) for key, has in demands.items()}
