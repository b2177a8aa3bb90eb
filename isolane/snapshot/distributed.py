"""Multi-rank saves and resharded loads over torch.distributed (any backend; gloo on CPU).

Protocol of a save, every rank calling ``SnapshotStore.save`` with its own state dict:

The steps are the save transaction's (``isolane.snapshot.transaction``: begin, write
a part, commit, discard, after-commit); this module adds the collectives around them.

1. rank 0 begins the transaction (checks the name, picks the generation and the
   parent, writes the ``_writing.json`` marker, so GC leaves the generation alone
   while rank 0 lives) and broadcasts ``{generation, parent}``, or its error;
2. every rank writes its state dict under ``<generation>/rank-<r>/`` (chunks, zarr
   metadata, then its partial manifest ``_part.json``; a rank on rank 0's host leaves
   their sync to rank 0's one sync of the write group in step 4), all ranks in parallel;
3. all-gather of every rank's outcome (its partial manifest, or its error): the barrier;
4. rank 0 merges the parts while it syncs the write group, then writes
   ``isolane.json``, the commit, only if every rank succeeded; otherwise it removes
   the generation;
5. broadcast of the result: every rank returns after the commit, or raises.

A rank that dies breaks the collective of step 3 on the others (gloo sees the closed
connection at once; a hung rank shows after the process group's ``timeout``): rank 0
then raises ``DistributedSaveError`` and commits nothing. If rank 0 dies too, the
generation stays uncommitted, its marker names a dead process, and ``gc`` sweeps it.

Object collectives carry JSON text only (manifests, error messages).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from isolane.config import physical_device
from isolane.errors import DistributedSaveError, InvalidArgumentError, IsolaneError
from isolane.snapshot.dtypes import as_bytes, dtype_from_name, itemsize
from isolane.snapshot.manifest import (
    PART_MANIFEST,
    ChunkRecord,
    Manifest,
    ShardRef,
    TensorRecord,
)
from isolane.snapshot.marker import unmark_writing
from isolane.snapshot.names import ROOT, check_metadata, check_snapshot_name
from isolane.snapshot.reader import SnapshotReader, empty_tensor
from isolane.snapshot.resident import RESIDENT
from isolane.snapshot.results import SnapshotInfo
from isolane.snapshot.sharding import (
    Shard,
    check_shards,
    global_view,
    merge_parts,
    part_prefix,
    plan_row_slices,
    rank_view,
    row_nbytes,
    row_range,
)
from isolane.snapshot.transaction import SaveDriver, SaveTransaction
from isolane.snapshot.tree import dotted_key, flatten_state
from isolane.storage.base import BlobStore

Progress = Callable[[int, int], None]
Distributed = bool | dist.ProcessGroup | None


@dataclass(frozen=True)
class RankGroup:
    """The process group of a multi-rank save (``group`` None: the default group)."""

    group: dist.ProcessGroup | None
    rank: int
    world_size: int


def active_group(distributed: Distributed) -> RankGroup | None:
    """None: save from this process alone. ``distributed`` None detects an initialised
    default group of more than one rank; True requires the default group; a
    ProcessGroup names the ranks that save together."""
    if distributed is False:
        return None
    ready = dist.is_available() and dist.is_initialized()
    if distributed is None:
        if not ready or dist.get_world_size() == 1:
            return None
        return RankGroup(None, dist.get_rank(), dist.get_world_size())
    if not ready:
        raise InvalidArgumentError(
            "distributed= needs torch.distributed initialised: call "
            "torch.distributed.init_process_group('gloo') first (torchrun sets up its "
            "environment), or pass distributed=False")
    group = None if distributed is True else distributed
    return RankGroup(group, dist.get_rank(group), dist.get_world_size(group))


def save_distributed(saves: SaveDriver, ranks: RankGroup, state_dict: Any, name: str,
                     metadata: Mapping[str, Any] | None, *,
                     shards: Mapping[str, Shard] | None, overwrite: bool,
                     parent: str | bool | None, mirror: bool | None,
                     progress: Progress | None) -> SnapshotInfo:
    """Save this rank's state dict as its share of snapshot ``name`` through the store's
    save driver (``saves``); collective: every rank of the group must call it. Returns
    once rank 0 has committed."""
    started = time.perf_counter()
    local_error: Exception | None = None
    try:  # local checks: a failure here still takes part in every collective below
        check_snapshot_name(name)
        user_meta = check_metadata(metadata)
        tree, leaves = flatten_state(state_dict)
        refs = check_shards(shards or {}, {dotted_key(leaf.path): tuple(leaf.tensor.shape)
                                           for leaf in leaves})
    except Exception as exc:
        local_error = exc
    saves.claim()
    try:
        begin: dict[str, Any] = {}
        tx: SaveTransaction | None = None
        if ranks.rank == 0:
            if local_error is not None:
                begin = {"error": _describe(0, local_error)}
            else:
                try:  # raised after the broadcast, not before it
                    tx = saves.begin(name, overwrite=overwrite, parent=parent, mark=True)
                    begin = {"generation": tx.generation, "overwrite": overwrite,
                             "parent": tx.parent_ref}
                except (IsolaneError, OSError) as exc:
                    begin, local_error = {"error": str(exc)}, exc
        try:
            begin = _broadcast(ranks, begin)
        except RuntimeError as exc:
            if tx is not None:
                tx.discard()
            raise DistributedSaveError(
                f"the ranks could not start saving '{name}' together ({exc}): every rank "
                "of the group must call save(), or pass distributed=False to save from "
                "one process alone") from None
        if "error" in begin:
            if local_error is not None:
                raise local_error
            raise DistributedSaveError(f"rank 0 refused to save '{name}': {begin['error']}")
        generation = begin["generation"]
        outcome: dict[str, Any]
        if local_error is not None:
            outcome = {"error": _describe(ranks.rank, local_error)}
        else:
            try:
                if tx is None:
                    tx = saves.join(name, generation, begin["parent"], overwrite=overwrite)
                outcome = {"part": _write_part(tx, ranks.rank, tree, leaves, progress),
                           "shards": {k: [r.offset, r.total] for k, r in refs.items()}}
            except Exception as exc:
                local_error = exc
                outcome = {"error": _describe(ranks.rank, exc)}
        try:
            outcomes = _all_gather(ranks, outcome)
        except RuntimeError as exc:
            if ranks.rank == 0 and tx is not None:
                tx.discard()
            raise DistributedSaveError(
                f"a rank failed or died while saving '{name}' ({exc}); nothing was "
                "committed: fix that rank and save again (leftovers are removed now, or "
                "by 'isolane gc')") from None
        result: dict[str, Any] = {}
        if ranks.rank == 0 and tx is not None:
            result = _commit(tx, outcomes, user_meta, mirror=mirror, started=started)
        try:
            result = _broadcast(ranks, result)
        except RuntimeError as exc:
            raise DistributedSaveError(
                f"rank 0 died while committing '{name}' ({exc}); run 'isolane ls' to see "
                "whether it committed") from None
        if "error" in result:
            if local_error is not None:
                raise local_error
            raise DistributedSaveError(f"'{name}' was not committed: {result['error']}")
        return SnapshotInfo(**result["info"])
    finally:
        saves.release()


def _write_part(tx: SaveTransaction, rank: int, tree: Any, leaves: Any,
                progress: Progress | None) -> str:
    """This rank's share, under ``rank-<r>/``, ending in its partial manifest (its
    JSON text is returned)."""
    part = part_prefix(rank)
    request = tx.request(tree, leaves, {}, {}, stage_all=False, part=part)
    tx.write(request, progress).future.result()
    return tx.part_json(part)


def _commit(tx: SaveTransaction, outcomes: list[dict[str, Any]], metadata: dict[str, Any],
            *, mirror: bool | None, started: float) -> dict[str, Any]:
    """Rank 0: merge the parts and commit, if every rank succeeded; else discard."""
    errors = [o["error"] for o in outcomes if "error" in o]
    if errors:
        tx.discard()
        return {"error": "; ".join(errors)}
    try:
        info = commit_parts(tx, [o["part"] for o in outcomes],
                            [{k: ShardRef(*v) for k, v in o["shards"].items()}
                             for o in outcomes], metadata, mirror=mirror, started=started)
    except (IsolaneError, OSError) as exc:
        return {"error": str(exc)}
    return {"info": info.to_dict()}


def commit_parts(tx: SaveTransaction, parts_json: list[str],
                 shards: list[dict[str, ShardRef]], metadata: dict[str, Any], *,
                 mirror: bool | None, started: float,
                 encode_dcp: Callable[[], dict[str, Any]] | None = None,
                 part_devices: Mapping[int, tuple[str, ...]] | None = None) -> SnapshotInfo:
    """The coordinator's commit of a multi-rank save (this protocol's rank 0, or DCP's
    coordinator): merge the ranks' partial manifests (``parts_json[r]`` from rank r),
    write the manifest, then the after-commit steps (``part_devices``: the write groups
    of the parts written on other hosts, by rank; ``encode_dcp``: DCP's metadata for
    the manifest). A failure discards the generation and is raised.

    Every rank of this host left the durability of its part (chunks, links, metadata,
    part manifest) to one sync of each file system of the write group, which starts
    first and runs while the parts are checked and merged: the manifest is written
    only once it is done. Parts written on another host synced themselves."""
    stores = tx.driver.stores
    here = [part_prefix(r) for r in range(len(parts_json)) if r not in (part_devices or {})]
    synced = RESIDENT.submit(sync_write_group, stores, what=f"sync of {tx.prefix}")
    try:
        parts = [Manifest.from_json(p.encode(), f"rank {r} of {tx.prefix}")
                 for r, p in enumerate(parts_json)]
        parent = ({"name": tx.parent.name, "generation": tx.parent.generation}
                  if tx.parent is not None else None)
        merged = merge_parts(parts, shards, name=tx.name, generation=tx.generation,
                             committed_at=time.time(), seconds=time.perf_counter() - started,
                             metadata=metadata, parent=parent,
                             devices=tuple(s.url for s in stores),
                             part_devices=part_devices)
        if encode_dcp is not None:
            merged = replace(merged, dcp=encode_dcp())
        for part in here:  # a committed generation never lacks a part manifest
            stores[0].size(f"{tx.prefix}/{part}/{PART_MANIFEST}")
        synced.result()
        merged = tx.commit(merged)
    except BaseException:
        with contextlib.suppress(BaseException):
            synced.result()  # no sync still runs while the generation is removed
        tx.discard()
        raise
    with contextlib.suppress(OSError):
        unmark_writing(stores[0], tx.prefix)
    return tx.after_commit(merged, mirror=mirror)


def sync_write_group(stores: Sequence[BlobStore]) -> None:
    """Make everything written on the write group durable: one sync of each file system
    its devices lie on (devices that share one are synced once)."""
    for blob in stores_to_sync(stores):
        blob.sync_all()


def stores_to_sync(stores: Sequence[BlobStore]) -> list[BlobStore]:
    """The stores whose ``sync_all`` covers all of ``stores``: the first of each local
    file system (``st_dev``) and every store without local files."""
    seen: set[int] = set()
    out: list[BlobStore] = []
    for blob in stores:
        root = blob.local_path(ROOT)
        device = physical_device(root) if root is not None else None
        if device is not None:
            if device in seen:
                continue
            seen.add(device)
        out.append(blob)
    return out


def _describe(rank: int, exc: BaseException | None) -> str:
    return f"rank {rank}: {type(exc).__name__}: {exc}"


def _broadcast(ranks: RankGroup, payload: dict[str, Any]) -> dict[str, Any]:
    box: list[Any] = [json.dumps(payload) if ranks.rank == 0 else None]
    dist.broadcast_object_list(box, group=ranks.group, group_src=0)
    return dict(json.loads(box[0]))


def _all_gather(ranks: RankGroup, payload: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[Any] = [None] * ranks.world_size
    dist.all_gather_object(out, json.dumps(payload), group=ranks.group)
    return [dict(json.loads(text)) for text in out]


# -- loading ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Reshard:
    """How to load a multi-rank snapshot as rank ``rank`` of ``world_size``."""

    manifest: Manifest  # the whole merged manifest
    rank: int
    world_size: int
    pieces: Mapping[int, tuple[TensorRecord, ...]]  # split tensor id -> its pieces on every rank


def choose_view(manifest: Manifest, shard: tuple[int, int] | None
                ) -> tuple[Manifest, Reshard | None]:
    """The manifest to load from: a rank's own part when the world size matches the
    save's, else rank 0's structure with split tensors resliced (``Reshard``).
    ``shard`` (rank, world_size) defaults to this process's torch.distributed rank."""
    if shard is None:
        ready = dist.is_available() and dist.is_initialized()
        shard = (dist.get_rank(), dist.get_world_size()) if ready else (0, 1)
    rank, world = shard
    row_range(1, rank, world)  # validates rank against world
    if world == len(manifest.ranks):
        return rank_view(manifest, rank), None
    view, pieces = global_view(manifest)
    return view, Reshard(manifest, rank, world, pieces)


def read_resharded(reader: SnapshotReader, view: Manifest, prefix: str, ids: set[int],
                   plan: Reshard, progress: Progress | None = None) -> dict[int, torch.Tensor]:
    """Tensors by id: whole ones as saved by rank 0, split ones as this rank's rows,
    read from only the chunks that hold them."""
    out = reader.read(view, prefix, {i for i in ids if i not in plan.pieces}, progress)
    chunks_of: dict[int, list[ChunkRecord]] = defaultdict(list)
    for chunk in plan.manifest.chunks:
        if chunk.tensor is not None:
            chunks_of[chunk.tensor].append(chunk)
    records = {t.id: t for t in view.tensors}
    for tid in sorted(ids & set(plan.pieces)):
        rec = records[tid]
        lo, hi = row_range(rec.shape[0], plan.rank, plan.world_size)
        dtype = dtype_from_name(rec.dtype)
        tensor = empty_tensor(replace(rec, shape=(hi - lo, *rec.shape[1:])))
        raw = as_bytes(tensor)
        slices, packed = plan_row_slices(plan.pieces[tid], chunks_of, lo, hi,
                                         row_nbytes(rec.shape, itemsize(dtype)))
        reader.read_slices(prefix, slices, raw, f"tensor '{rec.key}'")
        for p in packed:
            whole = as_bytes(reader.read(plan.manifest, prefix, {p.source.id})[p.source.id])
            raw[p.dst_offset:p.dst_offset + p.stop - p.start].copy_(whole[p.start:p.stop])
        out[tid] = tensor
    return out
