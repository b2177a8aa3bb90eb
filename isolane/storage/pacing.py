"""I/O pacing: a thread's byte-rate limiter, consulted by the blob stores per write.

A lane that meters its jobs (the governor's token bucket) installs the bucket around
each job with ``paced_by``; ``LocalBlobStore`` then writes in slices of
``slice_for(rate)`` (1-4 MiB, smaller at lower rates) and asks ``pace`` before each
one. A metered 32 MiB chunk thus reaches the device as 1-4 MiB writes spread over
time, not one burst that KV reads queue behind. Bytes a job does not pace itself are
charged when it ends (``paced_by``), so the rate holds for every store.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

SLICE_BYTES = 4 << 20  # the largest slice (at high rates)
MIN_SLICE_BYTES = 1 << 20  # the smallest (a multiple of 4 KiB: O_DIRECT stays aligned)
SLICE_S = 0.005  # a slice is about this much of the pacer's rate


def slice_for(rate: float) -> int:
    """The write slice at ``rate`` bytes/s: ~SLICE_S of it in whole MiB, 1-4 MiB. A KV
    read that lands behind a slice on the device waits for it: at a low rate the slices
    are few anyway, so they are made small (a 1 MiB write costs a queued read ~0.6 ms
    on a 1.8 GB/s disk, a 4 MiB one ~2.3 ms)."""
    whole = int(rate * SLICE_S) // MIN_SLICE_BYTES * MIN_SLICE_BYTES
    return max(MIN_SLICE_BYTES, min(SLICE_BYTES, whole))


class Pacer(Protocol):
    @property
    def rate(self) -> float | None:
        """Bytes a second, or None: unlimited (then writes are not sliced)."""

    def consume(self, nbytes: int) -> float:
        """Wait until ``nbytes`` may go; returns the seconds waited."""


class _State(threading.local):
    pacer: Pacer | None = None
    paced: int = 0
    waited: float = 0.0


_state = _State()


def slice_bytes() -> int | None:
    """How much to write a call while this thread is paced; None: no pacing."""
    pacer = _state.pacer
    rate = None if pacer is None else pacer.rate
    return None if rate is None else slice_for(rate)


def pace(nbytes: int) -> None:
    """Wait for ``nbytes`` of this thread's pacer (no-op when unpaced)."""
    pacer = _state.pacer
    if pacer is not None:
        _state.waited += pacer.consume(nbytes)
        _state.paced += nbytes


@contextmanager
def paced_by(pacer: Pacer, nbytes: int) -> Iterator[list[float]]:
    """Pace this thread's writes with ``pacer`` inside the block; on leaving, charge
    what remains of ``nbytes`` not paced by the writes themselves. Yields a one-item
    list that holds the seconds waited once the block ends."""
    outer = (_state.pacer, _state.paced, _state.waited)
    _state.pacer, _state.paced, _state.waited = pacer, 0, 0.0
    waited = [0.0]
    try:
        yield waited
        if nbytes > _state.paced:
            _state.waited += pacer.consume(nbytes - _state.paced)
    finally:
        waited[0] = _state.waited
        _state.pacer, _state.paced, _state.waited = outer
