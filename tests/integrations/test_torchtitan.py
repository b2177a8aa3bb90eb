"""TorchTitan's own CheckpointManager, subclassed by ``IsolaneCheckpointManager``, saving
an FSDP2 model with TorchTitan's optimizer and LR-scheduler containers on 2 real ranks
(gloo on CPU) and loading the newest step on 1 (tests/integrations/torchtitan_worker.py)."""

from __future__ import annotations

from pathlib import Path

from isolane import SnapshotStore
from tests.support.procs import run_ranks

WORKER = Path(__file__).with_name("torchtitan_worker.py")


def run(root: Path, mode: str, world: int) -> list[str]:
    for code, err in run_ranks(WORKER, [str(root), mode], world, timeout_s=240):
        assert code == 0, err
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
