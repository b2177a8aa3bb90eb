#!/usr/bin/env python
"""KV routing across storage nodes, placement units side by side: per block, whole
chain, chain segments; hit rate, load, keys moved and node requests per restore, on the
Mooncake conversation trace and three generated heavy-tailed traces.

    python benchmarks/bench_routing.py --quick                      # smoke test, ~1 min
    python benchmarks/bench_routing.py --out docs/BENCHMARKS.md     # full run, 3-15 min

A simulation of isolane's pure routing logic (``isolane.cluster.ring``,
``chain_segments``): no servers, no disks; the replays run in ``--workers`` processes.
Traces (``_trace.py``, ``_trace_gen.py``), replayed in timestamp order: a request's
blocks are prefix ids (equal ids, equal prefix). Routers, on the same requests:

- ``per-block ring``: isolane's ring (256 points a node), every block by its own key;
- ``per-block mod-N``: ``xxh3_64(key) mod N``, every block by its own key;
- ``whole-chain ring``: the chain's routing digest (the key of block ``k - 1``, k = 2)
  on the ring: a prompt's blocks all on one node;
- ``whole-chain bounded``: + bounded loads (``BoundedLoadRouter``, c = 1.25, load =
  blocks served so far, a chain kept where it was served last while within its bound);
- ``segment ring``: segment i (S blocks) of a chain by its segment digest on the ring
  (``plan_segments``: segment 0 anchored at the routing digest, segment i >= 1 at its
  own first block);
- ``segment bounded``: + bounded loads, per segment: what the cluster client runs;
- ``segment bounded hot only``: bounded loads for hot segments only (served more than
  ``HOT_FACTOR`` x the mean segment on their ring owner); the others stay on their ring
  owner whatever its load (evaluated here, not used by the client);
- ``segment v1 bounded``: ``segment bounded`` with every segment anchored at the routing digest
  (the segment digests before anchors, version 1);
- ``segment spread`` (on version-1 segments): a chain's segment j on the first node
  along the ring walk from its digest that holds fewer than ``ceil((j + 1) / N)`` of
  the chain's segments before it (``spread_owners``, evaluated here, not used by the
  client): every chain spreads evenly over the nodes;
- ``segment spread bounded``: + bounded loads, starting from the spread owner.

Every node is a cache of the given policy (LRU or S3-FIFO, ``isolane.kvpool.tiers.eviction``)
holding a share of the trace's unique blocks divided by N. A request's hits are the
longest prefix of its blocks resident where they route (a block after a miss is
useless); then every block is touched or admitted there, tail first (as the memory
tier does: the head is evicted last; head first is replayed beside it for a few routers,
``ORDER_ROUTERS``). Reported per trace and N:
block hit rate, request-level prefix hit rate (the mean over requests of the share of
their blocks hit), max/mean load (blocks served per node), node requests per restore
(one request per node holding some of the prompt's blocks, as ``RemoteKVPool`` reads a
prompt, against ``ceil(n / S)``), and keys moved on join/leave (the share of stored
block copies whose node changes, over the ideal ``1 / max(N_old, N_new)``).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import math
import multiprocessing
import random
import statistics
import sys
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C
import _quick

C.ensure_repo_importable()

import xxhash  # noqa: E402
from _route_families import avoid_nodes, predecessors, replay_ordered  # noqa: E402
from _trace import (  # noqa: E402
    BLOCK_BYTES,
    DEFAULT_TRACE,
    Trace,
    capacity_blocks,
    first_requests,
    load_trace,
    replay_unlimited,
    touch_or_admit,
)
from _trace_gen import GENERATORS  # noqa: E402

import isolane  # noqa: E402
from isolane.cluster.chain_segments import DEFAULT_SEGMENT_BLOCKS, segment_digest  # noqa: E402
from isolane.cluster.ring import BoundedLoadRouter, HashRing  # noqa: E402
from isolane.kvpool.tiers.eviction import EvictionPolicy, LRUPolicy, S3FIFOPolicy  # noqa: E402

SECTION = "routing"
ROUTERS = ("per-block ring", "per-block mod-N", "whole-chain ring", "whole-chain bounded",
           "segment ring", "segment bounded", "segment bounded hot only", "segment v1 bounded",
           "segment spread", "segment spread bounded", "per-block bounded",
           "segment avoid 1", "segment avoid 3", "segment avoid 1 bounded")
PER_BLOCK = ("per-block ring", "per-block mod-N")
SEGMENTS = ("segment ring", "segment bounded", "segment bounded hot only",
            "segment v1 bounded", "segment spread", "segment spread bounded",
            "segment avoid 1", "segment avoid 3", "segment avoid 1 bounded")
FAMILIES = ("segment ring", "segment bounded", "segment avoid 1", "segment avoid 3",
            "segment avoid 1 bounded", "segment spread", "per-block bounded")
"""The bound table's rows (``render_families``): each placement family tried, its hit
rate gap, load and keys moved per N; the spread oracle and per-block with bounded loads
(the best per-block placement that meets the load target) beside them."""
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
SLACKS = (1.0, 1.5, 2.0, 3.0)
"""``slack`` of ``spread_owners`` in the trade-off table (the routers use 1: strict)."""
MOVE_TRIALS = 3
HIT_SLACK = 0.001  # target: segments >= best per-block - 0.1 points
LOAD_TARGET = 1.25
MOVE_TARGET = 1.1
K_VARIANTS = {"agent-loops": 5}
NAMINGS = 5
"""Node namings of the noise table: the same placement rule on other node names."""
NOISE_NODES = (16, 64)
NOISE_ROUTERS = ("per-block ring", "segment bounded")
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

    @property
    def pos(self) -> npt.NDArray[np.uint64]:
        return positions(self.digests)


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
    members: list[set[int]] = []
    runs: list[list[tuple[int, int, int]]] = []

    def unit(name: Hashable, digest: Callable[[], bytes]) -> int:
        u = unit_of.get(name)
        if u is None:
            u = unit_of[name] = len(digests)
            digests.append(digest())
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
                         else segment_digest(keys[a], i))
                mine.append((u, start, min(len(ids), start + step)))
                order = chains.setdefault(d, [])
                if scheme != "chain" and i == len(order):
                    order.append(u)
        for u, start, stop in mine:
            members[u].update(ids[start:stop])
        runs.append(mine)
    return Units(runs, digests, np.array([len(m) for m in members], dtype=np.int64),
                 list(chains.values()) if scheme != "chain" else [])


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
    elif kind.endswith("ring"):
        node_of = ring_owners(HashRing(nodes), index, units.pos).tolist()
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
    passed on once; only those are placed with bounded loads."""
    ring = HashRing(nodes)
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
            node = router.place(units.digests[u], loads, cost, prefer=prefer)
            if node is None:
                raise RuntimeError("no node to place on (none is down here)")
            loads[node] += cost
            last[u] = node
            mine.extend([index[node]] * (stop - start))
        serve.append(mine)
    return Routing(serve, [loads[n] for n in nodes])


def avoid_of(units: Units, kind: str, ring: HashRing, index: dict[str, int]) -> list[int]:
    """Per unit, its node under ``segment avoid w`` (``w`` from the router's name)."""
    window = int(kind.split()[2])
    return avoid_nodes(units, predecessors(units), ring, index,
                       ring_owners(ring, index, units.pos), window)


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
_TRACES: dict[str, Trace] = {}  # set before the workers fork
_KEYS: dict[str, dict[int, bytes]] = {}
_K: dict[str, int] = {}  # trace -> k of its routing digest
_UNITS: dict[tuple[str, str, int], Units] = {}


def units_for(trace: str, kind: str, s: int) -> Units:
    scheme = ("block" if kind.startswith("per-block") else "chain" if kind.startswith("whole")
              else "segment-v1" if kind in V1 else "segment")
    key = (trace, scheme, s if scheme.startswith("segment") else 0)
    if key not in _UNITS:
        _UNITS[key] = make_units(_TRACES[trace], _KEYS[trace], scheme, s, _K[trace])
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
    group: str = "main"  # "main", "sweep" (S), "slack" (the trade-off table), "noise", "order"
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
    slack: float = 1.0
    seconds: float = 0.0
    order: str = ORDER


def label(policy: str, size: float | None) -> str:
    return f"{policy} {'inf' if size is None else f'{size:g}'}"


def run_case(case: Case) -> CaseResult:
    start = time.perf_counter()
    trace = _TRACES[case.trace]
    units = units_for(case.trace, case.router, case.s)
    routing = route(trace, units, case.router, case.nodes, case.cluster, case.slack)
    res = CaseResult(case.trace, case.router, case.nodes, case.s, case.cluster,
                     slack=case.slack, order=case.order)
    res.max_over_mean = max(routing.loads) / statistics.mean(routing.loads)
    stored: list[set[int]] = [set() for _ in range(case.nodes)]
    for ids, nodes in zip(trace.requests, routing.serve, strict=True):
        for h, i in zip(ids, nodes, strict=True):
            stored[i].add(h)
    sizes = [len(x) for x in stored]
    res.stored_max_over_mean = max(sizes) / statistics.mean(sizes)
    requests = restore_requests(routing)
    res.requests_per_restore = statistics.mean(requests)
    if case.router.startswith("whole"):
        bounds = [1] * len(trace.requests)
    else:
        step = 1 if case.router in PER_BLOCK else case.s
        bounds = [-(-len(ids) // step) for ids in trace.requests]
    res.bound_per_restore = statistics.mean(bounds)
    res.over_bound = sum(r > b for r, b in zip(requests, bounds, strict=True))
    for policy, size in case.labels:
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
                 "segment v1 ring", "segment spread", "segment avoid 1", "segment avoid 3"):
        units = units_for(trace, kind, s)
        pos, weight = units.pos, units.blocks.astype(np.float64)

        def owners(names: list[str], index: dict[str, int], units: Units = units,
                   kind: str = kind) -> npt.NDArray[np.int64]:
            ring = HashRing(names)
            if kind.endswith("spread"):
                return np.array(spread_nodes(units, ring, index), dtype=np.int64)
            if "avoid" in kind:
                return np.array(avoid_of(units, kind, ring, index), dtype=np.int64)
            return ring_owners(ring, index, units.pos)

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
                base = owners(old, index)
                for t in range(MOVE_TRIALS):
                    if after > n:
                        new = [*old, f"http://10.9.{t}.1:7070"]
                        index[new[-1]] = len(index)
                    else:
                        gone = rng.choice(old)
                        new = [x for x in old if x != gone]
                    changed = owners(new, index) != base
                    res.fractions.append(float(weight[changed].sum() / weight.sum()))
                out.append(res)
        log(f"  moves {trace} {kind}: " + ", ".join(
            f"{m.before}->{m.after} {statistics.median(m.ratios()):.2f}x"
            for m in out if m.router == kind and m.trace == trace))
    return out


def run_slack_moves(trace: str, s: int) -> dict[float, float]:
    """Per slack of ``segment spread``: the median share of stored block copies that
    move when a node joins ``SWEEP_NODES`` nodes (``MOVE_TRIALS`` new names), over the
    ideal."""
    units = units_for(trace, "segment spread", s)
    weight = units.blocks.astype(np.float64)
    old = node_names(SWEEP_NODES)
    index = {name: i for i, name in enumerate(old)}
    out = {}
    for slack in SLACKS:
        base = np.array(spread_nodes(units, HashRing(old), index, slack))
        ratios = []
        for t in range(MOVE_TRIALS):
            new = [*old, f"http://10.9.{t}.1:7070"]
            index[new[-1]] = len(old)
            now = np.array(spread_nodes(units, HashRing(new), index, slack))
            ratios.append(float(weight[now != base].sum() / weight.sum()) * (SWEEP_NODES + 1))
        out[slack] = statistics.median(ratios)
    return out


# -- the report ----------------------------------------------------------------------------------
def pct(value: float) -> str:
    return f"{value * 100:.1f} %"


def by(results: list[CaseResult], **want: object) -> list[CaseResult]:
    return [r for r in results if all(getattr(r, k) == v for k, v in want.items())]


def median_of(results: list[CaseResult], fn: Callable[[CaseResult], float]) -> float:
    return statistics.median(fn(r) for r in results)


def render(args: argparse.Namespace, traces: dict[str, Trace], ceilings: dict[str, float],
           results: list[CaseResult], sweep: list[CaseResult], moves: list[MoveResult],
           seconds: float,
           slack: tuple[list[CaseResult], dict[str, dict[float, float]]] = ([], {}),
           noise: list[CaseResult] | None = None,
           ordered: list[CaseResult] | None = None) -> str:
    s = args.segment_blocks
    out = ["## KV routing across nodes (`benchmarks/bench_routing.py`)", ""]
    out += [f"Command: `{C.command_line()}`  ", f"Date: {C.now_text()}  ",
            "Machine: " + C.machine_description(C.REPO_ROOT, versions()), ""]
    out.append(
        f"A simulation of isolane's pure routing logic (no servers, no disks; {seconds:.0f} s "
        f"in all, in {args.workers} processes). Routers: `per-block ring` / `per-block "
        "mod-N` = every block by its own key on isolane's ring (256 points a node) / by "
        "`xxh3_64 mod N`; `whole-chain ring` = a prompt's blocks all on the ring owner of "
        f"its routing digest (the key of block k - 1, k = {K} unless the trace says "
        "otherwise); `whole-chain bounded` = + bounded "
        f"loads (c = {LOAD_BOUND}, load = blocks served so far, a chain kept where it was "
        f"served last while within its bound); `segment ring` = segment i (S = {s} blocks) "
        "of a chain on the ring owner of its segment digest (segment 0 anchored at the "
        "routing digest, segment i >= 1 at its own first block); `segment bounded` = + "
        "bounded loads per segment, the cluster client's placement; `segment bounded hot "
        f"only` = bounded loads only for segments served more than {HOT_FACTOR:g}x the mean "
        "segment on their ring owner, the others on their owner whatever its load (an "
        "evaluated option, not the client's); `segment v1 bounded` "
        "= `segment bounded` with every segment anchored at the routing digest (version 1, before "
        "anchors); `segment spread` (+ `bounded`) = version-1 segments, segment j on the "
        "first node along its ring walk holding fewer than ceil((j + 1) / N) of the "
        "chain's earlier segments (an evaluated option, not the client's: it moves more "
        "on a join); `per-block bounded` = every block with bounded loads (the per-block "
        "placement that meets the load target); `segment avoid w` (+ `bounded`) = "
        "segment i on its ring owner unless that is the ring owner of one of its w "
        "predecessors' digests, else the first node along its own walk that is not (an "
        "evaluated option: its choice reads only digests, so a join moves a segment only "
        "if its owner or a predecessor's owner changes). Each node caches its share of the given "
        "percentage of the trace's unique blocks (LRU or S3-FIFO) and sees a request's "
        "blocks tail first, as isolane's memory tier admits and touches them (last table: "
        "head first). Node namings per case: "
        f"{args.clusters} (medians).")
    out += ["", "### Traces", ""]
    rows = []
    for name, trace in traces.items():
        lengths = sorted((len(r) for r in trace.requests), reverse=True)
        top = sum(lengths[:max(1, len(lengths) // 20)]) / trace.blocks
        rows.append([f"`{name}`", trace.description, f"{len(trace.requests):,}",
                     f"{trace.blocks:,}", f"{trace.unique_blocks:,}",
                     f"{trace.blocks / len(trace.requests):.1f}", str(lengths[0]),
                     pct(top), pct(ceilings[name])])
    out.append(C.markdown_table(
        ["trace", "what", "requests", "blocks", "unique", "mean blocks a request",
         "longest", "blocks in the longest 5 % of requests", "ceiling (one unlimited cache)"],
        rows))
    out += render_hits(args, traces, ceilings, results)
    out += render_sweep(args, sweep)
    out += render_slack(args, sweep, *slack)
    out += render_moves(moves)
    out += render_targets(args, traces, results, moves)
    out += render_noise(args, results, noise)
    out += render_families(args, traces, results, moves)
    out += render_order(args, traces, results, ordered or [])
    return "\n".join(out) + "\n"


def header(lbl: str) -> str:
    return "∞" if lbl.endswith("inf") else f"{lbl} %"


def hit_cell(r: list[CaseResult], lbl: str, best: float) -> str:
    value = median_of(r, lambda c: c.block_hits[lbl])
    text = pct(value)
    return f"**{text}**" if round(value, 3) >= round(best, 3) else text


def render_hits(args: argparse.Namespace, traces: dict[str, Trace],
                ceilings: dict[str, float], results: list[CaseResult]) -> list[str]:
    out = ["", "### Hit rate, load and requests per restore", ""]
    out.append("Block hit rate at each policy and cache size (`∞`: unlimited caches, what "
               "the placement alone loses), the best of each column in bold; `req.` = "
               f"request-level prefix hit rate (s3fifo, {args.sizes[1]:g} %); "
               "max/mean = blocks served per node; stored = max/mean of the distinct "
               "blocks that route to each node (the cache room each would need); "
               "requests/restore = one per node holding "
               "some of the prompt's blocks (as `RemoteKVPool` restores), mean over "
               "requests, with the mean bound "
               "(`ceil(n / S)`; per block: n; whole chain: 1).")
    labels = [label(p, z) for p, z in args.labels]
    mid = label("s3fifo", args.sizes[1])
    for name in traces:
        for n in args.nodes:
            mine = {k: by(results, trace=name, nodes=n, router=k) for k in args.routers}
            mine = {k: v for k, v in mine.items() if v}
            if not mine:
                continue
            best = {lbl: max(median_of(v, lambda c, lbl=lbl: c.block_hits[lbl])
                             for v in mine.values()) for lbl in labels}
            loaded = max(mine, key=lambda k: median_of(mine[k], lambda c: c.max_over_mean))
            rows = []
            for k, v in mine.items():
                rows.append([f"`{k}`", *(hit_cell(v, lbl, best[lbl]) for lbl in labels),
                             pct(median_of(v, lambda c: c.request_hits[mid])),
                             f"{median_of(v, lambda c: c.max_over_mean):.2f}",
                             f"{median_of(v, lambda c: c.stored_max_over_mean):.2f}",
                             f"{median_of(v, lambda c: c.requests_per_restore):.1f} "
                             f"(≤ {median_of(v, lambda c: c.bound_per_restore):.1f})"])
            out += ["", f"`{name}`, {n} nodes (ceiling {pct(ceilings[name])}; the most "
                    f"loaded: `{loaded}`, max/mean "
                    f"{median_of(mine[loaded], lambda c: c.max_over_mean):.2f}):", ""]
            out.append(C.markdown_table(
                ["router", *(header(lbl) for lbl in labels), "req.", "max/mean",
                 "stored", "requests/restore"], rows))
    return out


def render_sweep(args: argparse.Namespace, sweep: list[CaseResult]) -> list[str]:
    if not sweep:
        return []
    lbl = label("s3fifo", args.sizes[1])
    out = ["", f"### Segment size S ({SWEEP_NODES} nodes, {lbl.replace(' ', ', ')} %)", ""]
    out.append("Block hit rate · requests per restore · max/mean load of the segment "
               "routers at each S (S = 1 places every block on its own; the per-block rows "
               "are the baselines of the same run).")
    names = list(dict.fromkeys(r.trace for r in sweep))
    rows = []
    for kind in SWEPT:
        for s in S_SWEEP:
            cells: list[object] = [f"`{kind}`", s]
            for name in names:
                r = by(sweep, trace=name, router=kind, s=s)
                cells.append(f"{pct(median_of(r, lambda c: c.block_hits[lbl]))} · "
                             f"{median_of(r, lambda c: c.requests_per_restore):.1f} · "
                             f"{median_of(r, lambda c: c.max_over_mean):.2f}")
            rows.append(cells)
    for kind in PER_BLOCK:
        cells = [f"`{kind}`", "-"]
        for name in names:
            r = by(sweep, trace=name, router=kind)
            cells.append(f"{pct(median_of(r, lambda c: c.block_hits[lbl]))} · "
                         f"{median_of(r, lambda c: c.requests_per_restore):.1f} · "
                         f"{median_of(r, lambda c: c.max_over_mean):.2f}")
        rows.append(cells)
    out.append(C.markdown_table(["router", "S", *(f"`{n}`" for n in names)], rows))
    out += ["", choose_s(args, sweep)]
    return out


def render_slack(args: argparse.Namespace, sweep: list[CaseResult],
                 slacked: list[CaseResult], slack_moves: dict[str, dict[float, float]]
                 ) -> list[str]:
    """Spreading a chain evenly (``spread_owners``) against keys moved on a join."""
    if not slacked or not sweep:
        return []
    lbl = label("s3fifo", args.sizes[1])
    names = list(dict.fromkeys(r.trace for r in slacked))
    out = ["", f"### Spreading a chain against keys moved ({SWEEP_NODES} nodes, "
           f"{lbl.replace(' ', ', ')} %, S = {args.segment_blocks})", ""]
    out.append(
        "`segment spread` with a looser bound: segment j avoids nodes that hold "
        "`ceil(slack x (j + 1) / N)` of the chain's segments before it (slack 1: the "
        "routers above). Each cell: block hit rate against the best per-block baseline "
        f"(points) · stored max/mean · keys moved when a node joins {SWEEP_NODES} nodes "
        f"(x ideal, median of {MOVE_TRIALS}).")
    rows = []
    best = {name: max(median_of(by(sweep, trace=name, router=k), lambda c: c.block_hits[lbl])
                      for k in PER_BLOCK) for name in names}
    for x in SLACKS:
        cells: list[object] = [f"{x:g}"]
        for name in names:
            r = by(slacked, trace=name, slack=x)
            gap = median_of(r, lambda c: c.block_hits[lbl]) - best[name]
            cells.append(f"{gap * 100:+.1f} · {median_of(r, lambda c: c.stored_max_over_mean):.2f}"
                         f" · {slack_moves[name][x]:.2f}x")
        rows.append(cells)
    out.append(C.markdown_table(["slack", *(f"`{n}`" for n in names)], rows))
    ok = [x for x in SLACKS if all(
        median_of(by(slacked, trace=n, slack=x), lambda c: c.block_hits[lbl]) - best[n]
        >= -HIT_SLACK and slack_moves[n][x] <= MOVE_TARGET for n in names)]
    out += ["", "Slack meeting both the hit-rate target and keys moved ≤ "
            f"{MOVE_TARGET:g}x on every trace here: " + (", ".join(f"{x:g}" for x in ok)
                                                      if ok else "none") + "."]
    return out


def choose_s(args: argparse.Namespace, sweep: list[CaseResult]) -> str:
    """Per S: the worst gap over the traces of ``segment bounded`` to the best per-block
    baseline, and its requests per restore on the first trace."""
    lbl = label("s3fifo", args.sizes[1])
    names = list(dict.fromkeys(r.trace for r in sweep))
    parts = []
    ok = []
    for s in S_SWEEP:
        gaps = []
        for name in names:
            mine = median_of(by(sweep, trace=name, router="segment bounded", s=s),
                             lambda c: c.block_hits[lbl])
            base = max(median_of(by(sweep, trace=name, router=k), lambda c: c.block_hits[lbl])
                       for k in PER_BLOCK)
            gaps.append((mine - base, name))
        worst = min(gaps)
        if worst[0] >= -HIT_SLACK:
            ok.append(s)
        rq = median_of(by(sweep, trace=names[0], router="segment bounded", s=s),
                       lambda c: c.requests_per_restore)
        parts.append(f"S = {s}: {worst[0] * 100:+.1f} points (`{worst[1]}`), "
                     f"{rq:.1f} requests a restore on `{names[0]}`")
    verdict = (f"S within 0.1 points of the best per-block baseline on every trace: "
               f"{', '.join(map(str, ok))}." if ok else
               "No S keeps `segment bounded` within 0.1 points of the best per-block "
               "baseline on every trace.")
    return ("Worst gap of `segment bounded` to the best per-block baseline over the "
            "traces, and the locality it buys: " + "; ".join(parts) + ". " + verdict
            + f" This run's tables use S = {args.segment_blocks} (the default "
            f"`cluster.segment_blocks` is {DEFAULT_SEGMENT_BLOCKS}).")


def render_moves(moves: list[MoveResult]) -> list[str]:
    out = ["", "### Keys moved on join and leave", ""]
    out.append(f"Share of stored block copies whose node changes, over the ideal (1 / "
               f"max(N_old, N_new)); median of {MOVE_TRIALS} trials (other new names or "
               "departing nodes; mod-N: one), worst in brackets. Bounded routers move what "
               "their ring moves: the mover hands over the units whose ring owner changed.")
    changes = list(dict.fromkeys((m.before, m.after) for m in moves))
    rows = []
    for name in dict.fromkeys(m.trace for m in moves):
        for kind in dict.fromkeys(m.router for m in moves):
            cells: list[object] = [f"`{name}`", f"`{kind}`"]
            for before, after in changes:
                m = next(x for x in moves if (x.trace, x.router, x.before, x.after)
                         == (name, kind, before, after))
                r = m.ratios()
                cells.append(f"{statistics.median(r):.2f}x ({max(r):.2f}x)")
            rows.append(cells)
    out.append(C.markdown_table(["trace", "router", *(f"{a} → {b}" for a, b in changes)],
                                rows))
    return out


def render_targets(args: argparse.Namespace, traces: dict[str, Trace],
                   results: list[CaseResult], moves: list[MoveResult]) -> list[str]:
    out = ["", f"### Targets (issue 14), S = {args.segment_blocks}", ""]
    out.append("Per trace, over every node count, policy and cache size: the smallest gap "
               "of block hit rate to the best per-block baseline (target ≥ -0.1 points), "
               "the largest max/mean load (≤ 1.25), the worst median keys moved on a join "
               "(≤ 1.1x ideal), restores needing more than ceil(n / S) requests (0).")
    labels = [label(p, z) for p, z in args.labels if z is not None]
    rows = []
    for kind in [k for k in SEGMENTS if k in args.routers]:
        for name in traces:
            gap, where = math.inf, ""
            loads, over = 0.0, 0
            for n in args.nodes:
                mine = by(results, trace=name, router=kind, nodes=n)
                if not mine:
                    continue
                loads = max(loads, median_of(mine, lambda c: c.max_over_mean))
                over += sum(c.over_bound for c in mine)
                for lbl in labels:
                    base = max(median_of(by(results, trace=name, router=b, nodes=n),
                                         lambda c, lbl=lbl: c.block_hits[lbl])
                               for b in PER_BLOCK)
                    g = median_of(mine, lambda c, lbl=lbl: c.block_hits[lbl]) - base
                    if g < gap:
                        gap, where = g, f"N = {n}, {lbl} %"
            ring_kind = ("segment spread" if "spread" in kind else "segment v1 ring"
                         if "v1" in kind else kind.removesuffix(" bounded")
                         if "avoid" in kind else "segment ring")
            joins = [statistics.median(m.ratios()) for m in moves
                     if m.trace == name and m.router == ring_kind and m.after > m.before]
            worst_join = max(joins) if joins else math.nan
            verdicts = [gap >= -HIT_SLACK, loads <= LOAD_TARGET, worst_join <= MOVE_TARGET,
                        over == 0]
            rows.append([f"`{kind}`", f"`{name}`", f"{gap * 100:+.1f} points ({where})",
                         f"{loads:.2f}", f"{worst_join:.2f}x", str(over),
                         "all met" if all(verdicts) else "not met: " + ", ".join(
                             w for w, ok in zip(("hit rate", "load", "keys moved",
                                                 "requests"), verdicts, strict=True)
                             if not ok)])
    out.append(C.markdown_table(["router", "trace", "hit rate vs best per-block",
                                 "max/mean load", "keys moved on join", "restores over "
                                 "ceil(n/S)", "verdict"], rows))
    return out


def render_noise(args: argparse.Namespace, results: list[CaseResult],
                 noise: list[CaseResult] | None) -> list[str]:
    """The same placement rule under other node names: how far equally good placements
    lie apart, next to the target's 0.1 points."""
    if not noise:
        return []
    labels = [label(p, z) for p, z in args.labels if z is not None]
    out = ["", f"### Node namings: how far equal placements lie apart ({NAMINGS} namings)", ""]
    out.append(
        "The same router on other node names (another cut of the ring; `per-block mod-N` "
        "has one placement whatever the names). Per trace and N: the range over the "
        "namings of each router's block hit rate, the widest over the policies and sizes "
        "(the column where it is widest); then the worst gap, over the policies and "
        "sizes, of `segment bounded`'s median over the namings to the better of `per-block "
        "mod-N` and `per-block ring`'s median (the target: ≥ -0.1 points).")
    rows = []
    pooled = [*noise, *(r for r in results if r.cluster == 0 and r.router in NOISE_ROUTERS
                        and r.nodes in NOISE_NODES)]
    for name in dict.fromkeys(r.trace for r in noise):
        for n in NOISE_NODES:
            cells: list[object] = [f"`{name}`", n]
            medians: dict[tuple[str, str], float] = {}
            for kind in NOISE_ROUTERS:
                r = by(pooled, trace=name, router=kind, nodes=n)
                if not r:
                    break
                width, where = max(
                    (max(c.block_hits[lbl] for c in r) - min(c.block_hits[lbl] for c in r), lbl)
                    for lbl in labels)
                cells.append(f"{width * 100:.1f} points ({where} %)")
                for lbl in labels:
                    medians[(kind, lbl)] = median_of(r, lambda c, lbl=lbl: c.block_hits[lbl])
            mod = by(results, trace=name, router="per-block mod-N", nodes=n)
            if len(cells) < 2 + len(NOISE_ROUTERS) or not mod:
                continue
            gap = min((medians[("segment bounded", lbl)] - max(
                medians[("per-block ring", lbl)],
                median_of(mod, lambda c, lbl=lbl: c.block_hits[lbl])), lbl) for lbl in labels)
            cells.append(f"{gap[0] * 100:+.1f} points ({gap[1]} %)")
            rows.append(cells)
    out.append(C.markdown_table(
        ["trace", "N", *(f"`{k}`: range over namings" for k in NOISE_ROUTERS),
         "`segment bounded` (median) vs best per-block (median)"], rows))
    return out


def join_ratio(moves: list[MoveResult], trace: str, kind: str, n: int) -> float:
    """The median keys moved (x ideal) when a node joins ``n`` nodes, for the router whose
    owners ``kind`` follows (a bounded router moves what its ring moves)."""
    static = ("per-block ring" if kind.startswith("per-block") and kind != "per-block mod-N"
              else "segment ring" if kind in ("segment bounded", "segment bounded hot only")
              else kind.removesuffix(" bounded"))
    m = [x for x in moves if (x.trace, x.router, x.before) == (trace, static, n)
         and x.after > x.before]
    return statistics.median(m[0].ratios()) if m else math.nan


def family_gaps(results: list[CaseResult], trace: str, kind: str, n: int,
                labels: list[str]) -> tuple[float, str]:
    """The worst gap (over ``labels``) of ``kind``'s block hit rate to the best per-block
    baseline at ``n`` nodes, and the label where it is."""
    mine = by(results, trace=trace, router=kind, nodes=n)
    return min((median_of(mine, lambda c, lbl=lbl: c.block_hits[lbl]) - max(
        median_of(by(results, trace=trace, router=b, nodes=n),
                  lambda c, lbl=lbl: c.block_hits[lbl]) for b in PER_BLOCK), lbl)
        for lbl in labels)


def render_families(args: argparse.Namespace, traces: dict[str, Trace],
                    results: list[CaseResult], moves: list[MoveResult]) -> list[str]:
    """The same-run bound: per trace and N, every placement family tried against the
    three targets, and the best hit rate of the ones that meet the other two."""
    kinds = [k for k in FAMILIES if k in args.routers]
    labels = [label(p, z) for p, z in args.labels if z is not None]
    if not kinds or not labels:
        return []
    out = ["", "### Placement families against the targets, per node count (same run)", ""]
    out.append(
        "Each cell: the worst gap of block hit rate to the best per-block baseline over "
        "the policies and sizes (points; target ≥ -0.1) · max/mean load (≤ 1.25) · keys "
        "moved when a node joins (x ideal, median; ≤ 1.1). `best within moves` / `best "
        "within load and moves`: the best gap among the segment families that meet the "
        "move target / both other targets at that N (`per-block bounded` is not a segment "
        "family: it shows what the load target costs per-block placement itself).")
    rows = []
    summary: dict[str, list[tuple[float, float]]] = {"small": [], "large": []}
    for name in traces:
        for n in args.nodes:
            cells: list[object] = [f"`{name}`", n]
            fits: list[tuple[float, str]] = []
            movable: list[tuple[float, str]] = []
            spread = math.nan
            for kind in kinds:
                if not by(results, trace=name, router=kind, nodes=n):
                    cells.append("-")
                    continue
                gap, _ = family_gaps(results, name, kind, n, labels)
                load = median_of(by(results, trace=name, router=kind, nodes=n),
                                 lambda c: c.max_over_mean)
                moved = join_ratio(moves, name, kind, n)
                cells.append(f"{gap * 100:+.1f} · {load:.2f} · {moved:.2f}x")
                if kind == "segment spread":
                    spread = gap
                elif kind.startswith("segment") and moved <= MOVE_TARGET:
                    movable.append((gap, kind))
                    if load <= LOAD_TARGET:
                        fits.append((gap, kind))
            for got in (movable, fits):
                best = max(got) if got else (math.nan, "none")
                cells.append(f"{best[0] * 100:+.1f} (`{best[1]}`)" if got else "none")
            rows.append(cells)
            if fits:
                summary["small" if n <= 16 else "large"].append((max(fits)[0], spread))
    out.append(C.markdown_table(["trace", "N", *(f"`{k}`" for k in kinds),
                                 "best within moves", "best within load and moves"], rows))
    parts = []
    for key, text in (("small", "at 4-16 nodes"), ("large", "at 64 nodes")):
        got = summary[key]
        if got:
            parts.append(
                f"{text}, the best segment family within the load and move targets "
                f"reaches {min(g for g, _ in got) * 100:+.1f} .. "
                f"{max(g for g, _ in got) * 100:+.1f} points of the best per-block baseline "
                f"(worst .. best trace and N), the spread oracle (no move bound) "
                f"{min(s for _, s in got) * 100:+.1f} .. {max(s for _, s in got) * 100:+.1f}")
    if parts:
        out += ["", "In this run, " + "; ".join(parts) + "."]
    return out


def render_order(args: argparse.Namespace, traces: dict[str, Trace],
                 results: list[CaseResult], ordered: list[CaseResult]) -> list[str]:
    """The caches touched tail first (the model) against head first, same placements."""
    if not ordered:
        return []
    labels = [label(p, z) for p, z in args.labels if z is not None]
    out = ["", "### Cache touch order: tail first (the tables above) against head first", ""]
    out.append(
        "The tables above replay every node cache touching or admitting a request's "
        "blocks tail first, so a chain's head is the most recent and is evicted last (as "
        "vLLM frees a request's blocks in reverse order, and as isolane's memory tier "
        "does since this run); here the same placements are replayed head first as well "
        "(the order before: a chain's head evicted first, which kills its whole prefix). "
        "Per trace and N: "
        "the change of the best per-block hit rate (range over the policies and sizes), "
        "then per segment router the worst gap to the best per-block baseline of the same "
        "order, head first → tail first, and the change of its own hit rate (range).")
    rows = []
    head, tail = ordered, [r for r in results if r.cluster == 0]
    for name in traces:
        for n in args.nodes:
            if not by(ordered, trace=name, nodes=n):
                continue

            def best(pool: list[CaseResult], lbl: str, n: int = n, name: str = name
                     ) -> float:
                return max(median_of(by(pool, trace=name, router=b, nodes=n),
                                     lambda c: c.block_hits[lbl]) for b in PER_BLOCK)

            change = [best(tail, lbl) - best(head, lbl) for lbl in labels]
            cells: list[object] = [f"`{name}`", n,
                                   f"{min(change) * 100:+.1f} .. {max(change) * 100:+.1f}"]
            for kind in ORDER_ROUTERS:
                if kind in PER_BLOCK:
                    continue
                gaps, own = [], []
                for pool in (head, tail):
                    mine = by(pool, trace=name, router=kind, nodes=n)
                    own.append([median_of(mine, lambda c, lbl=lbl: c.block_hits[lbl])
                                for lbl in labels])
                    gaps.append(min(o - best(pool, lbl)
                                    for o, lbl in zip(own[-1], labels, strict=True)))
                change = [b - a for a, b in zip(*own, strict=True)]
                cells.append(f"{gaps[0] * 100:+.1f} → {gaps[1] * 100:+.1f} (own "
                             f"{min(change) * 100:+.1f} .. {max(change) * 100:+.1f})")
            rows.append(cells)
    out.append(C.markdown_table(
        ["trace", "N", "best per-block: tail first - head first (points)",
         *(f"`{k}`: worst gap, head → tail" for k in ORDER_ROUTERS if k not in PER_BLOCK)],
        rows))
    return out


def versions() -> dict[str, str]:
    out = {"isolane": isolane.__version__}
    for name in ("xxhash", "numpy"):
        out[name] = importlib.metadata.version(name)
    return out


# -- command line -----------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake trace (.jsonl)")
    p.add_argument("--traces", default=",".join(["mooncake", *GENERATORS]),
                   help="comma-separated: mooncake and/or " + ", ".join(GENERATORS))
    p.add_argument("--segment-blocks", type=int, default=DEFAULT_SEGMENT_BLOCKS,
                   help="S of the segment routers")
    p.add_argument("--clusters", type=int, default=1, help="node namings per case (medians)")
    p.add_argument("--workers", type=int, default=2, help="processes for the replays")
    p.add_argument("--no-sweep", action="store_true", help="skip the S sweep")
    _quick.add_argument(p)
    p.add_argument("--out", type=Path, help="markdown file whose section to (re)write")
    p.add_argument("--section", default=SECTION, help="section marker name in --out")
    p.add_argument("--json", type=Path, default=C.REPO_ROOT / ".bench" / "routing.json",
                   help="raw results (default .bench/routing.json)")
    args = p.parse_args(argv)
    args.routers, args.nodes = ROUTERS, NODE_COUNTS
    args.policies, args.sizes = tuple(POLICIES), SIZES
    if args.quick:  # every trace (its first requests), router and the sweep; 8 nodes, S3-FIFO
        _quick.enter(args, p, folders=())
        args.nodes, args.policies = (8,), ("s3fifo",)
    # S3-FIFO (the pool's default) at every size, LRU at the middle one, and unlimited
    # caches: the run stays within minutes.
    args.labels = (*(("s3fifo", z) for z in args.sizes),
                   *((("lru", args.sizes[1]),) if "lru" in args.policies else ()),
                   ("lru", None))
    args.trace_names = [t.strip() for t in args.traces.split(",") if t.strip()]
    unknown = set(args.trace_names) - {"mooncake", *GENERATORS}
    if unknown:
        p.error(f"unknown traces {sorted(unknown)}; choose from mooncake, "
                + ", ".join(GENERATORS))
    if min(args.clusters, args.workers, args.segment_blocks) < 1:
        p.error("--clusters, --workers and --segment-blocks must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()

    def log(text: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f} s]{text}", file=sys.stderr, flush=True)

    traces: dict[str, Trace] = {}
    for name in args.trace_names:
        trace = load_trace(args.trace) if name == "mooncake" else GENERATORS[name]()
        if args.quick:
            trace = first_requests(trace, QUICK_REQUESTS)
        traces[trace.name] = trace
        _K[trace.name] = K
        if trace.name in K_VARIANTS:  # the same requests, routed with another k
            k = K_VARIANTS[trace.name]
            variant = f"{trace.name} (k = {k})"
            traces[variant] = replace(trace, name=variant, description=(
                f"the same requests, the routing digest at block {k - 1} (k = {k})"))
            _K[variant] = k
    for name, trace in traces.items():
        _TRACES[name] = trace
        _KEYS[name] = {h: blake(f"{trace.name.split()[0]}-{h}".encode())
                       for ids in trace.requests for h in ids}
    ceilings = {name: replay_unlimited(t) for name, t in traces.items()}
    labels = args.labels
    cases = [Case(name, kind, n, args.segment_blocks, c, labels)
             for name in traces for n in args.nodes for kind in args.routers
             for c in range(1 if kind.endswith("mod-N") else args.clusters)]
    mid = (("s3fifo", args.sizes[1]),)
    sweep_cases = [] if args.no_sweep else [
        Case(name, kind, SWEEP_NODES, s, 0, mid, group="sweep") for name in traces
        for kind in SWEPT for s in S_SWEEP] + [
        Case(name, kind, SWEEP_NODES, 1, 0, mid, group="sweep") for name in traces
        for kind in PER_BLOCK] + [
        Case(name, "segment spread", SWEEP_NODES, args.segment_blocks, 0, mid, slack=x,
             group="slack") for name in traces for x in SLACKS]
    noise_cases = [] if args.no_sweep else [
        Case(name, kind, n, args.segment_blocks, c, labels[:-1], group="noise")
        for name in traces for n in NOISE_NODES if n in args.nodes
        for kind in NOISE_ROUTERS for c in range(1, NAMINGS)]
    order_cases = [Case(name, kind, n, args.segment_blocks, 0, labels[:-1], group="order",
                        order="head")
                   for name in traces for n in args.nodes for kind in ORDER_ROUTERS
                   if kind in args.routers]
    results: list[CaseResult] = []
    ordered: list[CaseResult] = []
    sweep: list[CaseResult] = []
    slacked: list[CaseResult] = []
    noise: list[CaseResult] = []
    # Cases are independent: spread them over processes (fork shares the traces).
    # Longest first, so the pool does not end on one long case.
    order = sorted([*cases, *sweep_cases, *noise_cases, *order_cases], key=lambda c: -c.nodes * (
        3 if "bounded" in c.router else 1) * len(c.labels))
    with multiprocessing.get_context("fork").Pool(args.workers) as pool:
        for case, res in zip(order, pool.imap(run_case, order), strict=True):
            {"main": results, "sweep": sweep, "slack": slacked,
             "noise": noise, "order": ordered}[case.group].append(res)
            lbl = label(*case.labels[min(1, len(case.labels) - 1)])
            log(f"  {case.trace} N={case.nodes} S={case.s} {case.router:20} "
                f"{lbl}: {res.block_hits[lbl] * 100:.1f} %, max/mean "
                f"{res.max_over_mean:.2f}, req/restore {res.requests_per_restore:.1f} "
                f"({res.seconds:.1f} s)")
    moves: list[MoveResult] = []
    slack_moves: dict[str, dict[float, float]] = {}
    for name in traces:
        moves += run_moves(name, args.segment_blocks, log)
        if not args.no_sweep:
            slack_moves[name] = run_slack_moves(name, args.segment_blocks)
            log(f"  slack moves {name}: {slack_moves[name]}")
    seconds = time.perf_counter() - start
    raw = {"date": C.now_text(), "command": C.command_line(), "versions": versions(),
           "seconds": seconds, "ceilings": ceilings,
           "results": [vars(r) for r in results], "sweep": [vars(r) for r in sweep],
           "slack": [vars(r) for r in slacked], "slack_moves": slack_moves,
           "noise": [vars(r) for r in noise], "order": [vars(r) for r in ordered],
           "moves": [vars(m) for m in moves]}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(raw, indent=1))
    print(f"wrote {args.json}", file=sys.stderr)
    report = render(args, traces, ceilings, results, sweep, moves, seconds,
                    (slacked, slack_moves), noise, ordered)
    C.print_report(report, args.out, args.section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
