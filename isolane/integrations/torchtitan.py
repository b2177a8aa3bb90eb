"""TorchTitan's checkpoints as isolane snapshots: ``IsolaneCheckpointManager``.

TorchTitan's ``CheckpointManager`` calls ``dcp.save(state, checkpoint_id=<folder>/step-N)``
with no storage writer of its own, and finds, loads and purges checkpoints by listing
that folder; its config has no storage-writer option. So the recipe is a subclass that
keeps everything else (intervals, async mode, the model/optimizer/LR-scheduler/dataloader
states, last-step and HF exports) and overrides only where the bytes go:

- ``dcp_save``/``dcp_load``: ``IsolaneStorageWriter``/``IsolaneStorageReader`` on the
  snapshot ``step-N`` (an existing one is overwritten, as TorchTitan's folder is);
  ``async_mode="async"`` stages through isolane's staging. HF exports (``to_hf``,
  ``from_hf``) stay TorchTitan's own, on files;
- ``_find_load_step`` and ``_load``: the newest ``step-N`` snapshot of the store;
- ``_purge_stale_checkpoints``: ``keep_latest_k`` deletes older ``step-N`` snapshots.

    manager = IsolaneCheckpointManager(config, store="/mnt/nvme/ckpt", dataloader=...,
                                       model_parts=..., optimizers=..., lr_schedulers=...,
                                       states={}, sd_adapter=None)

``store``: what ``IsolaneStorageWriter`` accepts (a ``SnapshotStore``, a folder, a config,
``s3://``, a node URL). ``async_mode="async_with_pinned_mem"`` runs the save in another
process and is refused: use ``"async"``.
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import async_save, save
from torchtitan.components.checkpointer.base import MODEL
from torchtitan.components.checkpointer.dcp import AsyncMode, CheckpointManager

from isolane.errors import InvalidArgumentError, SnapshotNotFoundError
from isolane.integrations.dcp import (
    IsolaneStorageReader,
    IsolaneStorageWriter,
    StoreLike,
    open_owned_store,
)

STEP = re.compile(r"step-(\d+)")  # fullmatch: TorchTitan's checkpoint names


class IsolaneCheckpointManager(CheckpointManager):  # type: ignore[misc]
    """TorchTitan's ``CheckpointManager`` writing to ``store`` (module docstring)."""

    def __init__(self, config: Any, *, store: StoreLike, **kwargs: Any) -> None:
        if getattr(config, "async_mode", "disabled") == "async_with_pinned_mem":
            raise InvalidArgumentError(
                "async_mode='async_with_pinned_mem' saves from another process, which "
                "cannot use this process's isolane store: use async_mode='async' (isolane "
                "stages into its own pinned-size buffers)")
        self.store, self._owned = open_owned_store(self, store)
        self._newest: str | None = None  # the snapshot the last dcp_save wrote
        super().__init__(config, **kwargs)

    @torch.no_grad()
    def dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: Any,
                 enable_garbage_collection: bool = False, to_hf: bool = False) -> Any:
        if to_hf:
            return super().dcp_save(state_dict, checkpoint_id, async_mode,
                                    enable_garbage_collection, to_hf)
        name = _name(checkpoint_id)
        self._newest = name  # an async save's counts for keep_latest_k before it commits
        writer = IsolaneStorageWriter(self.store, name, overwrite=True)
        if async_mode == AsyncMode.ASYNC:
            return async_save(state_dict, storage_writer=writer, process_group=self.pg)
        save(state_dict, storage_writer=writer)
        return None

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool,
                 from_quantized: bool) -> None:
        if from_hf:
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            return
        dcp_load(state_dict, storage_reader=IsolaneStorageReader(self.store,
                                                                 _name(checkpoint_id)))
        if MODEL in self.states:  # TorchTitan flattens the model's states: load them back
            self.states[MODEL].load_state_dict(state_dict)

    def _steps(self, *, saving: bool = False) -> list[int]:
        """The steps saved (``saving``: and the one in flight), oldest first."""
        names = {info.name for info in self.store.list()}
        if saving and self._newest is not None:
            names.add(self._newest)
        found = (STEP.fullmatch(name) for name in names)
        return sorted(int(m.group(1)) for m in found if m is not None)

    def _find_load_step(self, folder: str = "") -> int:
        steps = self._steps()
        return steps[-1] if steps else -1

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        load_step = self._find_load_step() if step == -1 else step
        if load_step == -1:  # nothing saved yet: TorchTitan's initial load, or a fresh start
            return bool(super()._load(step))
        states = self._states_to_load(load_step == 0)
        self.dcp_load(states, checkpoint_id=self._create_checkpoint_id(load_step),
                      from_hf=False, from_quantized=False)
        return True

    def _purge_stale_checkpoints(self) -> None:
        if self.keep_latest_k <= 0 or (dist.is_initialized() and dist.get_rank() != 0):
            return
        for step in self._steps(saving=True)[:-self.keep_latest_k]:
            try:
                self.store.delete(f"step-{step}")
            except SnapshotNotFoundError:
                continue

    def _close(self) -> None:
        super()._close()
        if self._owned is not None:
            self._owned()


def _name(checkpoint_id: str) -> str:
    """The snapshot of TorchTitan's checkpoint folder ``<folder>/step-N``."""
    return PurePosixPath(str(checkpoint_id)).name


__all__ = ["IsolaneCheckpointManager"]
