"""isolane as a torch.distributed.checkpoint (DCP) storage layer.

A DCP save is a multi-rank save of the save transaction (``isolane.snapshot.transaction``)
whose collectives are DCP's own. In DCP's call order:

1. ``set_up_storage_writer`` (all ranks): learn the rank and the coordinator;
2. ``prepare_local_plan`` (all ranks): the planner's items, unchanged;
3. ``prepare_global_plan`` (coordinator): the transaction begins (name checked, parent
   chosen, generation named, ``_writing.json`` marker written); every rank's plan
   carries ``{generation, parent}`` in its ``storage_data``;
4. ``write_data`` (all ranks): the rank's items (tensor chunks as they lie, byte items
   as uint8 tensors) are written as its part ``rank-<r>/`` by the store's writer
   (staging, O_DIRECT, the host governor, striping, chunks linked from the parent when
   unchanged), ending in its partial manifest, which travels back in a ``WriteResult``;
5. ``finish`` (coordinator, only once every rank succeeded): the parts are merged and
   the manifest, DCP's metadata inside as data (``dcp_metadata``), committed last.

Ranks on several hosts: each writes to its own store's write group; a rank whose group
is not the coordinator's (``_Begun.home``) links nothing it does not hold, uploads its
part to the mirror in the background (``SnapshotStore.mirror_part``), and the manifest
lists it in ``remote_ranks`` (read from the mirror, ``SnapshotStore.tiers_of``).

A rank that fails or dies: DCP never calls ``finish``, nothing commits; the generation
is left behind with the coordinator's marker and ``isolane gc`` sweeps it once that
process is gone. Loading (``IsolaneStorageReader``) reads each stored item whole through
the restore path (``isolane.snapshot.dcp_reader``).
"""

from __future__ import annotations

import contextlib
import io
import json
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.distributed.tensor import DTensor
from torch.futures import Future

from isolane.errors import (
    DistributedSaveError,
    InvalidArgumentError,
    IsolaneError,
    UnsupportedValueError,
)
from isolane.snapshot.dcp_metadata import (
    ItemPlace,
    encode_metadata,
    item_key,
    without_remote_chunks,
)
from isolane.snapshot.dcp_reader import IsolaneStorageReader
from isolane.snapshot.dcp_target import DCPTarget
from isolane.snapshot.distributed import commit_parts
from isolane.snapshot.names import check_metadata, check_snapshot_name
from isolane.snapshot.results import SnapshotInfo
from isolane.snapshot.sharding import part_prefix
from isolane.snapshot.transaction import SaveTransaction
from isolane.snapshot.tree import flatten_state

# The fqn of the WriteResult that carries a rank's partial manifest to the coordinator
# (DCP hands the results to ``finish`` only; no state dict key starts with a NUL).
PART_FQN = "\0isolane-part"


@dataclass(frozen=True)
class _Begun:
    """What the coordinator's ``prepare_global_plan`` tells every rank."""

    generation: str
    parent: list[str] | None
    home: tuple[str, ...]  # the coordinator's write group (its manifest's devices)


class IsolaneStorageWriter(StorageWriter):
    """Writes a DCP checkpoint as snapshot ``name`` of ``store`` (a ``SnapshotStore``).

    ``overwrite``, ``parent``, ``mirror`` and ``metadata`` mean what they mean for
    ``SnapshotStore.save``. Also DCP's ``AsyncStager``: ``dcp.async_save`` stages through
    ``stage`` (a copy of every tensor, DTensors as DTensors) before it returns. One
    instance serves one save at a time; after ``finish`` (coordinator) ``info`` holds
    the committed snapshot's ``SnapshotInfo``."""

    _synchronize_after_execute: bool = False  # stage() returns once the copy is done

    def __init__(self, store: DCPTarget, name: str, *, overwrite: bool = False,
                 parent: str | bool | None = None, mirror: bool | None = None,
                 metadata: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.store = store
        self.name = check_snapshot_name(name)
        self.overwrite = overwrite
        self.parent = parent
        self.mirror = mirror
        self.metadata = check_metadata(metadata)
        self.info: SnapshotInfo | None = None
        self._coordinator = False
        self._rank = 0
        self._tx: SaveTransaction | None = None
        self._started = time.perf_counter()

    # -- DCP's call order ------------------------------------------------------------------
    def reset(self, checkpoint_id: Any = None) -> None:
        """A new save; a ``checkpoint_id`` given to ``dcp.save`` names the snapshot."""
        if checkpoint_id is not None:
            self.name = check_snapshot_name(str(checkpoint_id))
        self.info = None
        self._tx = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any
                              ) -> None:
        self._coordinator = is_coordinator
        self._rank = int(kwargs.get("rank", 0))
        self._started = time.perf_counter()

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.name)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        saves = self.store.saves
        saves.claim()
        try:
            self._tx = saves.begin(self.name, overwrite=self.overwrite, parent=self.parent,
                                   mark=True)
        finally:
            saves.release()
        if self._tx.parent is not None:  # parts other hosts wrote are not here to link
            self._tx.parent = without_remote_chunks(self._tx.parent)
        begun = _Begun(self._tx.generation, self._tx.parent_ref, _write_group(self.store))
        return [replace(plan, storage_data=begun) for plan in plans]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        begun = plan.storage_data
        if not isinstance(begun, _Begun):
            raise InvalidArgumentError("the DCP plan carries no isolane transaction: "
                                       "prepare_global_plan did not run on the coordinator")
        saves = self.store.saves
        items: dict[str, torch.Tensor] = {}
        results: list[WriteResult] = []
        for item in plan.items:
            key = item_key(item.index)
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                assert isinstance(data, io.BytesIO)
                tensor = torch.frombuffer(bytearray(data.getbuffer()), dtype=torch.uint8) \
                    if data.getbuffer().nbytes else torch.empty(0, dtype=torch.uint8)
            else:
                assert isinstance(data, torch.Tensor)
                tensor = data.detach()
            items[key] = tensor
            results.append(WriteResult(index=item.index,
                                       size_in_bytes=tensor.numel() * tensor.element_size(),
                                       storage_data=ItemPlace(self._rank, key)))
        tree, leaves = flatten_state(items)
        here = _write_group(self.store)
        away = here != begun.home  # another host: its part reaches the manifest's by the mirror
        if away and self.store.mirror_store is None:
            raise InvalidArgumentError(
                f"rank {self._rank} writes to {here[0]} but the coordinator to "
                f"{begun.home[0]}: ranks on several hosts need a capacity group (mirror) "
                "in every host's config, where their parts come together")
        saves.claim()
        try:
            tx = self._tx if self._tx is not None and self._tx.generation == begun.generation \
                else self._join(begun)
            request = tx.request(tree, leaves, {}, {}, stage_all=False,
                                 part=part_prefix(self._rank))
            part = tx.write(request).future.result()
        finally:
            saves.release()
        if away:
            self.store.mirror_part(part, f"{tx.prefix}/{part_prefix(self._rank)}")
        results.append(WriteResult(index=MetadataIndex(PART_FQN), size_in_bytes=0,
                                   storage_data={"rank": self._rank, "devices": list(here),
                                                 "part": part.to_json().decode()}))
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _join(self, begun: _Begun) -> SaveTransaction:
        """This rank's view of the coordinator's transaction. The parent is linked from
        only where this host holds it: not at all when its manifest is elsewhere (the
        rank is on another host), and never the parts other hosts wrote."""
        saves = self.store.saves
        try:
            tx = saves.join(self.name, begun.generation, begun.parent,
                            overwrite=self.overwrite)
        except FileNotFoundError:
            return saves.join(self.name, begun.generation, None, overwrite=self.overwrite)
        if tx.parent is not None:
            tx.parent = without_remote_chunks(tx.parent)
        return tx

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        tx = self._tx
        if tx is None:
            raise InvalidArgumentError("finish() before prepare_global_plan(): only DCP's "
                                       "coordinator commits")
        parts: dict[int, str] = {}
        remote: list[int] = []
        places: dict[MetadataIndex, ItemPlace] = {}
        home = list(_write_group(self.store))
        for rank_results in results:
            for result in rank_results:
                if result.index.fqn == PART_FQN:
                    rank = int(result.storage_data["rank"])
                    parts[rank] = result.storage_data["part"]
                    if result.storage_data["devices"] != home:
                        remote.append(rank)
                else:
                    places[result.index] = result.storage_data
        saves = self.store.saves
        saves.claim()
        try:
            if sorted(parts) != list(range(len(results))):
                tx.discard()
                raise DistributedSaveError(
                    f"'{self.name}': parts came from ranks {sorted(parts)} of "
                    f"{len(results)}; nothing was committed")
            try:
                encoded = encode_metadata(metadata, places, remote)
            except UnsupportedValueError:
                tx.discard()
                raise
            self.info = commit_parts(tx, [parts[r] for r in range(len(results))],
                                     [{} for _ in results], self.metadata,
                                     mirror=self.mirror, started=self._started, dcp=encoded)
        finally:
            saves.release()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False  # chosen explicitly, never picked from a path

    # -- AsyncStager -----------------------------------------------------------------------
    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A copy of ``state_dict`` that later training steps do not touch: tensors
        (DTensors: their local shards, wrapped again) copied to CPU memory, containers
        rebuilt, other values kept as they are."""
        staged: dict[str, Any] = _staged(state_dict)
        return staged

    def synchronize_staging(self) -> None:
        """Nothing to wait for: ``stage`` returns once the copy is done."""

    def close(self) -> None:
        """Nothing to release: the store belongs to the caller."""


def _write_group(store: DCPTarget) -> tuple[str, ...]:
    return tuple(blob.url for blob in store.stores)


def _staged(value: Any) -> Any:
    if isinstance(value, DTensor):
        local = _copy(value.to_local())
        return DTensor.from_local(local, value.device_mesh, value.placements,
                                  run_check=False, shape=value.shape, stride=value.stride())
    if isinstance(value, torch.Tensor):
        return _copy(value)
    if isinstance(value, dict):
        out = type(value)() if type(value) in (dict,) else dict()
        for k, v in value.items():
            out[k] = _staged(v)
        return out
    if isinstance(value, list):
        return [_staged(v) for v in value]
    if isinstance(value, tuple) and type(value) is tuple:
        return tuple(_staged(v) for v in value)
    return value


def _copy(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(t, device="cpu", memory_format=torch.contiguous_format)
    out.copy_(t.detach())
    return out


# -- the native API over DCP ----------------------------------------------------------------

def holds_dtensor(value: Any) -> bool:
    """True when a DTensor lies anywhere in the (nested) state dict."""
    if isinstance(value, DTensor):
        return True
    if isinstance(value, Mapping):
        return any(holds_dtensor(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(holds_dtensor(v) for v in value)
    return False


def save_through_dcp(store: DCPTarget, state_dict: dict[str, Any], name: str,
                     metadata: Mapping[str, Any] | None, *, overwrite: bool,
                     parent: str | bool | None, mirror: bool | None,
                     group: dist.ProcessGroup | None) -> SnapshotInfo:
    """``SnapshotStore.save`` of a state dict holding DTensors: a collective ``dcp.save``
    through ``IsolaneStorageWriter``; every rank returns the coordinator's info."""
    writer = IsolaneStorageWriter(store, name, overwrite=overwrite, parent=parent,
                                  mirror=mirror, metadata=metadata)
    with _rank_errors(f"saving '{name}'"):
        dcp_save(state_dict, storage_writer=writer, process_group=group)
    if not (dist.is_available() and dist.is_initialized()):
        assert writer.info is not None
        return writer.info
    box: list[Any] = [json.dumps(writer.info.to_dict()) if writer.info else None]
    dist.broadcast_object_list(box, group=group, group_src=0)
    return SnapshotInfo(**json.loads(box[0]))


def load_through_dcp(store: DCPTarget, name: str, *, into: Any,
                     keys: list[str] | None) -> Any:
    """``SnapshotStore.load`` of a snapshot saved through DCP: into ``into`` (DTensors
    resharded to their own mesh and placements; a collective under torch.distributed),
    or, without it, the whole state dict with full tensors in this process alone."""
    reader = IsolaneStorageReader(store, name)
    if into is not None:
        if keys is not None:
            raise InvalidArgumentError("keys= and into= together: leave the unwanted keys "
                                       "out of into= instead")
        with _rank_errors(f"loading '{name}'"):
            dcp_load(into, storage_reader=reader)
        return into
    state: dict[str, Any] = {}
    # torch's own DCP-to-torch.save conversion does the same: the public load() fills
    # a copy of an empty dict, this planner fills the dict it is given
    with _rank_errors(f"loading '{name}'"):
        _load_state_dict(state, storage_reader=reader, no_dist=True,
                 planner=_EmptyStateDictLoadPlanner(  # type: ignore[no-untyped-call]
                     keys=set(keys) if keys else None))
    return state


@contextlib.contextmanager
def _rank_errors(what: str) -> Iterator[None]:
    """DCP's ``CheckpointException`` (a BaseException holding every failed rank's
    error) as the error of the lowest failed rank when isolane raised it, else as a
    ``DistributedSaveError`` naming the ranks."""
    try:
        yield
    except CheckpointException as exc:
        failures = exc.failures
        first = failures[min(failures)][0] if failures else None
        if isinstance(first, IsolaneError):
            raise first from None
        raise DistributedSaveError(
            f"{what} failed on rank(s) {sorted(failures)}: "
            f"{type(first).__name__}: {first}") from None


__all__ = ["IsolaneStorageReader", "IsolaneStorageWriter", "holds_dtensor",
           "load_through_dcp", "save_through_dcp"]
