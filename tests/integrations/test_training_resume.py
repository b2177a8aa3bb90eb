"""Kill a real training (SIGKILL, in a child process) and resume it: the resumed run
must produce bit-exact the losses and final weights of an uninterrupted run."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from isolane import SnapshotStore
from tests.integrations import training as T

pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parents[2]


def killed_run(mode: str, store: Path, workdir: Path, kill_at: int) -> dict[int, str]:
    """Run the training in a child that SIGKILLs itself after step ``kill_at``."""
    proc = subprocess.run([sys.executable, "-m", "tests.integrations.training", mode, str(store),
                           str(workdir), str(kill_at)], cwd=REPO, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    losses = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            losses[rec["step"]] = rec["loss"]
    return losses


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


def check_resume(full: dict[int, str], killed: dict[int, str], resumed: dict[int, str],
                 start: int, kill_at: int, total: int) -> None:
    assert sorted(full) == list(range(1, total + 1))
    assert sorted(killed) == list(range(1, kill_at + 1))
    # the child computed the same losses as this process: the comparison below is fair
    assert all(killed[s] == full[s] for s in killed)
    assert sorted(resumed) == list(range(start + 1, total + 1))
    assert resumed == {s: full[s] for s in range(start + 1, total + 1)}


def test_periodic_snapshot_resumes_bit_exact_after_sigkill(tmp_path: Path) -> None:
    full, full_model, _ = T.train_plain(tmp_path / "full")
    kill_at = 7
    killed = killed_run("plain", tmp_path / "run", tmp_path, kill_at)
    with SnapshotStore(tmp_path / "run") as store:  # keep_last=2: steps 3 and 6
        assert [i.name for i in store.list()] == ["step-3", "step-6"]
    resumed, model, start = T.train_plain(tmp_path / "run", resume=True)
    assert start == 6
    check_resume(full, killed, resumed, start, kill_at, T.PLAIN_STEPS)
    assert_same_weights(model, full_model)
    with SnapshotStore(tmp_path / "run") as store:  # the resumed run saved 9, pruned to 2
        assert [i.name for i in store.list()] == ["step-6", "step-9"]


def test_resume_without_the_rng_states_diverges(tmp_path: Path) -> None:
    """Guards the test above: the loop really depends on the restored RNG states."""
    full, _, _ = T.train_plain(tmp_path / "full")
    T.train_plain(tmp_path / "run", kill_at=None)
    with SnapshotStore(tmp_path / "run") as store:
        store.delete("step-9")  # resume from step 6
    resumed, _, start = T.train_plain(tmp_path / "run", resume=True, scramble_rng=True)
    assert start == 6
    assert all(resumed[s] != full[s] for s in range(7, T.PLAIN_STEPS + 1))


def test_hf_trainer_callback_resumes_bit_exact_after_sigkill(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    full, full_model, _, _ = T.train_hf(tmp_path / "full", tmp_path / "w-full")
    # the Trainer wrote no checkpoint folders of its own: the snapshots replaced them
    assert not list((tmp_path / "w-full" / "hf-out").glob("checkpoint-*"))
    # save_steps=4 and the final step; save_total_limit=2
    with SnapshotStore(tmp_path / "full") as store:
        assert [i.name for i in store.list()] == ["checkpoint-8", "checkpoint-10"]
    kill_at = 9
    killed = killed_run("hf", tmp_path / "run", tmp_path / "w-run", kill_at)
    resumed, model, start, _ = T.train_hf(tmp_path / "run", tmp_path / "w-run", resume=True)
    assert start == 8
    check_resume(full, killed, resumed, start, kill_at, T.HF_STEPS)
    assert_same_weights(model, full_model)
    # the resume folder (weights + trainer_state.json) is removed once training began
    assert not list((tmp_path / "w-run" / "hf-out" / "isolane-resume").glob("*"))


def test_hf_resume_checkpoint_without_snapshots_starts_fresh(tmp_path: Path) -> None:
    from transformers import Trainer, TrainingArguments

    from isolane.integrations.callbacks import IsolaneTrainerCallback

    with SnapshotStore(tmp_path / "s") as store:
        cb = IsolaneTrainerCallback(store)
        args = TrainingArguments(output_dir=str(tmp_path / "o"), use_cpu=True, report_to=[])
        trainer = Trainer(model=T.tiny_llama(), args=args, callbacks=[cb])
        assert cb.resume_checkpoint(trainer) is None


def test_lightning_checkpoint_io_resumes_bit_exact_after_sigkill(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    from isolane.integrations.lightning_io import read_ref

    total = T.PL_EPOCHS * T.PL_BATCHES
    full, full_module, _ = T.train_lightning(tmp_path / "full", tmp_path / "w-full")
    ckpts = tmp_path / "w-full" / "pl-ckpt"
    # save_top_k=2 removed the first epoch's checkpoint: its file and its snapshot
    files = sorted(p.name for p in ckpts.glob("*.ckpt"))
    assert files == ["epoch=1-step=12.ckpt", "epoch=2-step=18.ckpt", "last.ckpt"]
    with SnapshotStore(tmp_path / "full") as store:
        names = sorted(i.name for i in store.list())
        assert names == sorted(read_ref(ckpts / f) for f in files)
    kill_at = 9
    killed = killed_run("lightning", tmp_path / "run", tmp_path / "w-run", kill_at)
    resumed, module, start = T.train_lightning(tmp_path / "run", tmp_path / "w-run",
                                               resume=True)
    assert start == T.PL_BATCHES  # the epoch-end checkpoint before the kill
    check_resume(full, killed, resumed, start, kill_at, total)
    assert_same_weights(module, full_module)


def test_lightning_reference_file_is_required(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    from isolane.errors import InvalidArgumentError, SnapshotNotFoundError
    from isolane.integrations.lightning_io import IsolaneCheckpointIO

    with SnapshotStore(tmp_path / "s") as store:
        io = IsolaneCheckpointIO(store, async_=False)
        state: dict[str, Any] = {"state_dict": {"w": torch.arange(4.0)}, "epoch": 1}
        io.save_checkpoint(state, tmp_path / "c" / "a.ckpt")
        assert torch.equal(io.load_checkpoint(tmp_path / "c" / "a.ckpt")["state_dict"]["w"],
                           torch.arange(4.0))
        torch.save(state, tmp_path / "c" / "plain.ckpt")
        with pytest.raises(InvalidArgumentError, match="not an isolane checkpoint reference"):
            io.load_checkpoint(tmp_path / "c" / "plain.ckpt")
        io.remove_checkpoint(tmp_path / "c" / "a.ckpt")
        assert not (tmp_path / "c" / "a.ckpt").exists() and store.list() == []
        with pytest.raises(SnapshotNotFoundError):
            io.load_checkpoint(tmp_path / "c" / "a.ckpt")
        io.remove_checkpoint(tmp_path / "c" / "a.ckpt")  # idempotent
        io.teardown()
