"""Terminal output helpers: byte sizes, rates, and a progress bar with GB/s.

Imports nothing heavy: ``isolane --help`` loads this module.
"""

from __future__ import annotations

import threading
import time
from types import TracebackType
from typing import TextIO

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(nbytes: float) -> str:
    """``1536`` -> ``1.5 KiB`` (binary units, as config sizes are written)."""
    value = float(nbytes)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def gb_per_s(nbytes: float, seconds: float) -> float:
    """Decimal GB/s (1e9 bytes a second); 0 when no time was measured."""
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def rate_text(nbytes: float, seconds: float) -> str:
    return f"{gb_per_s(nbytes, seconds):.2f} GB/s"


class ProgressBar:
    """Renders ``(bytes_done, bytes_total)`` callbacks as one line with GB/s.

    Pass it as the library's ``progress`` callback. Thread-safe (callbacks may come from
    lane threads); redraws at most every ``interval_s``. ``stream=None`` makes it a
    no-op, which is what the CLI uses when stderr is not a terminal or with ``--quiet``.
    Use as a context manager: leaving it erases the line, so the summary that follows
    stands alone.
    """

    def __init__(self, label: str, stream: TextIO | None, *, width: int = 24,
                 interval_s: float = 0.1) -> None:
        self.label = label
        self.stream = stream
        self.width = width
        self.interval_s = interval_s
        self._start = time.perf_counter()
        self._last_draw = 0.0
        self._drawn = False
        self._lock = threading.Lock()

    def __call__(self, done: int, total: int) -> None:
        if self.stream is None:
            return
        with self._lock:
            now = time.perf_counter()
            if done < total and now - self._last_draw < self.interval_s:
                return
            self._last_draw = now
            self.stream.write("\r" + self.render(done, total, now - self._start))
            self.stream.flush()
            self._drawn = True

    def render(self, done: int, total: int, elapsed_s: float) -> str:
        """The bar as text (pure: also what the tests check)."""
        fraction = min(1.0, done / total) if total > 0 else 1.0
        filled = round(fraction * self.width)
        bar = "#" * filled + "." * (self.width - filled)
        return (f"{self.label} [{bar}] {fraction * 100:3.0f}%  "
                f"{human_bytes(done)} / {human_bytes(total)}  {rate_text(done, elapsed_s)}")

    def close(self) -> None:
        if self.stream is None:
            return
        with self._lock:
            if self._drawn:
                self.stream.write("\r\x1b[2K")
                self.stream.flush()
                self._drawn = False

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
