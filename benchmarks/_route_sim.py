"""The routing simulation of ``bench_routing.py``: its cases and constants, the units
each router places (blocks, chains or segments), the routers, the node caches' replay
and the keys moved on join/leave. Pure CPU work; the report is ``_route_report.py``."""

from __future__ import annotations

import hashlib
import importlib.metadata
import math
import random
import statistics
import sys
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C

C.ensure_repo_importable()

import xxhash  # noqa: E402
from _route_families import avoid_nodes, predecessors, replay_ordered  # noqa: E402
from _route_hrw import Rendezvous, hrw_owners  # noqa: E402
from _trace import (  # noqa: E402
    BLOCK_BYTES,
    Trace,
    capacity_blocks,
    touch_or_admit,
)

import isolane  # noqa: E402
from isolane.cluster.chain_placement import ChainPlacement  # noqa: E402
from isolane.cluster.chain_segments import segment_digest  # noqa: E402
from isolane.cluster.membership import Membership  # noqa: E402
from isolane.cluster.ring import BoundedLoadRouter, HashRing  # noqa: E402
from tests.support.eviction_oracles import EvictionPolicy, LRUPolicy, S3FIFOPolicy  # noqa: E402

SECTION = "routing"
ROUTERS = ("per-block ring", "per-block mod-N", "whole-chain ring", "whole-chain bounded",
           "segment ring", "segment bounded", "segment bounded hot only", "segment v1 bounded",
           "segment spread", "segment spread bounded", "per-block bounded",
           "segment avoid 1", "segment avoid 3", "segment avoid 1 bounded",
           "segment bounded sticky", "per-block bounded sticky",
           "per-block hrw", "per-block hrw bounded", "segment hrw", "segment hrw bounded",
           "segment affine spill")
PER_BLOCK = ("per-block ring", "per-block mod-N")
SEGMENTS = ("segment ring", "segment bounded", "segment bounded hot only",
            "segment v1 bounded", "segment spread", "segment spread bounded",
            "segment avoid 1", "segment avoid 3", "segment avoid 1 bounded",
            "segment bounded sticky", "segment hrw", "segment hrw bounded",
            "segment affine spill")
AFFINE = ("segment affine ring", "segment affine bounded", "segment affine spill")
"""Chain-affine segments (``chain_segments.plan_segments``, version 3): every segment
of a chain walks the nodes from its chain's home digest (segment 0's digest) instead of
its own, so a chain's segments live on its home node and spill, under bounded loads,
along the home's walk; each segment still has its own bounded-load memory."""
CLIENT = {"segment bounded": False, "segment affine spill": True}
"""Routers that run the cluster client's own placement and reads
(``isolane.cluster.chain_placement.ChainPlacement``, ``route_client``), router ->
whether chain-affine: ``segment bounded`` = each segment's home is its own digest and no
write bound (version 2); ``segment affine spill`` = the client's placement now. Routed
during the replay, as the client reads: a block is read from the first of its segment's
read candidates that holds it, so a hit stays where it is, and the blocks after the
first miss are written where ``place`` says."""
WRITE_HALF_LIFE_SHARE = 0.5
"""``segment affine spill``'s ``write_half_life``: this share of the segments the
cluster's caches hold (the middle cache size)."""
HRW = ("per-block hrw", "per-block hrw bounded", "segment hrw", "segment hrw bounded")
"""Rendezvous (highest-random-weight) placement (``_route_hrw.py``) instead of the ring:
each unit on its highest-scoring node (``bounded``: walked down the scores)."""
STICKY = ("segment bounded sticky", "per-block bounded sticky")
"""Bounded loads for writes only (``route_sticky``): a unit is read where it was written
while its first block there is resident (whatever that node's load: a hit is not moved,
as ``ClusterRouter.read_candidates`` tries the node a segment was written to first), and
placed anew with bounded loads, preferring that node, only when it would miss there.
Where a unit is read then depends on the caches, so these are routed during the replay,
once per policy and size."""
FAMILIES = ("segment ring", "segment bounded", "segment bounded sticky", "segment avoid 1",
            "segment avoid 3", "segment avoid 1 bounded", "segment spread", "per-block ring",
            "per-block bounded", "per-block bounded sticky", "segment hrw",
            "segment hrw bounded", "per-block hrw", "per-block hrw bounded")
"""The bound table's rows (``render_families``): each placement family tried, its hit
rate gap, load and keys moved per N; the spread oracle and the per-block placements on
the ring (the ring alone, with bounded loads, with bounded writes: S = 1, what a
consistent-hash placement that meets the move target gets without segments) beside
them."""
ORDER_ROUTERS = ("per-block ring", "per-block mod-N", "segment bounded", "segment spread")
"""Routers replayed with the caches touched head first as well (``render_order``)."""
ORDER = "tail"
"""The node caches' touch order in every table but the touch-order one: a request's
blocks tail first, as ``MemoryTier.put_many``/``get_many`` touch them (head first, the
order before, is replayed beside it)."""
V1 = ("segment v1 bounded", "segment v1 ring", "segment spread", "segment spread bounded")
"""Routers on version-1 segments (every segment anchored at the routing digest): the
placement before anchors, and the spread routers, which need a chain's segments in
order (``Units.chains``)."""
SWEPT = ("segment bounded", "segment spread bounded")  # the S sweep's routers
NODE_COUNTS = (4, 8, 16, 64)
POLICIES = {"lru": LRUPolicy, "s3fifo": S3FIFOPolicy}
SIZES = (5.0, 10.0, 20.0)
S_SWEEP = (1, 2, 4, 8, 16, 32)
SWEEP_NODES = 16
K = 2  # prefix blocks of the routing digest
LOAD_BOUND = 1.25
HOT_FACTOR = 4.0
"""``segment bounded hot only``: a unit is hot past this many times the mean blocks served
per unit on its ring owner."""
MOVE_TRIALS = 3
HIT_SLACK = 0.001  # target: segments >= best per-block - 0.1 points
LOAD_TARGET = 1.25
MOVE_TARGET = 1.1
K_VARIANTS = {"agent-loops": 5}
NAMINGS = 5
"""Node namings of the noise table: the same placement rule on other node names."""
NOISE_NODES = (16, 64)
NOISE_ROUTERS = ("per-block ring", "segment bounded")
NAMING_ROUTERS = ("segment hrw bounded", "segment hrw", "segment bounded", "per-block hrw",
                  "per-block ring", "per-block mod-N")
"""Columns of the naming table (``render_naming_gaps``, runs with ``--clusters`` > 1)."""
QUICK_REQUESTS = 300  # --quick: each trace cut to its first requests
"""Traces also run with another ``k`` (``ClusterOptions.prefix_blocks``): agent-loops'
sessions share 4 blocks, so k = 2 names them all alike."""


def node_names(n: int, cluster: int = 0) -> list[str]:
    """``n`` node URLs; another ``cluster`` names them (and so cuts the ring) anew."""
    return [f"http://10.{cluster}.{i // 250}.{i % 250 + 1}:7070" for i in range(n)]


def blake(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def positions(digests: Sequence[bytes]) -> npt.NDArray[np.uint64]:
    """Ring positions (``xxh3_64`` of each digest, as ``HashRing`` computes them)."""
    return np.fromiter((xxhash.xxh3_64_intdigest(d) for d in digests), dtype=np.uint64,
                       count=len(digests))


def ring_owners(ring: HashRing, index: dict[str, int], pos: npt.NDArray[np.uint64]
                ) -> npt.NDArray[np.int64]:
    """``ring.owner`` of every position at once (node indices)."""
    points, owners = ring.points()
    at = np.searchsorted(np.array(points, dtype=np.uint64), pos, side="left")
    at[at == len(points)] = 0
    return np.array([index[o] for o in owners], dtype=np.int64)[at]


# -- placement units ---------------------------------------------------------------------------
@dataclass
class Units:
    """The placement units of a trace under one scheme: per request, ``(unit, start,
    stop)`` runs of its blocks; per unit its digest; per unit the distinct blocks it
    stores (for keys moved)."""

    runs: list[list[tuple[int, int, int]]]
    digests: list[bytes]
    blocks: npt.NDArray[np.int64]
    chains: list[list[int]]  # segments: per chain, its units in segment order
    homes: list[bytes]  # per unit, its chain's home digest (``AFFINE``; segment 0's digest)

    @property
    def pos(self) -> npt.NDArray[np.uint64]:
        return positions(self.digests)

    @property
    def home_pos(self) -> npt.NDArray[np.uint64]:
        return positions(self.homes)


def make_units(trace: Trace, keys: dict[int, bytes], scheme: str, s: int, k: int = 2
               ) -> Units:
    """``scheme``: ``block`` (a unit a block), ``chain`` (the whole chain by its routing
    digest, the key of block ``k - 1``), ``segment`` (segments of ``s`` blocks, as the
    client places them: ``plan_segments``, segment ``i >= 1`` anchored at its first
    block) or ``segment-v1`` (every segment anchored at the routing digest, the
    placement before anchors: segment ``i`` of every chain behind a shared prefix on one
    node)."""
    unit_of: dict[Hashable, int] = {}
    chains: dict[int, list[int]] = {}
    digests: list[bytes] = []
    homes: list[bytes] = []
    members: list[set[int]] = []
    runs: list[list[tuple[int, int, int]]] = []

    def unit(name: Hashable, digest: Callable[[], bytes], home: Callable[[], bytes]
             | None = None) -> int:
        u = unit_of.get(name)
        if u is None:
            u = unit_of[name] = len(digests)
            digests.append(digest())
            homes.append(home() if home is not None else digests[-1])
            members.append(set())
        return u

    for ids in trace.requests:
        mine: list[tuple[int, int, int]] = []
        if scheme == "block":
            for j, h in enumerate(ids):
                mine.append((unit(h, lambda h=h: keys[h]), j, j + 1))
        else:
            d = ids[min(k, len(ids)) - 1]
            step = len(ids) if scheme == "chain" else s
            for i, start in enumerate(range(0, len(ids), step)):
                # equal ids: equal prefixes, so an anchor id names the segment
                a = ids[start] if scheme == "segment" and i else d
                name = d if scheme == "chain" else (a, i)
                u = unit(name, lambda a=a, i=i: keys[a] if scheme == "chain"
                         else segment_digest(keys[a], i),
                         lambda d=d: keys[d] if scheme == "chain"
                         else segment_digest(keys[d], 0))
                mine.append((u, start, min(len(ids), start + step)))
                order = chains.setdefault(d, [])
                if scheme != "chain" and i == len(order):
                    order.append(u)
        for u, start, stop in mine:
            members[u].update(ids[start:stop])
        runs.append(mine)
    return Units(runs, digests, np.array([len(m) for m in members], dtype=np.int64),
                 list(chains.values()) if scheme != "chain" else [], homes)


def spread_owners(ring: HashRing, digests: Sequence[bytes], slack: float = 1.0) -> list[str]:
    """Spread placement of one chain's segments ``0 .. len(digests) - 1`` (their segment
    digests, in order): segment ``j`` goes to the first node along the ring walk from its
    digest that holds fewer than ``ceil(slack * (j + 1) / N)`` of the chain's segments
    before it. With slack 1 a chain of ``m`` segments puts ``floor(m / N)`` or
    ``ceil(m / N)`` of them on every node it uses (none twice while ``m <= N``) instead
    of a binomial number; segment 0 stays on its ring owner. Deterministic, but the
    bound depends on ``N``: a join re-places segments beyond the new node's share."""
    n = len(ring)
    held: dict[str, int] = {}
    out: list[str] = []
    for j, digest in enumerate(digests):
        bound = max(1, math.ceil(slack * (j + 1) / n - 1e-9))
        node = next(x for x in ring.walk(digest) if held.get(x, 0) < bound)
        held[node] = held.get(node, 0) + 1
        out.append(node)
    return out


def spread_nodes(units: Units, ring: HashRing, index: dict[str, int], slack: float = 1.0
                 ) -> list[int]:
    """Per unit, its node under ``spread_owners`` (node indices)."""
    out = [0] * len(units.digests)
    for order in units.chains:
        for u, node in zip(order, spread_owners(ring, [units.digests[u] for u in order],
                                                slack), strict=True):
            out[u] = index[node]
    return out


# -- routing a trace ----------------------------------------------------------------------------
@dataclass
class Routing:
    serve: list[list[int]]  # per request, the node of each block
    loads: list[float]


def route(trace: Trace, units: Units, kind: str, n: int, cluster: int, slack: float = 1.0
          ) -> Routing:
    nodes = node_names(n, cluster)
    index = {name: i for i, name in enumerate(nodes)}
    serve: list[list[int]] = []
    loads = [0.0] * n
    if kind.endswith("mod-N"):
        node_of = (units.pos % np.uint64(n)).astype(np.int64).tolist()
    elif kind.endswith("hrw"):
        node_of = hrw_owners(nodes, units.pos).tolist()
    elif kind.endswith("ring"):
        node_of = ring_owners(HashRing(nodes), index, units.home_pos if kind in AFFINE
                              else units.pos).tolist()
    elif kind.endswith("spread"):
        node_of = spread_nodes(units, HashRing(nodes), index, slack)
    elif kind.startswith("segment avoid") and not kind.endswith("bounded"):
        node_of = avoid_of(units, kind, HashRing(nodes), index)
    else:
        return route_bounded(trace, units, kind, nodes)
    for runs in units.runs:
        mine: list[int] = []
        for u, start, stop in runs:
            mine.extend([node_of[u]] * (stop - start))
            loads[node_of[u]] += stop - start
        serve.append(mine)
    return Routing(serve, loads)


def route_bounded(trace: Trace, units: Units, kind: str, nodes: list[str]) -> Routing:
    """Bounded loads as a client runs them: the blocks served so far are the load
    reports; a unit stays on the node that served it last while within its bound.
    ``hot only``: a unit stays on its ring owner, whatever the load, until it is hot
    (served more than ``HOT_FACTOR`` x the mean a unit on its owner was served) or was
    passed on once; only those are placed with bounded loads. ``hrw``: the walk goes
    down the unit's rendezvous scores instead of along the ring."""
    ring: Any = Rendezvous(nodes) if kind in HRW else HashRing(nodes)
    if kind in HRW:
        ring.prefill(units.digests, units.pos)
    index = {name: i for i, name in enumerate(nodes)}
    router = BoundedLoadRouter(ring, LOAD_BOUND)
    first = (spread_nodes(units, ring, index) if "spread" in kind else
             avoid_of(units, kind, ring, index) if "avoid" in kind else None)
    hot_only = "hot only" in kind
    loads = dict.fromkeys(nodes, 0.0)
    last: dict[int, str] = {}
    served: dict[int, float] = {}
    owner: dict[int, str] = {}
    owned = dict.fromkeys(nodes, 0)
    serve: list[list[int]] = []
    for runs in units.runs:
        mine: list[int] = []
        for u, start, stop in runs:
            cost = float(stop - start)
            if hot_only:
                served[u] = served.get(u, 0.0) + cost
                own = owner.get(u)
                if own is None:
                    own = owner[u] = ring.owner(units.digests[u])
                    owned[own] += 1
                if u not in last and served[u] <= HOT_FACTOR * loads[own] / owned[own]:
                    loads[own] += cost  # cold: on its ring owner
                    mine.extend([index[own]] * (stop - start))
                    continue
            prefer = last.get(u)
            if prefer is None and first is not None:
                prefer = nodes[first[u]]  # the spread owner, while within its bound
            walk = units.homes[u] if kind in AFFINE else units.digests[u]
            node = place_on(router, walk, loads, cost, prefer)
            loads[node] += cost
            last[u] = node
            mine.extend([index[node]] * (stop - start))
        serve.append(mine)
    return Routing(serve, [loads[n] for n in nodes])


def place_on(router: BoundedLoadRouter, digest: bytes, loads: dict[str, float], cost: float,
             prefer: str | None) -> str:
    """The bounded router's node for a unit; every node is up in the simulation."""
    node = router.place(digest, loads, cost, prefer=prefer)
    if node is None:
        raise RuntimeError("no node to place on (none is down here)")
    return node


def avoid_of(units: Units, kind: str, ring: HashRing, index: dict[str, int]) -> list[int]:
    """Per unit, its node under ``segment avoid w`` (``w`` from the router's name)."""
    window = int(kind.split()[2])
    return avoid_nodes(units, predecessors(units), ring, index,
                       ring_owners(ring, index, units.pos), window)


def route_sticky(trace: Trace, units: Units, nodes: list[str], policy: str,
                 capacity: int | None, order: str = ORDER) -> tuple[Routing, int, float]:
    """``STICKY``: routing and replay at once (the placement reads the caches). Returns
    the routing, the blocks hit and the sum over requests of the share hit, as
    ``replay_ordered`` counts them."""
    ring = HashRing(nodes)
    index = {name: i for i, name in enumerate(nodes)}
    router = BoundedLoadRouter(ring, LOAD_BOUND)
    caches: list[Any]
    if capacity is None:
        caches = [set() for _ in nodes]

        def store(cache: Any, h: int) -> None:
            cache.add(h)
    else:
        budget = capacity * BLOCK_BYTES
        caches = [POLICIES[policy](budget) for _ in nodes]

        def store(cache: Any, h: int) -> None:
            touch_or_admit(cache, h, budget)
    loads = dict.fromkeys(nodes, 0.0)
    last: dict[int, str] = {}
    serve: list[list[int]] = []
    hits, share = 0, 0.0
    for ids, runs in zip(trace.requests, units.runs, strict=True):
        mine: list[int] = []
        for u, start, stop in runs:
            cost = float(stop - start)
            node = last.get(u)
            if node is None or ids[start] not in caches[index[node]]:
                node = place_on(router, units.digests[u], loads, cost, node)
            loads[node] += cost
            last[u] = node
            mine.extend([index[node]] * (stop - start))
        serve.append(mine)
        got, part = replay_ordered([ids], [mine], caches, store, order)
        hits += got
        share += part
    if capacity is not None:
        for cache in caches:
            if cache.nbytes > capacity * BLOCK_BYTES:
                raise RuntimeError(f"cache over budget: {cache.nbytes} > {capacity}")
    return Routing(serve, [loads[n] for n in nodes]), hits, share


def client_placement(trace: Trace, kind: str, nodes: list[str], s: int
                     ) -> ChainPlacement:
    """The client's ``ChainPlacement`` for router ``kind`` (``CLIENT``) on ``nodes``."""
    half = math.inf
    if CLIENT[kind]:
        cached = capacity_blocks(trace.unique_blocks, SIZES[1], 1)
        half = max(1.0, WRITE_HALF_LIFE_SHARE * cached / s)
    return ChainPlacement(Membership(nodes, load_bound=LOAD_BOUND), remember=1 << 30,
                          write_half_life=half)


def client_reads(ids: Sequence[int], runs: list[tuple[int, int, int]], units: Units,
                 kind: str, chains: ChainPlacement, loads: dict[str, float],
                 caches: dict[str, Any]) -> list[str]:
    """The node each block of the longest cached prefix of ``ids`` is read from: the
    first of its segment's read candidates that holds it (as ``read_prefix``)."""
    out: list[str] = []
    for u, start, stop in runs:
        home = units.homes[u] if CLIENT[kind] else units.digests[u]
        cands = chains.read_candidates(units.digests[u], home, loads, float(stop - start))
        for p in range(start, stop):
            node = next((c for c in cands if ids[p] in caches[c]), None)
            if node is None:
                return out
            out.append(node)
    return out


def route_client(trace: Trace, units: Units, kind: str, nodes: list[str], s: int,
                 policy: str, capacity: int | None, order: str = ORDER
                 ) -> tuple[Routing, int, float, ChainPlacement, dict[str, Any]]:
    """``CLIENT``: routing and replay at once with the client's placement and reads.
    Returns the routing, the blocks hit, the sum over requests of the share hit (as
    ``replay_ordered`` counts them), the placement and the caches as they ended."""
    chains = client_placement(trace, kind, nodes, s)
    index = {name: i for i, name in enumerate(nodes)}
    caches: dict[str, Any]
    if capacity is None:
        caches = {n: set() for n in nodes}

        def store(cache: Any, h: int) -> None:
            cache.add(h)
    else:
        budget = capacity * BLOCK_BYTES
        caches = {n: POLICIES[policy](budget) for n in nodes}

        def store(cache: Any, h: int) -> None:
            touch_or_admit(cache, h, budget)
    loads = dict.fromkeys(nodes, 0.0)
    serve: list[list[int]] = []
    hits, share = 0, 0.0
    for ids, runs in zip(trace.requests, units.runs, strict=True):
        read = client_reads(ids, runs, units, kind, chains, loads, caches)
        got = len(read)
        for u, start, stop in runs:
            if stop <= got:
                continue
            home = units.homes[u] if CLIENT[kind] else units.digests[u]
            first = max(start, got)
            node = chains.place(units.digests[u], home, loads, float(stop - first))
            if node is None:
                raise RuntimeError("no node to place on (none is down here)")
            read += [node] * (stop - first)
        for node in read:
            loads[node] += 1
        mine = [index[n] for n in read]
        serve.append(mine)
        hits += got
        share += got / len(ids)
        pairs = zip(reversed(ids), reversed(read), strict=True) if order == "tail" \
            else zip(ids, read, strict=True)
        for h, n in pairs:
            store(caches[n], h)
    if capacity is not None:
        for cache in caches.values():
            if cache.nbytes > capacity * BLOCK_BYTES:
                raise RuntimeError(f"cache over budget: {cache.nbytes} > {capacity}")
    return Routing(serve, [loads[n] for n in nodes]), hits, share, chains, caches


def restore_requests(routing: Routing) -> list[int]:
    """Per request: the nodes holding some of its blocks (a restore asks each once)."""
    return [len(set(nodes)) for nodes in routing.serve]


def replay(trace: Trace, routing: Routing, n: int, policy: str, capacity: int | None,
           order: str = ORDER) -> tuple[float, float]:
    """(block hit rate, request-level prefix hit rate); ``order``: the caches see a
    request's blocks tail first (``ORDER``, as the memory tier does) or head first."""
    caches: list[Any]
    if capacity is None:
        caches = [set() for _ in range(n)]

        def store(cache: Any, h: int) -> None:
            cache.add(h)
    else:
        budget = capacity * BLOCK_BYTES
        caches = [POLICIES[policy](budget) for _ in range(n)]

        def store(cache: Any, h: int) -> None:
            touch_or_admit(cache, h, budget)

    hits, share = replay_ordered(trace.requests, routing.serve, caches, store, order)
    if capacity is not None:
        for cache in caches:
            held: EvictionPolicy[Hashable] = cache
            if held.nbytes > capacity * BLOCK_BYTES:
                raise RuntimeError(f"cache over budget: {held.nbytes} > {capacity}")
    return hits / trace.blocks, share / len(trace.requests)


# -- cases, run in worker processes ---------------------------------------------------------------
TRACES: dict[str, Trace] = {}  # set before the workers fork
BLOCK_KEYS: dict[str, dict[int, bytes]] = {}
DIGEST_K: dict[str, int] = {}  # trace -> k of its routing digest
_UNITS: dict[tuple[str, str, int], Units] = {}


def units_for(trace: str, kind: str, s: int) -> Units:
    scheme = ("block" if kind.startswith("per-block") else "chain" if kind.startswith("whole")
              else "segment-v1" if kind in V1 else "segment")
    key = (trace, scheme, s if scheme.startswith("segment") else 0)
    if key not in _UNITS:
        _UNITS[key] = make_units(TRACES[trace], BLOCK_KEYS[trace], scheme, s, DIGEST_K[trace])
    return _UNITS[key]


@dataclass
class Case:
    trace: str
    router: str
    nodes: int
    s: int
    cluster: int
    labels: tuple[tuple[str, float | None], ...]  # (policy, size %) replays
    slack: float = 1.0  # of the spread routers
    group: str = "main"  # "main", "sweep" (S), "noise", "order"
    order: str = ORDER  # the caches' touch order (``replay``)


@dataclass
class CaseResult:
    trace: str
    router: str
    nodes: int
    s: int
    cluster: int
    block_hits: dict[str, float] = field(default_factory=dict)  # "s3fifo 10" -> rate
    request_hits: dict[str, float] = field(default_factory=dict)
    max_over_mean: float = 0.0
    requests_per_restore: float = 0.0  # mean over requests
    bound_per_restore: float = 0.0  # mean ceil(n / S) (segments) or n (per block)
    over_bound: int = 0  # restores needing more requests than ceil(n / S)
    stored_max_over_mean: float = 0.0  # distinct blocks that route to each node
    stored_cv: float = 0.0  # their coefficient of variation over the nodes
    slack: float = 1.0
    seconds: float = 0.0
    order: str = ORDER


def label(policy: str, size: float | None) -> str:
    return f"{policy} {'inf' if size is None else f'{size:g}'}"


def run_case(case: Case) -> CaseResult:
    start = time.perf_counter()
    trace = TRACES[case.trace]
    units = units_for(case.trace, case.router, case.s)
    res = CaseResult(case.trace, case.router, case.nodes, case.s, case.cluster,
                     slack=case.slack, order=case.order)
    sticky: dict[str, Routing] = {}
    if case.router in STICKY or case.router in CLIENT:
        # one routing per policy and size; the worst load of them
        for policy, size in case.labels:
            cap = None if size is None else capacity_blocks(trace.unique_blocks, size,
                                                            case.nodes)
            lbl = label(policy, size)
            names = node_names(case.nodes, case.cluster)
            if case.router in CLIENT:
                sticky[lbl], got, part, _, _ = route_client(
                    trace, units, case.router, names, case.s, policy, cap, case.order)
            else:
                sticky[lbl], got, part = route_sticky(trace, units, names, policy, cap,
                                                      case.order)
            res.block_hits[lbl] = got / trace.blocks
            res.request_hits[lbl] = part / len(trace.requests)
        routing = sticky[label(*case.labels[min(1, len(case.labels) - 1)])]
        res.max_over_mean = max(max(r.loads) / statistics.mean(r.loads)
                                for r in sticky.values())
    else:
        routing = route(trace, units, case.router, case.nodes, case.cluster, case.slack)
        res.max_over_mean = max(routing.loads) / statistics.mean(routing.loads)
    stored: list[set[int]] = [set() for _ in range(case.nodes)]
    for ids, nodes in zip(trace.requests, routing.serve, strict=True):
        for h, i in zip(ids, nodes, strict=True):
            stored[i].add(h)
    sizes = [len(x) for x in stored]
    res.stored_max_over_mean = max(sizes) / statistics.mean(sizes)
    res.stored_cv = statistics.pstdev(sizes) / statistics.mean(sizes)
    requests = restore_requests(routing)
    res.requests_per_restore = statistics.mean(requests)
    if case.router.startswith("whole"):
        bounds = [1] * len(trace.requests)
    else:
        step = 1 if case.router.startswith("per-block") else case.s
        bounds = [-(-len(ids) // step) for ids in trace.requests]
    res.bound_per_restore = statistics.mean(bounds)
    res.over_bound = sum(r > b for r, b in zip(requests, bounds, strict=True))
    for policy, size in case.labels if not sticky else ():
        cap = None if size is None else capacity_blocks(trace.unique_blocks, size, case.nodes)
        b, r = replay(trace, routing, case.nodes, policy, cap, case.order)
        res.block_hits[label(policy, size)] = b
        res.request_hits[label(policy, size)] = r
    res.seconds = time.perf_counter() - start
    return res


# -- keys moved ------------------------------------------------------------------------------------
@dataclass
class MoveResult:
    trace: str
    router: str
    before: int
    after: int
    fractions: list[float] = field(default_factory=list)

    @property
    def ideal(self) -> float:
        return 1 / max(self.before, self.after)

    def ratios(self) -> list[float]:
        return [f / self.ideal for f in self.fractions]


def run_moves(trace: str, s: int, log: Callable[[str], None]) -> list[MoveResult]:
    """Share of stored block copies whose node changes when a node joins or leaves."""
    out = []
    rng = random.Random(5)
    for kind in ("per-block ring", "per-block mod-N", "whole-chain ring", "segment ring",
                 "segment v1 ring", "segment spread", "segment avoid 1", "segment avoid 3",
                 "per-block hrw", "segment hrw", "segment affine ring"):
        units = units_for(trace, kind, s)
        pos, weight = units.pos, units.blocks.astype(np.float64)

        for n in NODE_COUNTS:
            old = node_names(n)
            index = {name: i for i, name in enumerate([*old, "http://10.9.9.9:7070"])}
            for after in (n + 1, n - 1):
                res = MoveResult(trace, kind, n, after)
                if kind.endswith("mod-N"):
                    base = pos % np.uint64(n)
                    now = pos % np.uint64(after)
                    res.fractions.append(float(weight[base != now].sum() / weight.sum()))
                    out.append(res)
                    continue
                base = unit_owners(units, kind, old, index)
                for t in range(MOVE_TRIALS):
                    if after > n:
                        new = [*old, f"http://10.9.{t}.1:7070"]
                        index[new[-1]] = len(index)
                    else:
                        gone = rng.choice(old)
                        new = [x for x in old if x != gone]
                    changed = unit_owners(units, kind, new, index) != base
                    res.fractions.append(float(weight[changed].sum() / weight.sum()))
                out.append(res)
        log(f"  moves {trace} {kind}: " + ", ".join(
            f"{m.before}->{m.after} {statistics.median(m.ratios()):.2f}x"
            for m in out if m.router == kind and m.trace == trace))
    return out


def unit_owners(units: Units, kind: str, names: list[str], index: dict[str, int]
                ) -> npt.NDArray[np.int64]:
    """The node of each unit under router ``kind`` over ``names``, as its number in
    ``index`` (one numbering for the nodes before and after a change, so owners
    compare)."""
    if kind.endswith("hrw"):  # indices in ``names``, mapped to ``index``
        at = np.array([index[x] for x in names], dtype=np.int64)
        return at[hrw_owners(names, units.pos)]
    ring = HashRing(names)
    if kind.endswith("spread"):
        return np.array(spread_nodes(units, ring, index), dtype=np.int64)
    if "avoid" in kind:
        return np.array(avoid_of(units, kind, ring, index), dtype=np.int64)
    return ring_owners(ring, index, units.home_pos if kind in AFFINE else units.pos)


# -- the report ----------------------------------------------------------------------------------


def versions() -> dict[str, str]:
    out = {"isolane": isolane.__version__}
    for name in ("xxhash", "numpy"):
        out[name] = importlib.metadata.version(name)
    return out
