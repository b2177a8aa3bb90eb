"""Multi-rank saves and resharded loads over torch.distributed (any backend; gloo on CPU).

Protocol of a save, every rank calling ``SnapshotStore.save`` with its own state dict:

1. rank 0 checks the name, picks the generation and the parent, writes the
   ``_writing.json`` marker (so GC leaves the generation alone while rank 0 lives) and
   broadcasts ``{generation, parent}``, or its error;
2. every rank writes its state dict under ``<generation>/rank-<r>/`` (chunks, zarr
   metadata, fsyncs, then its partial manifest ``_part.json``), all ranks in parallel;
3. all-gather of every rank's outcome (its partial manifest, or its error): the barrier;
4. rank 0 merges the parts and writes ``isolane.json``, the commit, only if every rank
   succeeded; otherwise it removes the generation;
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
import os
import socket
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from isolane.errors import (
    DistributedSaveError,
    InvalidArgumentError,
    IsolaneError,
    SnapshotExistsError,
)
from isolane.snapshot.dtypes import as_bytes, dtype_from_name, itemsize
from isolane.snapshot.manifest import (
    MANIFEST,
    WRITING_MARKER,
    ChunkRecord,
    Manifest,
    ShardRef,
    TensorRecord,
)
from isolane.snapshot.reader import SnapshotReader, empty_tensor
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
from isolane.snapshot.tree import dotted_key, flatten_state

if TYPE_CHECKING:
    from isolane.snapshot.store import SnapshotInfo, SnapshotStore

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


def save_distributed(store: SnapshotStore, ranks: RankGroup, state_dict: Any, name: str,
                     metadata: Mapping[str, Any] | None, *,
                     shards: Mapping[str, Shard] | None, overwrite: bool,
                     parent: str | bool | None, mirror: bool | None,
                     progress: Progress | None) -> SnapshotInfo:
    """Save this rank's state dict as its share of snapshot ``name``; collective: every
    rank of the group must call it. Returns once rank 0 has committed."""
    from isolane.snapshot.store import SnapshotInfo, check_metadata, check_snapshot_name

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
    store._save_slot.acquire()
    try:
        begin: dict[str, Any] = {}
        if ranks.rank == 0:
            if local_error is not None:
                begin = {"error": _describe(0, local_error)}
            else:
                begin, local_error = _begin(store, name, overwrite=overwrite, parent=parent)
        try:
            begin = _broadcast(ranks, begin)
        except RuntimeError as exc:
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
                part = _write_part(store, ranks.rank, name, generation, tree, leaves,
                                   begin["parent"], progress)
                outcome = {"part": part.to_json().decode(),
                           "shards": {k: [r.offset, r.total] for k, r in refs.items()}}
            except Exception as exc:
                local_error = exc
                outcome = {"error": _describe(ranks.rank, exc)}
        try:
            outcomes = _all_gather(ranks, outcome)
        except RuntimeError as exc:
            if ranks.rank == 0:
                _discard(store, name, generation)
            raise DistributedSaveError(
                f"a rank failed or died while saving '{name}' ({exc}); nothing was "
                "committed: fix that rank and save again (leftovers are removed now, or "
                "by 'isolane gc')") from None
        result: dict[str, Any] = {}
        if ranks.rank == 0:
            result = _commit(store, name, generation, begin, outcomes, user_meta,
                             mirror=mirror, started=started)
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
        store._save_slot.release()


def _begin(store: SnapshotStore, name: str, *, overwrite: bool, parent: str | bool | None
           ) -> tuple[dict[str, Any], Exception | None]:
    from isolane.snapshot.manifest import zarr_group_meta
    from isolane.snapshot.store import _prefix, new_generation

    generation = None
    try:
        store._raise_unreported_async_error()
        if not overwrite and store._state(name).exists:
            raise SnapshotExistsError(name, store.url)  # early; the commit checks again
        pm = store._parent_manifest(parent, name)
        generation = new_generation()
        prefix = _prefix(name, generation)
        store.stores[0].write_atomic(f"{prefix}/{WRITING_MARKER}", json.dumps(
            {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
        ).encode())
        for blob in store.stores:
            blob.write(f"{prefix}/zarr.json",
                       zarr_group_meta({"isolane": {"manifest": MANIFEST}}), durable=False)
    except (IsolaneError, OSError) as exc:  # raised after the broadcast, not before it
        if generation is not None:
            _discard(store, name, generation)
        return {"error": str(exc)}, exc
    return {"generation": generation, "overwrite": overwrite,
            "parent": [pm.name, pm.generation] if pm is not None else None}, None


def _write_part(store: SnapshotStore, rank: int, name: str, generation: str, tree: Any,
                leaves: Any, parent: list[str] | None, progress: Progress | None
                ) -> Manifest:
    from isolane.snapshot.store import _prefix

    parent_manifest = (store._manifest(store.stores, parent[0], parent[1])
                       if parent is not None else None)
    folder = part_prefix(rank)
    request = store._request(name, generation, f"{_prefix(name, generation)}/{folder}", tree,
                             leaves, {}, {}, parent_manifest, stage_all=False, part=folder)
    return store._writer.start(request, progress).future.result()


def _commit(store: SnapshotStore, name: str, generation: str, begin: Mapping[str, Any],
            outcomes: list[dict[str, Any]], metadata: dict[str, Any], *,
            mirror: bool | None, started: float) -> dict[str, Any]:
    from isolane.snapshot.store import _prefix

    errors = [o["error"] for o in outcomes if "error" in o]
    try:
        if errors:
            raise _Refused("; ".join(errors))
        prefix = _prefix(name, generation)
        parts = [Manifest.from_json(o["part"].encode(), f"rank {r} of {prefix}")
                 for r, o in enumerate(outcomes)]
        shards = [{k: ShardRef(*v) for k, v in o["shards"].items()} for o in outcomes]
        parent = ({"name": begin["parent"][0], "generation": begin["parent"][1]}
                  if begin["parent"] else None)
        merged = merge_parts(parts, shards, name=name, generation=generation,
                             committed_at=time.time(), seconds=time.perf_counter() - started,
                             metadata=metadata, parent=parent,
                             devices=tuple(s.url for s in store.stores))
        for blob in store.stores:  # the ranks synced their folders, not this file
            blob.sync([prefix], files=[f"{prefix}/zarr.json"])
        merged, replaced = store._local.commit(merged, overwrite=begin["overwrite"])
    except (IsolaneError, OSError) as exc:
        _discard(store, name, generation)
        return {"error": str(exc)}
    with contextlib.suppress(OSError):
        store.stores[0].delete(f"{prefix}/{WRITING_MARKER}")
    do_mirror = store.config.snapshot.mirror if mirror is None else mirror
    info = store._after_commit(merged, replaced, mirror=do_mirror)
    return {"info": info.to_dict()}


def _discard(store: SnapshotStore, name: str, generation: str) -> None:
    from isolane.snapshot.store import ROOT

    # What cannot be removed now has no manifest and a dead marker: GC sweeps it.
    with contextlib.suppress(OSError):
        store._remove_generation(store.stores, name, generation)
        for blob in store.stores:
            if not blob.children(f"{ROOT}/{name}"):
                blob.delete_prefix(f"{ROOT}/{name}")


class _Refused(IsolaneError):
    pass


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
