"""Fixed log-spaced latency buckets that processes can add up (pure).

The host lane plane carries each member's KV read latencies as counts in the same
``BINS`` buckets, so merging the members is a sum of arrays and the host percentiles
come from the sum. Whole microseconds; values below 16 µs are exact, above that
``PER_OCTAVE`` = 16 buckets per power of two (each at most 1/16 = 6 % wide), up to
``MAX_US`` (2**27 µs, about 134 s; anything slower counts as that).

A percentile is interpolated linearly inside its bucket by rank, so a p99 that falls
in a 5-5.3 ms bucket is not rounded up to 5.3 ms.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from isolane.errors import InvalidArgumentError

PER_OCTAVE_BITS = 4
PER_OCTAVE = 1 << PER_OCTAVE_BITS
MAX_OCTAVE = 27
MAX_US = (1 << MAX_OCTAVE) - 1
BINS = PER_OCTAVE + (MAX_OCTAVE - PER_OCTAVE_BITS) * PER_OCTAVE  # 384

Counts = npt.NDArray[np.uint32]


def bucket_of(us: int) -> int:
    """The bucket of a latency in whole microseconds."""
    us = min(max(int(us), 0), MAX_US)
    if us < PER_OCTAVE:
        return us
    octave = us.bit_length() - 1  # >= PER_OCTAVE_BITS
    shift = octave - PER_OCTAVE_BITS
    return PER_OCTAVE + shift * PER_OCTAVE + (us >> shift) - PER_OCTAVE


def bucket_bounds(index: int) -> tuple[int, int]:
    """The lowest and highest microsecond value of bucket ``index``."""
    if not 0 <= index < BINS:
        raise InvalidArgumentError(f"bucket {index} out of range 0..{BINS - 1}")
    if index < PER_OCTAVE:
        return index, index
    shift = (index - PER_OCTAVE) // PER_OCTAVE
    low = ((index % PER_OCTAVE) + PER_OCTAVE) << shift
    return low, low + (1 << shift) - 1


def empty() -> Counts:
    return np.zeros(BINS, dtype=np.uint32)


def quantile_us(counts: Counts, q: float) -> float | None:
    """The ``q``-quantile (0 < q <= 1) of ``counts`` in µs; None when it is empty."""
    if not 0 < q <= 1:
        raise InvalidArgumentError(f"quantile must be in (0, 1], got {q}")
    total = int(counts.sum(dtype=np.uint64))
    if not total:
        return None
    rank = max(1, math.ceil(q * total))
    cumulative = np.cumsum(counts, dtype=np.uint64)
    index = int(np.searchsorted(cumulative, rank))
    below = int(cumulative[index - 1]) if index else 0
    low, high = bucket_bounds(index)
    inside = int(counts[index])
    return low + (high + 1 - low) * (rank - below) / inside if high > low else float(low)


def summary_ms(counts: Counts) -> dict[str, float | int | None]:
    """JSON-able p50/p99/p999 in ms and the count."""
    def ms(q: float) -> float | None:
        value = quantile_us(counts, q)
        return None if value is None else round(value / 1e3, 3)
    return {"p50": ms(0.5), "p99": ms(0.99), "p999": ms(0.999),
            "count": int(counts.sum(dtype=np.uint64))}
