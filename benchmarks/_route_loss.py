"""The node-loss table of ``bench_routing.py``: the share of the cached prefix blocks a
cluster still serves after one of its N nodes dies, per placement, with stored copies,
hit rate and load beside it (pure CPU work on ``_route_sim``'s routings).

A trace is replayed through the node caches (S3-FIFO, the middle cache size) as in the
hit-rate tables. Then every request of the trace is read again against the caches as
they ended: *before*, the longest prefix of its blocks resident where they route; after
node ``d`` dies, that prefix cut at the first block that routed to ``d`` (a client reads
a dead owner's segments as misses, and a prefix ends at its first miss). The share is
the sum over requests and over every ``d`` of *after* over ``N`` x the sum of *before*:
with one copy of each block, ``(N - 1) / N`` is the most any placement keeps. Requests of
at least ``LONG_BLOCKS`` blocks are counted apart (long prompts).
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C

C.ensure_repo_importable()

from _route_sim import (  # noqa: E402
    BEFORE,
    CLIENT,
    CLIENT_ROUTER,
    TRACES,
    WHOLE_CHAIN,
    client_reads,
    make_caches,
    node_names,
    replay_tail_first,
    route,
    route_client,
    units_for,
)
from _trace import capacity_blocks  # noqa: E402

LOSS_NODES = (3, 4, 8)
LOSS_ROUTERS = (BEFORE, WHOLE_CHAIN, CLIENT_ROUTER)
"""Segments by their own digests (version 2, before), whole chains on one node, and the
cluster client's chain-affine segments (version 3)."""
BASELINE_ROUTER = BEFORE
LOSS_LABEL = ("s3fifo", 10.0)
LONG_BLOCKS = 32
TARGET = 0.9  # served share after a loss >= TARGET x (N - 1) / N
STORED_TARGET = 1.1  # stored block copies <= this x the unique blocks


@dataclass
class LossCase:
    trace: str
    router: str
    nodes: int
    s: int


@dataclass
class LossResult:
    trace: str
    router: str
    nodes: int
    s: int
    share: float = 0.0  # served after one node dies / before, mean over the dead node
    share_long: float = 0.0  # the same over requests of >= LONG_BLOCKS blocks
    long_requests: int = 0
    stored: float = 0.0  # distinct (node, block) copies routed over the unique blocks
    block_hits: float = 0.0  # block hit rate of the replay (LOSS_LABEL)
    max_over_mean: float = 0.0  # blocks served per node
    requests_per_restore: float = 0.0
    seconds: float = 0.0

    @property
    def ideal(self) -> float:
        return (self.nodes - 1) / self.nodes

    @property
    def met(self) -> bool:
        return min(self.share, self.share_long) >= TARGET * self.ideal \
            and self.stored <= STORED_TARGET


def lost_prefix(ids: list[int], nodes: list[int], resident: list[Any], n: int
                ) -> tuple[int, int]:
    """(blocks served before, sum over each dead node of the blocks served after)."""
    before = len(ids)
    for pos, (h, i) in enumerate(zip(ids, nodes, strict=True)):
        if h not in resident[i]:
            before = pos
            break
    first: dict[int, int] = {}
    for pos in range(before):
        first.setdefault(nodes[pos], pos)
    after = sum(first.get(d, before) for d in range(n))
    return before, after


def run_loss_case(case: LossCase) -> LossResult:
    start = time.perf_counter()
    trace = TRACES[case.trace]
    units = units_for(case.trace, case.router, case.s)
    policy, size = LOSS_LABEL
    cap = capacity_blocks(trace.unique_blocks, size, case.nodes)
    res = LossResult(case.trace, case.router, case.nodes, case.s)
    reads: list[list[int]] | None = None
    if case.router in CLIENT:  # the client's reads: from the first candidate holding a block
        names = node_names(case.nodes)
        routing, hits, _, chains, by_name = route_client(trace, units, case.router, names,
                                                         case.s, policy, cap)
        caches: list[Any] = [by_name[n] for n in names]
        index = {n: i for i, n in enumerate(names)}
        loads = dict(zip(names, routing.loads, strict=True))
        reads = [[index[n] for n in client_reads(ids, runs, units, case.router, chains,
                                                 loads, by_name)]
                 for ids, runs in zip(trace.requests, units.runs, strict=True)]
    else:
        routing = route(units, case.router, case.nodes)
        caches, store = make_caches(case.nodes, policy, cap)
        hits, _ = replay_tail_first(trace.requests, routing.serve, caches, store)
    res.block_hits = hits / trace.blocks
    res.max_over_mean = max(routing.loads) / statistics.mean(routing.loads)
    res.requests_per_restore = statistics.mean(len(set(x)) for x in routing.serve)
    copies: list[set[int]] = [set() for _ in range(case.nodes)]
    totals = [0, 0, 0, 0]  # before, after, long before, long after
    for r, (ids, nodes) in enumerate(zip(trace.requests, routing.serve, strict=True)):
        for h, i in zip(ids, nodes, strict=True):
            copies[i].add(h)
        if reads is not None:  # where the prefix is read now; past it, nothing is
            nodes = reads[r] + [case.nodes] * (len(ids) - len(reads[r]))
        before, after = lost_prefix(list(ids), nodes, [*caches, set()], case.nodes)
        totals[0] += before * case.nodes
        totals[1] += after
        if len(ids) >= LONG_BLOCKS:
            res.long_requests += 1
            totals[2] += before * case.nodes
            totals[3] += after
    res.share = totals[1] / totals[0] if totals[0] else 0.0
    res.share_long = totals[3] / totals[2] if totals[2] else 0.0
    res.stored = sum(len(c) for c in copies) / trace.unique_blocks
    res.seconds = time.perf_counter() - start
    return res


def loss_cases(traces: list[str], s: int) -> list[LossCase]:
    """Every trace, N and router."""
    return [LossCase(t, r, n, s) for t in traces for n in LOSS_NODES for r in LOSS_ROUTERS]


def render_loss(results: list[LossResult]) -> str:
    """The node-loss table (markdown) and a line on the client's placement."""
    policy, size = LOSS_LABEL
    head = ("| trace | N | placement | served after a node dies | long prompts "
            f"(>= {LONG_BLOCKS} blocks) | target ({TARGET:g} x (N-1)/N) | stored copies "
            f"| block hit rate ({policy} {size:g} %) | max/mean load | nodes a restore |")
    rows = [head, "|" + "---|" * 10]
    for r in results:
        rows.append(
            f"| {r.trace} | {r.nodes} | `{r.router}` | {r.share * 100:.1f} % | "
            + (f"{r.share_long * 100:.1f} % ({r.long_requests} requests)"
               if r.long_requests else "none") + f" | {TARGET * r.ideal * 100:.1f} % "
            f"{'met' if r.met else 'not met'} | {r.stored:.3f}x | {r.block_hits * 100:.1f} % "
            f"| {r.max_over_mean:.2f} | {r.requests_per_restore:.2f} |")
    intro = (
        "Share of the cached prefix blocks still served after one of N nodes dies "
        "(`_route_loss.py`: every request read again against the caches as the replay "
        "left them, cut at its first block on the dead node; the mean over which node "
        f"dies). `{BASELINE_ROUTER}`: each segment by its own digest with bounded loads "
        f"(version 2); `{WHOLE_CHAIN}`: a chain on the node of its routing digest; "
        f"`{CLIENT_ROUTER}`: the cluster client's placement (version 3), every segment "
        "on its chain's home node (the owner of segment 0's digest), leaving it past its "
        "load bound or write share, or starting past 3 % of its cache, along its own "
        "digest's walk; the segment routers read "
        "every request through the client's read candidates. "
        "Stored "
        "copies: distinct (node, block) pairs written over the unique blocks.")
    return intro + "\n\n" + "\n".join(rows) + "\n"


HEADLINE_TRACE = "mooncake-conversation"


def headline_rows(results: list[LossResult], where: dict[str, str]) -> list[Any]:
    """``results/routing_node_loss.json``: per N on the Mooncake trace, the client's
    served share after a loss (all requests and long prompts) against the limit of one
    copy, its stored copies and its hit rate against segments on their own digests."""
    import _results

    rows: list[Any] = []
    for n in LOSS_NODES:
        mine = [r for r in results if r.trace == HEADLINE_TRACE and r.nodes == n]
        client = next((r for r in mine if r.router == CLIENT_ROUTER), None)
        base = next((r for r in mine if r.router == BASELINE_ROUTER), None)
        if client is None or base is None:
            continue
        ideal = client.ideal * 100
        for what, share, before in (
                ("prefix blocks served", client.share, base.share),
                (f"prompts of >= {LONG_BLOCKS} blocks: prefix blocks served",
                 client.share_long, base.share_long)):
            rows.append(_results.Result(
                area="Cluster and routing",
                measure=f"{what} after 1 of {n} nodes dies, Mooncake conversation trace "
                        "(simulation)",
                value=round(share * 100, 1), unit="%", peer="one copy's limit (N-1)/N",
                peer_value=round(ideal, 1), ratio=round(share * 100 / ideal * 100, 1),
                ratio_unit="%", target=f">= {TARGET * 100:g} %",
                met=share * 100 >= TARGET * ideal,
                why=f"segments placed by their own digests (before): {before * 100:.1f} %",
                **where))
        rows.append(_results.Result(
            area="Cluster and routing",
            measure=f"stored block copies, {n} nodes, Mooncake conversation trace "
                    "(simulation)",
            value=round(client.stored, 3), unit="x unique blocks",
            target=f"<= {STORED_TARGET:g}x", met=client.stored <= STORED_TARGET, **where))
        rows.append(_results.Result(
            area="Cluster and routing",
            measure=f"block hit rate with chain-affine segments, {n} nodes, Mooncake "
                    "conversation trace (simulation)",
            value=round(client.block_hits * 100, 2), unit="%",
            peer="segments placed by their own digests (before)",
            peer_value=round(base.block_hits * 100, 2),
            ratio=round(client.block_hits / base.block_hits, 2) if base.block_hits else None,
            **where))
    return rows
