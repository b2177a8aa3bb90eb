"""Loading a DCP checkpoint from isolane: torch.distributed.checkpoint's
``StorageReader`` (``isolane.snapshot.dcp`` writes them).

In DCP's call order: ``read_metadata`` finds the live generation (local, else the
mirror) and decodes DCP's metadata from the manifest (``dcp_metadata``), then
``read_data`` reads each stored item the plan needs whole through the restore path
(``SnapshotReader``: O_DIRECT, every chunk's hash checked), straight into the planner's
target when it is exactly that item, else into fresh memory whose slices are copied into
the targets. Every target's dtype is checked before anything is read. Byte items are
accepted only through ``torch.load(weights_only=True)``: never unpickled further.
"""

from __future__ import annotations

import io
import pickle
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from isolane.errors import IntegrityError, InvalidArgumentError, UnsupportedValueError
from isolane.snapshot.dcp_metadata import (
    ItemPlace,
    decode_metadata,
    index_of,
    item_key,
    remote_parts,
)
from isolane.snapshot.dcp_target import DCPTarget
from isolane.snapshot.dtypes import dtype_name
from isolane.snapshot.names import check_snapshot_name

if TYPE_CHECKING:
    from isolane.snapshot.catalog import Located
    from isolane.snapshot.manifest import Manifest


def copy_item(target: torch.Tensor, stored: torch.Tensor, item: ReadItem) -> None:
    """Copy the part of ``stored`` (the item's saved chunk) that ``item`` reads into
    ``target``."""
    src = stored
    for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths,
                                              strict=True)):
        src = src.narrow(dim, start, length)
    with torch.no_grad():
        target.copy_(src)


@dataclass(frozen=True)
class SavedItems:
    """A DCP snapshot's items as its manifest records them: DCP's metadata, and the
    stored tensor each DCP item is (found by the item's index)."""

    name: str
    metadata: Metadata
    places: dict[tuple[str, tuple[int, ...] | None], ItemPlace]
    ids: dict[tuple[int, str], int]

    @classmethod
    def of(cls, manifest: Manifest, name: str) -> SavedItems:
        if manifest.dcp is None:
            raise InvalidArgumentError(
                f"snapshot '{name}' was not saved through torch.distributed.checkpoint; "
                "load it with SnapshotStore.load")
        metadata, places = decode_metadata(manifest.dcp, f"snapshot '{name}'")
        ids: dict[tuple[int, str], int] = {}
        for part in manifest.ranks:
            for key, node in part.tree.get("items", []):
                if isinstance(key, str) and isinstance(node, dict) and node.get("t") == "tensor":
                    ids[(part.rank, key)] = int(node["id"])
        return cls(name, metadata, places, ids)

    def id_of(self, item: ReadItem) -> int:
        """The id of the stored tensor ``item`` reads from."""
        index = item.storage_index
        place = self.places.get(index_of(index.fqn, index.offset))
        tid = None if place is None else self.ids.get((place.rank, place.key))
        if tid is None:
            raise IntegrityError(f"snapshot '{self.name}'",
                                 f"DCP item {item_key(index)!r} is not in the manifest")
        return tid


class IsolaneStorageReader(StorageReader):
    """Reads the DCP checkpoint saved as snapshot ``name`` of ``store`` (local copy, else
    the mirror). Thread-safe per call; one load at a time per instance."""

    def __init__(self, store: DCPTarget | None, name: str) -> None:
        super().__init__()
        self.store = store
        self.name = check_snapshot_name(name)
        self._located: Located | None = None
        self._items: SavedItems | None = None

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id is not None:
            self.name = check_snapshot_name(str(checkpoint_id))
        self._located = None

    def _target(self) -> DCPTarget:
        if self.store is None:  # a subclass that reads elsewhere overrides the reads
            raise InvalidArgumentError("this DCP reader has no store to read from")
        return self.store

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        located = self._target().snapshot_files(self.name)
        self._items = SavedItems.of(located.manifest, self.name)
        self._located = located
        return self._items.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        if self._located is None:
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        located, saved = self._located, self._items
        if located is None or saved is None:
            raise InvalidArgumentError("read_data() before read_metadata()")
        records = {t.id: t for t in located.manifest.tensors}
        by_id: dict[int, list[ReadItem]] = defaultdict(list)
        for item in plan.items:
            by_id[saved.id_of(item)].append(item)
        # An item read exactly into its target goes straight there (O_DIRECT, then hash).
        into: dict[int, torch.Tensor] = {}
        targets: dict[ReadItem, torch.Tensor] = {}
        for tid, items in by_id.items():
            rec = records[tid]
            for item in items:
                if item.type == LoadItemType.BYTE_IO:
                    continue
                target = planner.resolve_tensor(item).detach()
                if dtype_name(target.dtype) != rec.dtype:
                    raise InvalidArgumentError(
                        f"'{item.dest_index.fqn}' is {dtype_name(target.dtype)} here but "
                        f"{rec.dtype} in snapshot '{self.name}'; load into a tensor of the "
                        "saved dtype and convert after")
                targets[item] = target
            only = items[0]
            if (len(items) == 1 and only.type == LoadItemType.TENSOR
                    and tuple(only.lengths) == rec.shape and not any(only.storage_offsets)
                    and targets[only].device.type == "cpu" and targets[only].is_contiguous()):
                into[tid] = targets[only]
        read: dict[int, torch.Tensor] = {}
        store = self._target()
        tiers = store.tiers_of(located)
        remote = {int(p.removeprefix("rank-")) for p in remote_parts(located.manifest.dcp)}
        for n, tier in enumerate(tiers):  # here, then (parts other hosts wrote) the mirror
            ids = {tid for tid in by_id
                   if len(tiers) == 1 or (records[tid].rank in remote) == (n == 1)}
            read.update(store.reader(tier).read(
                tier.manifest, tier.prefix, ids,
                into={tid: t for tid, t in into.items() if tid in ids}))
        for tid, items in by_id.items():
            stored = read[tid]
            for item in items:
                if item.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(item, checked_bytes(stored, item.storage_index.fqn))
                    continue
                target = targets[item]
                if tid not in into:
                    copy_item(target, stored, item)
                planner.commit_tensor(item, target)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


def checked_bytes(stored: torch.Tensor, fqn: str) -> io.BytesIO:
    """A byte item for the planner, after ``torch.load(weights_only=True)`` accepted it:
    the planner then unpickles what that load rebuilt, never the stored bytes."""
    raw = io.BytesIO(stored.numpy().tobytes())
    try:
        value = torch.load(raw, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as exc:
        raise UnsupportedValueError(
            f"[{fqn!r}]", "this non-tensor value needs more than torch.load(weights_only="
            f"True) to load ({str(exc).splitlines()[0]}); isolane never unpickles stored "
            "data: keep such objects out of the checkpoint, or store them as tensors, "
            "numbers and strings") from None
    out = io.BytesIO()
    torch.save(value, out)
    out.seek(0)
    return out


__all__ = ["IsolaneStorageReader"]
