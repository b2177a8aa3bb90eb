"""isolane as a torch.distributed.checkpoint (DCP) storage layer.

A DCP save is a multi-rank save of the save transaction (``isolane.snapshot.transaction``)
whose collectives are DCP's own. In DCP's call order:

1. ``set_up_storage_writer`` (all ranks): learn the rank and the coordinator;
2. ``prepare_local_plan`` (all ranks): the planner's items, unchanged; on the
   coordinator the transaction begins meanwhile, while the other ranks plan (name
   checked, parent chosen, generation named, ``_writing.json`` marker written);
3. ``prepare_global_plan`` (coordinator): every rank's plan carries the transaction as a
   ``Begun`` in its ``storage_data``, with the parent's chunks on the coordinator's write
   group, so that no other rank reads the parent's manifest;
4. ``write_data`` (all ranks): the rank's items (tensor chunks as they lie, byte items
   as uint8 tensors) are written as its part ``rank-<r>/`` by the store's writer
   (staging, O_DIRECT, the host governor, striping, chunks linked from the parent when
   unchanged), ending in its partial manifest, which travels back in a ``WriteResult``;
5. ``finish`` (coordinator, only once every rank succeeded): the parts are merged and
   the manifest, DCP's metadata inside as data (``dcp_metadata``), committed last.

Ranks on several hosts: each writes to its own store's write group; a rank whose group
is not the coordinator's (``Begun.home``) links nothing it does not hold, uploads its
part to the mirror in the background (``SnapshotStore.mirror_part``), and the manifest
lists it in ``remote_ranks`` (read from the mirror, ``SnapshotStore.tiers_of``).

A rank that fails or dies: DCP never calls ``finish``, nothing commits; the generation
is left behind with the coordinator's marker and ``isolane gc`` sweeps it once that
process is gone. Loading (``IsolaneStorageReader``) reads each stored item whole through
the restore path (``isolane.snapshot.dcp_reader``).
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import json
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

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
from isolane.snapshot.manifest import ChunkRecord, Manifest
from isolane.snapshot.names import check_metadata, check_snapshot_name
from isolane.snapshot.results import SnapshotInfo
from isolane.snapshot.sharding import part_prefix
from isolane.snapshot.staging import StagingPool
from isolane.snapshot.transaction import ParentLinks, SaveTransaction
from isolane.snapshot.tree import flatten_state
from isolane.storage.aligned import AlignedBuffer, align_up

# The fqn of the WriteResult that carries a rank's partial manifest to the coordinator
# (DCP hands the results to ``finish`` only; no state dict key starts with a NUL).
PART_FQN = "\0isolane-part"


@dataclass(frozen=True)
class Begun:
    """What the coordinator's ``prepare_global_plan`` tells every rank."""

    generation: str
    parent: list[str] | None
    home: tuple[str, ...]  # the coordinator's write group (its manifest's devices)
    # the parent's chunks on that write group, which its ranks may link (None: not
    # sent, a rank reads the parent's manifest)
    parent_chunks: tuple[ChunkRecord, ...] | None = None


@dataclass(frozen=True)
class PartWritten:
    """One rank's part as its ``write_data`` reports it to the coordinator."""

    rank: int
    devices: list[str]  # the write group it went to
    part: str  # its partial manifest (JSON text)


class PartSaves(Protocol):
    """The save transaction's steps as a DCP save takes them, wherever the snapshot is
    written: a store of this process (``LocalPartSaves``) or a storage node
    (``isolane.client.dcp_parts``). One save at a time per instance."""

    def begin(self, name: str, *, overwrite: bool, parent: str | bool | None) -> Begun:
        """On the coordinator: the generation every rank writes into."""
        ...

    def write_part(self, name: str, begun: Begun, rank: int,
                   items: dict[str, torch.Tensor], *, overwrite: bool) -> PartWritten:
        """On every rank: its items as part ``rank-<r>`` of ``begun``'s generation."""
        ...

    def commit(self, name: str, begun: Begun, parts: dict[int, PartWritten], world: int,
               metadata: Metadata, places: Mapping[MetadataIndex, ItemPlace],
               user_metadata: dict[str, Any], *, overwrite: bool, mirror: bool | None,
               started: float) -> SnapshotInfo:
        """On the coordinator, once every rank wrote its part: the manifest, last."""
        ...


class LocalPartSaves:
    """A DCP save into ``store``, a ``SnapshotStore`` of this process (module docstring):
    the ranks of each host write to that host's store."""

    def __init__(self, store: DCPTarget) -> None:
        self.store = store
        self._tx: SaveTransaction | None = None  # the coordinator's

    def begin(self, name: str, *, overwrite: bool, parent: str | bool | None) -> Begun:
        saves = self.store.saves
        saves.claim()
        try:
            self._tx = saves.begin(name, overwrite=overwrite, parent=parent, mark=True)
        finally:
            saves.release()
        linkable = None
        if isinstance(self._tx.parent, Manifest):  # other hosts' parts are not here to link
            self._tx.parent = without_remote_chunks(self._tx.parent)
            linkable = tuple(self._tx.parent.chunks)
        return Begun(self._tx.generation, self._tx.parent_ref, _write_group(self.store),
                     linkable)

    def write_part(self, name: str, begun: Begun, rank: int,
                   items: dict[str, torch.Tensor], *, overwrite: bool) -> PartWritten:
        tree, leaves = flatten_state(items)
        here = _write_group(self.store)
        away = here != begun.home  # another host: its part reaches the manifest's by the mirror
        if away and self.store.mirror_store is None:
            raise InvalidArgumentError(
                f"rank {rank} writes to {here[0]} but the coordinator to "
                f"{begun.home[0]}: ranks on several hosts need a capacity group (mirror) "
                "in every host's config, where their parts come together")
        saves = self.store.saves
        saves.claim()
        try:
            tx = self._tx if self._tx is not None and self._tx.generation == begun.generation \
                else self._join(name, begun, overwrite, away=away)
            request = tx.request(tree, leaves, {}, {}, stage_all=False,
                                 part=part_prefix(rank))
            part = tx.write(request).future.result()
            text = tx.part_json(part_prefix(rank))
        finally:
            saves.release()
        if away:
            self.store.mirror_part(part, f"{tx.prefix}/{part_prefix(rank)}")
        return PartWritten(rank, list(here), text)

    def _join(self, name: str, begun: Begun, overwrite: bool, *, away: bool
              ) -> SaveTransaction:
        """This rank's view of the coordinator's transaction. The parent is linked from
        only where this host holds it: on the coordinator's write group, by the chunks
        it sent; on another, by this host's copy of the parent's manifest if any, never
        the parts other hosts wrote."""
        saves = self.store.saves
        if not away and begun.parent is not None and begun.parent_chunks is not None:
            links = ParentLinks(begun.parent[0], begun.parent[1], begun.parent_chunks)
            return saves.join(name, begun.generation, links, overwrite=overwrite)
        try:
            tx = saves.join(name, begun.generation, begun.parent, overwrite=overwrite)
        except FileNotFoundError:
            return saves.join(name, begun.generation, None, overwrite=overwrite)
        if isinstance(tx.parent, Manifest):
            tx.parent = without_remote_chunks(tx.parent)
        return tx

    def commit(self, name: str, begun: Begun, parts: dict[int, PartWritten], world: int,
               metadata: Metadata, places: Mapping[MetadataIndex, ItemPlace],
               user_metadata: dict[str, Any], *, overwrite: bool, mirror: bool | None,
               started: float) -> SnapshotInfo:
        tx = self._tx
        if tx is None or tx.generation != begun.generation:
            raise InvalidArgumentError("finish() before prepare_global_plan(): only DCP's "
                                       "coordinator commits")
        home = list(_write_group(self.store))
        remote = [rank for rank, written in parts.items() if written.devices != home]
        saves = self.store.saves
        saves.claim()
        try:
            try:
                check_ranks(name, parts, world)
            except DistributedSaveError:
                tx.discard()
                raise
            return commit_parts(tx, [parts[r].part for r in range(world)],
                                [{} for _ in range(world)], user_metadata, mirror=mirror,
                                started=started,
                                encode_dcp=lambda: encode_metadata(metadata, places, remote),
                                part_devices={r: tuple(parts[r].devices) for r in remote})
        finally:
            saves.release()


def check_ranks(name: str, parts: Mapping[int, PartWritten], world: int) -> None:
    """Every rank of the world wrote exactly one part."""
    if sorted(parts) != list(range(world)):
        raise DistributedSaveError(f"'{name}': parts came from ranks {sorted(parts)} of "
                                   f"{world}; nothing was committed")


class IsolaneStorageWriter(StorageWriter):
    """Writes a DCP checkpoint as snapshot ``name`` of ``store`` (a ``SnapshotStore``).

    ``overwrite``, ``parent``, ``mirror`` and ``metadata`` mean what they mean for
    ``SnapshotStore.save``. Also DCP's ``AsyncStager``: ``dcp.async_save`` stages through
    ``stage`` (a copy of every tensor, DTensors as DTensors) before it returns. One
    instance serves one save at a time; after ``finish`` (coordinator) ``info`` holds
    the committed snapshot's ``SnapshotInfo``. ``saves``: where the steps go (default:
    ``LocalPartSaves(store)``); ``store`` None (a node's saves) stages with plain copies."""

    _synchronize_after_execute: bool = False  # stage() returns once the copy is done

    def __init__(self, store: DCPTarget | None, name: str, *, overwrite: bool = False,
                 parent: str | bool | None = None, mirror: bool | None = None,
                 metadata: Mapping[str, Any] | None = None,
                 saves: PartSaves | None = None) -> None:
        super().__init__()
        if saves is None:
            if store is None:
                raise InvalidArgumentError("IsolaneStorageWriter needs a store or saves=")
            saves = LocalPartSaves(store)
        self.store = store
        self.saves = saves
        self.name = check_snapshot_name(name)
        self.overwrite = overwrite
        self.parent = parent
        self.mirror = mirror
        self.metadata = check_metadata(metadata)
        self.info: SnapshotInfo | None = None
        self._coordinator = False
        self._rank = 0
        self._begun: Begun | None = None
        self._started = time.perf_counter()
        self._arena: _Arena | None = None  # the staging buffers of the last stage()
        self.staged_bytes = 0  # the tensor bytes the last stage() copied into them
        self._read = threading.Event()  # the save has read what stage() left unstaged
        self._read.set()

    # -- DCP's call order ------------------------------------------------------------------
    def reset(self, checkpoint_id: Any = None) -> None:
        """A new save; a ``checkpoint_id`` given to ``dcp.save`` names the snapshot."""
        if checkpoint_id is not None:
            self.name = check_snapshot_name(str(checkpoint_id))
        self.info = None
        self._begun = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any
                              ) -> None:
        self._coordinator = is_coordinator
        self._rank = int(kwargs.get("rank", 0))
        self._started = time.perf_counter()
        if self._arena is not None:  # an async save: free its staging if it fails early
            threading.Thread(target=self._release_after, args=(threading.current_thread(),
                                                               self._arena),
                             name="isolane-dcp-staging", daemon=True).start()

    def _release_after(self, save: threading.Thread, arena: _Arena) -> None:
        """Once the save's thread is gone (a save that failed before ``write_data``
        included), the buffers of ``arena`` go back and the caller is let go."""
        save.join()
        if self._arena is arena:
            self.release_staging()

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.name)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """The plan unchanged; the coordinator begins the transaction meanwhile, while
        the other ranks plan (it reads the parent's manifest, marks the generation)."""
        if self._coordinator:
            self._begun = self.saves.begin(self.name, overwrite=self.overwrite,
                                           parent=self.parent)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        if self._begun is None:
            raise InvalidArgumentError("prepare_global_plan() before prepare_local_plan() "
                                       "on the coordinator: DCP's call order begins the "
                                       "isolane transaction there")
        return [replace(plan, storage_data=self._begun) for plan in plans]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        begun = plan.storage_data
        if not isinstance(begun, Begun):
            raise InvalidArgumentError("the DCP plan carries no isolane transaction: "
                                       "prepare_global_plan did not run on the coordinator")
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
        try:
            written = self.saves.write_part(self.name, begun, self._rank, items,
                                            overwrite=self.overwrite)
        finally:
            self.release_staging()
        results.append(WriteResult(index=MetadataIndex(PART_FQN), size_in_bytes=0,
                                   storage_data=written))
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        begun = self._begun
        if begun is None:
            raise InvalidArgumentError("finish() before prepare_global_plan(): only DCP's "
                                       "coordinator commits")
        parts: dict[int, PartWritten] = {}
        places: dict[MetadataIndex, ItemPlace] = {}
        for rank_results in results:
            for result in rank_results:
                if isinstance(result.storage_data, PartWritten):
                    parts[result.storage_data.rank] = result.storage_data
                else:
                    places[result.index] = result.storage_data
        self.info = self.saves.commit(self.name, begun, parts, len(results), metadata, places,
                                      self.metadata, overwrite=self.overwrite,
                                      mirror=self.mirror, started=self._started)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False  # chosen explicitly, never picked from a path

    # -- AsyncStager -----------------------------------------------------------------------
    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A copy of ``state_dict`` that later training steps do not touch, in the store's
        staging pool (``snapshot.staging_budget``): tensors (DTensors: their local
        shards, wrapped again) are copied into its page-aligned buffers as long as the
        buffers out leave one chunk of the budget to the writer; containers are
        rebuilt, other values kept as they are. What does not fit stays the caller's
        tensor and ``synchronize_staging`` (which ``dcp.async_save`` calls before it
        returns) waits until the background write has read it, so a state larger than
        the budget holds the caller longer instead of exceeding it. The buffers go back
        to the pool once this rank's part is written (or its save failed)."""
        if self.store is None:  # no staging pool here: plain copies
            copied: dict[str, Any] = _staged(state_dict, None)
            return copied
        arena = _Arena(self.store.staging)
        staged: dict[str, Any] = _staged(state_dict, arena)
        self._arena = arena
        self.staged_bytes = arena.staged_bytes
        self._read = threading.Event()
        self._synchronize_after_execute = arena.overflow
        return staged

    @property
    def should_synchronize_after_execute(self) -> bool:
        """True when the last ``stage`` left tensors for the save to read."""
        return self._synchronize_after_execute

    def synchronize_staging(self) -> None:
        """Waits, when ``stage`` left tensors unstaged, until the save has read them."""
        if self._synchronize_after_execute:
            self._read.wait()

    def release_staging(self) -> None:
        """Return the staging buffers of the last ``stage`` to the pool (the staged
        state must not be read after this)."""
        arena, self._arena = self._arena, None
        if arena is not None:
            arena.release()
        self._read.set()

    def close(self) -> None:
        """Returns any staging buffers still out; the store belongs to the caller."""
        self.release_staging()


def _write_group(store: DCPTarget) -> tuple[str, ...]:
    return tuple(blob.url for blob in store.stores)


class _Arena:
    """The staging buffers one ``stage`` fills: tensors up to a slot are packed into
    slot-sized buffers, larger ones take a buffer each; a tensor that does not fit in
    what the budget leaves (one slot kept for the writer) is not staged."""

    def __init__(self, pool: StagingPool) -> None:
        self.pool = pool
        self.keep_free = pool.slot_capacity
        self.buffers: list[AlignedBuffer] = []
        self.current: AlignedBuffer | None = None
        self.offset = 0
        self.staged_bytes = 0
        self.overflow = False

    def place(self, nbytes: int) -> int | None:
        """The address of ``nbytes`` of staging memory, or None when full."""
        size = align_up(max(nbytes, 1), _TENSOR_ALIGN)
        if self.current is not None and self.offset + size <= self.current.capacity:
            address = self.current.address + self.offset
            self.offset += size
            return address
        buf = self.pool.try_acquire(max(size, self.pool.slot_bytes), keep_free=self.keep_free)
        if buf is None:
            self.overflow = True
            return None
        self.buffers.append(buf)
        if size <= self.pool.slot_bytes:
            self.current, self.offset = buf, size
        return buf.address

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` copied into staging memory, else ``t`` itself (not staged)."""
        nbytes = t.numel() * t.element_size()
        if nbytes == 0 or t.is_quantized:
            return _copy(t)
        address = self.place(nbytes)
        if address is None:
            return t
        # No buffer export: the pool may unmap a buffer it evicts; the staged state is
        # read only until this rank's part is written, before the buffers go back.
        memory = (ctypes.c_char * nbytes).from_address(address)
        out = torch.frombuffer(memory, dtype=torch.uint8).view(t.dtype).view(t.shape)
        out.copy_(t.detach())
        self.staged_bytes += nbytes
        return out

    def release(self) -> None:
        buffers, self.buffers, self.current = self.buffers, [], None
        for buf in buffers:
            self.pool.release(buf)


_TENSOR_ALIGN = 64


def _staged(value: Any, arena: _Arena | None) -> Any:
    if isinstance(value, DTensor):
        local = _copy(value.to_local()) if arena is None else arena.copy(value.to_local())
        return DTensor.from_local(local, value.device_mesh, value.placements,
                                  run_check=False, shape=value.shape, stride=value.stride())
    if isinstance(value, torch.Tensor):
        return _copy(value) if arena is None else arena.copy(value)
    if isinstance(value, dict):
        out = type(value)() if type(value) in (dict,) else dict()
        for k, v in value.items():
            out[k] = _staged(v, arena)
        return out
    if isinstance(value, list):
        return [_staged(v, arena) for v in value]
    if isinstance(value, tuple) and type(value) is tuple:
        return tuple(_staged(v, arena) for v in value)
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


__all__ = ["Begun", "IsolaneStorageReader", "IsolaneStorageWriter", "LocalPartSaves",
           "PartSaves", "PartWritten", "check_ranks", "holds_dtensor",
           "load_through_dcp", "save_through_dcp"]
