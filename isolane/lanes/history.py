"""The host's KV read latencies over several seconds, kept by the member that governs.

The plane carries each member's last ``EPOCHS`` epochs (1.6 s): enough to cut on, too
short to grow on. One window's p99 (a few thousand reads, a handful of device stalls)
often reads under the SLO at write rates whose long-run p99 is over it, and a governor
that grows on it grows into those rates. ``HostHistory`` keeps the merged host
histogram of every epoch for ``HISTORY_S`` (refreshed from the plane while the epoch is
still in the members' rings, kept after), so the law can judge the p99 of *every* read
taken at the current rate since it was set, however long ago that was.

Pure apart from numpy; not thread-safe (the governor calls it under its lock).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from isolane.lanes.epochs import epoch_span, merge_by_epoch, sum_counts
from isolane.lanes.histogram import Counts
from isolane.lanes.plane_format import EPOCH_S, EPOCHS, SlotRecord

HISTORY_S = 10.0  # how far back the elected member keeps the host's latencies


class HostHistory:
    """Merged host KV get histograms per epoch, for the last ``keep_s`` seconds."""

    def __init__(self, keep_s: float = HISTORY_S) -> None:
        self.keep_epochs = max(EPOCHS, round(keep_s / EPOCH_S))
        self._epochs: dict[int, Counts] = {}

    def update(self, records: Iterable[SlotRecord], now: float) -> None:
        """Refresh the epochs still in the members' rings from their records. An epoch
        only gains reads while it is published, so a member that left (its slot gone)
        does not take back what it had published: the elementwise maximum is kept."""
        first, last = epoch_span(now, EPOCHS)
        for epoch, counts in merge_by_epoch(records, first, last).items():
            kept = self._epochs.get(epoch)
            self._epochs[epoch] = counts if kept is None else np.maximum(kept, counts)
        oldest = last - self.keep_epochs + 1
        for epoch in [e for e in self._epochs if e < oldest or e > last]:
            del self._epochs[epoch]  # too old, or from before a clock step back

    def since(self, start_s: float, now: float) -> tuple[Counts, int]:
        """The merged histogram of the epochs that start at or after ``start_s`` (all
        kept epochs for ``-inf``) up to ``now``, and its count."""
        first, last = epoch_span(now, self.keep_epochs, start_s)
        total = sum_counts(c for e, c in self._epochs.items() if first <= e <= last)
        return total, int(total.sum())

    def clear(self) -> None:
        self._epochs.clear()
