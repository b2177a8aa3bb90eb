"""The governor judged on the host: every process's KV reads, every process's writes.

``HostGovernor`` is the ``Governor`` of a scheduler that joined its config's host lane
plane (``isolane.lanes.plane``). Each control period every member:

1. publishes its slot: heartbeat, its KV get latencies per epoch, its write and
   background demand (bytes queued or in flight) and measured rates, its limits;
2. reads the live members; the lowest-numbered live member that governs is the
   **elected** one. It alone runs the control law on the host: the read p99 of all
   members' KV gets since its last change (merged histograms; the last window's to
   cut on, and every one since the change, kept for seconds in
   ``history.HostHistory``, to grow on: ``control.host_judgement``), against the
   summed write rates, and publishes the host write and background rates in the plane's
   governor block (with its controllers' state, so a successor continues from there);
3. sets its own buckets to its fair share: the host rate split equally between the
   members with demand (``isolane.lanes.control.fair_shares``). The floor
   ``write_bandwidth_min`` and the cap hold for the host total.

Why one elected member rather than AIMD in every writer: N writers each cutting on
the same signal cut the host N times for one breach and oscillate against each
other; one controller sees the summed rate and decides once, and the split is
exact and fair by construction. Election needs no messages: the lowest live slot,
recomputed each period, so a killed leader is replaced one period later.

A member alone on the host is its own elected member: it behaves as the
per-process governor. A plane with all slots taken leaves this member governing
itself alone (``joined`` False).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from isolane.config import QosConfig
from isolane.lanes.control import (
    GROW_EVIDENCE,
    MIN_USE,
    SETTLE_PERIODS,
    Evidence,
    adopt_state,
    export_state,
    fair_shares,
    grow_hold_s,
    host_judgement,
)
from isolane.lanes.decisions import DECISIONS_KEPT, round_rate
from isolane.lanes.epochs import EpochHistograms, epoch_span, merge_epochs
from isolane.lanes.histogram import quantile_us, summary_ms
from isolane.lanes.history import HostHistory
from isolane.lanes.memory import Settled, recall, remember
from isolane.lanes.metrics import LatencyWindow
from isolane.lanes.plane import HostPlane, Member
from isolane.lanes.plane_format import EPOCH_S, EPOCHS, FLAG_GOVERNS, SlotRecord
from isolane.lanes.qos import Clock, Governor, TokenBucket

HOST_DECISIONS_KEPT = 8  # in the plane's governor block (it is 3.8 KiB)
REMEMBER_EVERY_S = 5.0  # rewrite an unchanged settled limit this often (its age)
REMEMBER_CHANGE = 0.02  # ... and a changed one at once when it moved by more


@dataclass(frozen=True)
class LocalState:
    """What this process tells the plane about itself besides latencies."""

    roles: int
    threads: tuple[int, int, int]
    write_demand: int
    background_demand: int


def window_epochs(window_s: float) -> int:
    return max(1, min(EPOCHS - 1, round(window_s / EPOCH_S)))


def host_latency(members: list[Member], now: float, window_s: float,
                 since_s: float = -math.inf) -> tuple[Any, int]:
    """The merged KV get histogram of the fresh members over the window (only epochs
    that start at or after ``since_s``) and its count."""
    first, last = epoch_span(now, window_epochs(window_s), since_s)
    counts = merge_epochs((m.record for m in members if m.fresh), first, last)
    return counts, int(counts.sum())


class HostGovernor(Governor):
    """A ``Governor`` whose signal and rates are the host's (see the module doc)."""

    def __init__(self, qos: QosConfig, read: LatencyWindow, write_bucket: TokenBucket,
                 background_bucket: TokenBucket, *, plane: HostPlane,
                 local: Callable[[], LocalState], clock: Clock = time.monotonic) -> None:
        super().__init__(qos, read, write_bucket, background_bucket, clock=clock)
        self.plane = plane
        self.local = local
        self.epochs = EpochHistograms()
        self.history = HostHistory()  # the host's reads over seconds, while elected
        read.listeners.append(self.epochs.record)
        self.leading = False
        self.joined = False
        self.host_write_rate: float | None = self.write.rate
        self.host_background_rate: float | None = self.background.rate
        self.members_seen = 0
        self.writers_with_demand = 0
        self._host_decisions: list[dict[str, Any]] = []
        self.warm_start: float | None = None  # the remembered limit this one started at
        self._remembered: tuple[float, float] | None = None  # (limit, wall s) written
        self._held_ok = False  # the last judgement: every read at this rate held the SLO

    def _after_fork_in_child(self) -> None:
        super()._after_fork_in_child()
        self.leading = False
        self.joined = False

    # -- control ---------------------------------------------------------------------------
    def step(self, now: float | None = None) -> None:
        with self._lock:
            now = self.clock() if now is None else now
            self._observe_clock(now)
            self.steps += 1
            write_bps, background_bps = self._measure(now, self.qos.read_p99_window_s)
            if self.plane.check() or self.plane.slot is None:
                self.joined = self.plane.join(now) is not None
            if not self.joined:
                self._step_alone(now, write_bps, background_bps)
                return
            self._publish(now, write_bps, background_bps)
            members = self.plane.members(now)
            self.members_seen = len(members)
            mine = self.plane.slot
            governing = [m.index for m in members if m.fresh and m.record.flags & FLAG_GOVERNS]
            block = self.plane.read_governor()
            if governing and min(governing) == mine:
                self._lead(now, members, block)
            else:
                self.leading = False
                self._follow(block)
            self._take_share(members)

    def _step_alone(self, now: float, write_bps: float, background_bps: float) -> None:
        """No slot: govern this process on its own reads, as without a plane."""
        window_s = self.qos.read_p99_window_s
        recent = self.read.summary(now, since=max(now - window_s, self._last_cut))
        if recent.count or not self.read.summary(now, since=now - window_s).count:
            self._apply(now, recent.p99_s, write_bps, background_bps)
        self._set_buckets(self.write.rate, self.background.rate)

    def _publish(self, now: float, write_bps: float, background_bps: float) -> None:
        state = self.local()
        epochs, bins = self.epochs.snapshot()
        self.plane.publish(SlotRecord(
            heartbeat_s=now, roles=state.roles, flags=FLAG_GOVERNS,
            threads=state.threads, write_demand=state.write_demand,
            background_demand=state.background_demand, write_bps=write_bps,
            background_bps=background_bps, write_limit=self.write_bucket.rate,
            background_limit=self.background_bucket.rate, kv_gets=self.epochs.total,
            epochs=epochs, bins=bins))

    def _lead(self, now: float, members: list[Member], block: dict[str, Any] | None) -> None:
        if not self.leading:  # just elected: continue from the previous member's state
            self.leading = True
            self.history.clear()
            if block is not None:
                adopt_state(self.write, block.get("write"))
                adopt_state(self.background, block.get("background"))
                changed = block.get("changed_s")
                if isinstance(changed, int | float) and changed <= now:
                    self._last_cut = float(changed)
                decisions = block.get("decisions")
                if isinstance(decisions, list):
                    self._host_decisions = [d for d in decisions if isinstance(d, dict)][
                        -HOST_DECISIONS_KEPT:]
            else:  # a fresh plane: start from the last settled limit, if remembered
                self._warm_start(now)
        self._held_ok = False
        window_s = self.qos.read_p99_window_s
        fresh = [m for m in members if m.fresh]
        write_bps = sum(m.record.write_bps for m in fresh)
        background_bps = sum(m.record.background_bps for m in fresh)
        self.history.update((m.record for m in fresh), now)
        settled = self._last_cut + SETTLE_PERIODS * self.qos.governor_period_s
        recent, count = host_latency(members, now, window_s, settled)
        _all, in_window = host_latency(members, now, window_s)
        p99_us = quantile_us(recent, 0.99) if count else None
        decide = True
        if not count and in_window:
            decide = False  # reads exist, none since the last change: wait for its effect
        else:
            decide, judged, why = self._judge(now, settled, recent, count, in_window)
            p99_us = None if judged is None else judged * 1e6
            if not decide:
                self.write.state = why
                if count:  # what the host reads look like, though the law waits
                    self.read_p99_s = (quantile_us(recent, 0.99) or 0) / 1e6
        rate = self.write.rate
        if self._held_ok and decide and rate is not None and write_bps >= MIN_USE * rate:
            self._settled(rate)  # the rate these reads were taken at, and it bound
        if decide:
            before = len(self.write.decisions) + len(self.background.decisions)
            self._apply(now, None if p99_us is None else p99_us / 1e6, write_bps,
                        background_bps)
            fresh_decisions = sorted([*self.write.decisions, *self.background.decisions],
                                     key=lambda d: d.at_s)
            added = len(self.write.decisions) + len(self.background.decisions) - before
            for decision in fresh_decisions[len(fresh_decisions) - max(0, added):]:
                self._host_decisions.append({
                    "at_s": decision.at_s, "lane": decision.lane,
                    "p99_ms": None if decision.read_p99_s is None
                    else round(decision.read_p99_s * 1e3, 3),
                    "old": round_rate(decision.old_rate), "new": round_rate(decision.new_rate),
                    "reason": decision.reason[:80], "pid": os.getpid()})
            self._host_decisions = self._host_decisions[-HOST_DECISIONS_KEPT:]
        self.host_write_rate = self.write.rate
        self.host_background_rate = self.background.rate
        self.plane.write_governor({
            "pid": os.getpid(), "slot": self.plane.slot, "updated_s": now,
            "changed_s": None if self._last_cut == -math.inf else self._last_cut,
            "read_p99_ms": None if self.read_p99_s is None else round(self.read_p99_s * 1e3, 3),
            "write": export_state(self.write), "background": export_state(self.background),
            "steps": self.steps, "decisions": self._host_decisions,
            "warm_start": self.warm_start,
        })

    def _judge(self, now: float, settled: float, recent: Any, count: int,
               in_window: int) -> tuple[bool, float | None, str]:
        """The target law's evidence on the host: the last window since the change
        (``recent``) and every read since it (the long history)."""
        held, held_count = self.history.since(settled, now)
        held_p99 = quantile_us(held, 0.99) if held_count else None
        recent_p99 = quantile_us(recent, 0.99) if count else None
        span = min(now - settled, self.history.keep_epochs * EPOCH_S)
        slo_s = self.write.slo_s
        # Settled (worth remembering): the evidence growth needs, every read at this
        # rate for grow_hold_s, within the SLO (at the operating point or under it).
        self._held_ok = (held_p99 is not None and held_p99 / 1e6 <= slo_s
                         and recent_p99 is not None and recent_p99 / 1e6 <= slo_s
                         and held_count >= GROW_EVIDENCE
                         and span >= grow_hold_s(held_p99 / 1e6 / slo_s))
        return host_judgement(
            slo_s,
            Evidence(None if recent_p99 is None else recent_p99 / 1e6, count,
                     min(span, self.qos.read_p99_window_s)),
            Evidence(None if held_p99 is None else held_p99 / 1e6, held_count, span),
            in_window, self.qos.read_p99_window_s)

    # -- warm start ----------------------------------------------------------------------
    def _warm_start(self, now: float) -> None:
        """Elected on a fresh plane: start the host write rate at the last settled
        limit remembered beside the plane (``isolane.lanes.memory``), not unlimited."""
        found = recall(self.plane.path, self.plane.digest, slo_s=self.write.slo_s,
                       now_s=time.time())
        if found is None:
            return
        before = self.write.rate
        self.write.start_from(now, found.limit, found.ceiling,
                              f"the last settled host limit {found.limit / 1e6:.0f} MB/s "
                              f"(SLO {found.slo_s * 1e3:g} ms)")
        if self.write.rate == before:
            return
        self.warm_start = self.write.rate
        self._last_cut = now  # judged on the reads taken at it, like any change
        self._host_decisions.append({
            "at_s": now, "lane": "write", "p99_ms": None, "old": round_rate(before),
            "new": round_rate(self.write.rate),
            "reason": self.write.state[:80], "pid": os.getpid()})

    def _settled(self, limit: float) -> None:
        """``limit`` held the SLO for a hold window: write it as the host's settled
        limit, at once when it moved, else every REMEMBER_EVERY_S (so its age stays
        that of the last good evidence)."""
        wall = time.time()
        if self._remembered is not None:
            last, at = self._remembered
            if abs(limit - last) <= REMEMBER_CHANGE * last and wall - at < REMEMBER_EVERY_S:
                return
        ceiling = self.write.ceiling
        if remember(self.plane.path, self.plane.digest,
                    Settled(limit, ceiling, self.write.slo_s, wall)):
            self._remembered = (limit, wall)

    def _follow(self, block: dict[str, Any] | None) -> None:
        """Take the host rates the elected member published (checked: shared file)."""
        if block is None:
            return
        for name in ("write", "background"):
            part = block.get(name)
            rate = part.get("rate") if isinstance(part, dict) else None
            if rate is not None and not (isinstance(rate, int | float) and rate > 0):
                continue
            value = None if rate is None else float(rate)
            if name == "write":
                self.host_write_rate = value
                adopt_state(self.write, part)
            else:
                self.host_background_rate = value
                adopt_state(self.background, part)
        p99 = block.get("read_p99_ms")
        self.read_p99_s = p99 / 1e3 if isinstance(p99, int | float) else None
        decisions = block.get("decisions")
        if isinstance(decisions, list):
            self._host_decisions = [d for d in decisions if isinstance(d, dict)]
        changed = block.get("changed_s")
        if isinstance(changed, int | float):
            self._last_cut = float(changed)
        warm = block.get("warm_start")
        self.warm_start = float(warm) if isinstance(warm, int | float) and warm > 0 else None

    def _take_share(self, members: list[Member]) -> None:
        mine = self.plane.slot
        fresh = [m for m in members if m.fresh]
        if mine is not None and all(m.index != mine for m in fresh):
            fresh.append(Member(mine, SlotRecord(), True, True))
        write_demand = {m.index: m.record.write_demand > 0 or m.record.write_bps > 0
                        for m in fresh}
        background_demand = {m.index: m.record.background_demand > 0
                             or m.record.background_bps > 0 for m in fresh}
        self.writers_with_demand = sum(write_demand.values())
        write = fair_shares(self.host_write_rate, write_demand)
        background = fair_shares(self.host_background_rate, background_demand)
        key = -1 if mine is None else mine
        self._set_buckets(write.get(key, self.host_write_rate),
                          background.get(key, self.host_background_rate))

    # -- thread and reporting ----------------------------------------------------------
    def stop(self) -> None:
        super().stop()
        self.plane.leave()
        self.joined = False
        self.leading = False

    def stats(self, now: float | None = None) -> dict[str, Any]:
        out = super().stats(now)
        now = self.clock() if now is None else now
        out.update({
            "write_rate_bytes_per_s": round_rate(self.write_bucket.rate),
            "background_rate_bytes_per_s": round_rate(self.background_bucket.rate),
            "host": {
                "plane": str(self.plane.path), "joined": self.joined,
                "slot": self.plane.slot, "elected": self.leading,
                "members": self.members_seen,
                "writers_with_demand": self.writers_with_demand,
                "warm_start_bytes_per_s": round_rate(self.warm_start),
                "write_rate_bytes_per_s": round_rate(self.host_write_rate),
                "background_rate_bytes_per_s": round_rate(self.host_background_rate),
                "decisions": [{**d, "age_s": round(now - float(d.get("at_s", now)), 3)}
                              for d in self._host_decisions][-DECISIONS_KEPT:],
            },
        })
        return out


def host_read_latency(members: list[Member], now: float, window_s: float) -> dict[str, Any]:
    """JSON-able host p50/p99/p999 (ms) of the fresh members' KV gets over the window."""
    counts, _count = host_latency(members, now, window_s)
    return summary_ms(counts)
