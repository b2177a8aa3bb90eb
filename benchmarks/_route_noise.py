"""The noise of ``bench_routing.py``'s hit-rate targets, measured in the same run: how
much a placement's worst hit-rate gap moves when only the names of the blocks change.

A *naming* of a trace hashes every block id with its own salt (``_route_sim.
name_blocks``; naming 0 is the tables'): every segment and block lands elsewhere on
the ring and its walks, while the workload (which requests share which prefixes, in
which order) is the same. Under each naming the run replays the per-block baselines,
the placement before (``segment bounded``) and the client's (``segment affine spill``)
at every node count, policy and finite cache size, and takes each placement's worst
gap to the best per-block one, as the targets table does. A placement's *spread* is
the max - min of its worst gap over the namings. The client's placement is *within
noise* of the one before when the mean over namings of (client's worst gap - before's
worst gap, same naming) is no more negative than before's own spread.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C

C.ensure_repo_importable()

from _route_report import targets  # noqa: E402
from _route_sim import BEFORE, CLIENT_ROUTER, PER_BLOCK, Case, CaseResult, label  # noqa: E402

NOISE_ROUTERS = (*PER_BLOCK, BEFORE, CLIENT_ROUTER)
"""What a worst gap needs: the two per-block baselines and the two segment placements."""


def noise_cases(traces: list[str], nodes: tuple[int, ...], s: int,
                labels: tuple[tuple[str, float | None], ...], namings: int) -> list[Case]:
    """The replays of namings 1 .. ``namings`` - 1 (naming 0 is the tables' own run), at
    the finite cache sizes only (the targets leave unlimited caches aside)."""
    finite = tuple(lbl for lbl in labels if lbl[1] is not None)
    return [Case(name, kind, n, s, finite, naming) for naming in range(1, namings)
            for name in traces for n in nodes for kind in NOISE_ROUTERS]


@dataclass
class NamingSpread:
    """One trace's worst hit-rate gaps (shares) under each naming, naming 0 first."""

    trace: str
    client: list[float]
    before: list[float]

    @property
    def client_spread(self) -> float:
        return max(self.client) - min(self.client)

    @property
    def before_spread(self) -> float:
        return max(self.before) - min(self.before)

    @property
    def difference(self) -> float:
        """Mean over namings of client - before (same naming)."""
        return statistics.mean(c - b for c, b in zip(self.client, self.before, strict=True))

    @property
    def within_noise(self) -> bool:
        return self.difference >= -self.before_spread - 1e-12

    def note(self) -> str:
        """One line for a result row's ``why``."""
        return (f"over {len(self.client)} namings of the trace's blocks: worst gap "
                f"{min(self.client) * 100:+.1f}..{max(self.client) * 100:+.1f} points "
                f"(before {min(self.before) * 100:+.1f}..{max(self.before) * 100:+.1f}); "
                f"mean difference {self.difference * 100:+.1f} points against before's "
                f"spread {self.before_spread * 100:.1f}: "
                + ("within noise" if self.within_noise else "beyond noise"))


def spreads(results: list[CaseResult], noise: list[CaseResult], traces: list[str],
            labels: tuple[tuple[str, float | None], ...]) -> list[NamingSpread]:
    """Per trace, both placements' worst gap under every naming (``results``: the
    tables' run, naming 0; ``noise``: the other namings)."""
    finite = [label(p, z) for p, z in labels if z is not None]
    runs = [*results, *noise]
    namings = sorted({r.naming for r in runs})
    out: list[NamingSpread] = []
    if len(namings) < 2:
        return out
    for name in traces:
        gaps: dict[str, list[float]] = {BEFORE: [], CLIENT_ROUTER: []}
        for naming in namings:
            mine = [r for r in runs if r.naming == naming]
            for kind, worst in gaps.items():
                t = targets(mine, [], name, kind, finite)
                if t is not None:
                    worst.append(t.gap)
        if gaps[CLIENT_ROUTER] and len(gaps[CLIENT_ROUTER]) == len(gaps[BEFORE]):
            out.append(NamingSpread(name, gaps[CLIENT_ROUTER], gaps[BEFORE]))
    return out


def render_noise(found: list[NamingSpread]) -> list[str]:
    if not found:
        return []
    n = len(found[0].client)
    out = ["", "### Noise of the hit-rate gaps", ""]
    out.append(
        f"The worst gap of the targets table under {n} namings of each trace: every block "
        "id hashed with another salt, so the ring and walk positions change and the "
        "workload does not (naming 0 is the tables'). Spread = max - min over the "
        f"namings; `{CLIENT_ROUTER}` is within noise of `{BEFORE}` when the mean of "
        "their difference (same naming) is no more negative than before's spread.")
    rows = []
    for f in found:
        rows.append([f"`{f.trace}`", ", ".join(f"{g * 100:+.1f}" for g in f.client),
                     f"{f.client_spread * 100:.1f}",
                     ", ".join(f"{g * 100:+.1f}" for g in f.before),
                     f"{f.before_spread * 100:.1f}", f"{f.difference * 100:+.1f}",
                     "within noise" if f.within_noise else "beyond noise"])
    out.append(C.markdown_table(
        ["trace", f"`{CLIENT_ROUTER}` worst gap (points)", "spread",
         f"`{BEFORE}` worst gap (points)", "spread", "mean difference", "verdict"], rows))
    return out
