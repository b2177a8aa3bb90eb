"""The report of ``bench_routing.py``: its tables and the page's ``routing`` rows, written
from the results of ``_route_sim.py`` (text from the data, never hard-coded)."""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C

C.ensure_repo_importable()

from _route_sim import (  # noqa: E402
    BEFORE,
    CLIENT_ROUTER,
    HIT_SLACK,
    LOAD_BOUND,
    LOAD_TARGET,
    MOVE_TARGET,
    MOVE_TRIALS,
    NODE_COUNTS,
    PER_BLOCK,
    WHOLE_CHAIN,
    CaseResult,
    K,
    MoveResult,
    label,
    versions,
)
from _trace import Trace  # noqa: E402


def pct(value: float) -> str:
    return f"{value * 100:.1f} %"


def find(results: list[CaseResult], trace: str, router: str, nodes: int
         ) -> CaseResult | None:
    return next((r for r in results if (r.trace, r.router, r.nodes) == (trace, router, nodes)),
                None)


def render(args: argparse.Namespace, traces: dict[str, Trace], ceilings: dict[str, float],
           results: list[CaseResult], moves: list[MoveResult], seconds: float) -> str:
    s = args.segment_blocks
    subset = f", N = {'/'.join(map(str, args.nodes))}" if args.nodes != NODE_COUNTS else ""
    out = [f"## KV routing across nodes{subset} (`benchmarks/bench_routing.py`)", ""]
    out += [f"Command: `{C.command_line()}`  ", f"Date: {C.now_text()}  ",
            "Machine: " + C.machine_description(C.REPO_ROOT, versions()), ""]
    out.append(
        f"A simulation of isolane's pure routing logic (no servers, no disks; {seconds:.0f} s "
        f"in all, in {args.workers} processes). Placements: `per-block ring` / `per-block "
        "mod-N` = every block by its own key on isolane's ring (256 points a node) / by "
        f"`xxh3_64 mod N` (the baselines); `{WHOLE_CHAIN}` = a prompt's blocks all on the "
        f"ring owner of its routing digest (the key of block {K - 1}), with bounded loads "
        f"(c = {LOAD_BOUND}, load = blocks served so far); `{BEFORE}` = segment i "
        f"(S = {s} blocks) on the ring owner of its own segment digest with bounded loads "
        f"(the placement before chain-affine segments); `{CLIENT_ROUTER}` = the cluster "
        "client's placement (`isolane.cluster.chain_placement`): a segment on its chain's "
        "home (or where it was written last) while within its load bound and its write "
        "share and starts before 3 % of the home's cache in blocks, else along its own "
        "digest's walk. The two segment placements run through "
        "the client's `ChainPlacement` during the replay, with its reads: a block is read "
        "from the first of its segment's read candidates that holds it, and only the "
        "blocks after the first miss are written. Each node caches its share of the given "
        "percentage of the trace's unique blocks (LRU or S3-FIFO) and sees a request's "
        "blocks tail first, as isolane's memory tier admits and touches them.")
    out += ["", "### Traces", ""]
    rows = []
    for name, trace in traces.items():
        lengths = sorted((len(r) for r in trace.requests), reverse=True)
        rows.append([f"`{name}`", trace.description, f"{len(trace.requests):,}",
                     f"{trace.blocks:,}", f"{trace.unique_blocks:,}",
                     f"{trace.blocks / len(trace.requests):.1f}", str(lengths[0]),
                     pct(ceilings[name])])
    out.append(C.markdown_table(
        ["trace", "what", "requests", "blocks", "unique", "mean blocks a request",
         "longest", "ceiling (one unlimited cache)"], rows))
    out += render_hits(args, traces, results)
    out += render_moves(moves)
    out += render_targets(args, traces, results, moves)
    return "\n".join(out) + "\n"


def render_hits(args: argparse.Namespace, traces: dict[str, Trace],
                results: list[CaseResult]) -> list[str]:
    out = ["", "### Hit rate, load and requests per restore", ""]
    out.append("Block hit rate at each policy and cache size (`∞`: unlimited caches, what "
               "the placement alone loses), the best of each column in bold; `req.` = "
               f"request-level prefix hit rate (s3fifo, {args.sizes[1]:g} %); "
               "max/mean = blocks served per node (the worst over the replays for the "
               "segment placements); stored = max/mean of the distinct blocks that route "
               "to each node; requests/restore = one per node holding some of the prompt's "
               "blocks, mean over requests, with the mean bound (`ceil(n / S)`; per block: "
               "n; whole chain: 1).")
    labels = [label(p, z) for p, z in args.labels]
    mid = label("s3fifo", args.sizes[1])
    for name in traces:
        for n in args.nodes:
            mine = [r for k in args.routers if (r := find(results, name, k, n)) is not None]
            if not mine:
                continue
            best = {lbl: max(r.block_hits[lbl] for r in mine) for lbl in labels}
            rows = []
            for r in mine:
                hits = [(f"**{pct(r.block_hits[lbl])}**"
                         if round(r.block_hits[lbl], 3) >= round(best[lbl], 3)
                         else pct(r.block_hits[lbl])) for lbl in labels]
                rows.append([f"`{r.router}`", *hits, pct(r.request_hits[mid]),
                             f"{r.max_over_mean:.2f}", f"{r.stored_max_over_mean:.2f}",
                             f"{r.requests_per_restore:.1f} (≤ {r.bound_per_restore:.1f})"])
            out += ["", f"`{name}`, {n} nodes:", ""]
            out.append(C.markdown_table(
                ["router", *("∞" if lbl.endswith("inf") else f"{lbl} %" for lbl in labels),
                 "req.", "max/mean", "stored", "requests/restore"], rows))
    return out


def render_moves(moves: list[MoveResult]) -> list[str]:
    out = ["", "### Keys moved on join and leave", ""]
    out.append(f"Share of stored block copies whose node changes, over the ideal (1 / "
               f"max(N_old, N_new)); median of {MOVE_TRIALS} trials (other new names or "
               f"departing nodes; mod-N: one), worst in brackets. The per-block and "
               f"`{WHOLE_CHAIN}` placements move what their rings move (the units whose "
               f"ring owner changed); `{BEFORE}` and "
               f"`{CLIENT_ROUTER}` are measured where a replay with unlimited caches "
               "stored each segment: one on its home's owner moves when the home moves "
               "(the mover's rule); one that spilled off its home stays, and counts when "
               "the node a reader looks for it on changes (the first along its own walk "
               "past the home's owner).")
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


@dataclass
class Targets:
    """One placement's worst case on one trace over the run's node counts, policies and
    cache sizes (unlimited caches aside)."""

    gap: float  # block hit rate minus the best per-block placement's (a share)
    gap_where: str
    load: float  # max/mean blocks served per node
    join: float  # median keys moved on a join, x the ideal 1 / N
    join_worst: float  # the worst single join trial
    over_bound: int  # restores needing more than ceil(n / S) requests
    gap_case: CaseResult | None = None  # where the hit-rate gap is worst
    gap_label: str = ""
    join_via_home: float = math.nan  # the worst join's part from spilled segments
    # that moved with their home's owner (median over its trials)

    @property
    def verdicts(self) -> dict[str, bool]:
        return {"hit rate": self.gap >= -HIT_SLACK, "load": self.load <= LOAD_TARGET,
                "keys moved": self.join <= MOVE_TARGET, "requests": self.over_bound == 0}


def targets(results: list[CaseResult], moves: list[MoveResult], trace: str, kind: str,
            labels: list[str]) -> Targets | None:
    gap, where, load, over = math.inf, "", 0.0, 0
    case: CaseResult | None = None
    at = ""
    for r in results:
        if (r.trace, r.router) != (trace, kind):
            continue
        load = max(load, r.max_over_mean)
        over += r.over_bound
        base = [b for b in results if (b.trace, b.nodes) == (trace, r.nodes)
                and b.router in PER_BLOCK]
        for lbl in labels:
            g = r.block_hits[lbl] - max(b.block_hits[lbl] for b in base)
            if g < gap:
                gap, where, case, at = g, f"N = {r.nodes}, {lbl} %", r, lbl
    if math.isinf(gap):
        return None
    joins = [m for m in moves
             if (m.trace, m.router) == (trace, kind) and m.after > m.before]
    worst = max(joins, key=lambda m: statistics.median(m.ratios())) if joins else None
    via = worst.via_home_ratios() if worst is not None else []
    return Targets(gap, where, load,
                   statistics.median(worst.ratios()) if worst else math.nan,
                   max(max(m.ratios()) for m in joins) if joins else math.nan, over,
                   case, at, statistics.median(via) if via else math.nan)


def long_request_note(mine: Targets, results: list[CaseResult]) -> str:
    """Where the client's worst hit-rate cell loses to the placement before: the share
    of the difference from requests of at least half a node's cache ("" when the run did
    not measure it)."""
    case, lbl = mine.gap_case, mine.gap_label
    if case is None or lbl not in case.long_hits:
        return ""
    peer = next((r for r in results if (r.trace, r.router, r.nodes, r.naming)
                 == (case.trace, BEFORE, case.nodes, case.naming)
                 and lbl in r.long_hits), None)
    if peer is None:
        return ""
    cap = case.node_cache[lbl]
    lost = (peer.block_hits[lbl] - case.block_hits[lbl]) * 100
    lost_long = (peer.long_hits[lbl] - case.long_hits[lbl]) * 100
    side = "below" if lost > 0 else "above"
    return (f"; there a node caches {cap} blocks, and the client's placement is "
            f"{abs(lost):.2f} points {side} the placement before; requests of >= "
            f"{cap / 2:.0f} blocks ({case.long_blocks[lbl] * 100:.0f} % of blocks), whose "
            f"segments up to 3 % of it share their home's cache, make "
            f"{abs(lost_long):.2f} of them"
            + ("" if (lost_long > 0) == (lost > 0) else " the other way"))


def render_targets(args: argparse.Namespace, traces: dict[str, Trace],
                   results: list[CaseResult], moves: list[MoveResult]) -> list[str]:
    out = ["", f"### Targets, S = {args.segment_blocks}", ""]
    out.append(f"Per trace, over every node count, policy and cache size: the worst gap of "
               f"block hit rate to the best per-block placement (target ≥ "
               f"{-HIT_SLACK * 100:.1f} points), the largest max/mean load (≤ "
               f"{LOAD_TARGET:g}), the worst median keys moved on a join (≤ "
               f"{MOVE_TARGET:g}x ideal), restores needing more than ceil(n / S) requests "
               "(0).")
    labels = [label(p, z) for p, z in args.labels if z is not None]
    rows = []
    for kind in (BEFORE, CLIENT_ROUTER):
        for name in traces:
            t = targets(results, moves, name, kind, labels)
            if t is None:
                continue
            failed = [w for w, ok in t.verdicts.items() if not ok]
            rows.append([f"`{kind}`", f"`{name}`",
                         f"{t.gap * 100:+.1f} points ({t.gap_where})", f"{t.load:.2f}",
                         f"{t.join:.2f}x", str(t.over_bound),
                         "not met: " + ", ".join(failed) if failed else "all met"])
    out.append(C.markdown_table(["router", "trace", "hit rate vs best per-block",
                                 "max/mean load", "keys moved on join",
                                 "restores over ceil(n/S)", "verdict"], rows))
    return out


def headline_rows(args: argparse.Namespace, traces: list[str], results: list[CaseResult],
                  moves: list[MoveResult], where: dict[str, str],
                  noise: dict[str, str] | None = None) -> list[Any]:
    """``results/routing.json``: per trace, the client's placement against the targets
    (worst over the run's node counts, policies and cache sizes), the placement before
    (segments by their own digests) beside it; ``noise``: per trace, the hit-rate gap's
    noise note (``_route_noise.NamingSpread.note``)."""
    import _results

    labels = [label(p, z) for p, z in args.labels if z is not None]
    span = f"N = {'/'.join(map(str, args.nodes))}"
    before_name = "before (segments by their own digests)"
    rows: list[Any] = []
    for name in traces:
        mine = targets(results, moves, name, CLIENT_ROUTER, labels)
        before = targets(results, moves, name, BEFORE, labels)
        if mine is None or before is None:
            continue
        rows.append(_results.Result(
            area="Cluster and routing",
            measure=f"block hit rate vs the best per-block placement, worst over {span}, "
                    f"policies and cache sizes, {name} trace (simulation)",
            value=round(mine.gap * 100, 1), unit="points", peer=before_name,
            peer_value=round(before.gap * 100, 1), target=f">= {-HIT_SLACK * 100:.1f} points",
            met=mine.verdicts["hit rate"],
            why=f"worst at {mine.gap_where}; before: {before.gap_where}"
                + long_request_note(mine, results)
                + (f"; {noise[name]}" if noise and name in noise else ""), **where))
        rows.append(_results.Result(
            area="Cluster and routing",
            measure=f"max / mean node load, worst over {span}, policies and cache sizes, "
                    f"{name} trace (simulation)",
            value=round(mine.load, 2), unit="x", peer=before_name,
            peer_value=round(before.load, 2), target=f"<= {LOAD_TARGET:g}x",
            met=mine.verdicts["load"], **where))
        rows.append(_results.Result(
            area="Cluster and routing",
            measure=f"keys moved when a node joins, worst over {span}, {name} trace "
                    "(simulation)",
            value=round(mine.join, 2), unit="x ideal 1/N", peer=before_name,
            peer_value=round(before.join, 2), target=f"<= {MOVE_TARGET:g}x",
            met=mine.verdicts["keys moved"],
            why=f"median of {MOVE_TRIALS} joins; the worst single join: "
                f"{mine.join_worst:.2f}x (segments where the client stored them: on their "
                "home, moved with it; spilled, read elsewhere when their walk changes)"
                + (f"; {mine.join_via_home:.2f}x of the worst median are spilled segments "
                   "that move only because their home's owner did (inherent to placing "
                   "later segments relative to it), the rest what the new node takes, "
                   "whole chains at a time"
                   if not math.isnan(mine.join_via_home) else ""),
            **where))
    return rows
