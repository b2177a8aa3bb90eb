"""Deterministic few-step trainings of a tiny Llama, shared by the tests and their child
processes (``python -m tests.integrations.training MODE STORE WORKDIR KILL_AT``).

Each run records every step's loss (``float.hex``, so equality is bit-exact) and can
SIGKILL itself after step ``kill_at`` once the snapshot it should resume from has
committed, which makes the resume point deterministic while the kill stays a real one.
The model has attention dropout and the plain loop draws from torch, Python and NumPy
generators, so a resume that did not restore the RNGs diverges.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

VOCAB = 96
SEQ = 16


def tiny_llama(seed: int = 0) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, attention_dropout=0.1)
    return LlamaForCausalLM(config)


def seed_all(seed: int = 0) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def token_data(n: int = 24, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n, SEQ), generator=g)


def wait_until(condition: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met before the kill")
        time.sleep(0.01)


def kill_self() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def emit(step: int, loss: float) -> None:
    print(json.dumps({"step": step, "loss": loss.hex()}), flush=True)


# -- plain PyTorch loop ------------------------------------------------------------------
PLAIN_EVERY, PLAIN_STEPS = 3, 10


def train_plain(store_dir: Path, kill_at: int | None = None, resume: bool = False,
                scramble_rng: bool = False) -> tuple[dict[int, str], Any, int]:
    from isolane import SnapshotStore
    from isolane.integrations.callbacks import PeriodicSnapshot

    seed_all()
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    losses: dict[int, str] = {}
    with SnapshotStore(store_dir) as store, PeriodicSnapshot(store, PLAIN_EVERY,
                                                             keep_last=2) as ckpt:
        start = ckpt.resume(model, opt, sched) if resume else 0
        if scramble_rng:  # what a resume that forgot the RNG states would continue with
            seed_all(123)
        for step in range(start + 1, PLAIN_STEPS + 1):
            batch = torch.randint(0, VOCAB, (4, SEQ))  # the global torch generator
            scale = 1.0 + random.random() * 0.01 + float(np.random.rand()) * 0.01
            loss = model(batch, labels=batch).loss * scale
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            losses[step] = loss.item().hex()
            emit(step, loss.item())
            ckpt.step(step, model, opt, sched)
            if step == kill_at:
                last = ckpt.name(step - step % PLAIN_EVERY)
                wait_until(lambda last=last: last in [i.name for i in store.list()])
                kill_self()
    return losses, model, start


# -- Hugging Face Trainer ----------------------------------------------------------------
HF_SAVE_STEPS, HF_STEPS = 4, 10


def train_hf(store_dir: Path, workdir: Path, kill_at: int | None = None,
             resume: bool = False) -> tuple[dict[int, str], Any, int, Any]:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from isolane import SnapshotStore
    from isolane.integrations.callbacks import IsolaneTrainerCallback

    seed_all()
    model = tiny_llama()
    data = [{"input_ids": row, "labels": row} for row in token_data()]  # 6 batches an epoch
    args = TrainingArguments(
        output_dir=str(workdir / "hf-out"), max_steps=HF_STEPS, per_device_train_batch_size=4,
        learning_rate=3e-3, lr_scheduler_type="linear", warmup_steps=2, save_strategy="steps",
        save_steps=HF_SAVE_STEPS, save_total_limit=2, logging_strategy="no", report_to=[],
        use_cpu=True, disable_tqdm=True, seed=0, dataloader_num_workers=0)
    losses: dict[int, str] = {}
    store = SnapshotStore(store_dir)
    cb = IsolaneTrainerCallback(store)

    class Record(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == kill_at:
                name = f"checkpoint-{kill_at - kill_at % HF_SAVE_STEPS}"
                wait_until(lambda: name in [i.name for i in store.list()])
                kill_self()

    last_loss: list[float] = []
    model.register_forward_hook(lambda _m, _i, out: last_loss.append(out.loss.item()))

    class Losses(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            losses[state.global_step] = last_loss[-1].hex()
            emit(state.global_step, last_loss[-1])

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[cb, Losses(), Record()])
    resume_from = cb.resume_checkpoint(trainer) if resume else None
    trainer.train(resume_from_checkpoint=resume_from)
    start = min(losses) - 1
    store.close()
    return losses, model, start, cb


# -- PyTorch Lightning -------------------------------------------------------------------
PL_EPOCHS, PL_BATCHES = 3, 6


def train_lightning(store_dir: Path, workdir: Path, kill_at: int | None = None,
                    resume: bool = False) -> tuple[dict[int, str], Any, int]:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from isolane import SnapshotStore
    from isolane.integrations.callbacks import IsolaneCheckpointIO

    seed_all()
    losses: dict[int, str] = {}
    ckpt_dir = workdir / "pl-ckpt"

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.llama = tiny_llama()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (ids,) = batch
            loss: torch.Tensor = self.llama(ids, labels=ids).loss
            step = self.global_step + 1
            losses[step] = loss.item().hex()
            emit(step, loss.item())
            return loss

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
            return {"optimizer": opt,
                    "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 3, gamma=0.8)}

    class Kill(L.Callback):
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == kill_at:
                wait_until(lambda: (ckpt_dir / "last.ckpt").exists())
                kill_self()

    module = Module()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(token_data()),
                                         batch_size=4, shuffle=True)
    store = SnapshotStore(store_dir)
    checkpoint = ModelCheckpoint(dirpath=ckpt_dir, every_n_epochs=1, save_top_k=2,
                                 monitor="step", mode="max", save_last=True)
    trainer = L.Trainer(max_epochs=PL_EPOCHS, accelerator="cpu", devices=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[checkpoint, Kill()],
                        plugins=[IsolaneCheckpointIO(store)])
    trainer.fit(module, loader, ckpt_path="last" if resume else None)
    store.close()
    start = min(losses) - 1
    return losses, module, start


def main(argv: list[str]) -> None:
    mode, store_dir, workdir, kill_at = argv[0], Path(argv[1]), Path(argv[2]), int(argv[3])
    torch.set_num_threads(1)  # as the tests' fixture does
    if mode == "plain":
        train_plain(store_dir, kill_at)
    elif mode == "hf":
        train_hf(store_dir, workdir, kill_at)
    elif mode == "lightning":
        train_lightning(store_dir, workdir, kill_at)
    raise SystemExit(f"step {kill_at} was never reached")


if __name__ == "__main__":
    main(sys.argv[1:])
