#!/usr/bin/env python
"""KV routing across storage nodes: keys moved on join/leave, load under Zipf-skewed
prefixes, and cache hit rate on the Mooncake conversation trace.

    python benchmarks/bench_routing.py --quick                      # smoke test, ~40 s
    python benchmarks/bench_routing.py --out docs/BENCHMARKS.md     # full run, ~3 min

A simulation of the pure routing logic (``isolane.kvpool.ring``): no servers, no disks;
the trace replays run in ``--workers`` processes. Routers, side by side on the same keys
and request streams:

- ``mod-N``: ``xxh3_64(routing digest) mod N``;
- ``uhashring``: the PyPI consistent-hash ring at its defaults (md5 points, 160 per
  node), on the routing digest;
- ``per-block``: isolane's ring, every block by its own key (a chain's blocks scatter);
- ``isolane``: isolane's ring (256 points per node) on the routing digest;
- ``isolane bounded``: + bounded loads, c = 1.25 (``BoundedLoadRouter``), a chain kept on
  the node that served it last while that node stays within its bound (``prefer``);
- ``isolane bounded+hot``: + hot replicas (R = 1, power of two choices; ``place_request``).

The routing digest of a chain is the key of its block ``min(k, len) - 1`` (``k`` = 2
unless stated): every prefix-aware router routes the same digest.

1. **Keys moved** when 8 -> 9, 8 -> 7, 64 -> 65 and 64 -> 63 nodes: the fraction of
   ``--keys`` random routing digests whose node changes, over the ideal (the share of
   the node that joins or leaves, 1 / max(N_old, N_new)); median and worst of the
   trials (joins: different new names; leaves: different departing nodes). For the
   bounded router, placement depends on loads: the fraction of the requests of a Zipf
   (s = 1.0) stream that go to another node, next to the same fraction for the ring
   without bounds.
2. **Load** under Zipf-skewed prefix popularity: ``--chains`` chains (lengths 1 + a
   geometric number of blocks, mean ~24 as in the trace), ``--requests`` requests drawn
   with Zipf exponent s = 0.8, 1.0, 1.2; a request's blocks count as load on the node(s)
   that serve them; max/mean over nodes, median of ``--seeds`` seeds. Bounded loads use
   the blocks served so far as the load reports.
3. **Hit rate** on the trace with 4, 8 and 16 nodes, each node an S3-FIFO cache (the
   pool's default policy) holding 5/10/20 % of the unique blocks divided by the number
   of nodes (and unlimited caches: what routing alone loses). A request's hits are the
   longest prefix of its blocks resident on the node(s) its blocks route to. Hot
   chains' blocks are also written to their replica nodes (the copies are counted).
   Medians over ``--clusters`` namings of the nodes (each cuts the ring differently).
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C

C.ensure_repo_importable()

import uhashring  # noqa: E402
import xxhash  # noqa: E402
from _trace import (  # noqa: E402
    BLOCK_BYTES,
    DEFAULT_TRACE,
    README_CEILING,
    Trace,
    capacity_blocks,
    load_trace,
    prefix_hits,
    replay_unlimited,
    touch_or_admit,
)

import isolane  # noqa: E402
from isolane.kvpool.eviction import EvictionPolicy, S3FIFOPolicy  # noqa: E402
from isolane.kvpool.ring import (  # noqa: E402
    BoundedLoadRouter,
    HashRing,
    HotReplicas,
    place_request,
)

SECTION = "routing"
ROUTERS = ("mod-N", "uhashring", "per-block", "isolane", "isolane bounded",
           "isolane bounded+hot")
MOVES = ((8, 9), (8, 7), (64, 65), (64, 63))
ZIPF_S = (0.8, 1.0, 1.2)
LOAD_NODES = (8, 64)
TRACE_NODES = (4, 8, 16)
TRACE_SIZES = (5.0, 10.0, 20.0)
K_SWEEP = (1, 2, 4)
LOAD_BOUND = 1.25
REPLICAS = 1
HOT_HALF_LIFE_S = 60.0
HOT_SHARE = 0.25  # a chain is hot past this fraction of one node's fair share of requests
SYNTHETIC_RATE = 1000.0  # requests per second of the synthetic Zipf streams
MEAN_BLOCKS = 24
REQUEST_TRIALS = 3  # trials of the (requests) rows of keys moved: whole replays each


def node_names(n: int, cluster: int = 0) -> list[str]:
    """``n`` node URLs; another ``cluster`` names them (and so cuts the ring) anew."""
    return [f"http://10.{cluster}.{i // 250}.{i % 250 + 1}:7070" for i in range(n)]


def blake(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def hot_threshold(rate_per_s: float, n_nodes: int) -> float:
    """Decayed count of a chain holding ``HOT_SHARE`` of one node's fair share: the
    decayed total of all requests at a steady rate is ``rate * half_life / ln 2``."""
    return max(2.0, HOT_SHARE * rate_per_s * HOT_HALF_LIFE_S / math.log(2) / n_nodes)


# -- static routers: one node per routing digest --------------------------------------------
def static_owner(kind: str, nodes: Sequence[str]) -> Callable[[bytes], str]:
    if kind == "mod-N":
        names = list(nodes)
        return lambda d: names[xxhash.xxh3_64_intdigest(d) % len(names)]
    if kind == "uhashring":
        ring = uhashring.HashRing(nodes=list(nodes))
        return lambda d: str(ring.get_node(d.hex()))
    if kind in ("isolane", "per-block"):
        return HashRing(nodes).owner
    raise ValueError(kind)


class IsolaneClient:
    """isolane's composed router as a client runs it: bounded loads on the blocks served
    so far (the load reports), the node each chain was served on last as ``prefer``,
    and with ``hot_threshold`` hot replicas (``place_request``)."""

    def __init__(self, nodes: Sequence[str], *, hot_threshold: float | None,
                 rng_seed: int = 1) -> None:
        self.ring = HashRing(nodes)
        self.router = BoundedLoadRouter(self.ring, LOAD_BOUND)
        self.hot = (HotReplicas(hot_threshold, HOT_HALF_LIFE_S, REPLICAS)
                    if hot_threshold is not None else None)
        self.rng = random.Random(rng_seed)
        self.loads = dict.fromkeys(nodes, 0.0)
        self.last: dict[bytes, str] = {}
        self.holders: dict[bytes, set[str]] = {}  # nodes holding a copy of each chain
        self.requests = 0
        self.uncopied = 0  # requests sent to a node without their (known) chain

    def route(self, digest: bytes, cost: float, now: float) -> tuple[str, tuple[str, ...]]:
        """The node for one request, and the other replicas its blocks are copied to."""
        hot = self.hot
        if hot is not None:
            hot.record(digest, now)
        node = place_request(self.router, digest, self.loads, cost, hot=hot, now=now,
                             rng=self.rng, prefer=self.last.get(digest))
        assert node is not None  # no node is skipped here
        self.loads[node] += cost
        self.last[digest] = node
        copies: tuple[str, ...] = ()
        if hot is not None and hot.is_hot(digest, now):
            copies = tuple(r for r in hot.replica_nodes(self.ring, digest) if r != node)
        holders = self.holders.setdefault(digest, set())
        self.requests += 1
        if holders and node not in holders:
            self.uncopied += 1
        holders.add(node)
        holders.update(copies)
        return node, copies


# -- 1. keys moved -------------------------------------------------------------------------
@dataclass
class MoveResult:
    router: str
    before: int
    after: int
    fractions: list[float] = field(default_factory=list)

    @property
    def ideal(self) -> float:
        return 1 / max(self.before, self.after)

    def ratios(self) -> list[float]:
        return [f / self.ideal for f in self.fractions]


def changed_nodes(before: Sequence[str], after: Sequence[str]) -> float:
    return sum(a != b for a, b in zip(before, after, strict=True)) / len(before)


def move_trials(before: int, after: int, trials: int, rng: random.Random
                ) -> list[tuple[list[str], list[str]]]:
    """(old nodes, new nodes) per trial: joins add differently named nodes, leaves
    remove different nodes."""
    old = node_names(before)
    if after > before:
        return [(old, [*old, f"http://10.9.{t}.1:7070"]) for t in range(trials)]
    gone = rng.sample(old, min(trials, len(old)))
    return [(old, [n for n in old if n != g]) for g in gone]


def run_moves(digests: list[bytes], block_keys: list[bytes], zipf: Workload, trials: int,
              log: Callable[[str], None]) -> list[MoveResult]:
    results = []
    rng = random.Random(5)
    for before, after in MOVES:
        pairs = move_trials(before, after, trials, rng)
        for kind in ("mod-N", "uhashring", "per-block", "isolane"):
            res = MoveResult(kind, before, after)
            keys = block_keys if kind == "per-block" else digests
            old_owner = static_owner(kind, pairs[0][0])
            base = [old_owner(d) for d in keys]
            for _, new_nodes in (pairs[:1] if kind == "mod-N" else pairs):
                owner = static_owner(kind, new_nodes)
                res.fractions.append(changed_nodes(base, [owner(d) for d in keys]))
            results.append(res)
        # Load-dependent placement: requests of one Zipf stream that change node.
        plain = MoveResult("isolane (requests)", before, after)
        bounded = MoveResult("isolane bounded (requests)", before, after)
        base_plain = zipf.static_nodes(HashRing(pairs[0][0]).owner)
        base_bounded = zipf.bounded_nodes(pairs[0][0], hot=False)[0]
        for _, new_nodes in pairs[:REQUEST_TRIALS]:
            plain.fractions.append(changed_nodes(
                base_plain, zipf.static_nodes(HashRing(new_nodes).owner)))
            bounded.fractions.append(changed_nodes(
                base_bounded, zipf.bounded_nodes(new_nodes, hot=False)[0]))
        results += [plain, bounded]
        for res in results[-6:]:
            log(f"  moved {before}->{after} {res.router:28} median "
                f"{statistics.median(res.ratios()):.2f}x ideal, worst {max(res.ratios()):.2f}x")
    return results


# -- 2. load under Zipf ----------------------------------------------------------------------
class Workload:
    """``chains`` chains with Zipf(s) popularity and ``requests`` requests drawn from it."""

    def __init__(self, seed: int, s: float, chains: int, requests: int) -> None:
        rng = np.random.default_rng(seed)
        self.digests = [blake(b"chain-%d-%d" % (seed, i)) for i in range(chains)]
        self.lengths: npt.NDArray[np.int64] = 1 + rng.geometric(1 / (MEAN_BLOCKS - 1), chains)
        ranks = rng.permutation(chains) + 1  # popularity independent of the digests
        weights = ranks.astype(np.float64) ** -s
        self.picks: npt.NDArray[np.int64] = rng.choice(chains, size=requests,
                                                       p=weights / weights.sum())
        self.s = s
        self._block_keys: list[list[bytes]] | None = None

    def block_keys(self) -> list[list[bytes]]:
        if self._block_keys is None:
            self._block_keys = [[blake(d + i.to_bytes(4, "little")) for i in range(int(n))]
                                for d, n in zip(self.digests, self.lengths, strict=True)]
        return self._block_keys

    def static_nodes(self, owner: Callable[[bytes], str]) -> list[str]:
        """The node of every request when each chain has one fixed node."""
        per_chain = [owner(d) for d in self.digests]
        return [per_chain[c] for c in self.picks.tolist()]

    def bounded_nodes(self, nodes: Sequence[str], *, hot: bool) -> tuple[list[str], float]:
        """The node of every request under isolane's bounded router, and the share of
        requests sent to a node that holds no copy of their chain yet (a chain's first
        request not counted)."""
        client = IsolaneClient(
            nodes, hot_threshold=hot_threshold(SYNTHETIC_RATE, len(nodes)) if hot else None)
        lengths = self.lengths.tolist()
        out = [client.route(self.digests[c], float(lengths[c]), i / SYNTHETIC_RATE)[0]
               for i, c in enumerate(self.picks.tolist())]
        return out, client.uncopied / client.requests

    def loads(self, kind: str, nodes: Sequence[str]) -> tuple[npt.NDArray[np.float64], float]:
        """Blocks served per node over the whole stream, and the share of requests sent
        to a node without a copy of their chain (0 for fixed placements)."""
        index = {n: i for i, n in enumerate(nodes)}
        if kind == "per-block":
            owner = HashRing(nodes).owner
            per_chain = np.zeros((len(self.digests), len(nodes)))
            for c, keys in enumerate(self.block_keys()):
                for key in keys:
                    per_chain[c, index[owner(key)]] += 1
            counts = np.bincount(self.picks, minlength=len(self.digests))
            out: npt.NDArray[np.float64] = counts @ per_chain
            return out, 0.0
        uncopied = 0.0
        if kind in ("isolane bounded", "isolane bounded+hot"):
            served, uncopied = self.bounded_nodes(nodes, hot=kind.endswith("hot"))
            node_of = np.array([index[n] for n in served])
        else:
            node_of = np.array([index[n] for n in self.static_nodes(static_owner(kind, nodes))])
        load = np.bincount(node_of, weights=self.lengths[self.picks], minlength=len(nodes))
        return load, uncopied


@dataclass
class LoadResult:
    router: str
    s: float
    nodes: int
    max_over_mean: list[float] = field(default_factory=list)
    uncopied: list[float] = field(default_factory=list)  # requests sent where no copy is


def run_loads(chains: int, requests: int, seeds: int, log: Callable[[str], None]
              ) -> list[LoadResult]:
    results = []
    for n in LOAD_NODES:
        nodes = node_names(n)
        for s in ZIPF_S:
            mine = {kind: LoadResult(kind, s, n) for kind in ROUTERS}
            for seed in range(seeds):
                work = Workload(seed, s, chains, requests)
                for kind in ROUTERS:
                    load, uncopied = work.loads(kind, nodes)
                    mine[kind].max_over_mean.append(float(load.max() / load.mean()))
                    mine[kind].uncopied.append(uncopied)
            for res in mine.values():
                log(f"  load N={n} s={s} {res.router:20} max/mean "
                    f"{statistics.median(res.max_over_mean):.2f}, sent where no copy is "
                    f"{statistics.median(res.uncopied) * 100:.1f} %")
            results += mine.values()
    return results


# -- 3. hit rate on the trace ----------------------------------------------------------------
@dataclass
class Routing:
    """Per request: the node index serving it (or one per block) and replica copies."""

    router: str
    nodes: int
    k: int
    serve: list[int | list[int]]
    copies: list[tuple[int, ...]]
    loads: list[float]

    @property
    def max_over_mean(self) -> float:
        return max(self.loads) / statistics.mean(self.loads)


@dataclass
class HitResult:
    """One router at one cluster size and k; lists hold one value per node naming."""

    router: str
    nodes: int
    k: int
    hit_rates: dict[str, list[float]] = field(default_factory=dict)  # "5".."inf" -> rates
    max_over_mean: list[float] = field(default_factory=list)
    copied_blocks: list[int] = field(default_factory=list)
    seconds: float = 0.0

    def rate(self, label: str) -> float:
        return statistics.median(self.hit_rates[label])


def route_trace(trace: Trace, keys: dict[int, bytes], kind: str, n: int, k: int,
                cluster: int) -> Routing:
    nodes = node_names(n, cluster)
    index = {name: i for i, name in enumerate(nodes)}
    loads = [0.0] * n
    serve: list[int | list[int]] = []
    copies: list[tuple[int, ...]] = []
    if kind == "per-block":
        owner = HashRing(nodes).owner
        node_of = {h: index[owner(key)] for h, key in keys.items()}
        for ids in trace.requests:
            route = [node_of[h] for h in ids]
            for i in route:
                loads[i] += 1
            serve.append(route)
            copies.append(())
        return Routing(kind, n, k, serve, copies, loads)
    digests = [keys[ids[min(k, len(ids)) - 1]] for ids in trace.requests]
    if kind in ("mod-N", "uhashring", "isolane"):
        owner = static_owner(kind, nodes)
        for ids, digest in zip(trace.requests, digests, strict=True):
            i = index[owner(digest)]
            loads[i] += len(ids)
            serve.append(i)
            copies.append(())
        return Routing(kind, n, k, serve, copies, loads)
    rate = len(trace.requests) / max(1.0, (trace.timestamps_ms[-1] - trace.timestamps_ms[0])
                                      / 1000)
    client = IsolaneClient(nodes, hot_threshold=hot_threshold(rate, n)
                           if kind.endswith("hot") else None)
    for ids, digest, ts in zip(trace.requests, digests, trace.timestamps_ms, strict=True):
        node, extra = client.route(digest, float(len(ids)), ts / 1000)
        serve.append(index[node])
        copies.append(tuple(index[r] for r in extra))
    return Routing(kind, n, k, serve, copies, [client.loads[name] for name in nodes])


def replay_routed(trace: Trace, routing: Routing, capacity: int | None) -> tuple[float, int]:
    """Block hit rate with one cache per node (S3-FIFO of ``capacity`` blocks, or
    unlimited for None), and the blocks copied to replicas."""
    n = routing.nodes
    caches: list[Any]
    if capacity is None:
        caches = [set() for _ in range(n)]
        store: Callable[[Any, int], None] = set.add
    else:
        budget = capacity * BLOCK_BYTES
        caches = [S3FIFOPolicy(budget) for _ in range(n)]

        def store(cache: Any, h: int) -> None:
            touch_or_admit(cache, h, budget)

    hits = copied = 0
    for ids, serve, extra in zip(trace.requests, routing.serve, routing.copies, strict=True):
        if isinstance(serve, int):
            cache = caches[serve]
            hits += prefix_hits(ids, cache)
            for h in ids:
                store(cache, h)
        else:
            for pos, (h, i) in enumerate(zip(ids, serve, strict=True)):
                if h not in caches[i]:
                    hits += pos
                    break
            else:
                hits += len(ids)
            for h, i in zip(ids, serve, strict=True):
                store(caches[i], h)
        for i in extra:  # a hot chain's blocks are written to its other replicas too
            for h in ids:
                if h not in caches[i]:
                    copied += 1
                store(caches[i], h)
    if capacity is not None:
        for cache in caches:
            policy: EvictionPolicy[Hashable] = cache
            if policy.nbytes > capacity * BLOCK_BYTES:
                raise RuntimeError(f"cache over budget: {policy.nbytes} > {capacity}")
    return hits / trace.blocks, copied


def size_label(percent: float | None) -> str:
    return "inf" if percent is None else f"{percent:g}"


_TRACE: Trace | None = None  # set before the worker processes fork
_KEYS: dict[int, bytes] = {}


def trace_case(case: tuple[str, int, int, int, tuple[float, ...]]
               ) -> tuple[dict[str, float], float, int, float]:
    """Route the trace once, replay it at every cache size: (rates, max/mean, copies, s)."""
    kind, n, k, cluster, sizes = case
    assert _TRACE is not None
    start = time.perf_counter()
    routing = route_trace(_TRACE, _KEYS, kind, n, k, cluster)
    rates: dict[str, float] = {}
    copied = 0
    for percent in (*sizes, None):
        cap = None if percent is None else capacity_blocks(_TRACE.unique_blocks, percent, n)
        rates[size_label(percent)], copies = replay_routed(_TRACE, routing, cap)
        copied = max(copied, copies)
    return rates, routing.max_over_mean, copied, time.perf_counter() - start


def run_trace(trace: Trace, kinds: Sequence[str], node_counts: Sequence[int],
              sizes: Sequence[float], ks: Sequence[int], clusters: int, workers: int,
              log: Callable[[str], None]) -> list[HitResult]:
    global _TRACE, _KEYS
    _TRACE = trace
    _KEYS = {h: blake(b"mooncake-%d" % h) for ids in trace.requests for h in ids}
    sweep_at = node_counts[len(node_counts) // 2]
    results: dict[tuple[str, int, int], HitResult] = {}
    cases = []
    for n in node_counts:
        for k in ks:
            for kind in kinds:
                if k != 2 and (n != sweep_at or kind not in ("isolane", "isolane bounded")):
                    continue  # the k sweep: isolane's routers, one cluster size
                results[(kind, n, k)] = HitResult(kind, n, k)
                # mod-N ignores names; the k sweep is a side table: one naming each.
                namings = 1 if kind == "mod-N" or k != 2 else clusters
                cases += [(kind, n, k, cluster, tuple(sizes)) for cluster in range(namings)]
    # Cases are independent: spread them over processes (fork shares the trace).
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        for case, (rates, mom, copied, secs) in zip(
                cases, pool.imap(trace_case, cases), strict=True):
            kind, n, k, cluster, _ = case
            res = results[(kind, n, k)]
            for label, rate in rates.items():
                res.hit_rates.setdefault(label, []).append(rate)
            res.max_over_mean.append(mom)
            res.copied_blocks.append(copied)
            res.seconds += secs
            log(f"  trace N={n} k={k} naming {cluster} {kind:20} " + " ".join(
                f"{lbl}%:{r * 100:.1f}" for lbl, r in rates.items())
                + f" max/mean {mom:.2f} ({secs:.1f} s)")
    return list(results.values())


# -- the report ----------------------------------------------------------------------------
def pct(value: float) -> str:
    return f"{value * 100:.1f} %"


def render(args: argparse.Namespace, moves: list[MoveResult], loads: list[LoadResult],
           hits: list[HitResult], trace: Trace | None, ceiling: float | None,
           seconds: float) -> str:
    out = ["## KV routing across nodes (`benchmarks/bench_routing.py`)", ""]
    out += [f"Command: `{C.command_line()}`  ", f"Date: {C.now_text()}  ",
            "Machine: " + C.machine_description(C.REPO_ROOT, versions()), ""]
    out.append(
        "A simulation of the pure routing logic (no servers, no disks; "
        f"{seconds:.0f} s in all, the trace replays in {args.workers} processes). "
        "Routers: `mod-N` = xxh3 of the routing digest mod N; `uhashring` = the "
        f"PyPI ring at its defaults (md5, 160 points a node); `per-block` = isolane's ring "
        "with every block routed by its own key; `isolane` = `HashRing` (256 points a "
        "node) on the routing digest; `isolane bounded` = + bounded loads "
        f"(`BoundedLoadRouter`, c = {LOAD_BOUND}, keeping a chain on the node that served "
        "it last while that node stays within its bound); `isolane bounded+hot` = + hot "
        f"replicas (R = {REPLICAS}, power of two choices; `place_request`). The routing "
        "digest of a chain is the key of its block k - 1 (k = 2 unless stated), the same "
        "for every prefix-aware router.")
    out += ["", "### Keys moved on join and leave", ""]
    out.append(f"Fraction of {args.keys:,} random routing digests (per-block: "
               "the block keys of as many blocks) whose node changes, over the ideal "
               "(the share of the node that joins or leaves: 1/9, 1/8, 1/65, 1/64); median "
               f"of {args.trials} trials (different new names or departing nodes), worst "
               "in brackets (mod-N: one trial, it does not depend on the name). "
               "`(requests)` rows: the share of a Zipf (s = 1.0) request stream that goes "
               "to another node. Weighted by requests, one hot chain whose owner changes "
               "moves a lot (the worst `isolane (requests)` trials); under bounded loads "
               "every request that was passed on follows the loads, and a membership "
               "change perturbs them everywhere, so such requests move far more than the "
               "keys do.")
    out.append("")
    cols = [f"{a} → {b}" for a, b in MOVES]
    rows = []
    for router in dict.fromkeys(m.router for m in moves):
        cells: list[object] = [f"`{router}`"]
        for before, after in MOVES:
            res = next(m for m in moves if m.router == router and (m.before, m.after)
                       == (before, after))
            r = res.ratios()
            cells.append(f"{statistics.median(r):.2f}x ({max(r):.2f}x) · "
                         f"{pct(statistics.median(res.fractions))}")
        rows.append(cells)
    out.append(C.markdown_table(["router", *cols], rows))
    out += ["", "### Load under Zipf-skewed prefixes", ""]
    out.append(f"{args.chains:,} chains (1 + geometric blocks, mean ~{MEAN_BLOCKS}), "
               f"{args.requests:,} requests drawn with Zipf exponent s; load = blocks "
               "served per node; max/mean over nodes, median of "
               f"{args.seeds} seeds (all runs in `.bench/routing.json`). Bounded loads see "
               "the blocks served so far as the nodes' load reports; hot = a chain past "
               f"{HOT_SHARE:g} of one node's fair share of requests (decayed, half-life "
               f"{HOT_HALF_LIFE_S:g} s at {SYNTHETIC_RATE:g} requests/s).")
    out.append("")
    headers = ["router", *(f"N={n} s={s:g}" for n in LOAD_NODES for s in ZIPF_S)]
    rows = []
    for router in ROUTERS:
        cells = [f"`{router}`"]
        for n in LOAD_NODES:
            for s in ZIPF_S:
                res = next(r for r in loads if (r.router, r.nodes, r.s) == (router, n, s))
                cells.append(f"{statistics.median(res.max_over_mean):.2f}")
        rows.append(cells)
    out.append(C.markdown_table(headers, rows))
    out += ["", "The price of the bound: share of requests sent to a node that holds no "
            "copy of their chain yet (a chain's first request not counted; a hot chain's "
            "replicas hold copies): such a request finds no KV there and leaves another "
            "copy. 0 for the fixed placements; per-block scatters every chain by design. "
            "isolane's router keeps a chain on the node that served it last while that "
            "node stays within its bound (`prefer`).", ""]
    rows = []
    for router in ("isolane bounded", "isolane bounded+hot"):
        cells = [f"`{router}`"]
        for n in LOAD_NODES:
            for s in ZIPF_S:
                res = next(r for r in loads if (r.router, r.nodes, r.s) == (router, n, s))
                cells.append(pct(statistics.median(res.uncopied)))
        rows.append(cells)
    out.append(C.markdown_table(headers, rows))
    if trace is not None and ceiling is not None:
        out += render_hits(args, hits, trace, ceiling)
    out += render_targets(moves, loads, hits)
    return "\n".join(out) + "\n"


def render_hits(args: argparse.Namespace, hits: list[HitResult], trace: Trace,
                ceiling: float) -> list[str]:
    out = ["", "### Hit rate on the Mooncake conversation trace", ""]
    out.append(
        f"`{args.trace.name}`: {len(trace.requests):,} requests, {trace.blocks:,} blocks of "
        f"512 tokens ({trace.unique_blocks:,} unique), replayed in timestamp order. Every "
        "request starts with the same block (a shared system prompt): with k = 1 every "
        "prefix-aware router sends all of them to one node. Each node's cache is S3-FIFO "
        "holding the given share of the unique blocks divided by N; `∞` = unlimited "
        "caches (what the routing alone loses). Hits = the longest prefix of a request's "
        "blocks resident where its blocks route. max/mean = blocks served per node over "
        f"the hour. Unlimited single cache (ceiling): **{pct(ceiling)}** (README: "
        f"{README_CEILING * 100:.1f} %).")
    labels = [*(size_label(s) for s in args.trace_sizes), "inf"]
    spread = max((max(h.hit_rates[lbl]) - min(h.hit_rates[lbl]), h.router, h.nodes, lbl)
                 for h in hits for lbl in labels)
    out.append("")
    out.append(f"Medians over {args.clusters} namings of the nodes (each cuts the ring "
               "differently; `mod-N` does not depend on names and the k table uses the first "
               "naming only); the largest spread "
               f"between namings: {spread[0] * 100:.1f} points (`{spread[1]}`, {spread[2]} "
               f"nodes, {'∞' if spread[3] == 'inf' else spread[3] + ' %'}). The best "
               "router of each column in bold. `per-block` has the highest max/mean load "
               "because every request reads the shared first block from one node.")
    if not any(any(h.copied_blocks) for h in hits):
        out.append("No chain of the trace got hot at this threshold (a conversation does "
                   f"not reach {HOT_SHARE:g} of a node's fair share of requests), so "
                   "`isolane bounded+hot` routes exactly as `isolane bounded` here.")

    def header(lbl: str) -> str:
        return "∞" if lbl == "inf" else f"{lbl} %"

    for n in args.trace_nodes:
        mine = [h for h in hits if h.nodes == n and h.k == 2]
        if not mine:
            continue
        best = {lbl: max(round(h.rate(lbl), 3) for h in mine) for lbl in labels}
        rows = []
        for h in mine:
            copied = statistics.median(h.copied_blocks)
            rows.append([f"`{h.router}`", *(
                f"**{pct(h.rate(lbl))}**" if round(h.rate(lbl), 3) == best[lbl]
                else pct(h.rate(lbl)) for lbl in labels),
                f"{statistics.median(h.max_over_mean):.2f}",
                f"{copied:,.0f}" if copied else "-"])
        out += ["", f"{n} nodes:", ""]
        out.append(C.markdown_table(
            ["router", *(header(lbl) for lbl in labels), "max/mean load",
             "blocks copied to replicas"], rows))
    sweep = [h for h in hits if h.router in ("isolane", "isolane bounded")
             and h.nodes == args.trace_nodes[len(args.trace_nodes) // 2]]
    if len({h.k for h in sweep}) > 1:
        n = sweep[0].nodes
        out += ["", f"Prefix blocks k (the routing digest is the key of block k - 1), "
                f"{n} nodes:", ""]
        rows = [[f"`{h.router}`", h.k, *(pct(h.rate(lbl)) for lbl in labels),
                 f"{statistics.median(h.max_over_mean):.2f}"]
                for h in sorted(sweep, key=lambda h: (h.router, h.k))]
        out.append(C.markdown_table(
            ["router", "k", *(header(lbl) for lbl in labels), "max/mean load"], rows))
    return out


def render_targets(moves: list[MoveResult], loads: list[LoadResult],
                   hits: list[HitResult]) -> list[str]:
    out = ["", "Targets (issue 5), read from the tables above:", ""]
    rows: list[list[object]] = []
    mine = [m for m in moves if m.router == "isolane"]
    worst = max(statistics.median(m.ratios()) for m in mine)
    rows.append(["keys moved ≤ 1.2 x ideal (`isolane`, median of trials)",
                 f"{worst:.2f}x at worst over the four changes (worst single trial "
                 f"{max(max(m.ratios()) for m in mine):.2f}x)",
                 "met" if worst <= 1.2 else "not met"])
    at1 = [r for r in loads if r.router == "isolane bounded" and r.s == 1.0]
    top = max(statistics.median(r.max_over_mean) for r in at1)
    unbounded = max(statistics.median(r.max_over_mean) for r in loads
                    if r.router == "isolane" and r.s == 1.0)
    rows.append(["max/mean load ≤ 1.25 at s = 1.0 (`isolane bounded`)",
                 f"{top:.3f} at worst (N = {', '.join(str(r.nodes) for r in at1)}); "
                 f"{unbounded:.2f} without the bound",
                 "met" if round(top, 3) <= 1.25 else "not met"])
    for router in ("isolane", "isolane bounded"):
        worst: dict[str, tuple[float, int]] = {}  # size -> (smallest gap, at N)
        for h in hits:
            if h.router != router or h.k != 2:
                continue
            base = next(b for b in hits if b.router == "per-block" and b.nodes == h.nodes)
            for lbl in h.hit_rates:
                gap = (h.rate(lbl) - base.rate(lbl), h.nodes)
                if lbl != "inf" and (lbl not in worst or gap < worst[lbl]):
                    worst[lbl] = gap
        if worst:
            met = [lbl for lbl, (gap, _) in worst.items() if round(gap, 3) >= 0]
            verdict = ("met" if len(met) == len(worst) else "not met" if not met
                       else f"met at {', '.join(lbl + ' %' for lbl in met)} only")
            rows.append([f"prefix-aware hit rate ≥ per-block hashing's (`{router}`, k = 2)",
                         "; ".join(f"{lbl} %: {gap * 100:+.1f} points (N = {n})"
                                   for lbl, (gap, n) in worst.items())
                         + " (the smallest gap over N per cache size)", verdict])
    out.append(C.markdown_table(["target", "reached", "verdict"], rows))
    return out


def versions() -> dict[str, str]:
    out = {"isolane": isolane.__version__}
    for name in ("uhashring", "xxhash", "numpy"):
        out[name] = importlib.metadata.version(name)
    return out


# -- command line ----------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake trace (.jsonl)")
    p.add_argument("--keys", type=int, default=50_000, help="routing digests for keys moved")
    p.add_argument("--trials", type=int, default=8, help="joins/leaves per change")
    p.add_argument("--chains", type=int, default=20_000, help="chains of the Zipf workload")
    p.add_argument("--requests", type=int, default=100_000, help="requests of a Zipf stream")
    p.add_argument("--seeds", type=int, default=3, help="Zipf workloads per (s, N)")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: fewer keys, requests and seeds; 8 nodes on the trace")
    p.add_argument("--clusters", type=int, default=3,
                   help="namings of the nodes per trace case (medians are reported)")
    p.add_argument("--workers", type=int, default=2, help="processes for the trace replays")
    p.add_argument("--no-trace", action="store_true", help="skip the hit-rate replay")
    p.add_argument("--out", type=Path, help="markdown file whose section to (re)write")
    p.add_argument("--section", default=SECTION, help="section marker name in --out")
    p.add_argument("--json", type=Path, default=C.REPO_ROOT / ".bench" / "routing.json",
                   help="raw results (default .bench/routing.json)")
    args = p.parse_args(argv)
    args.trace_nodes, args.trace_sizes = TRACE_NODES, TRACE_SIZES
    if args.quick:
        args.keys, args.trials, args.chains = 10_000, 3, 5_000
        args.requests, args.seeds, args.trace_nodes = 20_000, 1, (8,)
        args.clusters = 1
    if min(args.keys, args.trials, args.chains, args.requests, args.seeds, args.clusters,
           args.workers) < 1:
        p.error("--keys, --trials, --chains, --requests, --seeds, --clusters and --workers "
                "must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()

    def log(text: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f} s]{text}", file=sys.stderr, flush=True)

    digests = [blake(b"key-%d" % i) for i in range(args.keys)]
    block_keys = [blake(b"block-%d" % i) for i in range(args.keys)]
    zipf = Workload(99, 1.0, args.chains, args.requests)
    moves = run_moves(digests, block_keys, zipf, args.trials, log)
    loads = run_loads(args.chains, args.requests, args.seeds, log)
    trace = ceiling = None
    hits: list[HitResult] = []
    if not args.no_trace:
        trace = load_trace(args.trace)
        ceiling = replay_unlimited(trace)
        hits = run_trace(trace, ROUTERS, args.trace_nodes, args.trace_sizes, K_SWEEP,
                         args.clusters, args.workers, log)
    seconds = time.perf_counter() - start
    report = render(args, moves, loads, hits, trace, ceiling, seconds)
    print(report)
    raw = {"date": C.now_text(), "command": C.command_line(), "versions": versions(),
           "seconds": seconds, "ceiling": ceiling,
           "moves": [vars(m) for m in moves], "loads": [vars(r) for r in loads],
           "hits": [vars(h) for h in hits]}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(raw, indent=1))
    print(f"wrote {args.json}", file=sys.stderr)
    if args.out:
        C.replace_section(args.out, args.section, report)
        print(f"wrote section '{args.section}' of {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
