"""Placement families evaluated against the issue-14 targets in ``bench_routing.py``
(session 7): rules that spread a chain's segments over the nodes while a join moves
little, and the cache model's touch order.

- **avoid w** (``avoid_nodes``): segment ``i`` (version-2 anchored digests, as the
  client names them) goes to its ring owner unless that node is the ring owner of one of
  its ``w`` predecessors' digests; then to the first node along its own ring walk that
  is not. The choice depends only on the segment's digest and its predecessors' digests
  (their ring owners, not where they went), so a join changes a segment's node only if
  its own owner changes or one of its ``w`` predecessors' owners does: no cascade along
  the chain. The price is that second term: about ``w / N`` of the ideal on top.
- **touch order** (``replay_ordered``): the node caches see a request's blocks tail
  first (``tail``: the head of a chain is touched last, so it is evicted last, as vLLM
  frees a request's blocks in reverse order and as isolane's memory tier admits and
  touches a batch since session 7) or head first (``head``, the order before).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from isolane.cluster.ring import HashRing


class HasRuns(Protocol):
    runs: list[list[tuple[int, int, int]]]
    digests: list[bytes]


def predecessors(units: HasRuns) -> list[int]:
    """Per unit, the unit of the segment before it in its chain (-1 for segment 0).
    Anchored digests name the whole prefix, so every request agrees on it."""
    out = [-1] * len(units.digests)
    for runs in units.runs:
        for (a, _, _), (b, _, _) in itertools.pairwise(runs):
            out[b] = a
    return out


def avoid_nodes(units: HasRuns, preds: Sequence[int], ring: HashRing, index: dict[str, int],
                owners: npt.NDArray[np.int64], window: int) -> list[int]:
    """Per unit, its node under ``avoid window`` (node indices; ``owners`` = each unit's
    ring owner). Units are numbered in order of first use, so a predecessor comes first,
    but only its ring owner is read (no cascade)."""
    nodes = {i: name for name, i in index.items()}
    own = owners.tolist()
    out = list(own)
    for u, mine in enumerate(own):
        banned: set[int] = set()
        q = preds[u]
        while q >= 0 and len(banned) < window:
            banned.add(own[q])
            q = preds[q]
        if mine in banned and len(banned) < len(ring):
            skip = {nodes[i] for i in banned}
            out[u] = index[next(ring.walk(units.digests[u], skip=skip))]
    return out


def replay_ordered(requests: Sequence[Sequence[int]], serve: Sequence[Sequence[int]],
                   caches: list[Any], store: Callable[[Any, int], None], order: str
                   ) -> tuple[int, float]:
    """(blocks hit, sum over requests of the share hit): a request's hits are the longest
    resident prefix where its blocks route; then its blocks are touched or admitted
    head first or tail first (``order``)."""
    if order not in ("head", "tail"):
        raise ValueError(f"order must be 'head' or 'tail', got {order!r}")
    hits = 0
    share = 0.0
    for ids, nodes in zip(requests, serve, strict=True):
        got = len(ids)
        for pos, (h, i) in enumerate(zip(ids, nodes, strict=True)):
            if h not in caches[i]:
                got = pos
                break
        hits += got
        share += got / len(ids)
        pairs = zip(reversed(ids), reversed(nodes), strict=True) if order == "tail" \
            else zip(ids, nodes, strict=True)
        for h, i in pairs:
            store(caches[i], h)
    return hits, share
