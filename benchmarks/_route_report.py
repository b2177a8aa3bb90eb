"""The report of ``bench_routing.py``: every table and the summaries written from the
results of ``_route_sim.py`` (text from the data, never hard-coded)."""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C

C.ensure_repo_importable()

from _route_sim import (  # noqa: E402
    FAMILIES,
    HIT_SLACK,
    HOT_FACTOR,
    HRW,
    LOAD_BOUND,
    LOAD_TARGET,
    MOVE_TARGET,
    MOVE_TRIALS,
    NAMING_ROUTERS,
    NAMINGS,
    NODE_COUNTS,
    NOISE_NODES,
    NOISE_ROUTERS,
    ORDER_ROUTERS,
    PER_BLOCK,
    ROUTERS,
    S_SWEEP,
    SEGMENTS,
    SWEEP_NODES,
    SWEPT,
    CaseResult,
    K,
    MoveResult,
    label,
    versions,
)
from _trace import (  # noqa: E402
    Trace,
)

from isolane.cluster.chain_segments import DEFAULT_SEGMENT_BLOCKS  # noqa: E402


def pct(value: float) -> str:
    return f"{value * 100:.1f} %"


def by(results: list[CaseResult], **want: object) -> list[CaseResult]:
    return [r for r in results if all(getattr(r, k) == v for k, v in want.items())]


def median_of(results: list[CaseResult], fn: Callable[[CaseResult], float]) -> float:
    return statistics.median(fn(r) for r in results)


def render(args: argparse.Namespace, traces: dict[str, Trace], ceilings: dict[str, float],
           results: list[CaseResult], sweep: list[CaseResult], moves: list[MoveResult],
           seconds: float,
           noise: list[CaseResult] | None = None,
           ordered: list[CaseResult] | None = None) -> str:
    s = args.segment_blocks
    subset = [f"N = {'/'.join(map(str, args.nodes))}"] if args.nodes != NODE_COUNTS else []
    if len(args.routers) < len(ROUTERS):
        subset.append(f"{len(args.routers)} of the {len(ROUTERS)} routers")
    out = ["## KV routing across nodes" + (f", {', '.join(subset)}" if subset else "")
           + " (`benchmarks/bench_routing.py`)", ""]
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
        "bounded loads per segment (the cluster client's placement before chain-affine "
        "segments, run through the client's `ChainPlacement` with each segment its own "
        "home and no write bound); `segment affine ring` = every segment of a chain on "
        "the ring owner of its chain's home digest (segment 0's digest); "
        "`segment affine bounded` = + "
        "bounded loads along the home's walk; `segment affine spill` = the cluster "
        "client's placement (`isolane.cluster.chain_placement`, version 3): a segment "
        "taken by its home (or where it was written last) while within its load bound "
        "and its write share (segments placed lately, half-life: half the segments the "
        "10 % caches hold), else along its own digest's walk. Both are routed during the "
        "replay with the client's reads: a block is read from the first of its "
        "segment's read candidates that holds it, only the blocks after the first miss "
        "are written; `segment bounded hot "
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
        "if its owner or a predecessor's owner changes); `segment bounded sticky` / "
        "`per-block bounded sticky` = bounded loads for writes only: a unit is read where "
        "it was written while its first block is resident there, whatever that node's "
        "load, and placed anew (bounded, preferring that node) only when it would miss "
        "there (routed during the replay, once per policy and size; max/mean is the worst "
        "of them); `per-block hrw` / `segment hrw` (+ `bounded`) = rendezvous "
        "(highest-random-weight) hashing instead of the ring: a unit on the node with "
        "the highest `splitmix64(xxh3_64(digest) ^ xxh3_64(node))`, as even as mod-N in "
        "expectation, and a join moves only what the new node wins (bounded: the walk "
        "goes down the unit's scores, so units passed on spread over every node). "
        "Each node caches its share of the given "
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
    out += render_moves(moves)
    out += render_targets(args, traces, results, moves)
    out += render_noise(args, results, noise)
    out += render_families(args, traces, results, moves)
    out += render_naming_gaps(args, list(traces), results, moves)
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
            ring_kind = ("segment hrw" if kind in HRW else "segment affine ring"
                         if "affine" in kind else
                         "segment spread" if "spread" in kind else "segment v1 ring"
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
    static = ("per-block hrw" if kind.startswith("per-block hrw")
              else "segment hrw" if kind.startswith("segment hrw")
              else "per-block ring" if kind.startswith("per-block") and kind != "per-block mod-N"
              else "segment ring" if kind in ("segment bounded", "segment bounded hot only",
                                              "segment bounded sticky")
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
        "move target / both other targets at that N; `any within load and moves`: the "
        "same over every family here, the per-block ones (S = 1) included, which is what "
        "consistent-hash placement reaches at that N whatever the unit (`per-block "
        "ring` is itself one of the baselines: its gap is the ring's own to `per-block "
        "mod-N`, whose keys moved are N x the ideal).")
    rows = []
    summary: dict[str, list[tuple[float, float]]] = {"small": [], "large": []}
    reached: list[tuple[float, str, int, str]] = []  # best within load and moves, any unit
    for name in traces:
        for n in args.nodes:
            cells: list[object] = [f"`{name}`", n]
            fits: list[tuple[float, str]] = []
            movable: list[tuple[float, str]] = []
            anyfit: list[tuple[float, str]] = []
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
                if moved <= MOVE_TARGET and load <= LOAD_TARGET and kind != "segment spread":
                    anyfit.append((gap, kind))
                if kind == "segment spread":
                    spread = gap
                elif kind.startswith("segment") and moved <= MOVE_TARGET:
                    movable.append((gap, kind))
                    if load <= LOAD_TARGET:
                        fits.append((gap, kind))
            for got in (movable, fits, anyfit):
                best = max(got) if got else (math.nan, "none")
                cells.append(f"{best[0] * 100:+.1f} (`{best[1]}`)" if got else "none")
            rows.append(cells)
            if fits:
                summary["small" if n <= 16 else "large"].append((max(fits)[0], spread))
            if anyfit:
                reached.append((max(anyfit)[0], name, n, max(anyfit)[1]))
    out.append(C.markdown_table(["trace", "N", *(f"`{k}`" for k in kinds),
                                 "best within moves", "best within load and moves",
                                 "any within load and moves"], rows))
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
    if reached:
        met = [f"`{t}` N = {n} (`{k}`, {g * 100:+.1f})" for g, t, n, k in reached
               if g >= -HIT_SLACK]
        out += ["", f"Cells where some family of any unit meets all three targets: "
                f"{len(met)} of {len(reached)}" + (": " + ", ".join(met) if met else "")
                + ". Where none does, the best is "
                + ", ".join(f"`{t}` N = {n} {g * 100:+.1f} (`{k}`)" for g, t, n, k in reached
                            if g < -HIT_SLACK) + "."]
    return out


def render_order(args: argparse.Namespace, traces: dict[str, Trace],
                 results: list[CaseResult], ordered: list[CaseResult]) -> list[str]:
    """The caches touched tail first (the model) against head first, same placements."""
    if not ordered:
        return []
    labels = [label(p, z) for p, z in args.labels if z is not None]
    kinds = [k for k in ORDER_ROUTERS if k in args.routers and k not in PER_BLOCK]
    out = ["", "### Cache touch order: tail first (the tables above) against head first", ""]
    out.append(
        "The tables above replay every node cache touching or admitting a request's "
        "blocks tail first, so a chain's head is the most recent and is evicted last (as "
        "vLLM frees a request's blocks in reverse order, and as isolane's memory tier "
        "admits and touches a batch); here the same placements are replayed head first as well "
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
            for kind in kinds:
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
         *(f"`{k}`: worst gap, head → tail" for k in kinds)],
        rows))
    return out


def render_naming_gaps(args: argparse.Namespace, traces: list[str], results: list[CaseResult],
                       moves: list[MoveResult]) -> list[str]:
    """With ``--clusters`` > 1: per trace and N, each family's gap to the best per-block
    baseline as the median over the node namings, beside how far the namings spread it
    (the target's 0.1 points against the noise of the measurement)."""
    labels = [label(p, z) for p, z in args.labels if z is not None]
    kinds = [k for k in NAMING_ROUTERS if any(r.router == k for r in results)]
    if args.clusters < 2 or not labels or not kinds:
        return []
    out = ["", f"### Gap against naming noise ({args.clusters} node namings, same run)", ""]
    out.append(
        "Each cell: the family's worst gap, over the policies and sizes, of its median "
        "block hit rate over the namings to the best per-block baseline's median (points; "
        "target ≥ -0.1), and in brackets the widest range of its hit rate over the "
        "namings (points; `per-block mod-N` has one placement whatever the names). "
        "Then the best segment family within the load (≤ 1.25, median) and move (≤ 1.1x "
        "ideal on a join) targets, and its own range: a gap smaller than the range is "
        "within what renaming the nodes changes.")
    rows = []
    for name in traces:
        for n in args.nodes:
            cells: list[object] = [f"`{name}`", n]
            fits: list[tuple[float, float, str]] = []
            for kind in kinds:
                mine = by(results, trace=name, router=kind, nodes=n)
                if not mine or not all(by(results, trace=name, router=b, nodes=n)
                                       for b in PER_BLOCK):
                    cells.append("-")
                    continue
                gap, _ = family_gaps(results, name, kind, n, labels)
                width = max(max(c.block_hits[lbl] for c in mine)
                            - min(c.block_hits[lbl] for c in mine) for lbl in labels)
                cells.append(f"{gap * 100:+.1f} ({width * 100:.1f})")
                load = median_of(mine, lambda c: c.max_over_mean)
                if (kind.startswith("segment") and load <= LOAD_TARGET
                        and join_ratio(moves, name, kind, n) <= MOVE_TARGET):
                    fits.append((gap, width, kind))
            if len(cells) == 2 or all(c == "-" for c in cells[2:]):
                continue
            if fits:
                gap, width, kind = max(fits)
                cells += [f"{gap * 100:+.1f} (`{kind}`)", f"{width * 100:.1f}"]
            else:
                cells += ["none", "-"]
            rows.append(cells)
    out.append(C.markdown_table(
        ["trace", "N", *(f"`{k}`: median gap (range)" for k in kinds),
         "best segment family within load and moves", "its range over namings"], rows))
    return out
