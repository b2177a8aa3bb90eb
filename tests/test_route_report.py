"""The routing report's note on the worst hit-rate cell (benchmarks/_route_report.py):
it says which way the client's placement differs from the one before, in words that
stay true when the client is ahead."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import _route_report as report  # noqa: E402
import _route_sim as sim  # noqa: E402

LABEL = "s3fifo 5"


def cell(router: str, hits: float, long_hits: float) -> sim.CaseResult:
    return sim.CaseResult(trace="t", router=router, nodes=64, s=4,
                          block_hits={LABEL: hits}, long_hits={LABEL: long_hits},
                          node_cache={LABEL: 45}, long_blocks={LABEL: 0.86})


def note(client: tuple[float, float], before: tuple[float, float]) -> str:
    mine = cell(report.CLIENT_ROUTER, *client)
    targets = report.Targets(gap=-0.1, gap_where="", load=1.0, join=1.0, join_worst=1.0,
                             over_bound=0, gap_case=mine, gap_label=LABEL)
    return report.long_request_note(targets, [mine, cell(report.BEFORE, *before)])


def test_a_client_below_before_is_said_to_be_below() -> None:
    text = note(client=(0.20, 0.10), before=(0.22, 0.11))
    assert "2.00 points below the placement before" in text
    assert "1.00 of them" in text
    assert "-" not in text.split("caches")[1]


def test_a_client_above_before_is_said_to_be_above() -> None:
    text = note(client=(0.2434, 0.1548), before=(0.20, 0.11))
    assert "4.34 points above the placement before" in text
    assert "4.48 of them" in text
    assert "below" not in text
    assert "-" not in text.split("caches")[1]
