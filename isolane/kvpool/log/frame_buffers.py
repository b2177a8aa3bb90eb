"""Reusable frame buffers of one segment log, shared by every thread that appends.

A batch of small values is framed into one contiguous buffer (``framing.frame_puts``).
Fresh memory is faulted in page by page on its first use (about 1 µs a 4 KiB block), so
the log keeps the buffers of recent batches for the next ones: at most ``keep`` of
them, shared by the appending threads, the most recently used handed out first (one
buffer a thread would hold four frames of 17 MB for the pool's four put-lane threads at
batches of 4096 4 KiB blocks, used in turn). A thread that finds none free frames into
fresh memory, and that memory is kept for the next batch.
"""

from __future__ import annotations

import threading

import numpy as np
import numpy.typing as npt

from isolane.kvpool.log.framing import FRAME_SCRATCH_MAX

__all__ = ["FrameBuffers"]

Frame = npt.NDArray[np.uint8]


class FrameBuffers:
    """At most ``keep`` reusable frame buffers (see the module docstring). Thread-safe."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._free: list[Frame] = []  # most recently given back last
        self._lock = threading.Lock()

    def take(self) -> Frame | None:
        """A buffer no other thread holds, or None: frame into fresh memory."""
        with self._lock:
            return self._free.pop() if self._free else None

    def give(self, buffer: Frame | None) -> None:
        """Keep ``buffer`` (a frame's whole buffer, now written) for a later batch; the
        smallest kept one goes when ``keep`` are kept already. Buffers over
        ``FRAME_SCRATCH_MAX`` are not kept."""
        if buffer is None or not 0 < len(buffer) <= FRAME_SCRATCH_MAX:
            return
        with self._lock:
            if any(b is buffer for b in self._free):
                return
            self._free.append(buffer)
            if len(self._free) > self.keep:  # by position: == on arrays compares bytes
                del self._free[min(range(len(self._free)), key=lambda i: len(self._free[i]))]

    def kept(self) -> list[Frame]:
        """The buffers kept now (for tests and stats)."""
        with self._lock:
            return list(self._free)
