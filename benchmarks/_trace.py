"""The Mooncake conversation trace, for the hit-rate benchmarks (eviction, routing).

``/work/shared/data/mooncake_conversation_trace.jsonl`` (see the README beside it):
12,031 requests of one hour; each request's ``hash_ids`` are its 512-token prefix
blocks (equal ids: the same prefix), replayed in timestamp order. A request's hits are
the longest resident prefix of its blocks (a block after a miss is useless: its
attention depends on the missed one); every block is then touched if resident, else
admitted after evicting enough to stay in budget. All blocks weigh ``BLOCK_BYTES``.
"""

from __future__ import annotations

import json
from collections.abc import Container, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.support.eviction_oracles import EvictionPolicy

DEFAULT_TRACE = Path("/work/shared/data/mooncake_conversation_trace.jsonl")
README_CEILING = 0.366
"""The unlimited-cache hit rate the trace's README gives."""
BLOCK_BYTES = 1


@dataclass(frozen=True)
class Trace:
    requests: list[list[int]]  # hash_ids per request, in timestamp order
    blocks: int
    unique_blocks: int
    name: str = "mooncake-conversation"
    description: str = ""


def trace_of(name: str, description: str, rows: list[tuple[int, list[int]]]) -> Trace:
    """The trace of ``(timestamp_ms, ids)`` rows, sorted stably by time."""
    requests = [ids for _, ids in sorted(rows, key=lambda r: r[0])]
    return Trace(requests, sum(map(len, requests)), len({h for ids in requests for h in ids}),
                 name, description)


def load_trace(path: Path = DEFAULT_TRACE) -> Trace:
    with open(path) as f:
        rows = [(int(row["timestamp"]), [int(h) for h in row["hash_ids"]])
                for row in map(json.loads, filter(str.strip, f))]
    return trace_of(path.stem.removesuffix("_trace").replace("_", "-"),
                    f"`{path.name}` (the file's 512-token prefix block ids)", rows)


def first_requests(trace: Trace, n: int) -> Trace:
    """The trace cut to its first ``n`` requests (a ``--quick`` run's)."""
    return trace_of(trace.name, f"{trace.description}, its first "
                    f"{min(n, len(trace.requests)):,} requests",
                    list(enumerate(trace.requests[:n])))


def prefix_hits(ids: Sequence[int], cache: Container[int]) -> int:
    """How many leading blocks of ``ids`` are in ``cache``."""
    for i, h in enumerate(ids):
        if h not in cache:
            return i
    return len(ids)


def replay_unlimited(trace: Trace) -> float:
    """The block hit rate of a cache that never evicts: the ceiling."""
    seen: set[int] = set()
    hits = 0
    for ids in trace.requests:
        hits += prefix_hits(ids, seen)
        seen.update(ids)
    return hits / trace.blocks


def touch_or_admit(policy: EvictionPolicy[Hashable], key: int, capacity_bytes: int) -> None:
    """A hit is touched; a miss is admitted after evicting enough to stay in budget."""
    if key in policy:
        policy.touch(key)
        return
    over = policy.nbytes + BLOCK_BYTES - capacity_bytes
    if over > 0:
        policy.evict(over)
    policy.admit(key, BLOCK_BYTES)


def capacity_blocks(unique_blocks: int, percent: float, parts: int = 1) -> int:
    """``percent`` of the unique blocks, split over ``parts`` caches (at least 1 each)."""
    return max(1, round(unique_blocks * percent / 100 / parts))
