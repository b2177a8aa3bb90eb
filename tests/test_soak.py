"""The chaos soak's smoke run (``benchmarks/soak.py --quick``, 15 s of chaos): trainers, gc,
rm, inference and storage nodes under SIGKILLs, a full disk and flipped bytes, and a
cluster through etcd under a node kill, a node stop and an etcd restart; every
invariant the soak checks must hold."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_a_quick_soak_loses_nothing_and_breaks_no_invariant(tmp_path: Path) -> None:
    result_path = tmp_path / "soak.json"
    run = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "soak.py"), "--quick",
         "--dir", str(tmp_path / "soak"), "--json", str(result_path)],
        cwd=REPO, capture_output=True, text=True, timeout=900)
    assert result_path.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(result_path.read_text())
    report = run.stdout[-6000:]
    # A violation's detail (a hung member's stacks and the nodes') before the report.
    found = "\n\n".join(f"{v['invariant']}: {v['detail']}" for v in result["violations"])
    assert result["violations"] == [], found[-12000:] + "\n\n" + report[-2000:]
    assert run.returncode == 0, report + run.stderr[-3000:]
    assert (result["lost"], result["wrong"], result["orphans"], result["canary_changed"]) \
        == (0, 0, 0, 0)
    # The soak did what it claims: saves acknowledged and checked, faults injected.
    acked = {op[0]: op[1] for op in result["operations"]}
    for kind in ("sync", "async", "incremental", "overwrite", "dist", "remote"):
        assert acked[f"save ({kind}) acknowledged / failed"] > 0, (kind, report)
    assert acked["KV puts (embedded)"] > 0 and acked["KV puts (cluster)"] > 0, report
    assert sum(result["kills"].values()) > 0, report
    assert result["bytes_verified"] > 0
    assert result["counts"].get("final: snapshots loaded bit-exact", 0) > 0, report
    # The etcd cluster phase ran its three faults and ended whole.
    cluster = result["cluster"]
    assert [e["fault"] for e in cluster["events"]] == [
        "SIGKILL node and restart", "SIGSTOP node past its lease, SIGCONT", "etcd restart"]
    assert (cluster["clients"], cluster["registered"], cluster["wrong"]) == (2, 3, 0), report
    assert cluster["puts"] > 0 and cluster["blocks_checked"] > 0, report
    assert cluster["served_share_after"] is not None, report
