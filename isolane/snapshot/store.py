"""SnapshotStore: the public, synchronous checkpoint API.

Layout on every device of the write group (and on the mirror)::

    snapshots/<name>/<generation>/zarr.json        zarr v3 group
    snapshots/<name>/<generation>/<array>/zarr.json
    snapshots/<name>/<generation>/<array>/c.<i>... chunk files (this device's share)
    snapshots/<name>/<generation>/_packs/<n>/...    small tensors packed together
    snapshots/<name>/<generation>/isolane.json      manifest, device 0 only: the commit

A generation (``<time_ns>-<random>``) is one save attempt; the newest committed
generation with the latest commit time is the snapshot (``isolane.snapshot.catalog``:
commits of one name are serialised by a lock, so of two racing saves of a new name
one commits and the other gets ``SnapshotExistsError``). Overwriting writes a new
generation and removes the old one only after the new one has committed.

A generation whose manifest exists but cannot be read is *damaged*: it fails alone
(``IntegrityError`` for that name; ``list`` skips it, ``damaged`` reports it) and gc
never sweeps it.

Thread-safe: saves are serialised per store (a second save waits for an async save in
flight); loads, listing and verification run concurrently with them.
"""

from __future__ import annotations

import builtins
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch

from isolane.config import Config, default_config, is_url, load_config, store_config
from isolane.errors import (
    IntegrityError,
    InvalidArgumentError,
    InvalidNameError,
    IsolaneError,
    KeyNotFoundError,
    SnapshotExistsError,
    SnapshotNotFoundError,
)
from isolane.lanes.assignment import JobKind
from isolane.lanes.scheduler import LaneScheduler, shared_registry
from isolane.snapshot.catalog import (
    ROOT,
    SNAPSHOT_NAME,
    Catalog,
    DamagedSnapshot,
    NameState,
    prefix_of,
)
from isolane.snapshot.distributed import (
    Distributed,
    active_group,
    choose_view,
    read_resharded,
    save_distributed,
)
from isolane.snapshot.dtypes import dtype_name, itemsize
from isolane.snapshot.manifest import MANIFEST, PART_MANIFEST, Manifest
from isolane.snapshot.mirror import Mirrorer
from isolane.snapshot.plan import PACKS_GROUP, ChunkPlan, SavePlan, TensorSpec, plan_save
from isolane.snapshot.reader import SnapshotReader
from isolane.snapshot.retention import plan_retention, should_sweep
from isolane.snapshot.sharding import Shard
from isolane.snapshot.staging import StagingPool
from isolane.snapshot.transaction import ChunkFeed, SaveTransaction, UploadPlan
from isolane.snapshot.tree import (
    TensorLeaf,
    dotted_key,
    flatten_state,
    key_filter,
    tensor_ids,
    unflatten_state,
)
from isolane.snapshot.versions import Signature, TensorVersions, signature
from isolane.snapshot.writer import (
    ParentChunk,
    SaveJob,
    SaveRequest,
    SnapshotWriter,
    remove_if_empty,
)
from isolane.storage.base import BlobStore
from isolane.storage.registry import blob_store_from_url

log = logging.getLogger(__name__)

# How often a load re-reads after overwrites replaced the generation it was reading.
_RELOCATE_ATTEMPTS = 3

__all__ = ["ROOT", "DamagedSnapshot", "GcReport", "SaveHandle", "SnapshotInfo",
           "SnapshotStore", "check_snapshot_name"]
Progress = Callable[[int, int], None]
ChangeDetection = Literal["hash", "version"]


def check_snapshot_name(name: str) -> str:
    if not isinstance(name, str) or not SNAPSHOT_NAME.fullmatch(name) or ".." in name:
        shown = repr(name)
        raise InvalidNameError(
            f"invalid snapshot name {shown}: use 1-200 letters, digits and ._+=@- , starting "
            "with a letter or digit, with no '/', '..', spaces or control characters "
            "(e.g. 'step-100')")
    return name


@dataclass(frozen=True)
class SnapshotInfo:
    name: str
    generation: str
    committed_at: float
    logical_bytes: int
    stored_bytes: int
    written_bytes: int
    linked_bytes: int
    tensors: int
    seconds: float
    location: str  # "local" or "mirror"
    url: str
    parent: dict[str, str] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    mirrored: bool | None = None
    # The name's live generation when this was returned: a save's own generation,
    # unless a later commit (overwrite=True) has replaced it meanwhile.
    live_generation: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class GcReport:
    deleted_snapshots: tuple[str, ...]
    swept_generations: tuple[str, ...]
    damaged: tuple[DamagedSnapshot, ...] = ()  # reported, never swept


class SaveHandle:
    """Returned by ``save_async``: the tensors are staged; durability follows."""

    def __init__(self, name: str, future: Future[SnapshotInfo]) -> None:
        self.name = name
        self._future = future
        self.reported = False

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> SnapshotInfo:
        """Block until the snapshot is committed; raises the save's error."""
        self.reported = True
        return self._future.result(timeout)

    def exception(self) -> BaseException | None:
        return self._future.exception() if self._future.done() else None


@dataclass(frozen=True)
class Located:
    stores: builtins.list[BlobStore]
    prefix: str
    manifest: Manifest
    location: str


class SnapshotStore:
    """Checkpoints on the write group (and optionally mirrored to the capacity group).

    ``target``: None (the embedded default under ``$ISOLANE_HOME``), a folder, an fsspec
    URL such as ``s3://bucket/prefix``, a YAML config file, or a ``Config``.
    """

    def __new__(cls, target: str | os.PathLike[str] | Config | None = None, **kwargs: Any
                ) -> Any:
        """An ``http(s)://`` URL names a storage node: the result is then a
        ``RemoteSnapshotStore`` (save, load, list, info, verify, delete as here)."""
        if isinstance(target, str) and target.startswith(("http://", "https://")):
            from isolane.client.snapshot_store import RemoteSnapshotStore

            return RemoteSnapshotStore(target, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        target: str | os.PathLike[str] | Config | None = None,
        *,
        storage_options: Mapping[str, Any] | None = None,
        scheduler: LaneScheduler | None = None,
    ) -> None:
        self.config = _resolve_target(target, storage_options)
        group = self.config.require_group("write")
        self.stores: builtins.list[BlobStore] = [
            blob_store_from_url(d, storage_options=group.storage_options,
                                direct_io=group.direct_io) for d in group.devices]
        capacity = self.config.group("capacity")
        self.mirror_store: BlobStore | None = None
        if capacity is not None:
            self.mirror_store = blob_store_from_url(
                capacity.devices[0], storage_options=capacity.storage_options)
        self.scheduler = scheduler or shared_registry.get(self.config)
        snap = self.config.snapshot
        self.staging = StagingPool(snap.chunk_bytes, snap.staging_budget)
        self._writer = SnapshotWriter(self.stores, self.scheduler.lane(JobKind.CHECKPOINT_WRITE),
                                      self.staging)
        # Restores share the write lane but go first and are not metered by the governor.
        self._reader = SnapshotReader(self.stores, self.scheduler.lane(JobKind.CHECKPOINT_READ))
        self._mirrorer = (Mirrorer(self.stores, self.mirror_store,
                                   self.scheduler.lane(JobKind.MIRROR),
                                   attempts=snap.mirror_attempts,
                                   backoff_s=snap.mirror_backoff_s)
                          if self.mirror_store is not None else None)
        self._save_slot = threading.Semaphore(1)
        self._last_async: SaveHandle | None = None
        self._mirrors: dict[str, Future[None]] = {}
        self._local = Catalog(self.stores, "local")
        self._mirror = (Catalog([self.mirror_store], "mirror")
                        if self.mirror_store is not None else None)
        self._versions = TensorVersions()
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return self.stores[0].url

    # -- saving ----------------------------------------------------------------------------
    def save(self, state_dict: Any, name: str, metadata: Mapping[str, Any] | None = None, *,
             overwrite: bool = False, parent: str | bool | None = None,
             mirror: bool | None = None, progress: Progress | None = None,
             change_detection: ChangeDetection = "hash",
             shards: Mapping[str, Shard] | None = None,
             distributed: Distributed = None) -> SnapshotInfo:
        """Save and return once the snapshot is durable and committed.

        ``parent``: the snapshot to link unchanged chunks from (default: the newest in
        the store; False: none). ``change_detection``: ``"hash"`` finds unchanged
        chunks by content hash (always right); ``"version"`` also trusts torch's
        version counters to skip even the hashing of tensors untouched since they were
        saved from this process (see ``isolane.snapshot.versions`` for when that is
        wrong).

        Multi-rank: with torch.distributed initialised and more than one rank (or
        ``distributed=True`` / a ProcessGroup), this is a collective: every rank passes
        its own state dict, all ranks write in parallel and rank 0 commits once all
        have finished (see ``isolane.snapshot.distributed``); ``distributed=False``
        saves from this process alone. ``shards`` marks tensors split along dim 0 by
        dotted key, e.g. ``{"model.w": Shard(offset=512, total=1024)}``, so that a
        load with another world size can cut them anew."""
        ranks = active_group(distributed)
        if ranks is not None:
            if change_detection != "hash":
                raise InvalidArgumentError("multi-rank saves detect changes by hash only; "
                                           "drop change_detection='version'")
            return save_distributed(self, ranks, state_dict, name, metadata, shards=shards,
                                    overwrite=overwrite, parent=parent, mirror=mirror,
                                    progress=progress)
        if shards:
            raise InvalidArgumentError(
                "shards= describes a multi-rank save: initialise torch.distributed (e.g. "
                "under torchrun) so that every rank saves its piece")
        _job, finish = self._start(state_dict, name, metadata, overwrite=overwrite,
                                   parent=parent, mirror=mirror, progress=progress,
                                   stage_all=False, change_detection=change_detection)
        return finish.result()

    def save_async(self, state_dict: Any, name: str, metadata: Mapping[str, Any] | None = None,
                   *, overwrite: bool = False, parent: str | bool | None = None,
                   mirror: bool | None = None, progress: Progress | None = None,
                   change_detection: ChangeDetection = "hash") -> SaveHandle:
        """Return once every tensor is copied into staging (the caller may then mutate
        them); the save commits in the background. Errors surface on ``result()`` and,
        if nobody asked, on the next save."""
        job, finish = self._start(state_dict, name, metadata, overwrite=overwrite,
                                  parent=parent, mirror=mirror, progress=progress,
                                  stage_all=True, change_detection=change_detection)
        job.staged.wait()
        handle = SaveHandle(name, finish)
        self._last_async = handle
        return handle

    def _start(self, state_dict: Any, name: str, metadata: Mapping[str, Any] | None, *,
               overwrite: bool, parent: str | bool | None, mirror: bool | None,
               progress: Progress | None, stage_all: bool,
               change_detection: ChangeDetection = "hash"
               ) -> tuple[SaveJob, Future[SnapshotInfo]]:
        check_snapshot_name(name)
        if change_detection not in ("hash", "version"):
            raise InvalidArgumentError(f"change_detection must be 'hash' or 'version', "
                                       f"got {change_detection!r}")
        user_meta = check_metadata(metadata)
        tree, leaves = flatten_state(state_dict)  # refuses bad leaves before any I/O
        signatures = {leaf.id: signature(leaf.tensor) for leaf in leaves}
        job, finish, _request = self._begin(
            tree, leaves, signatures, name, user_meta, overwrite=overwrite, parent=parent,
            mirror=mirror, progress=progress, stage_all=stage_all,
            change_detection=change_detection)
        return job, finish

    def _begin(self, tree: Any, leaves: Sequence[TensorLeaf],
               signatures: Mapping[int, Signature | None], name: str,
               user_meta: dict[str, Any], *, overwrite: bool, parent: str | bool | None,
               mirror: bool | None, progress: Progress | None, stage_all: bool,
               change_detection: ChangeDetection = "hash", feed: ChunkFeed | None = None
               ) -> tuple[SaveJob, Future[SnapshotInfo], SaveRequest]:
        """Start the writer on a planned save (holding the save slot until it ends)."""
        self._save_slot.acquire()
        try:
            self._raise_unreported_async_error()
            if not overwrite and self._local.state(name).exists:
                raise SnapshotExistsError(name, self.url)  # early; commit checks again
            parent_manifest = self._parent_manifest(parent, name)
            generation = new_generation()
            request = self._request(
                name, generation, _prefix(name, generation), tree, leaves, signatures,
                user_meta, parent_manifest, stage_all=stage_all,
                change_detection=change_detection)
            if feed is not None:
                request = replace(request, feed=feed)
            replaced: builtins.list[str] = []

            def commit(manifest: Manifest) -> Manifest:
                committed, gone = self._local.commit(manifest, overwrite=overwrite)
                replaced.extend(gone)
                return committed

            request = replace(request, commit=commit)
            job = self._writer.start(request, progress)
        except BaseException:
            self._save_slot.release()
            raise
        finish: Future[SnapshotInfo] = Future()
        do_mirror = self.config.snapshot.mirror if mirror is None else mirror

        def committed(fut: Future[Manifest]) -> None:
            try:
                manifest = fut.result()
                self._remember_versions(manifest, leaves, signatures)
                info = self._after_commit(manifest, replaced, mirror=do_mirror)
            except BaseException as exc:
                self._save_slot.release()
                finish.set_exception(exc)
            else:
                self._save_slot.release()
                finish.set_result(info)

        job.future.add_done_callback(committed)
        return job, finish, request

    def begin_save(self, tree: Any, leaves: Sequence[TensorLeaf], name: str,
                   metadata: Mapping[str, Any] | None = None, *, overwrite: bool = False,
                   parent: str | bool | None = None, mirror: bool | None = None,
                   progress: Progress | None = None) -> SaveTransaction:
        """Start a save whose chunks the caller feeds (``isolane.snapshot.transaction``):
        ``leaves`` give keys, dtypes and shapes only (meta tensors do), ``tree`` is
        their flattened tree. Same commit, retention and mirroring as ``save``; a save
        of this store waits until the transaction ends."""
        check_snapshot_name(name)
        user_meta = check_metadata(metadata)
        feed = ChunkFeed(self.staging)
        _job, finish, request = self._begin(
            tree, leaves, {leaf.id: None for leaf in leaves}, name, user_meta,
            overwrite=overwrite, parent=parent, mirror=mirror, progress=progress,
            stage_all=False, feed=feed)
        return SaveTransaction(name, request.plan, _linkable(request), feed, self.staging,
                               finish)

    def plan_upload(self, leaves: Sequence[TensorLeaf], name: str, *,
                    parent: str | bool | None = None) -> UploadPlan:
        """The plan ``begin_save`` would follow for ``leaves`` now, the hashes of the
        parent's chunks it could link (what a client need not send) and that parent."""
        check_snapshot_name(name)
        parent_manifest = self._parent_manifest(parent, name)
        request = self._request(name, "plan", _prefix(name, "plan"), None, leaves,
                                {leaf.id: None for leaf in leaves}, {}, parent_manifest,
                                stage_all=False)
        return UploadPlan(request.plan, _linkable(request), request.parent)

    def _after_commit(self, manifest: Manifest, replaced: Sequence[str], *, mirror: bool
                      ) -> SnapshotInfo:
        """Drop the generations an overwrite replaced (their manifests are gone already),
        apply retention, start the mirror; the info names the live generation."""
        self._local.remember(manifest)
        for gen in replaced:
            self._remove_generation(self.stores, manifest.name, gen)
        if self.config.snapshot.keep_last is not None:
            self.gc(keep_last=self.config.snapshot.keep_last)
        if mirror:
            self._start_mirror(manifest)
        info = self._info(manifest, self.stores, "local")
        try:
            live = self._local.state(manifest.name).live
        except OSError as exc:
            log.warning("cannot tell which generation of '%s' is live: %s", manifest.name, exc)
            live = manifest
        return replace(info, live_generation=live.generation if live else None)

    def _request(self, name: str, generation: str, prefix: str, tree: Any,
                 leaves: Sequence[TensorLeaf], signatures: Mapping[int, Signature | None],
                 metadata: dict[str, Any], parent_manifest: Manifest | None, *,
                 stage_all: bool, change_detection: ChangeDetection = "hash",
                 part: str | None = None) -> SaveRequest:
        """Plan a save into ``prefix``; ``part`` is a rank's folder in a multi-rank save
        (its chunk keys are the parent's with that folder stripped)."""
        specs = [TensorSpec(leaf.id, tuple(str(p) for p in leaf.path),
                            dtype_name(leaf.tensor.dtype), tuple(leaf.tensor.shape),
                            itemsize(leaf.tensor.dtype)) for leaf in leaves]
        parent_devices: dict[str, int] = {}
        parent_chunks: dict[str, ParentChunk] = {}
        parent_ref = None
        if parent_manifest is not None:
            pprefix = _prefix(parent_manifest.name, parent_manifest.generation)
            parent_ref = {"name": parent_manifest.name,
                          "generation": parent_manifest.generation}
            for c in parent_manifest.chunks:
                key = c.key if part is None else c.key.removeprefix(f"{part}/")
                parent_devices[key] = c.device
                parent_chunks[c.hash] = ParentChunk(c.device, f"{pprefix}/{c.key}", c.stored)
        snap = self.config.snapshot
        plan = plan_save(specs, n_devices=len(self.stores), chunk_bytes=snap.chunk_bytes,
                         pack_threshold=snap.pack_threshold, parent_devices=parent_devices)
        known: dict[str, str] = {}
        if change_detection == "version" and parent_manifest is not None:
            known = self._known_hashes(plan, leaves, signatures, parent_manifest,
                                       parent_chunks)
        return SaveRequest(
            name=name, generation=generation, prefix=prefix, plan=plan, tree=tree,
            leaves=leaves, metadata=metadata, parent=parent_ref, parent_chunks=parent_chunks,
            stage_all=stage_all, known_hashes=known,
            manifest_key=MANIFEST if part is None else PART_MANIFEST)

    def _known_hashes(self, plan: SavePlan, leaves: Sequence[TensorLeaf],
                      signatures: Mapping[int, Signature | None], parent: Manifest,
                      parent_chunks: Mapping[str, ParentChunk]) -> dict[str, str]:
        """Chunks of tensors untouched since ``parent`` saved them, linkable as they lie."""
        chunks_of: dict[int, builtins.list[ChunkPlan]] = {}
        for chunk in plan.chunks:
            if not chunk.is_pack:
                chunks_of.setdefault(chunk.pieces[0].tensor_id, []).append(chunk)
        known: dict[str, str] = {}
        for leaf in leaves:
            hashes = self._versions.unchanged(leaf.tensor, signatures[leaf.id],
                                              parent.generation)
            chunks = chunks_of.get(leaf.id, [])
            if hashes is None or len(hashes) != len(chunks):
                continue
            for chunk, digest in zip(chunks, hashes, strict=True):
                source = parent_chunks.get(digest)
                if (source is not None and source.device == chunk.device
                        and source.stored == chunk.stored_nbytes):
                    known[chunk.key] = digest
        return known

    def _remember_versions(self, manifest: Manifest, leaves: Sequence[TensorLeaf],
                           signatures: Mapping[int, Signature | None]) -> None:
        hashes: dict[int, builtins.list[str]] = {}
        for record in manifest.chunks:
            if record.tensor is not None:
                hashes.setdefault(record.tensor, []).append(record.hash)
        for leaf in leaves:
            if leaf.id in hashes:
                self._versions.remember(leaf.tensor, signatures[leaf.id],
                                        manifest.generation, tuple(hashes[leaf.id]))

    def _raise_unreported_async_error(self) -> None:
        last = self._last_async
        if last is not None and not last.reported and last.exception() is not None:
            last.reported = True
            raise IsolaneError(f"the previous async save of '{last.name}' failed: "
                               f"{last.exception()}; it was not committed — save it again"
                               ) from last.exception()

    def _parent_manifest(self, parent: str | bool | None, name: str) -> Manifest | None:
        if parent is False:
            return None
        if isinstance(parent, str):
            return self._locate(parent).manifest
        newest = None
        for snap_name in self._local.names():
            manifest = self._local.state(snap_name).live  # damaged names are skipped
            if manifest is not None and (newest is None
                                         or manifest.committed_at > newest.committed_at):
                newest = manifest
        return newest

    def wait(self) -> None:
        """Wait for an async save in flight (its errors stay on its handle)."""
        self._save_slot.acquire()
        self._save_slot.release()

    # -- mirroring -------------------------------------------------------------------------
    def _start_mirror(self, manifest: Manifest) -> None:
        if self._mirrorer is None or self.mirror_store is None:
            raise IsolaneError("mirror=True needs a device group with role 'capacity' "
                               "in the config")
        target = self.mirror_store

        def mirrored_parent_chunks() -> dict[str, str]:
            out: dict[str, str] = {}
            if manifest.parent:
                pname, pgen = manifest.parent["name"], manifest.parent["generation"]
                try:
                    pm = self._manifest([target], pname, pgen)
                except (FileNotFoundError, IntegrityError):
                    return out
                prefix = _prefix(pname, pgen)
                out = {c.hash: f"{prefix}/{c.key}" for c in pm.chunks}
            return out

        future = self._mirrorer.start(manifest, _prefix(manifest.name, manifest.generation),
                                      mirrored_parent_chunks)
        with self._lock:
            self._mirrors[manifest.name] = future

    def wait_for_mirrors(self, timeout: float | None = None) -> dict[str, str | None]:
        """Wait for background mirrors; name -> None on success or the error text."""
        with self._lock:
            pending = dict(self._mirrors)
        out: dict[str, str | None] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        for name, fut in pending.items():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                fut.result(left)
                out[name] = None
            except Exception as exc:
                out[name] = f"{type(exc).__name__}: {exc}"
        return out

    def sync_mirrors(self) -> builtins.list[str]:
        """Mirror every committed local snapshot the mirror lacks; returns their names."""
        if self.mirror_store is None:
            raise IsolaneError("this store has no capacity group to mirror to; add one "
                               "with role 'capacity' to the config")
        started = []
        for name in self._local.names():
            live = self._local.state(name).live
            if live is None:
                continue
            if not self.mirror_store.exists(f"{_prefix(name, live.generation)}/{MANIFEST}"):
                self._start_mirror(live)
                started.append(name)
        return started

    # -- reading ---------------------------------------------------------------------------
    def load(self, name: str, map_location: str | torch.device = "cpu",
             keys: builtins.list[str] | None = None, progress: Progress | None = None,
             *, into: Any = None, mmap: bool = False,
             shard: tuple[int, int] | None = None) -> Any:
        """The state dict as saved (or the subtrees under ``keys``, reading only their
        bytes). Falls back to the mirror when the local copy is gone.

        ``into``: an existing state dict (e.g. ``model.state_dict()``) whose tensors
        are filled in place where the key, dtype and shape match — no fresh memory to
        fault in, which is what restores cost most; the returned dict holds those very
        tensors. After an error (e.g. IntegrityError) their contents are undefined:
        chunks are read straight into targets that O_DIRECT can fill before their hash
        is checked, so load them again from a healthy snapshot. ``mmap`` (local
        stores only): big tensors become private copy-on-write mappings of the chunk
        files, like ``torch.load(mmap=True)``; they are hash-checked at load all the
        same, writes never reach the files, and a mapping keeps a deleted snapshot's
        disk space until the tensor dies.

        Multi-rank snapshots: loaded with the saved world size (this process's
        torch.distributed rank, or ``shard=(rank, world_size)``), each rank gets its own
        state dict back; with any other world size (1 without torch.distributed), rank
        0's structure with every ``Shard``-marked tensor cut as
        ``torch.tensor_split(full, world_size)[rank]``, reading only the chunks that
        hold those rows."""
        check_snapshot_name(name)
        located = self._locate(name)
        for _ in range(_RELOCATE_ATTEMPTS):
            try:
                return self._load_located(name, located, map_location, keys, progress,
                                          into=into, mmap=mmap, shard=shard)
            except IntegrityError:
                # An overwrite in another process may have committed and removed the
                # generation located above: read the live one, or report the damage.
                now = self._locate(name)
                if now.manifest.generation == located.manifest.generation:
                    raise
                log.info("snapshot '%s' was overwritten while it loaded (generation %s is "
                         "live now); reading that", name, now.manifest.generation)
                located = now
        return self._load_located(name, located, map_location, keys, progress,
                                  into=into, mmap=mmap, shard=shard)

    def _load_located(self, name: str, located: Located, map_location: str | torch.device,
                      keys: builtins.list[str] | None, progress: Progress | None, *,
                      into: Any, mmap: bool, shard: tuple[int, int] | None) -> Any:
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
            known = {t.key for t in located.manifest.tensors}
            missing = [k for k in keys if not any(
                kk == k or kk.startswith(k + ".") for kk in known | _leaf_keys(located))]
            if missing:
                raise KeyNotFoundError(f"snapshot '{name}' has no key {missing[0]!r}; run "
                                       f"'isolane show {name}' to list its keys")
        reader = SnapshotReader(located.stores, self._reader.lane, self.staging)
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

    def verify(self, name: str, progress: Progress | None = None) -> SnapshotInfo:
        """Read back every chunk of the snapshot and check it; raises IntegrityError."""
        check_snapshot_name(name)
        located = self._locate(name)
        SnapshotReader(located.stores, self._reader.lane).verify(
            located.manifest, located.prefix, progress)
        return self._info(located.manifest, located.stores, located.location)

    def info(self, name: str) -> SnapshotInfo:
        check_snapshot_name(name)
        located = self._locate(name)
        return self._info(located.manifest, located.stores, located.location)

    def manifest(self, name: str) -> Manifest:
        return self._locate(check_snapshot_name(name)).manifest

    def snapshot_files(self, name: str) -> Located:
        """Where the newest committed generation of ``name`` lies: its tier's blob
        stores, its prefix there and its manifest (to stream its chunk files)."""
        return self._locate(check_snapshot_name(name))

    def list(self) -> list[SnapshotInfo]:
        """Committed snapshots, oldest first (mirror-only ones too, marked as such).
        Damaged ones are left out: ``damaged()`` reports them."""
        return self._scan()[0]

    def damaged(self) -> builtins.list[DamagedSnapshot]:
        """Generations whose manifest exists but cannot be read, on every tier."""
        return self._scan()[1]

    def _scan(self) -> tuple[builtins.list[SnapshotInfo], builtins.list[DamagedSnapshot]]:
        out: dict[str, SnapshotInfo] = {}
        damaged: builtins.list[DamagedSnapshot] = []
        for catalog in self._catalogs():
            try:
                for name in catalog.names():
                    state = catalog.state(name)
                    damaged.extend(state.damaged)
                    if name not in out and state.live is not None:
                        out[name] = self._info(state.live, catalog.stores, catalog.location)
            except OSError as exc:
                if catalog.location == "local":
                    raise
                log.warning("mirror %s unreachable, listing local snapshots only: %s",
                            catalog.primary.url, exc)
        return sorted(out.values(), key=lambda i: i.committed_at), damaged

    def path(self, name: str) -> str:
        """Where the snapshot's zarr group lives (device 0 of its tier)."""
        located = self._locate(check_snapshot_name(name))
        return f"{located.stores[0].url}/{located.prefix}"

    # -- deleting --------------------------------------------------------------------------
    def delete(self, name: str) -> None:
        """Remove a snapshot everywhere (local devices and mirror), damaged or not."""
        check_snapshot_name(name)
        found = False
        for catalog in self._catalogs():
            for gen in catalog.generations(name, all_devices=True):
                found = True
                self._remove_generation(catalog.stores, name, gen)
            for store in catalog.stores:
                if not store.children(f"{ROOT}/{name}"):
                    store.delete_prefix(f"{ROOT}/{name}")
        if not found:
            raise SnapshotNotFoundError(name, self.url)

    def gc(self, keep_last: int | None = None) -> GcReport:
        """Apply retention and sweep leftovers of failed or killed saves.

        Sweeps only what provably never committed (``retention.should_sweep``) and
        generations an overwrite superseded; a damaged manifest is reported in
        ``GcReport.damaged`` and never swept, and retention counts only readable
        snapshots. Each committed generation is self-contained (shared chunks are hard
        links or server-side copies), so removing one never touches another."""
        keep = keep_last if keep_last is not None else self.config.snapshot.keep_last
        grace = self.config.snapshot.gc_grace_s
        deleted: builtins.list[str] = []
        swept: builtins.list[str] = []
        damaged: builtins.list[DamagedSnapshot] = []
        committed: dict[str, float] = {}
        for catalog in self._catalogs():
            try:
                names = catalog.names(all_devices=True)
            except OSError as exc:
                if catalog.location == "local":
                    raise
                log.warning("mirror %s unreachable, collecting local garbage only: %s",
                            catalog.primary.url, exc)
                continue
            for name in names:
                state = catalog.state(name, all_devices=True)
                damaged.extend(state.damaged)
                live = state.live
                if live is not None:
                    committed[name] = max(committed.get(name, 0.0), live.committed_at)
                gens = [catalog.generation_state(name, m.generation, m, False)
                        for m in state.committed]
                gens += [catalog.generation_state(name, g, None, False) for g in state.others]
                emptied = False
                for gen in gens:
                    if should_sweep(gen, live.generation if live else None, grace_s=grace):
                        self._remove_generation(catalog.stores, name, gen.generation)
                        swept.append(f"{catalog.location}:{name}/{gen.generation}")
                        emptied = True
                # An empty name folder goes when this gc emptied it, or when nothing has
                # changed in it for the grace period (racers that failed together leave
                # one). One rmdir: it fails, and so spares the folder, once a starting
                # save has made its generation folder inside.
                for store in catalog.stores:
                    if emptied or _quiet_for(store, f"{ROOT}/{name}", grace):
                        remove_if_empty(store, f"{ROOT}/{name}")
        broken = {d.name for d in damaged}
        for name in plan_retention(sorted((n, t) for n, t in committed.items()
                                          if n not in broken), keep):
            self.delete(name)
            deleted.append(name)
        return GcReport(tuple(deleted), tuple(swept), tuple(damaged))

    # -- internals -------------------------------------------------------------------------
    def _catalogs(self) -> builtins.list[Catalog]:
        return [self._local] if self._mirror is None else [self._local, self._mirror]

    def _catalog(self, stores: builtins.list[BlobStore]) -> Catalog:
        if self._mirror is not None and stores[0] is self._mirror.primary:
            return self._mirror
        return self._local

    def _manifest(self, stores: builtins.list[BlobStore], name: str, gen: str) -> Manifest:
        return self._catalog(stores).manifest(name, gen)

    def _state(self, name: str) -> NameState:
        return self._local.state(name)

    def _locate(self, name: str) -> Located:
        """The live generation, local first, then the mirror; a damaged local copy
        falls back to a healthy mirror copy, else raises IntegrityError."""
        problem: DamagedSnapshot | None = None
        for catalog in self._catalogs():
            try:
                state = catalog.state(name)
            except OSError as exc:
                log.warning("cannot reach %s to look for '%s': %s", catalog.primary.url,
                            name, exc)
                continue
            if state.damaged:
                problem = problem or state.damaged[0]
                log.warning("snapshot '%s' is damaged on %s: %s", name, catalog.location,
                            state.damaged[0].problem)
                continue
            live = state.live
            if live is not None:
                self._check_devices(live, catalog)
                return Located(catalog.stores, _prefix(name, live.generation), live,
                                catalog.location)
        if problem is not None:
            raise problem.error()
        raise SnapshotNotFoundError(name, self.url)

    def _check_devices(self, manifest: Manifest, catalog: Catalog) -> None:
        used = max((c.device for c in manifest.chunks), default=0)
        if catalog.location == "local" and used >= len(catalog.stores):
            raise InvalidArgumentError(
                f"snapshot '{manifest.name}' was saved over {len(manifest.devices)} devices "
                f"({', '.join(manifest.devices)}) but this store has {len(catalog.stores)}; "
                "open it with the config that saved it")

    def _remove_generation(self, stores: builtins.list[BlobStore], name: str, gen: str) -> None:
        prefix = _prefix(name, gen)
        stores[0].delete(f"{prefix}/{MANIFEST}")  # uncommit first: a crash leaves leftovers
        self._catalog(stores).forget(name, gen)
        for store in stores:
            store.delete_prefix(prefix)

    def _info(self, manifest: Manifest, stores: builtins.list[BlobStore], location: str
              ) -> SnapshotInfo:
        mirrored = None
        if self.mirror_store is not None and location == "local":
            try:
                mirrored = self.mirror_store.exists(
                    f"{_prefix(manifest.name, manifest.generation)}/{MANIFEST}")
            except OSError:
                mirrored = None
        s = manifest.stats
        return SnapshotInfo(
            name=manifest.name, generation=manifest.generation,
            committed_at=manifest.committed_at, logical_bytes=s.logical_bytes,
            stored_bytes=s.stored_bytes, written_bytes=s.written_bytes,
            linked_bytes=s.linked_bytes, tensors=len(manifest.tensors), seconds=s.seconds,
            location=location, url=f"{stores[0].url}/{_prefix(manifest.name, manifest.generation)}",
            parent=manifest.parent, metadata=manifest.metadata, mirrored=mirrored)

    def close(self) -> None:
        """Wait for saves and mirrors in flight, then release buffers and connections."""
        self.wait()
        self.wait_for_mirrors()
        self.staging.close()
        for store in [*self.stores, *([self.mirror_store] if self.mirror_store else [])]:
            store.close()

    def __enter__(self) -> SnapshotStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SnapshotStore({self.url!r})"


def _linkable(request: SaveRequest) -> frozenset[str]:
    """Parent chunk hashes some tensor chunk of the plan could be linked to (same
    device, same stored size; packs are small and always sent, since their manifest
    records need every member's own hash)."""
    slots = {(c.device, c.stored_nbytes) for c in request.plan.chunks if not c.is_pack}
    return frozenset(h for h, p in request.parent_chunks.items()
                     if (p.device, p.stored) in slots and f"/{PACKS_GROUP}/" not in p.key)


_prefix = prefix_of


def _quiet_for(store: BlobStore, prefix: str, grace_s: float) -> bool:
    """True when the local folder ``prefix`` has not changed for ``grace_s`` seconds."""
    path = store.local_path(prefix)
    if path is None:
        return False
    try:
        return time.time() - os.lstat(path).st_mtime > grace_s
    except OSError:
        return False


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


def _leaf_keys(located: Located) -> set[str]:
    keys: set[str] = set()

    def visit(path: tuple[object, ...]) -> bool:
        keys.add(".".join(str(x) for x in path))
        return False

    unflatten_state(located.manifest.tree, lambda _i: torch.empty(0), visit)
    return keys


def new_generation() -> str:
    """A generation folder name: sortable by creation time, unique across writers."""
    return f"{time.time_ns():020d}-{secrets.token_hex(3)}"


def check_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    import json

    if metadata is None:
        return {}
    try:
        return dict(json.loads(json.dumps(dict(metadata), allow_nan=False)))
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"metadata must be JSON-serialisable (str keys; numbers, "
                               f"strings, lists, dicts): {exc}") from None


def _resolve_target(target: str | os.PathLike[str] | Config | None,
                    storage_options: Mapping[str, Any] | None) -> Config:
    if target is None:
        return default_config()
    if isinstance(target, Config):
        return target
    text = os.fspath(target)
    if not is_url(text) and text.endswith((".yaml", ".yml")) and Path(text).is_file():
        return load_config(text)
    return store_config(text, storage_options)
