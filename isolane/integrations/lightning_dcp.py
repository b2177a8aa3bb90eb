"""Lightning's ``ModelParallelStrategy`` (FSDP2, tensor parallel) checkpointing into isolane
through torch.distributed.checkpoint (imports lightning): ``IsolaneModelParallelStrategy``.

The way in is a strategy subclass. ``ModelParallelStrategy`` saves sharded checkpoints
itself (``save_checkpoint``/``load_checkpoint``; it bypasses ``CheckpointIO``) with
``dcp_save(state, checkpoint_id=Path(...))`` and a pickled ``meta.pt`` beside the shards,
so neither a ``CheckpointIO`` plugin nor an fsspec URL reaches it (the path goes
through ``pathlib.Path`` and ``mkdir``, and DCP's fsspec writer would pickle its
``.metadata`` too). The subclass overrides those two methods and ``remove_checkpoint``:

- **save**: every rank writes its shards with ``IsolaneStorageWriter`` into the snapshot
  ``lightning-<hash of the folder>-<file stem>`` (``lightning_io.snapshot_name_for``;
  re-saving a path, as ``last.ckpt`` is, overwrites its snapshot). The model under
  ``"state_dict"``, optimizer ``i`` under ``"optimizer_<i>"`` and the rest of Lightning's
  checkpoint (epoch, step, loops, callbacks, LR schedulers, hyperparameters) under
  ``"lightning"``, all in the one snapshot, committed once. Then rank 0 writes the JSON
  reference file at the checkpoint path (``lightning_io.write_ref``), so
  ``ckpt_path="last"``, ``best_model_path`` and top-k pruning keep working on files.
- **load**: the model and each optimizer are loaded in place (DCP reshards when the mesh
  changed), then the rest of the checkpoint is rebuilt from the snapshot's DCP metadata
  and returned to Lightning. Non-tensor values come back through
  ``torch.load(weights_only=True)``: hyperparameters that need more (a class, a custom
  object) are refused with their key.

The reference file must be readable by every rank (one host, or a shared folder for the
checkpoint directory); the shards themselves live in ``store``.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from isolane.config import is_node_target
from isolane.errors import InvalidArgumentError
from isolane.integrations.dcp import IsolaneStorageReader, IsolaneStorageWriter
from isolane.integrations.dcp import LocalStoreLike as StoreLike
from isolane.integrations.lightning_io import (
    read_ref,
    remove_referenced,
    snapshot_name_for,
    write_ref,
)
from isolane.snapshot.store import SnapshotStore

LIGHTNING_KEY = "lightning"
MODEL_KEY = "state_dict"


def _optimizer_key(index: int) -> str:
    return f"optimizer_{index}"


def _place(tree: dict[str, Any], path: tuple[str | int, ...], value: Any) -> None:
    """Put ``value`` at ``path`` (DCP's flattening path: keys, list indices) in ``tree``."""
    node: Any = tree
    for key, following in itertools.pairwise(path):
        empty: Any = [] if isinstance(following, int) else {}
        if isinstance(node, list):
            node.extend([None] * (int(key) + 1 - len(node)))
            if node[int(key)] is None:
                node[int(key)] = empty
            node = node[int(key)]
        else:
            node = node.setdefault(key, empty)
    last = path[-1]
    if isinstance(node, list):
        node.extend([None] * (int(last) + 1 - len(node)))
        node[int(last)] = value
    else:
        node[last] = value


def template_of(metadata: Metadata, top_key: str) -> dict[str, Any]:
    """The nested shape DCP saved under ``top_key``, from the checkpoint's metadata alone:
    an empty tensor of the saved size and dtype for each tensor, None for each other value
    (DCP reads those back as byte items). ``{}`` when nothing was saved under it."""
    tree: dict[str, Any] = {}
    for fqn, item in metadata.state_dict_metadata.items():
        path = tuple(metadata.planner_data.get(fqn, (fqn,))) if metadata.planner_data else (fqn,)
        if not path or path[0] != top_key:
            continue
        value = (torch.empty(item.size, dtype=item.properties.dtype)
                 if isinstance(item, TensorStorageMetadata) else None)
        _place(tree, path, value)
    return tree


class IsolaneModelParallelStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` whose sharded checkpoints are isolane snapshots.

    ``store``: a ``SnapshotStore`` or what ``SnapshotStore(...)`` accepts (a folder, a
    config, ``s3://...``), opened on each rank. The other arguments are
    ``ModelParallelStrategy``'s; ``save_distributed_checkpoint`` must stay True (a full,
    rank-0 checkpoint is Lightning's own file, not a sharded one)."""

    def __init__(self, store: StoreLike, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("save_distributed_checkpoint") is False:
            raise InvalidArgumentError(
                "IsolaneModelParallelStrategy saves sharded checkpoints: drop "
                "save_distributed_checkpoint=False, or use ModelParallelStrategy for a "
                "full checkpoint file")
        super().__init__(*args, **kwargs)
        self._store_arg = store
        self._store: SnapshotStore | None = store if isinstance(store, SnapshotStore) else None

    @property
    def store(self) -> SnapshotStore:
        """Opened on first use, in the rank's own process (the launcher may fork)."""
        if self._store is None:
            if isinstance(self._store_arg, SnapshotStore):
                return self._store_arg
            if is_node_target(self._store_arg):
                raise InvalidArgumentError(
                    f"{self._store_arg!r} is a storage node: sharded checkpoints are "
                    "written by the ranks themselves; give each host a folder or config")
            self._store = SnapshotStore(self._store_arg)
        return self._store

    def _checkpoint_path(self, filepath: Any) -> Path:
        return Path(self.broadcast(str(Path(filepath).absolute())))

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise InvalidArgumentError(
                "IsolaneModelParallelStrategy takes no storage_options; configure the "
                "SnapshotStore instead")
        path = self._checkpoint_path(filepath)
        name = snapshot_name_for(path)
        rest = dict(checkpoint)
        state: dict[str, Any] = {MODEL_KEY: rest.pop(MODEL_KEY)}
        for index, optim_state in enumerate(rest.pop("optimizer_states", [])):
            state[_optimizer_key(index)] = optim_state
        state[LIGHTNING_KEY] = rest
        dcp_save(state, storage_writer=IsolaneStorageWriter(
            self.store, name, overwrite=True, metadata={"lightning_path": str(path)}))
        if self.global_rank == 0:
            write_ref(path, name, self.store.url)
        self.barrier("isolane-checkpoint-ref")

    def load_checkpoint(self, checkpoint_path: Any,
                        weights_only: bool | None = None) -> dict[str, Any]:
        path = self._checkpoint_path(checkpoint_path)
        name = read_ref(path)
        model = self.model
        if model is None or self.lightning_module is None:
            raise InvalidArgumentError("the strategy has no model yet: Lightning loads a "
                                       "checkpoint after setup (ckpt_path= in fit)")
        module_state = {MODEL_KEY: get_model_state_dict(model)}
        dcp_load(module_state, storage_reader=IsolaneStorageReader(self.store, name))
        model.load_state_dict(module_state[MODEL_KEY], strict=self.lightning_module.strict_loading)
        options = StateDictOptions(cpu_offload=True)
        for index, optimizer in enumerate(self.optimizers):
            key = _optimizer_key(index)
            optim_state = {key: get_optimizer_state_dict(model, optimizer)}
            dcp_load(optim_state, storage_reader=IsolaneStorageReader(self.store, name))
            set_optimizer_state_dict(model, optimizer, optim_state_dict=optim_state[key],
                                     options=options)
        reader = IsolaneStorageReader(self.store, name)
        rest = template_of(reader.read_metadata(), LIGHTNING_KEY)
        if LIGHTNING_KEY not in rest:
            raise InvalidArgumentError(
                f"snapshot {name!r} has no {LIGHTNING_KEY!r} part: it was not written by "
                "IsolaneModelParallelStrategy")
        dcp_load(rest, storage_reader=reader)
        loaded: dict[str, Any] = rest[LIGHTNING_KEY]
        return loaded

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.global_rank != 0:
            return
        remove_referenced(self.store, Path(filepath).absolute())

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            if self._store is not None and not isinstance(self._store_arg, SnapshotStore):
                self._store.close()
                self._store = None
