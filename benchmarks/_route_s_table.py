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
instead of L. ``--from-json`` renders the table again from the raw results of several
runs (each ``--section`` of a split run), so one table covers them all.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C

C.ensure_repo_importable()

from _route_hrw import hrw_owners  # noqa: E402
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
    ring_owners,
    units_for,
    versions,
)
from _trace import capacity_blocks  # noqa: E402

from isolane.cluster.ring import HashRing  # noqa: E402

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

    def owners(names: list[str]) -> npt.NDArray[np.str_]:
        if kind.endswith("hrw"):
            return np.array(names)[hrw_owners(names, units.pos)]
        index = {x: i for i, x in enumerate(names)}
        return np.array(names)[ring_owners(HashRing(names), index, units.pos)]

    old = node_names(n)
    base = owners(old)
    return [float(weight[owners([*old, f"http://10.9.{t}.1:7070"]) != base].sum()
                  / weight.sum()) for t in range(MOVE_TRIALS)]


def s_table_moves(trace: str, nodes: Sequence[int], s_values: Sequence[int]
                  ) -> list[MoveResult]:
    return [MoveResult(trace, kind, n, n + 1, join_fractions(trace, kind, s, n), s=s)
            for s in s_values for kind in dict.fromkeys(STATIC.values()) for n in nodes]


# -- the table ----------------------------------------------------------------------------------
def _by(results: list[CaseResult], **want: object) -> list[CaseResult]:
    return [r for r in results if all(getattr(r, k) == v for k, v in want.items())]


def _median(results: list[CaseResult], lbl: str) -> float:
    return statistics.median(r.block_hits[lbl] for r in results)


def cell(results: list[CaseResult], moves: list[MoveResult], trace: str, n: int, s: int,
         labels: list[str]) -> tuple[float, float, str] | None:
    """The best family within the load and move targets at (trace, N, S): (median gap
    to the best per-block baseline, the worst over ``labels``; its widest range over the
    namings; the family), or None when no family there meets both."""
    base = {lbl: max(_median(_by(results, trace=trace, nodes=n, router=b), lbl)
                     for b in PER_BLOCK) for lbl in labels}
    fits = []
    for kind in S_FAMILIES:
        mine = _by(results, trace=trace, nodes=n, router=kind, s=s)
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
        "per-block placement (a segment of one block). `cache a node`: the blocks each "
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
    rows = []
    met: dict[int, list[tuple[str, int]]] = {s: [] for s in s_values}
    missed: dict[int, list[tuple[str, int, float]]] = {s: [] for s in s_values}
    growth: list[float] = []
    for name in traces:
        for n in nodes:
            if not _by(results, trace=name, nodes=n):
                continue
            caps = [capacity_blocks(unique[name], z, n) for z in sizes]
            mid = labels[len(labels) // 2]
            base = max(PER_BLOCK, key=lambda b, name=name, n=n, mid=mid: _median(
                _by(results, trace=name, nodes=n, router=b), mid))
            load = statistics.median(r.max_over_mean for r in _by(
                results, trace=name, nodes=n, router=base))
            cells: list[object] = [f"`{name}`", n, f"{min(caps):,} .. {max(caps):,}",
                                   f"`{base}` ({load:.2f})"]
            for s in s_values:
                got = cell(results, moves, name, n, s, labels)
                if got is None:
                    cells.append("none")
                    missed[s].append((name, n, -math.inf))
                    continue
                gap, width, kind = got
                ok = gap >= -HIT_SLACK
                (met[s].append((name, n)) if ok else missed[s].append((name, n, gap)))
                cells.append(f"{gap * 100:+.2f} ({width * 100:.1f}) `{short[kind]}`"
                             + (" ✓" if ok else ""))
            cvs = [statistics.median(r.stored_cv for r in mine) if mine else math.nan
                   for s in s_values
                   for mine in [_by(results, trace=name, nodes=n, router=MECHANISM, s=s)]]
            cells.append(" / ".join(f"{v:.3f}" for v in cvs))
            cells.append(" / ".join(
                f"{statistics.median(r.max_over_mean for r in mine):.2f}" if mine else "-"
                for s in s_values
                for mine in [_by(results, trace=name, nodes=n, router=MECHANISM, s=s)]))
            if s_values[0] == 1 and cvs[0] > 0:
                growth += [cvs[i] / cvs[0] / math.sqrt(s) for i, s in enumerate(s_values)
                           if s > 1 and not math.isnan(cvs[i])]
            rows.append(cells)
    out.append(C.markdown_table(
        ["trace", "N", "cache a node (blocks)", "best per-block (max/mean)",
         *(f"S = {s}" for s in s_values),
         "stored CV, S = " + "/".join(map(str, s_values)),
         "served max/mean, S = " + "/".join(map(str, s_values))], rows))
    total = len(rows)
    lines = []
    for s in s_values:
        worst = min(missed[s], key=lambda x: x[2]) if missed[s] else None
        lines.append(
            f"S = {s}: meets on {len(met[s])} of {total} cells" + (
                "" if not missed[s] else "; misses " + ", ".join(
                    f"`{t}` {n} ({'none' if g == -math.inf else f'{g * 100:+.2f}'})"
                    for t, n, g in missed[s])) + (
                f" (worst `{worst[0]}` N = {worst[1]})" if worst and worst[2] > -math.inf
                else ""))
    everywhere = [s for s in s_values if len(met[s]) == total]
    big = [s for s in everywhere if s >= 2]
    out += ["", "In this table: " + "; ".join(lines) + ".", "",
            "The largest S that meets the hit-rate target on every cell here: "
            + (f"S = {max(everywhere)}" if everywhere else "none, not even S = 1")
            + ("" if not everywhere or big else " (no S ≥ 2 does)") + "."]
    if growth:
        out += ["", f"Stored CV at S over the S = 1 value, divided by √S: "
                f"{min(growth):.2f} .. {max(growth):.2f} over the cells (1 = the binomial "
                "lumps model)."]
    return out


def render(args: argparse.Namespace, results: list[CaseResult], moves: list[MoveResult],
           unique: dict[str, int], seconds: float, sources: Sequence[str] = ()) -> str:
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
        out.append("Rendered from the raw results of: " + ", ".join(f"`{x}`" for x in sources)
                   + " (each run's command is in its own section).  ")
    out += ["Machine: " + C.machine_description(C.REPO_ROOT, versions()), "",
            f"The routing simulation of `bench_routing.py` ({seconds:.0f} s of replays in "
            f"all) on {', '.join(f'`{t}`' for t in traces)}, {clusters} node namings per "
            f"case, S = {', '.join(map(str, s_values))}; policies and sizes: "
            f"{', '.join(labels)}.", ""]
    out += render_s_table(results, moves, unique, sizes, labels, s_values)
    return "\n".join(out) + "\n"


def load_runs(paths: Sequence[Path]) -> tuple[list[CaseResult], list[MoveResult],
                                                dict[str, int], float]:
    """The S-table results, moves, unique blocks per trace and seconds of several raw
    JSON files (``--json`` of ``--s-table`` runs)."""
    results, moves, unique, seconds = [], [], {}, 0.0
    for path in paths:
        raw = json.loads(path.read_text())
        results += [CaseResult(**r) for r in raw["results"]]
        moves += [MoveResult(**m) for m in raw["moves"]]
        unique.update(raw["unique_blocks"])
        seconds += raw["seconds"]
    return results, moves, unique, seconds
