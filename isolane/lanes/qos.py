"""The governor: token buckets on the write and background lanes, set from the read
lane's measured p99 by the latency-target law of ``isolane.lanes.control``. With a
host lane plane, ``isolane.lanes.host_governor`` judges the host instead.

Pieces, from pure to threaded:

- ``TokenBucket``: a bytes-per-second limit with debt. Workers of a governed lane call
  ``consume(nbytes)`` before a job runs, so a throttled lane slows down its own
  workers and never the thread that submits a KV read.
- ``Governor``: two controllers and their buckets. Priority read > checkpoint write >
  background shows as the background lane being cut harder (the factor squared), to a
  lower floor, and given bandwidth back only once checkpoint writes are back at their
  ceiling. ``step`` is one control period; ``ensure_running`` starts a daemon thread
  that calls it every ``governor_period_s`` while the governor is alive.

A decision needs fresh evidence: after any change the next one looks only at read
samples recorded since, and only once there are enough of them
(``control.enough_evidence``), so a window still full of old slow samples does not cut
again and again. A clock that steps backwards resets that wait and the meter.
"""

from __future__ import annotations

import math
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

from isolane.config import QosConfig
from isolane.errors import InvalidArgumentError
from isolane.lanes.control import (
    CUT_EVIDENCE,
    SETTLE_PERIODS,
    TargetController,
    enough_evidence,
)
from isolane.lanes.decisions import DECISIONS_KEPT, round_rate
from isolane.lanes.forksafe import ForkSafe
from isolane.lanes.metrics import LatencyWindow
from isolane.storage.pacing import slice_for

Clock = Callable[[], float]
DEFAULT_BURST_BYTES = 32 << 20
BURST_S = 0.02  # a governed bucket's burst, in seconds of its rate
MIN_EVIDENCE = CUT_EVIDENCE  # (kept name) KV gets before the target law may cut


class TokenBucket(ForkSafe):
    """A bytes-per-second limit (``None``: unlimited) that lets any job through.

    ``reserve`` takes the tokens at once and may leave the bucket in debt: a 64 MiB
    chunk passes a 32 MiB burst and the caller (and whoever reserves next) waits the
    debt off, so the long-run rate holds without refusing big jobs. Thread-safe.
    """

    def __init__(self, rate_bytes_per_s: float | None, burst_bytes: int = DEFAULT_BURST_BYTES,
                 *, clock: Clock = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        _check_rate("rate_bytes_per_s", rate_bytes_per_s)
        if burst_bytes < 1:
            raise InvalidArgumentError(f"burst_bytes must be >= 1, got {burst_bytes}")
        self.burst_bytes = burst_bytes
        self._rate = rate_bytes_per_s
        self._clock = clock
        self._sleep = sleep
        self._tokens = float(burst_bytes)
        self._last = clock()
        self.consumed_bytes = 0  # every byte reserved: the governor's throughput meter
        self.waited_s = 0.0
        self._lock = threading.Lock()
        super().__init__()

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()

    @property
    def rate(self) -> float | None:
        return self._rate

    def set_rate(self, rate_bytes_per_s: float | None, *,
                 burst_bytes: int | None = None) -> None:
        """Change the limit; tokens earned so far are kept (at the old rate), up to the
        new ``burst_bytes`` if one is given."""
        _check_rate("rate_bytes_per_s", rate_bytes_per_s)
        with self._lock:
            self._refill(self._clock())
            self._rate = rate_bytes_per_s
            if burst_bytes is not None and burst_bytes >= 1:
                self.burst_bytes = burst_bytes
                self._tokens = min(self._tokens, float(burst_bytes))


    def _refill(self, now: float) -> None:
        if self._rate is None:
            self._tokens = float(self.burst_bytes)
        else:
            self._tokens = min(float(self.burst_bytes),
                               self._tokens + (now - self._last) * self._rate)
        self._last = now

    def reserve(self, nbytes: int) -> float:
        """Take ``nbytes`` of tokens now; return how long the caller must wait."""
        with self._lock:
            self._refill(self._clock())
            self.consumed_bytes += nbytes
            if self._rate is None:
                return 0.0
            self._tokens -= nbytes
            return -self._tokens / self._rate if self._tokens < 0 else 0.0

    def consume(self, nbytes: int) -> float:
        """``reserve`` and sleep off the wait; returns the seconds slept."""
        wait = self.reserve(nbytes)
        if wait > 0:
            self._sleep(wait)
            with self._lock:
                self.waited_s += wait
        return wait


def _check_rate(name: str, rate: float | None) -> None:
    if rate is not None and not rate > 0:
        raise InvalidArgumentError(f"{name} must be positive bytes per second or None "
                                   f"(unlimited), got {rate}")


def governed_burst(rate: float | None) -> int | None:
    """The burst a governed bucket gets at ``rate``: about BURST_S of it, at least one
    write slice, at most DEFAULT_BURST_BYTES. A writer that paused (between saves,
    say) then resumes at the rate instead of dumping 32 MiB at the device at once,
    which is what a KV read queued behind it would pay for. None: unlimited."""
    if rate is None:
        return None
    return int(min(DEFAULT_BURST_BYTES, max(slice_for(rate), rate * BURST_S)))


class Governor(ForkSafe):
    """Drives the write and background buckets from a latency window: the scheduler
    passes the read lane's KV gets (KV puts share the lane but are not the signal).

    ``step`` is one control period and may be called directly (tests pass their own
    clock); ``ensure_running`` starts the daemon thread that calls it every period.
    The thread holds only a weak reference, so a scheduler nobody uses is collected
    and its governor thread ends; ``stop`` ends it at once.
    """

    def __init__(self, qos: QosConfig, read: LatencyWindow, write_bucket: TokenBucket,
                 background_bucket: TokenBucket, *, clock: Clock = time.monotonic) -> None:
        self.qos = qos
        slo_s = qos.read_p99_slo_ms / 1e3
        share = qos.background_share
        self.write = TargetController(
            name="write", slo_s=slo_s, floor=qos.write_bandwidth_min,
            cap=qos.write_bandwidth_max, decrease_factor=qos.decrease_factor)
        self.background = TargetController(
            name="background", slo_s=slo_s, floor=qos.write_bandwidth_min * share, cap=None,
            decrease_factor=qos.decrease_factor ** 2)
        self.read = read
        self.write_bucket = write_bucket
        self.background_bucket = background_bucket
        write_bucket.set_rate(self.write.rate)
        background_bucket.set_rate(self.background.rate)
        self.clock = clock
        self.read_p99_s: float | None = None
        self.steps = 0
        self._last_cut = -math.inf  # the last change that later decisions must see past
        self._last_now = -math.inf
        self._meter: deque[tuple[float, int, int]] = deque()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        super().__init__()

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None

    # -- control ---------------------------------------------------------------------------
    def step(self, now: float | None = None) -> None:
        """One control period: read the read lane's p99, update both rates."""
        with self._lock:
            now = self.clock() if now is None else now
            self._observe_clock(now)
            self.steps += 1
            window_s = self.qos.read_p99_window_s
            write_bps, background_bps = self._measure(now, window_s)
            settled = self._last_cut + SETTLE_PERIODS * self.qos.governor_period_s
            recent = self.read.summary(now, since=max(now - window_s, settled))
            in_window = self.read.summary(now, since=now - window_s).count
            if not recent.count and in_window:
                return  # reads exist, but none since the last change: wait for its effect
            if not enough_evidence(
                    recent.p99_s, self.write.slo_s, recent.count, in_window,
                    now - self._last_cut, window_s):
                return  # too few samples since the last change for this p99
            self._apply(now, recent.p99_s, write_bps, background_bps)
            self._set_buckets(self.write.rate, self.background.rate)

    def _set_buckets(self, write: float | None, background: float | None) -> None:
        """Each bucket's burst is shaped to its rate (``governed_burst``)."""
        self.write_bucket.set_rate(write, burst_bytes=governed_burst(write))
        self.background_bucket.set_rate(background, burst_bytes=governed_burst(background))

    def _apply(self, now: float, p99: float | None, write_bps: float,
               background_bps: float) -> bool:
        """Run both controllers on ``p99``; True when a rate changed (the next
        decision then waits for evidence taken after it)."""
        self.read_p99_s = p99
        before = self._changes()
        self.write.update(p99, now, write_bps)
        self.background.update(p99, now, background_bps, may_increase=self.write.at_ceiling)
        changed = self._changes() > before
        if changed:
            self._last_cut = now
        return changed

    def _changes(self) -> int:
        return (self.write.cuts + self.background.cuts
                + self.write.increases + self.background.increases)

    def _observe_clock(self, now: float) -> None:
        """A clock that went backwards voids the meter and the wait for evidence
        (both compare with earlier times), so control goes on instead of stalling."""
        if now < self._last_now:
            self._meter.clear()
            self._last_cut = -math.inf
        self._last_now = now

    def _measure(self, now: float, window_s: float) -> tuple[float, float]:
        """Governed bytes per second of each bucket over about the last window."""
        self._meter.append((now, self.write_bucket.consumed_bytes,
                            self.background_bucket.consumed_bytes))
        while len(self._meter) > 2 and now - self._meter[1][0] >= window_s:
            self._meter.popleft()
        then, write0, background0 = self._meter[0]
        if now <= then:
            return 0.0, 0.0
        return ((self._meter[-1][1] - write0) / (now - then),
                (self._meter[-1][2] - background0) / (now - then))

    # -- thread ----------------------------------------------------------------------------
    def ensure_running(self) -> None:
        """Start the control thread unless it runs (cheap: called on every submit)."""
        if self._thread is not None:
            return
        with self._lock:
            if self._thread is not None:
                return
            self._stop = threading.Event()
            thread = threading.Thread(
                target=_run, args=(weakref.ref(self), self._stop, self.qos.governor_period_s),
                name="isolane-governor", daemon=True)
            thread.start()
            self._thread = thread

    def stop(self) -> None:
        """End the control thread (a later ``ensure_running`` starts a new one)."""
        with self._lock:
            thread, self._thread = self._thread, None
            self._stop.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- reporting -------------------------------------------------------------------------
    def stats(self, now: float | None = None) -> dict[str, Any]:
        now = self.clock() if now is None else now
        with self._lock:
            decisions = sorted([*self.write.decisions, *self.background.decisions],
                               key=lambda d: d.at_s)[-DECISIONS_KEPT:]
            return {
                "read_p99_ms": None if self.read_p99_s is None
                else round(self.read_p99_s * 1e3, 3),
                "write_rate_bytes_per_s": round_rate(self.write.rate),
                "background_rate_bytes_per_s": round_rate(self.background.rate),
                "floor_bytes_per_s": round_rate(self.write.floor),
                "background_floor_bytes_per_s": round_rate(self.background.floor),
                "cap_bytes_per_s": round_rate(self.write.cap),
                "write_state": self.write.state,
                "background_state": self.background.state,
                "cuts": self.write.cuts + self.background.cuts,
                "increases": self.write.increases + self.background.increases,
                "steps": self.steps,
                "running": self.running,
                "decisions": [d.as_dict(now) for d in decisions],
            }


def _run(ref: weakref.ref[Governor], stop: threading.Event, period_s: float) -> None:
    while not stop.wait(period_s):
        governor = ref()
        if governor is None:
            return  # its scheduler was collected
        governor.step()
        del governor
