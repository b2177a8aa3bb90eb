"""Keys moved on a join in the routing simulation (benchmarks/_route_sim.py): measured on
the segments where the client's placement put them, not where their chain's home is.
When every chain shares one home (sessions behind one tool prefix), the home node holds
only its write share and the rest spill along their own digests' walks: a join still
changes where about 1 / (N + 1) of them are read from."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import _route_sim as sim  # noqa: E402
from _trace import trace_of  # noqa: E402


def one_home_trace(sessions: int = 120) -> sim.Trace:
    """Sessions behind one shared 4-block prefix (k = 2: one home digest for all), each
    with a 40-block context of its own, read three times, one block longer each time."""
    rows: list[tuple[int, list[int]]] = []
    next_id = 5
    for s in range(sessions):
        context = [1, 2, 3, 4, *range(next_id, next_id + 40)]
        next_id += 40
        for turn in range(3):
            rows.append((s * 10 + turn, list(context)))
            context.append(next_id)
            next_id += 1
    return trace_of("one-home", "sessions behind one shared tool prefix", rows)


def moves_for(trace: sim.Trace, nodes: int) -> dict[str, sim.MoveResult]:
    sim.TRACES[trace.name] = trace
    sim.BLOCK_KEYS[trace.name, 0] = sim.name_blocks(trace)
    out = sim.run_moves(trace.name, 4, (nodes,), lambda _: None)
    return {m.router: m for m in out if m.after > m.before}


def test_a_join_moves_about_its_share_when_every_chain_shares_one_home() -> None:
    trace = one_home_trace()
    joins = moves_for(trace, 8)
    units = sim.units_for(trace.name, sim.CLIENT_ROUTER, 4)
    assert len(set(units.homes)) == 1  # the case measured: one home for every chain
    for kind in (sim.CLIENT_ROUTER, sim.BEFORE):
        ratio = statistics.median(joins[kind].ratios())
        assert 0.5 <= ratio <= 1.6, (kind, joins[kind].ratios())


def test_a_join_of_a_node_that_takes_no_segment_moves_nothing() -> None:
    """The measure counts a segment once: as moved by the mover (it sat on its home's
    owner and the home moved) or as read elsewhere (it had spilled and its walk off
    the home changed); a placement whose every segment stays put reports 0."""
    trace = one_home_trace(30)
    placed = sim.placed_units(trace.name, sim.CLIENT_ROUTER, 4, 8)
    old = sim.node_names(8)
    index = {name: i for i, name in enumerate([*old, "http://10.9.0.1:7070"])}
    units = sim.units_for(trace.name, sim.CLIENT_ROUTER, 4)
    same = sim.moved_share(units, placed, sim.HashRing(old), sim.HashRing(old), index,
                           chain_affine=True)
    assert same == (0.0, 0.0)
    grown, via_home = sim.moved_share(units, placed, sim.HashRing(old),
                                      sim.HashRing([*old, "http://10.9.0.1:7070"]), index,
                                      chain_affine=True)
    assert 0.0 < grown < 0.5
    assert 0.0 <= via_home <= grown
