"""TorchTitan's own CheckpointManager, subclassed by ``IsolaneCheckpointManager``, saving
an FSDP2 model with TorchTitan's optimizer and LR-scheduler containers on 2 real ranks
(gloo on CPU) and loading the newest step on 1 (tests/integrations/torchtitan_worker.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from isolane import SnapshotStore
from tests.support.procs import free_ports

WORKER = Path(__file__).with_name("torchtitan_worker.py")
REPO = Path(__file__).resolve().parents[2]


def run(root: Path, mode: str, world: int) -> list[str]:
    port = free_ports(1)[0]
    procs = [subprocess.Popen(
        [sys.executable, str(WORKER), str(root), mode],
        env={**os.environ, "RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r),
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
             "PYTHONPATH": str(REPO)},
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for r in range(world)]
    for proc in procs:
        _out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err[-3000:]
    return [line for path in sorted(root.glob(f"{mode}-rank-*.out"))
            for line in path.read_text().splitlines()]


def test_torchtitan_saves_at_two_ranks_and_resumes_at_one(tmp_path: Path) -> None:
    saved = run(tmp_path, "save", 2)
    assert sorted(saved) == sorted(f"SAVED {s} True" for s in (1, 2, 3) for _ in range(2))
    with SnapshotStore(tmp_path / "store") as store:  # keep_latest_k=2
        assert sorted(i.name for i in store.list()) == ["step-2", "step-3"]
        assert store.manifest("step-3").dcp is not None
    assert not (tmp_path / "ckpt").exists()  # nothing went to TorchTitan's folder
    assert run(tmp_path, "load", 1) == ["LOAD True model=True optim=True lr=True step=3"]
