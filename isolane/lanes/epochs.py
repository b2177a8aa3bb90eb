"""KV read latencies per short epoch, as a member publishes them, and their merge.

A member keeps a ring of ``EPOCHS`` histograms, one per ``EPOCH_S`` of the shared
monotonic clock (epoch ``e`` covers ``[e, e + 1) * EPOCH_S``); ``record`` adds to the
current one, resetting a ring entry that still holds an older epoch. The elected
member sums the epochs of every live member over a range (``merge_epochs``): the
host's latency distribution since its last decision, whoever did the reads.

Time going backwards (a stepped clock; CLOCK_MONOTONIC does not, test clocks may)
only makes ``record`` reset a ring entry early: nothing stalls on it.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable

import numpy as np

from isolane.lanes.forksafe import ForkSafe
from isolane.lanes.histogram import Counts, bucket_of, empty
from isolane.lanes.plane_format import EPOCH_S, EPOCHS, SlotRecord


def epoch_of(now: float) -> int:
    return int(now // EPOCH_S)


class EpochHistograms(ForkSafe):
    """This process's KV get latencies, per epoch. Thread-safe."""

    def __init__(self) -> None:
        self._epochs = [-1] * EPOCHS
        self._counts = [empty() for _ in range(EPOCHS)]
        self.total = 0
        self._lock = threading.Lock()
        super().__init__()

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()
        self._epochs = [-1] * EPOCHS  # the parent's reads are the parent's to publish
        self._counts = [empty() for _ in range(EPOCHS)]

    def record(self, seconds: float, nbytes: int, now: float) -> None:
        """One KV get that took ``seconds``, finished at ``now`` (LatencyWindow's
        listener signature)."""
        epoch = epoch_of(now)
        index = bucket_of(int(seconds * 1e6))
        ring = epoch % EPOCHS
        with self._lock:
            if self._epochs[ring] != epoch:
                self._epochs[ring] = epoch
                self._counts[ring] = empty()
            self._counts[ring][index] += 1
            self.total += 1

    def snapshot(self) -> tuple[list[tuple[int, int]], list[Counts]]:
        """(epoch, count) pairs and copies of their counts, ring order."""
        with self._lock:
            counts = [c.copy() for c in self._counts]
            epochs = list(self._epochs)
        return [(e, int(c.sum())) for e, c in zip(epochs, counts, strict=True)], counts


def epoch_span(now: float, epochs: int, since_s: float = -math.inf) -> tuple[int, int]:
    """The first and last epoch of the ``epochs`` up to ``now``, leaving out those that
    start before ``since_s``."""
    last = epoch_of(now)
    first = last - epochs + 1
    if since_s > -math.inf:
        first = max(first, epoch_of(since_s) + 1)
    return first, last


def merge_by_epoch(records: Iterable[SlotRecord], first: int,
                   last: int) -> dict[int, Counts]:
    """Each epoch ``first..last`` that has reads: the sum of the records' counts."""
    out: dict[int, Counts] = {}
    for record in records:
        for (epoch, count), counts in zip(record.epochs, record.bins, strict=False):
            if count and first <= epoch <= last:
                if epoch in out:
                    out[epoch] = out[epoch] + counts
                else:
                    out[epoch] = counts.astype(np.uint32, copy=True)
    return out


def sum_counts(histograms: Iterable[Counts]) -> Counts:
    """One histogram of many (summed wide, so no bucket wraps on the way)."""
    total = np.zeros_like(empty(), dtype=np.uint64)
    for counts in histograms:
        total += counts
    return total.astype(np.uint32)


def merge_epochs(records: Iterable[SlotRecord], first: int, last: int) -> Counts:
    """The sum of every record's histograms of epochs ``first..last`` (inclusive)."""
    return sum_counts(merge_by_epoch(records, first, last).values())
