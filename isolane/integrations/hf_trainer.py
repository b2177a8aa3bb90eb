"""Hugging Face ``transformers.Trainer`` checkpoints through isolane (imports transformers).

``IsolaneTrainerCallback`` replaces the Trainer's own checkpoint (``torch.save`` of the
model, optimizer, scheduler and RNG files into ``output_dir/checkpoint-N``): when the
Trainer decides to save (``save_steps``/``save_strategy``, set by its
``DefaultFlowCallback`` just before), the callback saves one snapshot
``<prefix><global_step>`` through the store — async by default — and clears
``control.should_save`` so the Trainer writes nothing. ``save_total_limit`` keeps the
newest snapshots of the prefix. Saves decided later, after an evaluation
(``save_strategy="best"``), are left to the Trainer.

Snapshot contents::

    {"model": model.state_dict(), "optimizer": ..., "scheduler": ..., "rng": capture_rng(),
     "trainer_state": TrainerState as its JSON text, "step": global_step}

Resuming (call order)::

    cb = IsolaneTrainerCallback(store)
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[cb])
    trainer.train(resume_from_checkpoint=cb.resume_checkpoint(trainer))  # None: fresh start

The Trainer restores its step counter and skips the batches already seen only from a
checkpoint folder holding ``trainer_state.json`` and the model weights, so
``resume_checkpoint`` writes exactly those two (``save_pretrained``, safetensors) into
``<output_dir>/isolane-resume/<name>`` and returns that folder. The optimizer, LR
scheduler and RNG states — the bulk — are not written there: the callback loads them
straight from the snapshot in ``on_train_begin`` (optimizer and scheduler exist by
then) and restores the RNGs at the first ``on_step_begin``, the point where the Trainer
restores its own RNG file after skipping batches. The folder is removed once training
has begun. Under torch.distributed, rank 0 saves the replicated state
(``step_snapshots.is_saving_rank``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from transformers import (
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from isolane.errors import IntegrityError, InvalidArgumentError
from isolane.integrations.rng import capture_rng, restore_rng
from isolane.integrations.step_snapshots import (
    PendingSave,
    SnapshotTarget,
    check_async,
    check_prefix,
    prune_snapshots,
    snapshots_with_prefix,
    start_save,
)

log = logging.getLogger(__name__)

RESUME_DIR = "isolane-resume"
TRAINER_STATE_NAME = "trainer_state.json"  # the Trainer's own file name


class IsolaneTrainerCallback(TrainerCallback):
    """Saves the Trainer's checkpoints as isolane snapshots; see the module docstring."""

    def __init__(self, store: SnapshotTarget, *, prefix: str = "checkpoint-",
                 async_: bool = True) -> None:
        check_async(store, async_)
        self.store = store
        self.prefix = check_prefix(prefix)
        self.async_ = async_
        self._pending: PendingSave | None = None
        self._resume: dict[str, Any] | None = None  # snapshot to restore at train begin
        self._resume_dir: Path | None = None
        self._rng: dict[str, Any] | None = None  # restored at the first step begin

    # -- saving --------------------------------------------------------------------------
    def on_step_end(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, **kwargs: Any) -> None:
        self._maybe_save(args, state, control, kwargs)

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState,
                     control: TrainerControl, **kwargs: Any) -> None:
        self._maybe_save(args, state, control, kwargs)

    def _maybe_save(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, objects: dict[str, Any]) -> None:
        if not control.should_save:
            return
        control.should_save = False  # the snapshot replaces the Trainer's checkpoint folder
        if not args.should_save:  # not the main process
            return
        self._finish_pending(args)
        model, optimizer, scheduler = (objects.get("model"), objects.get("optimizer"),
                                       objects.get("lr_scheduler"))
        if model is None or optimizer is None:
            raise InvalidArgumentError("the Trainer passed no model or optimizer to the "
                                       "callback; IsolaneTrainerCallback needs both")
        snapshot: dict[str, Any] = {
            "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "rng": capture_rng(), "step": int(state.global_step),
            # the Trainer's own serialisation of its state (TrainerState.save_to_json)
            "trainer_state": json.dumps(dataclasses.asdict(state), indent=2, sort_keys=True),
        }
        if scheduler is not None:
            snapshot["scheduler"] = scheduler.state_dict()
        name = f"{self.prefix}{state.global_step}"
        metadata = {"step": int(state.global_step), "epoch": state.epoch}
        self._pending = start_save(self.store, snapshot, name, metadata, self.async_)
        if self._pending is None:
            prune_snapshots(self.store, self.prefix, args.save_total_limit)

    def _finish_pending(self, args: TrainingArguments) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()
            prune_snapshots(self.store, self.prefix, args.save_total_limit)

    def on_train_end(self, args: TrainingArguments, state: TrainerState,
                     control: TrainerControl, **kwargs: Any) -> None:
        self._finish_pending(args)

    def wait(self, args: TrainingArguments) -> None:
        """Wait for the save in flight (raises its error) and apply save_total_limit."""
        self._finish_pending(args)

    # -- resuming ------------------------------------------------------------------------
    def resume_checkpoint(self, trainer: Trainer) -> str | None:
        """Prepare a resume from the newest snapshot of the prefix: returns the folder to
        pass as ``trainer.train(resume_from_checkpoint=...)``, or None when there is no
        snapshot (train from the start)."""
        for _step, name in reversed(snapshots_with_prefix(self.store, self.prefix)):
            try:
                snapshot = self.store.load(name)
            except IntegrityError as exc:
                log.warning("snapshot '%s' is damaged, trying the one before it: %s", name, exc)
                continue
            folder = Path(trainer.args.output_dir or ".") / RESUME_DIR / name
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            model: Any = trainer.model
            if hasattr(model, "save_pretrained"):  # handles tied weights the HF way
                model.save_pretrained(folder, state_dict=snapshot["model"])
            else:
                safetensors.torch.save_file(_untied(snapshot["model"]),
                                            str(folder / "model.safetensors"))
            (folder / TRAINER_STATE_NAME).write_text(snapshot["trainer_state"])
            self._resume, self._resume_dir = snapshot, folder
            return str(folder)
        return None

    def on_train_begin(self, args: TrainingArguments, state: TrainerState,
                       control: TrainerControl, **kwargs: Any) -> None:
        snapshot, self._resume = self._resume, None
        if snapshot is None:
            return
        if int(state.global_step) != int(snapshot["step"]):
            raise InvalidArgumentError(
                f"the Trainer resumed at step {state.global_step} but the snapshot is of step "
                f"{snapshot['step']}; pass the folder resume_checkpoint() returned to "
                "trainer.train(resume_from_checkpoint=...)")
        optimizer, scheduler = kwargs.get("optimizer"), kwargs.get("lr_scheduler")
        if optimizer is not None:
            optimizer.load_state_dict(snapshot["optimizer"])
        if scheduler is not None and "scheduler" in snapshot:
            scheduler.load_state_dict(snapshot["scheduler"])
        self._rng = snapshot["rng"]
        if self._resume_dir is not None:  # the Trainer has read it
            shutil.rmtree(self._resume_dir, ignore_errors=True)
            self._resume_dir = None

    def on_step_begin(self, args: TrainingArguments, state: TrainerState,
                      control: TrainerControl, **kwargs: Any) -> None:
        rng, self._rng = self._rng, None
        if rng is not None:
            restore_rng(rng)


def _untied(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors sharing memory: give later aliases their own copy."""
    seen: set[int] = set()
    out = {}
    for key, tensor in state.items():
        ptr = tensor.untyped_storage().data_ptr()
        out[key] = tensor.clone() if ptr in seen else tensor
        seen.add(ptr)
    return out
