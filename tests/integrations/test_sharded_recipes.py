"""The sharded-training recipes, each in real torchrun processes (gloo, CPU, FSDP2
``fully_shard``): a plain loop with ``ShardedCheckpoint`` and Lightning's
``ModelParallelStrategy`` through ``IsolaneModelParallelStrategy``. A run is cut after a
checkpoint and resumed in fresh processes; the resumed run must match the uninterrupted
one bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from isolane import SnapshotStore
from tests.support.procs import free_ports

HERE = Path(__file__).parent
REPO = HERE.parents[1]


def torchrun(script: str, *args: str, ranks: int = 2, timeout_s: float = 240) -> None:
    port = free_ports(1)[0]
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
         "--master-addr", "127.0.0.1", "--master-port", str(port), str(HERE / script),
         *args], capture_output=True, text=True, timeout=timeout_s, cwd=REPO)
    assert run.returncode == 0, run.stderr[-4000:]


def records(out: Path, mode: str) -> list[dict[str, Any]]:
    return [torch.load(out / f"{mode}-rank{r}.pt", weights_only=True) for r in range(2)]


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_fsdp2_loop_resumes_bit_exact_from_its_last_checkpoint(tmp_path: Path) -> None:
    store_dir, out = tmp_path / "store", tmp_path / "out"
    out.mkdir()
    torchrun("sharded_worker.py", str(store_dir), str(out), "train", "6")
    with SnapshotStore(str(store_dir)) as store:
        # keep_last=2 pruned step-2; step-4 was saved async while step 5 trained
        assert sorted(info.name for info in store.list()) == ["step-4", "step-6"]
        store.delete("step-6")  # the run "died" after step 5: resume from step 4
    torchrun("sharded_worker.py", str(store_dir), str(out), "resume", "6")

    trained, resumed = records(out, "train"), records(out, "resume")
    for rank in range(2):
        assert resumed[rank]["start"] == 4
        for step in (4, 5, 6):  # loaded state, then each step after it
            for part in ("weights", "moments"):
                assert_same(resumed[rank]["after"][step][part], trained[rank]["after"][step][part])
        assert resumed[rank]["losses"] == {5: trained[rank]["losses"][5],
                                           6: trained[rank]["losses"][6]}


def test_lightning_model_parallel_saves_snapshots_and_resumes_bit_exact(
        tmp_path: Path) -> None:
    store_dir, root, out = tmp_path / "store", tmp_path / "run", tmp_path / "out"
    out.mkdir()
    torchrun("lightning_dcp_worker.py", str(store_dir), str(root), str(out), "6")
    ckpt = root / "ckpt"
    files = sorted(p.name for p in ckpt.iterdir())
    assert files == ["epoch=3-step=4.ckpt", "epoch=5-step=6.ckpt", "last.ckpt"]
    with SnapshotStore(str(store_dir)) as store:
        names = sorted(info.name for info in store.list())
        refs = [json.loads((ckpt / f).read_text())["snapshot"] for f in files]
        # top-2 pruning deleted the step-2 snapshot with its file; last.ckpt was re-saved
        assert names == sorted(refs) and len(set(refs)) == 3
    fit = records(out, "fit")

    torchrun("lightning_dcp_worker.py", str(store_dir), str(root), str(out), "6",
             str(ckpt / "epoch=3-step=4.ckpt"))
    resumed = records(out, "resume")
    for rank in range(2):
        assert resumed[rank]["start"] == 4  # loops, epoch and step restored
        # model, AdamW moments and LR scheduler restored: the same steps 5 and 6
        assert resumed[rank]["losses"] == {5: fit[rank]["losses"][5], 6: fit[rank]["losses"][6]}
        assert_same(resumed[rank]["last"], fit[rank]["last"])
        assert resumed[rank]["lr"] == fit[rank]["lr"]


def test_bad_arguments_are_refused_with_the_way_out(tmp_path: Path) -> None:
    from isolane.errors import InvalidArgumentError
    from isolane.integrations.lightning_dcp import IsolaneModelParallelStrategy
    from isolane.integrations.sharded_loop import ShardedCheckpoint

    with pytest.raises(InvalidArgumentError, match="every_n_steps must be >= 1"):
        ShardedCheckpoint(str(tmp_path), every_n_steps=0)
    with pytest.raises(InvalidArgumentError, match="keep_last must be >= 1 or None"):
        ShardedCheckpoint(str(tmp_path), keep_last=0)
    with pytest.raises(InvalidArgumentError, match="drop save_distributed_checkpoint=False"):
        IsolaneModelParallelStrategy(str(tmp_path), save_distributed_checkpoint=False)
    strategy = IsolaneModelParallelStrategy(str(tmp_path))
    with pytest.raises(InvalidArgumentError, match="takes no storage_options"):
        strategy.save_checkpoint({}, tmp_path / "x.ckpt", storage_options={"a": 1})


def test_a_fresh_store_resumes_at_step_zero_and_loads_nothing(tmp_path: Path) -> None:
    from isolane.integrations.sharded_loop import ShardedCheckpoint

    model = torch.nn.Linear(4, 2)
    before = model.weight.detach().clone()
    optimizer = torch.optim.AdamW(model.parameters())
    ckpt = ShardedCheckpoint(str(tmp_path / "store"))
    try:
        assert ckpt.resume(model, optimizer) == 0
    finally:
        ckpt.close()
    assert torch.equal(model.weight, before)
