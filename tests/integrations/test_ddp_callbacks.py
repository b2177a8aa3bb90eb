"""PeriodicSnapshot in a data-parallel run: every rank calls it, rank 0 saves alone
(no multi-rank collective that would wait for ranks that never call save)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from isolane import SnapshotStore
from tests.support.procs import free_ports

WORKER = Path(__file__).with_name("ddp_worker.py")
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_every_rank_steps_rank_zero_saves(tmp_path: Path, mode: str) -> None:
    port = free_ports(1)[0]
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", str(port), str(WORKER),
         str(tmp_path), mode], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "SNAPSHOTS ['step-4', 'step-6']" in run.stdout  # keep_last=2, one copy each
    with SnapshotStore(str(tmp_path)) as store:
        state = store.load("step-6")
    torch.manual_seed(0)
    expected = torch.nn.Linear(8, 4).weight.detach()
    for step in range(1, 7):  # the same float additions as the workers
        expected.add_(step)
    assert torch.equal(state["model"]["weight"], expected)
