"""A node's load report: in-flight requests and bytes, recent bytes/s (pure: the
caller passes the time).

``ByteRate`` counts bytes in one-second slots over a sliding window; ``Load`` holds a
node's counters behind one lock. ``lane_latency_ms`` reads a lane's percentiles out of
``LaneScheduler.stats()`` whatever shape that has (keys may be missing).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class ByteRate:
    """Bytes per second over the last ``window_s`` whole seconds."""

    def __init__(self, window_s: int = 10) -> None:
        self.window_s = window_s
        self._slots = [0] * window_s
        self._second = [-1] * window_s

    def add(self, nbytes: int, now: float) -> None:
        second = int(now)
        i = second % self.window_s
        if self._second[i] != second:
            self._second[i], self._slots[i] = second, 0
        self._slots[i] += nbytes

    def per_s(self, now: float) -> float:
        second = int(now)
        total = sum(n for n, s in zip(self._slots, self._second, strict=True)
                    if second - self.window_s < s <= second)
        return total / self.window_s


@dataclass
class LoadSnapshot:
    requests: int
    bytes_in_flight: int
    bytes_in_per_s: float
    bytes_out_per_s: float
    bytes_in_total: int
    bytes_out_total: int


class Load:
    """Thread-safe counters of one node."""

    def __init__(self, window_s: int = 10) -> None:
        self._lock = threading.Lock()
        self.requests = 0
        self.bytes_in_flight = 0
        self.bytes_in_total = 0
        self.bytes_out_total = 0
        self._in = ByteRate(window_s)
        self._out = ByteRate(window_s)

    def request_started(self) -> None:
        with self._lock:
            self.requests += 1

    def request_finished(self) -> None:
        with self._lock:
            self.requests -= 1

    def hold(self, nbytes: int) -> None:
        """Bytes a handler holds in memory (received, not yet stored; or read, not yet sent)."""
        with self._lock:
            self.bytes_in_flight += nbytes

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_in_flight -= nbytes

    def received(self, nbytes: int, now: float) -> None:
        with self._lock:
            self.bytes_in_total += nbytes
            self._in.add(nbytes, now)

    def sent(self, nbytes: int, now: float) -> None:
        with self._lock:
            self.bytes_out_total += nbytes
            self._out.add(nbytes, now)

    def snapshot(self, now: float) -> LoadSnapshot:
        with self._lock:
            return LoadSnapshot(self.requests, self.bytes_in_flight, self._in.per_s(now),
                                self._out.per_s(now), self.bytes_in_total,
                                self.bytes_out_total)


def lane_latency_ms(lane: Mapping[str, Any]) -> dict[str, float | None]:
    """``{"p50", "p99", "p999"}`` in ms from one lane's stats; None where absent."""
    found = lane.get("latency_ms")
    source: Mapping[str, Any] = found if isinstance(found, Mapping) else {}
    out: dict[str, float | None] = {}
    for name in ("p50", "p99", "p999"):
        value = source.get(name, lane.get(f"{name}_ms"))
        out[name] = float(value) if isinstance(value, int | float) else None
    return out
