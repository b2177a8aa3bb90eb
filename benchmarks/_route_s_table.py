"""``bench_routing.py --s-table``: the hit-rate cost of the segment size S, measured.

For each S (S = 1 is per-block placement: a segment of one block), trace and node
count, the segment families ``S_FAMILIES`` run on ``--clusters`` node namings beside the
per-block baselines of the same run; the table keeps, per cell, the best family that
meets the load (median max/mean ≤ ``LOAD_TARGET``) and move (keys moved when a node
joins ≤ ``MOVE_TARGET`` x ideal, median of ``MOVE_TRIALS`` new names) targets, its
median gap to the best per-block baseline (the worst over the policies and sizes) and
the widest range of its hit rate over the namings. The mechanism column: the
coefficient of variation of the distinct blocks routed to each node (a node's cache
demand) under ``segment hrw`` (pure rendezvous hashing of the units, no load bound) at
each S, whose lumps of S blocks make a node's share of a chain binomial in L / S units
instead of L. A second table takes the cost of S itself: each S's best family against
S = 1's (the per-block placement that meets the same load and move targets, which the
best per-block baseline does not), with how that cost follows the growth of the
mechanism columns (Pearson r over the cells). ``--from-json`` renders the tables again
from the raw results of several runs (each ``--section`` of a split run), so one table
covers them all.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C

C.ensure_repo_importable()

from _route_report import by  # noqa: E402
from _route_sim import (  # noqa: E402
    HIT_SLACK,
    LOAD_TARGET,
    MOVE_TARGET,
    MOVE_TRIALS,
    PER_BLOCK,
    Case,
    CaseResult,
    MoveResult,
    label,
    node_names,
    unit_owners,
    units_for,
    versions,
)
from _trace import capacity_blocks  # noqa: E402

S_VALUES = (1, 2, 3, 4)
S_FAMILIES = ("segment bounded", "segment hrw", "segment hrw bounded")
"""The segment families of the S table: the client's (ring, bounded loads) and the two
rendezvous ones, the best within the load and move targets in earlier runs."""
STATIC = {"segment bounded": "segment ring", "segment hrw": "segment hrw",
          "segment hrw bounded": "segment hrw"}
"""Whose owners a family's keys moved follow (a bounded router moves what its hashing
moves)."""
MECHANISM = "segment hrw"
SECTION = "routing-s"


def s_table_cases(traces: Sequence[str], nodes: Sequence[int], s_values: Sequence[int],
                  clusters: int, labels: tuple[tuple[str, float | None], ...]) -> list[Case]:
    """The per-block baselines once (mod-N has one placement whatever the names) and
    every family at every S, each on ``clusters`` namings."""
    out = []
    for name in traces:
        for n in nodes:
            for kind in PER_BLOCK:
                out += [Case(name, kind, n, 1, c, labels, group="s-table")
                        for c in range(1 if kind.endswith("mod-N") else clusters)]
            out += [Case(name, kind, n, s, c, labels, group="s-table")
                    for s in s_values for kind in S_FAMILIES for c in range(clusters)]
    return out


def join_fractions(trace: str, kind: str, s: int, n: int) -> list[float]:
    """Share of the stored block copies whose node changes when a node joins ``n``
    nodes (``MOVE_TRIALS`` new names), for ``segment ring`` or ``segment hrw`` at S."""
    units = units_for(trace, kind, s)
    weight = units.blocks.astype(np.float64)
    old = node_names(n)
    index = {x: i for i, x in enumerate(old)}
    base = unit_owners(units, kind, old, index)
    out = []
    for t in range(MOVE_TRIALS):
        new = [*old, f"http://10.9.{t}.1:7070"]
        index[new[-1]] = n  # this trial's new node, beside the old ones
        moved = unit_owners(units, kind, new, index) != base
        out.append(float(weight[moved].sum() / weight.sum()))
    return out


def s_table_moves(trace: str, nodes: Sequence[int], s_values: Sequence[int]
                  ) -> list[MoveResult]:
    return [MoveResult(trace, kind, n, n + 1, join_fractions(trace, kind, s, n), s=s)
            for s in s_values for kind in dict.fromkeys(STATIC.values()) for n in nodes]


# -- the table ----------------------------------------------------------------------------------
def _median(results: list[CaseResult], lbl: str) -> float:
    return statistics.median(r.block_hits[lbl] for r in results)


def cell(results: list[CaseResult], moves: list[MoveResult], trace: str, n: int, s: int,
         labels: list[str]) -> tuple[float, float, str] | None:
    """The best family within the load and move targets at (trace, N, S): (median gap
    to the best per-block baseline, the worst over ``labels``; its widest range over the
    namings; the family), or None when no family there meets both."""
    base = {lbl: max(_median(by(results, trace=trace, nodes=n, router=b), lbl)
                     for b in PER_BLOCK) for lbl in labels}
    fits = []
    for kind in S_FAMILIES:
        mine = by(results, trace=trace, nodes=n, router=kind, s=s)
        if not mine:
            continue
        load = statistics.median(r.max_over_mean for r in mine)
        moved = [m for m in moves if (m.trace, m.router, m.before, m.s)
                 == (trace, STATIC[kind], n, s)]
        if load > LOAD_TARGET or not moved or statistics.median(moved[0].ratios()) > MOVE_TARGET:
            continue
        gap = min(_median(mine, lbl) - base[lbl] for lbl in labels)
        width = max(max(r.block_hits[lbl] for r in mine) - min(r.block_hits[lbl] for r in mine)
                    for lbl in labels)
        fits.append((gap, width, kind))
    return max(fits) if fits else None


def render_s_table(results: list[CaseResult], moves: list[MoveResult],
                   unique: dict[str, int], sizes: Sequence[float], labels: list[str],
                   s_values: Sequence[int]) -> list[str]:
    """The table and its verdict, every word of which comes from ``results``."""
    traces = list(dict.fromkeys(r.trace for r in results))
    nodes = sorted({r.nodes for r in results})
    out = [
        "Each S cell: the best segment family within the load (median max/mean ≤ "
        f"{LOAD_TARGET:g}) and move (keys moved on a join ≤ {MOVE_TARGET:g}x ideal) "
        "targets at that S, its median block hit rate over the node namings against the "
        "best per-block baseline's median (points, the worst over the policies and sizes; "
        f"target ≥ {-HIT_SLACK * 100:g}), the widest range of its hit rate over the namings "
        "in brackets, and the family (`bnd` = `segment bounded`, `hrw` = `segment hrw`, "
        "`hrw-b` = `segment hrw bounded`); ✓ = meets the hit-rate target. S = 1 is "
        "per-block placement: segments of one block, block 0 anchored at the routing "
        "digest as segment 0 always is, so a first block that many chains share (a "
        "system prompt) is stored once per routing digest's node instead of on one node. "
        "`cache a node`: the blocks each "
        f"node's cache holds at {min(sizes):g} .. {max(sizes):g} % of the unique blocks; "
        "`best per-block`: the better baseline at the middle size (median over the "
        "namings) and its max/mean load (mod-N moves N x the ideal on a join, the ring "
        "has no load bound: the target's baseline need not meet the other two targets). "
        f"Mechanism: the coefficient of variation over the nodes of the distinct blocks "
        f"routed to each (its cache demand) under `{MECHANISM}` (no load bound), median "
        "over the namings, at each S; √S is what S-block lumps of independent units "
        "would multiply the S = 1 value by; `served max/mean`: the blocks served by the "
        f"busiest node over the mean under `{MECHANISM}` (the same lumps, weighted by "
        "how often each block is asked for).", ""]
    short = {"segment bounded": "bnd", "segment hrw": "hrw", "segment hrw bounded": "hrw-b"}
    cells_of: dict[tuple[str, int], dict[int, tuple[float, float, str] | None]] = {}
    demand: dict[tuple[str, int], tuple[list[float], list[float]]] = {}  # cv, served
    rows = []
    for name in traces:
        for n in nodes:
            if not by(results, trace=name, nodes=n):
                continue
            caps = [capacity_blocks(unique[name], z, n) for z in sizes]
            mid = labels[len(labels) // 2]
            base = max(PER_BLOCK, key=lambda b, name=name, n=n, mid=mid: _median(
                by(results, trace=name, nodes=n, router=b), mid))
            load = statistics.median(r.max_over_mean for r in by(
                results, trace=name, nodes=n, router=base))
            row: list[object] = [f"`{name}`", n, f"{min(caps):,} .. {max(caps):,}",
                                 f"`{base}` ({load:.2f})"]
            got = cells_of[(name, n)] = {s: cell(results, moves, name, n, s, labels)
                                         for s in s_values}
            for s in s_values:
                if got[s] is None:
                    row.append("none")
                    continue
                gap, width, kind = got[s]  # type: ignore[misc]
                row.append(f"{gap * 100:+.2f} ({width * 100:.1f}) `{short[kind]}`"
                           + (" ✓" if gap >= -HIT_SLACK else ""))
            mech = [by(results, trace=name, nodes=n, router=MECHANISM, s=s) for s in s_values]
            cvs = [statistics.median(r.stored_cv for r in m) if m else math.nan for m in mech]
            served = [statistics.median(r.max_over_mean for r in m) if m else math.nan
                      for m in mech]
            demand[(name, n)] = (cvs, served)
            row += [" / ".join(f"{v:.3f}" for v in cvs), " / ".join(f"{v:.2f}" for v in served)]
            rows.append(row)
    out.append(C.markdown_table(
        ["trace", "N", "cache a node (blocks)", "best per-block (max/mean)",
         *(f"S = {s}" for s in s_values),
         "stored CV, S = " + "/".join(map(str, s_values)),
         "served max/mean, S = " + "/".join(map(str, s_values))], rows))
    out += verdicts(cells_of, s_values, "the hit-rate target (≥ the best per-block baseline "
                    f"{-HIT_SLACK * 100:g} points)", lambda key, s: _gap(cells_of[key][s]))
    if 1 not in s_values or len(s_values) < 2:
        return out
    out += ["", "### The cost of S itself: against S = 1 within the same targets", "",
            "The best per-block baseline meets neither other target everywhere (`per-block "
            "mod-N` moves N x the ideal on a join; the ring's load is unbounded), so S = 1 "
            "placement that meets the load and move targets can miss the hit-rate target "
            "too. Each cell: the best family at S minus the best at S = 1 (points, medians "
            "over the namings, both within the load and move targets); ✓ = within "
            f"{HIT_SLACK * 100:g} points.", ""]
    rows = []
    pairs: list[tuple[float, float, float]] = []  # cost, Δ stored CV, Δ served max/mean
    for key, got in cells_of.items():
        row = [f"`{key[0]}`", key[1]]
        for s in s_values[1:]:
            cost = _gap(got[s]) - _gap(got[1])
            row.append("-" if math.isnan(cost) else f"{cost * 100:+.2f}"
                       + (" ✓" if cost >= -HIT_SLACK else ""))
            cvs, served = demand[key]
            i = s_values.index(s)
            if not math.isnan(cost) and not math.isnan(cvs[i] + served[i] + cvs[0]):
                pairs.append((cost, cvs[i] - cvs[0], served[i] - served[0]))
        rows.append(row)
    out.append(C.markdown_table(["trace", "N", *(f"S = {s} - S = 1" for s in s_values[1:])],
                                rows))
    out += verdicts(cells_of, s_values[1:], f"S = 1's hit rate {-HIT_SLACK * 100:g} points",
                    lambda key, s: _gap(cells_of[key][s]) - _gap(cells_of[key][1]))
    if len(pairs) >= 3:
        costs = [c for c, _, _ in pairs]
        parts = []
        for what, xs in (("stored CV", [x for _, x, _ in pairs]),
                         ("served max/mean", [y for _, _, y in pairs])):
            if len(set(xs)) > 1 and len(set(costs)) > 1:
                parts.append(f"{what} r = {statistics.correlation(costs, xs):+.2f}")
        if parts:
            out += ["", f"Mechanism, over the {len(pairs)} (cell, S ≥ 2) pairs: the cost of S "
                    f"against S = 1 correlates with the growth of `{MECHANISM}`'s "
                    + " and ".join(parts) + " (Pearson; negative: the more a node's demand "
                    "comes in lumps, the more hit rate S costs)."]
    return out


def _gap(got: tuple[float, float, str] | None) -> float:
    return math.nan if got is None else got[0]


def verdicts(cells_of: dict[tuple[str, int], dict[int, tuple[float, float, str] | None]],
             s_values: Sequence[int], target: str,
             gap: Callable[[tuple[str, int], int], float]) -> list[str]:
    """Per S, the cells within ``HIT_SLACK`` of ``target`` (``gap``: the cell's margin,
    NaN where no family meets the load and move targets), and the largest S within it
    on every cell."""
    total = len(cells_of)
    lines, everywhere = [], []
    for s in s_values:
        got = [(key, gap(key, s)) for key in cells_of]
        missed = [(key, g) for key, g in got if math.isnan(g) or g < -HIT_SLACK]
        text = f"S = {s}: {total - len(missed)} of {total} cells within"
        if missed:
            text += ", not " + ", ".join(
                f"`{t}` {n} ({'none' if math.isnan(g) else f'{g * 100:+.2f}'})"
                for (t, n), g in missed)
        else:
            everywhere.append(s)
        lines.append(text)
    big = [s for s in everywhere if s >= 2]
    return ["", f"Against {target}: " + "; ".join(lines) + ".", "",
            f"The largest S within {target} on every cell here: "
            + (f"S = {max(everywhere)}" if everywhere else "none")
            + ("" if big or 1 not in s_values else
               ", so no S ≥ 2" if everywhere else
               f", not even S = {min(s_values)}") + "."]


def render(args: argparse.Namespace, results: list[CaseResult], moves: list[MoveResult],
           unique: dict[str, int], seconds: float,
           sources: Sequence[tuple[str, str]] = ()) -> str:
    labels = [label(p, z) for p, z in args.labels if z is not None]
    sizes = sorted({z for _, z in args.labels if z is not None})
    s_values = sorted({r.s for r in results if r.router in S_FAMILIES})
    nodes = sorted({r.nodes for r in results})
    traces = list(dict.fromkeys(r.trace for r in results))
    clusters = max(r.cluster for r in results) + 1
    out = [f"## Segment size S against the hit-rate target, N = {'/'.join(map(str, nodes))}"
           f" (`benchmarks/bench_routing.py --s-table`)", "",
           f"Command: `{C.command_line()}`  ", f"Date: {C.now_text()}  "]
    if sources:
        out.append("Rendered from the raw results (`--json`) of these runs: " + "; ".join(
            f"`{cmd}` ({date})" for cmd, date in sources) + ".  ")
    out += ["Machine: " + C.machine_description(C.REPO_ROOT, versions()), "",
            f"The routing simulation of `bench_routing.py` ({seconds:.0f} s of replays in "
            f"all) on {', '.join(f'`{t}`' for t in traces)}, {clusters} node namings per "
            f"case, S = {', '.join(map(str, s_values))}; policies and sizes: "
            f"{', '.join(labels)}.", ""]
    out += render_s_table(results, moves, unique, sizes, labels, s_values)
    return "\n".join(out) + "\n"


def load_runs(paths: Sequence[Path]) -> tuple[list[CaseResult], list[MoveResult],
                                                dict[str, int], float, list[tuple[str, str]]]:
    """The S-table results, moves, unique blocks per trace, seconds and (command, date)
    of each run, from several raw JSON files (``--json`` of ``--s-table`` runs)."""
    results, moves, unique, seconds = [], [], {}, 0.0
    runs: list[tuple[str, str]] = []
    for path in paths:
        raw = json.loads(path.read_text())
        results += [CaseResult(**r) for r in raw["results"]]
        moves += [MoveResult(**m) for m in raw["moves"]]
        unique.update(raw["unique_blocks"])
        seconds += raw["seconds"]
        runs.append((raw["command"], raw["date"]))
    return results, moves, unique, seconds, runs
