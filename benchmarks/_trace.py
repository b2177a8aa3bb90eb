"""The Mooncake conversation trace, for the hit-rate benchmarks (eviction, routing).

``/work/shared/data/mooncake_conversation_trace.jsonl`` (see the README beside it):
12,031 requests of one hour; each request's ``hash_ids`` are its 512-token prefix
blocks (equal ids: the same prefix). Requests are replayed in timestamp order. A
request's hits are the longest prefix of its blocks that is resident (a block after a
miss is useless: its attention depends on the missed one); every block is then touched
if resident, else admitted after evicting enough to stay in budget. All blocks weigh
the same (``BLOCK_BYTES``), so a budget in bytes is a budget in blocks.
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
    timestamps_ms: list[int]
    blocks: int
    unique_blocks: int
    name: str = "mooncake-conversation"
    description: str = ""


def load_trace(path: Path = DEFAULT_TRACE) -> Trace:
    rows = []
    with open(path) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                rows.append((int(row["timestamp"]), [int(h) for h in row["hash_ids"]]))
    rows.sort(key=lambda r: r[0])  # stable: equal timestamps keep file order
    requests = [ids for _, ids in rows]
    unique = len({h for ids in requests for h in ids})
    return Trace(requests, [t for t, _ in rows], sum(map(len, requests)), unique,
                 name=path.stem.removesuffix("_trace").replace("_", "-"),
                 description=f"`{path.name}` (the file's 512-token prefix block ids)")


def first_requests(trace: Trace, n: int) -> Trace:
    """The trace cut to its first ``n`` requests (a ``--quick`` run's)."""
    requests = trace.requests[:n]
    return Trace(requests, trace.timestamps_ms[:n], sum(map(len, requests)),
                 len({h for ids in requests for h in ids}), name=trace.name,
                 description=f"{trace.description}, its first {len(requests):,} requests")


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
