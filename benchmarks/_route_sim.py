"""The routing simulation of ``bench_routing.py``: its constants, the units each router
places (blocks, whole chains or segments), the routers, the node caches' replay and the
keys moved on a join or leave. Pure CPU work; the report is ``_route_report.py``."""

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
from tests.support.eviction_oracles import LRUPolicy, S3FIFOPolicy  # noqa: E402

SECTION = "routing"
PER_BLOCK = ("per-block ring", "per-block mod-N")
"""The baselines: every block by its own key on the ring / by ``xxh3_64 mod N``. The
hit-rate target compares a placement to the better of them."""
WHOLE_CHAIN = "whole-chain bounded"
"""A prompt's blocks all on one node (the chain's routing digest, bounded loads): the
node-loss table's third peer."""
BEFORE = "segment bounded"
"""Segments by their own digests with bounded loads (version 2): the placement before."""
CLIENT_ROUTER = "segment affine spill"
"""The cluster client's placement (``ChainPlacement``, chain-affine, version 3)."""
ROUTERS = (*PER_BLOCK, WHOLE_CHAIN, BEFORE, CLIENT_ROUTER)
CLIENT = {BEFORE: False, CLIENT_ROUTER: True}
"""Routers run through the client's own ``ChainPlacement`` and reads (``route_client``),
router -> whether chain-affine: ``segment bounded`` = each segment its own home, no write
bound; ``segment affine spill`` = a segment on its chain's home while within its load
bound and write share and starts before 3 % of the home's cache in blocks, else along
its own digest's walk. Routed during the replay, as
the client reads: a block is read from the first of its segment's read candidates that
holds it, and only the blocks after the first miss are written."""
WRITE_HALF_LIFE_SHARE = 0.5
"""``segment affine spill``'s ``write_half_life``: this share of the segments the
cluster's caches hold (the middle cache size)."""
NODE_COUNTS = (4, 8, 16, 64)
POLICIES = {"lru": LRUPolicy, "s3fifo": S3FIFOPolicy}
SIZES = (5.0, 10.0, 20.0)
K = 2  # prefix blocks of the routing digest (``cluster.prefix_blocks``)
LOAD_BOUND = 1.25
MOVE_TRIALS = 9  # joins and leaves per N: a join moves whole chains, whose share varies
HIT_SLACK = 0.001  # target: a placement >= the best per-block one - 0.1 points
LOAD_TARGET = 1.25
MOVE_TARGET = 1.1
QUICK_REQUESTS = 300  # --quick: each trace cut to its first requests


def node_names(n: int) -> list[str]:
    return [f"http://10.0.{i // 250}.{i % 250 + 1}:7070" for i in range(n)]


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
    stop)`` runs of its blocks; per unit its digest, its chain's home digest (segment
    0's digest) and the distinct blocks it stores (for keys moved)."""

    runs: list[list[tuple[int, int, int]]]
    digests: list[bytes]
    homes: list[bytes]
    blocks: npt.NDArray[np.int64]

    @property
    def pos(self) -> npt.NDArray[np.uint64]:
        return positions(self.digests)

    @property
    def home_pos(self) -> npt.NDArray[np.uint64]:
        return positions(self.homes)


def make_units(trace: Trace, keys: dict[int, bytes], scheme: str, s: int) -> Units:
    """``scheme``: ``block`` (a unit a block), ``chain`` (the whole chain by its routing
    digest, the key of block ``K - 1``) or ``segment`` (segments of ``s`` blocks as the
    client names them: ``plan_segments``, segment ``i >= 1`` anchored at its first
    block)."""
    unit_of: dict[Hashable, int] = {}
    digests: list[bytes] = []
    homes: list[bytes] = []
    members: list[set[int]] = []
    runs: list[list[tuple[int, int, int]]] = []

    def unit(name: Hashable, digest: Callable[[], bytes], home: Callable[[], bytes]) -> int:
        u = unit_of.get(name)
        if u is None:
            u = unit_of[name] = len(digests)
            digests.append(digest())
            homes.append(home())
            members.append(set())
        return u

    for ids in trace.requests:
        mine: list[tuple[int, int, int]] = []
        if scheme == "block":
            for j, h in enumerate(ids):
                mine.append((unit(h, lambda h=h: keys[h], lambda h=h: keys[h]), j, j + 1))
        elif scheme == "chain":
            d = ids[min(K, len(ids)) - 1]
            mine.append((unit(d, lambda d=d: keys[d], lambda d=d: keys[d]), 0, len(ids)))
        else:
            d = ids[min(K, len(ids)) - 1]
            for i, start in enumerate(range(0, len(ids), s)):
                # equal ids: equal prefixes, so an anchor id names the segment
                a = ids[start] if i else d
                u = unit((a, i), lambda a=a, i=i: segment_digest(keys[a], i),
                         lambda d=d: segment_digest(keys[d], 0))
                mine.append((u, start, min(len(ids), start + s)))
        for u, start, stop in mine:
            members[u].update(ids[start:stop])
        runs.append(mine)
    return Units(runs, digests, homes,
                 np.array([len(m) for m in members], dtype=np.int64))


# -- routing a trace ----------------------------------------------------------------------------
@dataclass
class Routing:
    serve: list[list[int]]  # per request, the node of each block
    loads: list[float]
    hits: list[int] = field(default_factory=list)  # per request (``route_client``)


def route(units: Units, kind: str, n: int) -> Routing:
    """A static router (the per-block baselines) or ``whole-chain bounded``."""
    nodes = node_names(n)
    index = {name: i for i, name in enumerate(nodes)}
    if kind == WHOLE_CHAIN:
        return route_bounded(units, nodes)
    if kind == "per-block mod-N":
        node_of = (units.pos % np.uint64(n)).astype(np.int64).tolist()
    else:
        node_of = ring_owners(HashRing(nodes), index, units.pos).tolist()
    serve: list[list[int]] = []
    loads = [0.0] * n
    for runs in units.runs:
        mine: list[int] = []
        for u, start, stop in runs:
            mine.extend([node_of[u]] * (stop - start))
            loads[node_of[u]] += stop - start
        serve.append(mine)
    return Routing(serve, loads)


def route_bounded(units: Units, nodes: list[str]) -> Routing:
    """Bounded loads as a client runs them: the blocks served so far are the load
    reports; a unit stays on the node that served it last while within its bound."""
    index = {name: i for i, name in enumerate(nodes)}
    router = BoundedLoadRouter(HashRing(nodes), LOAD_BOUND)
    loads = dict.fromkeys(nodes, 0.0)
    last: dict[int, str] = {}
    serve: list[list[int]] = []
    for runs in units.runs:
        mine: list[int] = []
        for u, start, stop in runs:
            cost = float(stop - start)
            node = router.place(units.digests[u], loads, cost, prefer=last.get(u))
            if node is None:
                raise RuntimeError("no node to place on (none is down here)")
            loads[node] += cost
            last[u] = node
            mine.extend([index[node]] * (stop - start))
        serve.append(mine)
    return Routing(serve, [loads[n] for n in nodes])


def make_caches(n: int, policy: str, capacity: int | None
                ) -> tuple[list[Any], Callable[[Any, int], None]]:
    """``n`` node caches (sets when unlimited) and how a block is stored in one."""
    if capacity is None:
        def add(cache: Any, h: int) -> None:
            cache.add(h)
        return [set() for _ in range(n)], add
    budget = capacity * BLOCK_BYTES

    def store(cache: Any, h: int) -> None:
        touch_or_admit(cache, h, budget)
    return [POLICIES[policy](budget) for _ in range(n)], store


def check_budget(caches: Sequence[Any], capacity: int | None) -> None:
    if capacity is None:
        return
    for cache in caches:
        if cache.nbytes > capacity * BLOCK_BYTES:
            raise RuntimeError(f"cache over budget: {cache.nbytes} > {capacity}")


def client_placement(trace: Trace, kind: str, nodes: list[str], s: int,
                     capacity: int | None = None) -> ChainPlacement:
    """The client's ``ChainPlacement`` for router ``kind`` (``CLIENT``) on ``nodes``,
    each node's cache holding ``capacity`` blocks (None: unbounded), as its stats report."""
    half = math.inf
    if CLIENT[kind]:
        cached = capacity_blocks(trace.unique_blocks, SIZES[1], 1)
        half = max(1.0, WRITE_HALF_LIFE_SHARE * cached / s)
    chains = ChainPlacement(Membership(nodes, load_bound=LOAD_BOUND), remember=1 << 30,
                            write_half_life=half)
    for node in nodes:
        chains.set_cache_blocks(node, capacity)
    return chains


def client_reads(ids: Sequence[int], runs: list[tuple[int, int, int]], units: Units,
                 kind: str, chains: ChainPlacement, loads: dict[str, float],
                 caches: dict[str, Any]) -> list[str]:
    """The node each block of the longest cached prefix of ``ids`` is read from: the
    first of its segment's read candidates that holds it (as ``read_prefix``)."""
    out: list[str] = []
    for u, start, stop in runs:
        home = units.homes[u] if CLIENT[kind] else units.digests[u]
        cands = chains.read_candidates(units.digests[u], home, loads, float(stop - start),
                                       start)
        for p in range(start, stop):
            node = next((c for c in cands if ids[p] in caches[c]), None)
            if node is None:
                return out
            out.append(node)
    return out


def route_client(trace: Trace, units: Units, kind: str, nodes: list[str], s: int,
                 policy: str, capacity: int | None
                 ) -> tuple[Routing, int, float, ChainPlacement, dict[str, Any]]:
    """``CLIENT``: routing and replay at once with the client's placement and reads.
    Returns the routing, the blocks hit, the sum over requests of the share hit, the
    placement and the caches as they ended."""
    chains = client_placement(trace, kind, nodes, s, capacity)
    index = {name: i for i, name in enumerate(nodes)}
    made, store = make_caches(len(nodes), policy, capacity)
    caches = dict(zip(nodes, made, strict=True))
    loads = dict.fromkeys(nodes, 0.0)
    serve: list[list[int]] = []
    hits, share = 0, 0.0
    per_request: list[int] = []
    for ids, runs in zip(trace.requests, units.runs, strict=True):
        read = client_reads(ids, runs, units, kind, chains, loads, caches)
        got = len(read)
        per_request.append(got)
        for u, start, stop in runs:
            if stop <= got:
                continue
            home = units.homes[u] if CLIENT[kind] else units.digests[u]
            first = max(start, got)
            node = chains.place(units.digests[u], home, loads, float(stop - first), start)
            if node is None:
                raise RuntimeError("no node to place on (none is down here)")
            read += [node] * (stop - first)
        for node in read:
            loads[node] += 1
        serve.append([index[n] for n in read])
        hits += got
        share += got / len(ids)
        for h, n in zip(reversed(ids), reversed(read), strict=True):
            store(caches[n], h)
    check_budget(made, capacity)
    return (Routing(serve, [loads[n] for n in nodes], per_request), hits, share, chains,
            caches)


def replay_tail_first(requests: Sequence[Sequence[int]], serve: Sequence[Sequence[int]],
                      caches: list[Any], store: Callable[[Any, int], None]
                      ) -> tuple[int, float]:
    """(blocks hit, sum over requests of the share hit): a request's hits are the longest
    resident prefix where its blocks route; then its blocks are touched or admitted tail
    first, as the memory tier does (the head of a chain is evicted last)."""
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
        for h, i in zip(reversed(ids), reversed(nodes), strict=True):
            store(caches[i], h)
    return hits, share


def replay(trace: Trace, routing: Routing, n: int, policy: str, capacity: int | None
           ) -> tuple[float, float]:
    """(block hit rate, request-level prefix hit rate) of a static routing."""
    caches, store = make_caches(n, policy, capacity)
    hits, share = replay_tail_first(trace.requests, routing.serve, caches, store)
    check_budget(caches, capacity)
    return hits / trace.blocks, share / len(trace.requests)


# -- cases, run in worker processes ---------------------------------------------------------------
TRACES: dict[str, Trace] = {}  # set before the workers fork
BLOCK_KEYS: dict[tuple[str, int], dict[int, bytes]] = {}  # (trace, naming) -> id -> key
_UNITS: dict[tuple[str, int, str, int], Units] = {}


def name_blocks(trace: Trace, naming: int = 0) -> dict[int, bytes]:
    """Each block id's 16-byte key under ``naming``: 0 is the tables' naming; another
    salts the hash, so every ring and walk position changes while the workload (which
    requests share which prefixes) stays the same (``_route_noise.py``)."""
    salt = "" if naming == 0 else f"naming {naming}/"
    return {h: blake(f"{salt}{trace.name}-{h}".encode()) for ids in trace.requests for h in ids}


def units_for(trace: str, kind: str, s: int, naming: int = 0) -> Units:
    scheme = ("block" if kind.startswith("per-block") else "chain" if kind == WHOLE_CHAIN
              else "segment")
    key = (trace, naming, scheme, s if scheme == "segment" else 0)
    if key not in _UNITS:
        _UNITS[key] = make_units(TRACES[trace], BLOCK_KEYS[trace, naming], scheme, s)
    return _UNITS[key]


@dataclass
class Case:
    trace: str
    router: str
    nodes: int
    s: int
    labels: tuple[tuple[str, float | None], ...]  # (policy, size %) replays
    naming: int = 0  # of the trace's blocks (``name_blocks``)


@dataclass
class CaseResult:
    trace: str
    router: str
    nodes: int
    s: int
    naming: int = 0
    block_hits: dict[str, float] = field(default_factory=dict)  # "s3fifo 10" -> rate
    request_hits: dict[str, float] = field(default_factory=dict)
    max_over_mean: float = 0.0  # the worst over the replays the router was run for
    requests_per_restore: float = 0.0  # mean over requests
    bound_per_restore: float = 0.0  # mean ceil(n / S) (segments) or n (per block)
    over_bound: int = 0  # restores needing more requests than ceil(n / S)
    stored_max_over_mean: float = 0.0  # distinct blocks that route to each node
    # ``CLIENT``, per finite cache: a node's cache in blocks, and the block hits (over
    # the trace's blocks) of requests of at least half of it, whose blocks on one node
    # fill much of its cache
    node_cache: dict[str, int] = field(default_factory=dict)
    long_hits: dict[str, float] = field(default_factory=dict)
    long_blocks: dict[str, float] = field(default_factory=dict)  # their share of blocks
    seconds: float = 0.0


def label(policy: str, size: float | None) -> str:
    return f"{policy} {'inf' if size is None else f'{size:g}'}"


def run_case(case: Case) -> CaseResult:
    start = time.perf_counter()
    trace = TRACES[case.trace]
    units = units_for(case.trace, case.router, case.s, case.naming)
    res = CaseResult(case.trace, case.router, case.nodes, case.s, case.naming)
    middle = label(*case.labels[min(1, len(case.labels) - 1)])
    if case.router in CLIENT:  # the placement reads the caches: one routing a replay
        routed: dict[str, Routing] = {}
        for policy, size in case.labels:
            cap = None if size is None else capacity_blocks(trace.unique_blocks, size,
                                                            case.nodes)
            lbl = label(policy, size)
            routed[lbl], got, part, _, _ = route_client(
                trace, units, case.router, node_names(case.nodes), case.s, policy, cap)
            res.block_hits[lbl] = got / trace.blocks
            res.request_hits[lbl] = part / len(trace.requests)
            if cap is not None:
                long = [len(ids) >= cap / 2 for ids in trace.requests]
                res.node_cache[lbl] = cap
                res.long_hits[lbl] = sum(h for h, y in zip(routed[lbl].hits, long,
                                                           strict=True) if y) / trace.blocks
                res.long_blocks[lbl] = sum(len(ids) for ids, y in zip(
                    trace.requests, long, strict=True) if y) / trace.blocks
        routing = routed[middle]
        res.max_over_mean = max(max(r.loads) / statistics.mean(r.loads)
                                for r in routed.values())
    else:
        routing = route(units, case.router, case.nodes)
        res.max_over_mean = max(routing.loads) / statistics.mean(routing.loads)
        for policy, size in case.labels:
            cap = None if size is None else capacity_blocks(trace.unique_blocks, size,
                                                            case.nodes)
            b, r = replay(trace, routing, case.nodes, policy, cap)
            res.block_hits[label(policy, size)] = b
            res.request_hits[label(policy, size)] = r
    stored: list[set[int]] = [set() for _ in range(case.nodes)]
    for ids, nodes in zip(trace.requests, routing.serve, strict=True):
        for h, i in zip(ids, nodes, strict=True):
            stored[i].add(h)
    sizes = [len(x) for x in stored]
    res.stored_max_over_mean = max(sizes) / statistics.mean(sizes)
    requests = [len(set(nodes)) for nodes in routing.serve]
    res.requests_per_restore = statistics.mean(requests)
    step = (max(map(len, trace.requests)) if case.router == WHOLE_CHAIN
            else 1 if case.router.startswith("per-block") else case.s)
    bounds = [-(-len(ids) // step) for ids in trace.requests]
    res.bound_per_restore = statistics.mean(bounds)
    res.over_bound = sum(r > b for r, b in zip(requests, bounds, strict=True))
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
    via_home: list[float] = field(default_factory=list)  # ``moved_share``'s second

    @property
    def ideal(self) -> float:
        return 1 / max(self.before, self.after)

    def ratios(self) -> list[float]:
        return [f / self.ideal for f in self.fractions]

    def via_home_ratios(self) -> list[float]:
        """The part of each trial's ratio from spilled segments that moved only with
        their home's owner (empty: not measured)."""
        return [f / self.ideal for f in self.via_home]


def placed_units(trace: str, kind: str, s: int, n: int) -> npt.NDArray[np.int64]:
    """``CLIENT``: the node (index in ``node_names(n)``) each unit of ``trace`` is stored
    on after a replay with unlimited caches (every unit written once, where the client's
    placement put it: its home or, past a bound, along its own walk)."""
    nodes = node_names(n)
    index = {name: i for i, name in enumerate(nodes)}
    units = units_for(trace, kind, s)
    _, _, _, chains, _ = route_client(TRACES[trace], units, kind, nodes, s, "lru", None)
    return np.array([index[chains.last(d) or nodes[0]] for d in units.digests],
                    dtype=np.int64)


def moved_share(units: Units, placed: npt.NDArray[np.int64], old: HashRing, new: HashRing,
                index: dict[str, int], *, chain_affine: bool) -> tuple[float, float]:
    """Share of the stored blocks of ``units`` (on ``placed``, node indices) whose node
    changes from ring ``old`` to ``new``: a unit on its home's owner moves when the
    home's owner changes (the mover's rule, ``ChainMover``); a unit that spilled off its
    home stays where it is, and is counted when the node a reader looks for it on
    changes (the first along its own digest's walk past the home's owner, which the
    mover does not move it to: the reader misses it and it is written again). Second:
    the share of those spilled units counted while their own digest's owner stayed,
    moved only because their home's owner did (they skip it)."""
    home_pos = units.home_pos if chain_affine else units.pos
    old_home = ring_owners(old, index, home_pos)
    new_home = ring_owners(new, index, home_pos)
    at_home = placed == old_home
    changed = at_home & (new_home != placed)
    names = {i: name for name, i in index.items()}

    def past_home(ring: HashRing, homes: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        own = ring_owners(ring, index, units.pos)
        for u in np.flatnonzero(~at_home & (own == homes)):
            own[u] = index[next(ring.walk(units.digests[u], skip=(names[int(homes[u])],)))]
        return own

    spilled = ~at_home & (past_home(old, old_home) != past_home(new, new_home))
    via_home = spilled & (ring_owners(old, index, units.pos) == ring_owners(new, index,
                                                                          units.pos))
    weight = units.blocks.astype(np.float64)
    total = weight.sum()
    return (float(weight[changed | spilled].sum() / total),
            float(weight[via_home].sum() / total))


def run_moves(trace: str, s: int, nodes: Sequence[int], log: Callable[[str], None]
              ) -> list[MoveResult]:
    """Share of stored block copies whose node changes when a node joins or leaves. A
    static or whole-chain router moves what its ring moves; the client's placements
    (``CLIENT``) are measured where their replay put each segment (``moved_share``)."""
    out = []
    rng = random.Random(5)
    for kind in ROUTERS:
        units = units_for(trace, kind, s)
        pos = units.pos
        weight = units.blocks.astype(np.float64)
        for n in nodes:
            old = node_names(n)
            index = {name: i for i, name in enumerate([*old, "http://10.9.9.9:7070"])}
            placed = placed_units(trace, kind, s, n) if kind in CLIENT else None
            for after in (n + 1, n - 1):
                res = MoveResult(trace, kind, n, after)
                out.append(res)
                if kind == "per-block mod-N":
                    changed = pos % np.uint64(n) != pos % np.uint64(after)
                    res.fractions.append(float(weight[changed].sum() / weight.sum()))
                    continue
                base = ring_owners(HashRing(old), index, pos)
                for t in range(MOVE_TRIALS):
                    if after > n:
                        new = [*old, f"http://10.9.{t}.1:7070"]
                        index[new[-1]] = len(index)
                    else:
                        gone = rng.choice(old)
                        new = [x for x in old if x != gone]
                    if placed is not None:
                        moved, via_home = moved_share(units, placed, HashRing(old),
                                                      HashRing(new), index,
                                                      chain_affine=CLIENT[kind])
                        res.fractions.append(moved)
                        res.via_home.append(via_home)
                        continue
                    changed = ring_owners(HashRing(new), index, pos) != base
                    res.fractions.append(float(weight[changed].sum() / weight.sum()))
        log(f"  moves {trace} {kind}: " + ", ".join(
            f"{m.before}->{m.after} {statistics.median(m.ratios()):.2f}x"
            for m in out if m.router == kind and m.trace == trace))
    return out


def versions() -> dict[str, str]:
    out = {"isolane": isolane.__version__}
    for name in ("xxhash", "numpy"):
        out[name] = importlib.metadata.version(name)
    return out
