"""The hint files of a reopen read ahead on a thread of their own.

A cold reopen of a large pool reads hundreds of MB of hints (46 B a block: 460 MB for
10M blocks). Read one by one on the reopening thread, the device waits while a hint is
decoded and the decoding waits while the next is read. ``HintReads`` reads them on one
thread, in the order the reopen loads them, at most ``window`` files ahead (that many
hints held in memory at once), asking the kernel to read ``window`` files further
ahead still (``POSIX_FADV_WILLNEED``); ``next`` hands the reopen each file's bytes, or
the ``OSError`` reading it raised (the reopen then scans that segment, as before).
Files are opened with ``O_NOFOLLOW`` (``read_nofollow``): a link is an error, never
followed.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from isolane.kvpool.log.segment_files import read_nofollow

__all__ = ["HintReads"]

_WINDOW = 8


THREAD_BYTES = 128 << 20
"""Hints of fewer bytes in all are read on the reopening thread (``threaded=False``):
measured at 1M blocks (46 MB of hints), the thread added more than it overlapped (cold
reopen 0.17 -> 0.21 s, and ~6 B a key of RSS its heap kept); at 10M (460 MB) it took
a cold reopen from 2.6 to 1.9 s."""


class HintReads:
    """Read ``paths`` (segment id, hint path), in that order, on a daemon thread (or,
    ``threaded=False``, each in ``next``, every file's read-ahead asked for up front);
    use as a context manager (leaving it stops the thread, also when not every file
    was taken)."""

    def __init__(self, paths: Sequence[tuple[int, Path]], window: int = _WINDOW,
                 threaded: bool = True) -> None:
        self._paths = list(paths)
        self._window = max(1, window)
        self._ready: queue.Queue[bytes | OSError] = queue.Queue(self._window)
        self._stop = threading.Event()
        self._taken = 0
        self._thread: threading.Thread | None = None
        if not threaded:
            for _, path in self._paths:
                _read_ahead(path)
            return
        self._thread = threading.Thread(target=self._run, name="isolane-hint-reads",
                                        daemon=True)
        self._thread.start()

    def next(self, segment_id: int) -> bytes | OSError:
        """The bytes of the next hint, which must be ``segment_id``'s (or the error)."""
        due = self._paths[self._taken][0] if self._taken < len(self._paths) else None
        if due != segment_id:
            raise ValueError(f"hint of segment {segment_id} asked out of order (next: "
                             f"{'none' if due is None else due})")
        self._taken += 1
        if self._thread is None:
            try:
                return read_nofollow(self._paths[self._taken - 1][1])
            except OSError as exc:
                return exc
        return self._ready.get()

    def _run(self) -> None:
        for path in [p for _, p in self._paths[:self._window]]:
            _read_ahead(path)
        for i, (_, path) in enumerate(self._paths):
            if i + self._window < len(self._paths):
                _read_ahead(self._paths[i + self._window][1])
            try:
                item: bytes | OSError = read_nofollow(path)
            except OSError as exc:
                item = exc
            while not self._stop.is_set():
                try:
                    self._ready.put(item, timeout=0.05)
                    break
                except queue.Full:
                    continue
            if self._stop.is_set():
                return

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> HintReads:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _read_ahead(path: Path) -> None:
    """Ask the kernel to start reading a hint file now (best effort)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)
