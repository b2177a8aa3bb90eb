"""Checkpoints of a sharded training loop (FSDP2 ``fully_shard``, tensor parallel, any
DTensor model) through torch.distributed.checkpoint into isolane: ``ShardedCheckpoint``.

Every rank calls it at the same step, as it calls ``dcp.save``: each rank writes its own
shards (``IsolaneStorageWriter``) and the snapshot ``<prefix><step>`` commits once, with
the model and optimizer state dicts of ``torch.distributed.checkpoint.state_dict``
(``get_state_dict``: FQN-keyed, DTensors as they are sharded) and the step::

    {"model": {...}, "optim": {"state": {...}, "param_groups": [...]}, "step": <int>}

``resume`` loads the newest committed ``<prefix><step>`` into the live model and
optimizer (resharded by DCP when the mesh differs from the one that saved) and returns
its step, 0 on a fresh start. Which snapshot is newest is decided on rank 0 and
broadcast as an integer, so every rank loads the same one.

With ``async_=True`` a save returns once DCP has staged the tensors (the writer is an
``AsyncStager``); the next save, ``wait`` and ``close`` wait for it and raise its error.
The save's collectives then run in the background on a gloo group of their own (made
once, on the first async save), since the training step's collectives (FSDP's
all-gathers) keep the default group busy meanwhile and two streams of collectives on one
group would be matched against each other.
``keep_last`` deletes older snapshots of this prefix after each commit (rank 0).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse, async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from isolane.config import is_node_target
from isolane.errors import InvalidArgumentError
from isolane.integrations.dcp import IsolaneStorageReader, IsolaneStorageWriter
from isolane.integrations.dcp import LocalStoreLike as StoreLike
from isolane.integrations.step_snapshots import prune_snapshots, snapshots_with_prefix
from isolane.snapshot.store import SnapshotStore


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _from_rank_zero(value: int) -> int:
    """``value`` as rank 0 has it, on every rank (a plain integer: nothing pickled)."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    device = "cpu" if dist.get_backend() == "gloo" else torch.device(
        "cuda", torch.cuda.current_device())
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.broadcast(tensor, src=0)
    return int(tensor.item())


class ShardedCheckpoint:
    """Save and resume a sharded model and its optimizer, one snapshot per saved step.

    Not thread-safe; call it from the training loop on every rank. ``store`` is a
    ``SnapshotStore`` or what ``SnapshotStore(...)`` accepts (then it is opened here and
    closed by ``close``)."""

    def __init__(self, store: StoreLike, *, every_n_steps: int = 1, prefix: str = "step-",
                 keep_last: int | None = None, async_: bool = False) -> None:
        if every_n_steps < 1:
            raise InvalidArgumentError(f"every_n_steps must be >= 1, got {every_n_steps}")
        if keep_last is not None and keep_last < 1:
            raise InvalidArgumentError(
                f"keep_last must be >= 1 or None (keep all), got {keep_last}")
        if is_node_target(store):
            raise InvalidArgumentError(
                f"{store!r} is a storage node: sharded checkpoints are written by the ranks "
                "themselves; give each host's ranks a folder or config")
        self._owned = not isinstance(store, SnapshotStore)
        self.store = store if isinstance(store, SnapshotStore) else SnapshotStore(store)
        self.every_n_steps = every_n_steps
        self.prefix = prefix
        self.keep_last = keep_last
        self.async_ = async_
        self._pending: Future[Any] | None = None
        self._async_group: dist.ProcessGroup | None = None

    def name_for(self, step: int) -> str:
        return f"{self.prefix}{step}"

    def step(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> bool:
        """Save when ``step`` is a multiple of ``every_n_steps``; True when it saved."""
        if step % self.every_n_steps:
            return False
        self.save(step, model, optimizer)
        return True

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """A collective: every rank calls it with its own shards."""
        self.wait()
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state, "step": step}
        writer = IsolaneStorageWriter(self.store, self.name_for(step))
        if self.async_:
            if self._async_group is None and dist.is_available() and dist.is_initialized():
                self._async_group = dist.new_group(backend="gloo")
            started = async_save(state, storage_writer=writer,
                                 process_group=self._async_group)
            self._pending = (started.upload_completion
                             if isinstance(started, AsyncSaveResponse) else started)
        else:
            dcp_save(state, storage_writer=writer)
            self._after_commit()

    def wait(self) -> None:
        """Wait for the pending async save; raise its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()
            self._after_commit()

    def _after_commit(self) -> None:
        if self.keep_last is not None and _rank() == 0:
            prune_snapshots(self.store, self.prefix, self.keep_last)

    def latest_step(self) -> int:
        """The newest committed ``<prefix><step>`` as rank 0 sees it; 0 when none."""
        found = snapshots_with_prefix(self.store, self.prefix) if _rank() == 0 else []
        return _from_rank_zero(found[-1][0] if found else 0)

    def resume(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
        """Load the newest snapshot of this prefix into ``model`` and ``optimizer``; its
        step, or 0 (and nothing loaded) when there is none. A collective."""
        self.wait()
        step = self.latest_step()
        if step == 0:
            return 0
        model_state, optim_state = get_state_dict(model, optimizer)
        state: dict[str, Any] = {"model": model_state, "optim": optim_state, "step": -1}
        dcp_load(state, storage_reader=IsolaneStorageReader(self.store, self.name_for(step)))
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        if state["step"] != step:
            raise InvalidArgumentError(
                f"snapshot {self.name_for(step)!r} holds step {state['step']!r}: it was not "
                "written by ShardedCheckpoint; load it with dcp.load and IsolaneStorageReader")
        return step

    def close(self) -> None:
        """Wait for the last save, then close the store if it was opened here."""
        try:
            self.wait()
        finally:
            if self._owned:
                self.store.close()
