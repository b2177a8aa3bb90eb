"""Loading a located snapshot into a state dict: ``keys=`` subtrees, ``into=`` targets
filled in place, ``mmap=``, and multi-rank snapshots (a rank's own part, or resharded
for another world size: ``isolane.snapshot.distributed``). The chunk reads are
``SnapshotReader``'s; this module decides what to read and where it goes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from isolane.errors import IntegrityError, InvalidArgumentError, KeyNotFoundError
from isolane.lanes.scheduler import LaneHandle
from isolane.snapshot.catalog import Located
from isolane.snapshot.distributed import choose_view, read_resharded
from isolane.snapshot.dtypes import dtype_name
from isolane.snapshot.manifest import Manifest
from isolane.snapshot.reader import SnapshotReader
from isolane.snapshot.staging import StagingPool
from isolane.snapshot.tree import dotted_key, flatten_state, key_filter, tensor_ids, unflatten_state

log = logging.getLogger(__name__)
Progress = Callable[[int, int], None]

# How often a load re-reads after overwrites replaced the generation it was reading.
RELOCATE_ATTEMPTS = 3


def load(locate: Callable[[], Located], lane: LaneHandle, staging: StagingPool, name: str,
         map_location: str | torch.device, keys: list[str] | None,
         progress: Progress | None, *, into: Any, mmap: bool,
         shard: tuple[int, int] | None) -> Any:
    """``SnapshotStore.load``: the live generation (``locate()``), read again when an
    overwrite in another process removed it mid-read."""
    located = locate()
    for _ in range(RELOCATE_ATTEMPTS):
        try:
            return load_located(located, lane, staging, name, map_location, keys, progress,
                                into=into, mmap=mmap, shard=shard)
        except IntegrityError:
            # An overwrite in another process may have committed and removed the
            # generation located above: read the live one, or report the damage.
            now = locate()
            if now.manifest.generation == located.manifest.generation:
                raise
            log.info("snapshot '%s' was overwritten while it loaded (generation %s is "
                     "live now); reading that", name, now.manifest.generation)
            located = now
    return load_located(located, lane, staging, name, map_location, keys, progress,
                        into=into, mmap=mmap, shard=shard)


def load_located(located: Located, lane: LaneHandle, staging: StagingPool, name: str,
                 map_location: str | torch.device, keys: list[str] | None,
                 progress: Progress | None, *, into: Any, mmap: bool,
                 shard: tuple[int, int] | None) -> Any:
    reshard = None
    if located.manifest.ranks:
        view, reshard = choose_view(located.manifest, shard)
        located = replace(located, manifest=view)
        if reshard is not None and (into is not None or mmap):
            raise InvalidArgumentError("into= and mmap= need the saved world size "
                                       f"({len(view.ranks)}); load without them")
    elif shard is not None:
        raise InvalidArgumentError(f"snapshot '{name}' was saved by one process and has "
                                   "no shards; load it without shard= (keys= selects "
                                   "parts)")
    wanted = key_filter(keys)
    ids = tensor_ids(located.manifest.tree, wanted)
    if keys is not None:
        check_keys(located.manifest, keys)
    reader = SnapshotReader(located.stores, lane, staging)
    if reshard is not None:
        tensors = read_resharded(reader, located.manifest, located.prefix, ids, reshard,
                                 progress)
        if str(map_location) != "cpu":
            tensors = {k: v.to(map_location) for k, v in tensors.items()}
        return unflatten_state(located.manifest.tree, tensors.__getitem__, wanted)
    direct, copy_later = _match_targets(located.manifest, ids, into)
    tensors = reader.read(located.manifest, located.prefix, ids, progress, mmap=mmap,
                          into={tid: t.detach() for tid, t in direct.items()})
    tensors.update(direct)
    for tid, target in copy_later.items():
        with torch.no_grad():
            target.copy_(tensors[tid])
        tensors[tid] = target
    if str(map_location) != "cpu":
        tensors = {k: v if k in direct or k in copy_later else v.to(map_location)
                   for k, v in tensors.items()}
    return unflatten_state(located.manifest.tree, tensors.__getitem__, wanted)


def check_keys(manifest: Manifest, keys: list[str]) -> None:
    """KeyNotFoundError for the first of ``keys`` that is neither a tensor's key nor a
    subtree of the snapshot."""
    known = {t.key for t in manifest.tensors} | leaf_keys(manifest)
    missing = [k for k in keys if not any(kk == k or kk.startswith(k + ".") for kk in known)]
    if missing:
        raise KeyNotFoundError(f"snapshot '{manifest.name}' has no key {missing[0]!r}; run "
                               f"'isolane show {manifest.name}' to list its keys")


def leaf_keys(manifest: Manifest) -> set[str]:
    """The dotted key of every leaf of the manifest's tree (tensors and other values)."""
    keys: set[str] = set()

    def visit(path: tuple[object, ...]) -> bool:
        keys.add(".".join(str(x) for x in path))
        return False

    unflatten_state(manifest.tree, lambda _i: torch.empty(0), visit)
    return keys


def _match_targets(manifest: Manifest, ids: set[int], into: Any
                   ) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """Target tensors of ``load(into=...)`` by snapshot tensor id: filled directly
    (contiguous CPU) or through a copy (other devices, strided)."""
    if into is None:
        return {}, {}
    _tree, leaves = flatten_state(into)
    by_key = {dotted_key(leaf.path): leaf.tensor for leaf in leaves}
    direct: dict[int, torch.Tensor] = {}
    later: dict[int, torch.Tensor] = {}
    for rec in manifest.tensors:
        target = by_key.get(rec.key)
        if rec.id not in ids or target is None:
            continue
        if tuple(target.shape) != rec.shape or dtype_name(target.dtype) != rec.dtype:
            raise InvalidArgumentError(
                f"into['{rec.key}'] is {dtype_name(target.dtype)}{list(target.shape)} but "
                f"the snapshot holds {rec.dtype}{list(rec.shape)}; load without into= "
                "or give a matching tensor")
        if target.device.type == "cpu" and target.is_contiguous():
            direct[rec.id] = target
        else:
            later[rec.id] = target
    return direct, later
