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

The facade: saving goes through ``isolane.snapshot.transaction`` (one driver for a
process, the ranks of ``isolane.snapshot.distributed`` and a node's upload), finding
through ``catalog``, loading through ``restore`` and ``reader``, delete and gc through
``collect``, mirroring through ``mirror``.

Thread-safe: saves are serialised per store (a second save waits for an async save in
flight); loads, listing and verification run concurrently with them.
"""

from __future__ import annotations

import builtins
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

import torch

from isolane.config import Config, refuse_node_target, target_config
from isolane.errors import IntegrityError, InvalidArgumentError, IsolaneError
from isolane.lanes.assignment import JobKind
from isolane.lanes.scheduler import LaneScheduler, shared_registry
from isolane.snapshot import collect, restore
from isolane.snapshot.catalog import Catalog, DamagedSnapshot, Located, locate
from isolane.snapshot.dcp import holds_dtensor, load_through_dcp, save_through_dcp
from isolane.snapshot.dcp_metadata import remote_parts
from isolane.snapshot.distributed import Distributed, active_group, save_distributed
from isolane.snapshot.feed import ChunkFeed, FedSave, UploadPlan
from isolane.snapshot.manifest import MANIFEST, Manifest
from isolane.snapshot.mirror import Mirrorer, mirror_manifest
from isolane.snapshot.names import (
    ROOT,
    ChangeDetection,
    check_change_detection,
    check_metadata,
    check_snapshot_name,
    prefix_of,
)
from isolane.snapshot.reader import SnapshotReader
from isolane.snapshot.results import GcReport, SaveHandle, SnapshotInfo
from isolane.snapshot.sharding import Shard
from isolane.snapshot.staging import StagingPool
from isolane.snapshot.transaction import SaveDriver, linkable
from isolane.snapshot.tree import TensorLeaf, flatten_state
from isolane.snapshot.versions import signature
from isolane.snapshot.writer import SaveJob, SnapshotWriter
from isolane.storage.base import BlobStore
from isolane.storage.registry import blob_store_from_url

log = logging.getLogger(__name__)

__all__ = ["ROOT", "DamagedSnapshot", "GcReport", "SaveHandle", "SnapshotInfo",
           "SnapshotStore", "check_snapshot_name"]
Progress = Callable[[int, int], None]


class SnapshotStore:
    """Checkpoints on the write group (and optionally mirrored to the capacity group).

    ``target``: None (the embedded default under ``$ISOLANE_HOME``), a folder, an fsspec
    URL such as ``s3://bucket/prefix``, a YAML config file, or a ``Config``. Storage
    node URLs are ``isolane.open_store``'s (a ``RemoteSnapshotStore``).
    """

    def __init__(
        self,
        target: str | os.PathLike[str] | Config | None = None,
        *,
        storage_options: Mapping[str, Any] | None = None,
        scheduler: LaneScheduler | None = None,
    ) -> None:
        refuse_node_target(target, "SnapshotStore", "open_store")
        self.config = target_config(target, "write", storage_options)
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
        # Restores share the write lane but go first and are not metered by the governor.
        self._read_lane = self.scheduler.lane(JobKind.CHECKPOINT_READ)
        self._mirrorer = (Mirrorer(self.stores, self.mirror_store,
                                   self.scheduler.lane(JobKind.MIRROR),
                                   attempts=snap.mirror_attempts,
                                   backoff_s=snap.mirror_backoff_s)
                          if self.mirror_store is not None else None)
        self._mirrors: dict[str, Future[None]] = {}
        self._local = Catalog(self.stores, "local")
        self._mirror = (Catalog([self.mirror_store], "mirror")
                        if self.mirror_store is not None else None)
        self._lock = threading.Lock()
        write_lane = self.scheduler.lane(JobKind.CHECKPOINT_WRITE)
        # One warm staging buffer per write-lane thread, faulted in on a background
        # thread when the first save starts (not at open: listing, verifying, deleting
        # and loading never need them): its copies then run into warm memory.
        self._prefill = write_lane.threads
        self.saves = SaveDriver(
            self, stores=self.stores, catalog=self._local,
            writer=SnapshotWriter(self.stores, write_lane, self.staging), settings=snap)

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
        if holds_dtensor(state_dict):
            if shards:
                raise InvalidArgumentError(
                    "shards= describes plain tensors split along dim 0; a state dict of "
                    "DTensors carries its placements itself: drop shards=")
            return save_through_dcp(self, state_dict, name, metadata, overwrite=overwrite,
                                    parent=parent, mirror=mirror,
                                    group=ranks.group if ranks is not None else None)
        if ranks is not None:
            self._warm_staging()
            if change_detection != "hash":
                raise InvalidArgumentError("multi-rank saves detect changes by hash only; "
                                           "drop change_detection='version'")
            return save_distributed(self.saves, ranks, state_dict, name, metadata,
                                    shards=shards, overwrite=overwrite, parent=parent,
                                    mirror=mirror, progress=progress)
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
        self.saves.async_saves.started(handle)
        return handle

    def _start(self, state_dict: Any, name: str, metadata: Mapping[str, Any] | None, *,
               overwrite: bool, parent: str | bool | None, mirror: bool | None,
               progress: Progress | None, stage_all: bool,
               change_detection: ChangeDetection = "hash"
               ) -> tuple[SaveJob, Future[SnapshotInfo]]:
        check_snapshot_name(name)
        check_change_detection(change_detection)
        user_meta = check_metadata(metadata)
        self._warm_staging()
        tree, leaves = flatten_state(state_dict)  # refuses bad leaves before any I/O
        signatures = {leaf.id: signature(leaf.tensor) for leaf in leaves}
        job, finish, _request = self.saves.start(
            tree, leaves, signatures, name, user_meta, overwrite=overwrite, parent=parent,
            mirror=mirror, progress=progress, stage_all=stage_all,
            change_detection=change_detection)
        return job, finish

    def begin_save(self, tree: Any, leaves: Sequence[TensorLeaf], name: str,
                   metadata: Mapping[str, Any] | None = None, *, overwrite: bool = False,
                   parent: str | bool | None = None, mirror: bool | None = None,
                   progress: Progress | None = None, plan: UploadPlan | None = None
                   ) -> FedSave:
        """Start a save whose chunks the caller feeds (``isolane.snapshot.feed``):
        ``leaves`` give keys, dtypes and shapes only (meta tensors do), ``tree`` is
        their flattened tree. Same commit, retention and mirroring as ``save``; a save
        of this store waits until the fed save ends. ``plan``: what ``plan_upload``
        answered for the same leaves and name, followed when the parent is still the
        one it was made for (``FedSave.plan_reused``), else the save is planned again."""
        check_snapshot_name(name)
        user_meta = check_metadata(metadata)
        self._warm_staging()
        feed = ChunkFeed(self.staging)
        _job, finish, request = self.saves.start(
            tree, leaves, {leaf.id: None for leaf in leaves}, name, user_meta,
            overwrite=overwrite, parent=parent, mirror=mirror, progress=progress,
            stage_all=False, feed=feed, planned=plan)
        return FedSave(name, request.plan, linkable(request), feed, self.staging, finish,
                       plan_reused=plan is not None and request.plan is plan.plan)

    def plan_upload(self, leaves: Sequence[TensorLeaf], name: str, *,
                    parent: str | bool | None = None) -> UploadPlan:
        """The plan ``begin_save`` would follow for ``leaves`` now, the hashes of the
        parent's chunks it could link (what a client need not send) and that parent."""
        check_snapshot_name(name)
        self._warm_staging()  # the upload of this plan comes next
        return self.saves.plan_upload(leaves, name, parent=parent)

    def wait(self) -> None:
        """Wait for an async save in flight (its errors stay on its handle)."""
        self.saves.wait()

    # -- mirroring -------------------------------------------------------------------------
    def start_mirror(self, manifest: Manifest) -> None:
        """Mirror a committed local snapshot to the capacity group in the background
        (``wait_for_mirrors`` waits for it)."""
        if self._mirrorer is None or self._mirror is None:
            raise IsolaneError("mirror=True needs a device group with role 'capacity' "
                               "in the config")
        mirror = self._mirror

        def mirrored_parent_chunks() -> dict[str, str]:
            out: dict[str, str] = {}
            if manifest.parent:
                pname, pgen = manifest.parent["name"], manifest.parent["generation"]
                try:
                    pm = mirror.manifest(pname, pgen)
                except (FileNotFoundError, IntegrityError):
                    return out
                prefix = prefix_of(pname, pgen)
                out = {c.hash: f"{prefix}/{c.key}" for c in pm.chunks}
            return out

        future = self._mirrorer.start(manifest, prefix_of(manifest.name, manifest.generation),
                                      mirrored_parent_chunks, remote_parts(manifest.dcp))
        with self._lock:
            self._mirrors[manifest.name] = future

    def mirror_part(self, part: Manifest, prefix: str) -> None:
        """Upload a rank's part written here to the mirror in the background, for a
        snapshot whose manifest another host commits (DCP, ranks on several hosts);
        ``wait_for_mirrors`` and ``close`` wait for it."""
        if self._mirrorer is None:
            raise IsolaneError(
                f"the part {prefix} was written on another write group than its "
                "snapshot's manifest, so only the mirror can bring them together: add a "
                "device group with role 'capacity' to this host's config")
        future = self._mirrorer.start(part, prefix, dict)
        with self._lock:
            self._mirrors[prefix] = future

    def tiers_of(self, located: Located) -> builtins.list[Located]:
        """Where the chunks of ``located`` lie: all there, or, for a local snapshot
        whose parts other hosts wrote (DCP), its own parts here and the others on the
        mirror (second)."""
        remote = tuple(f"{p}/" for p in remote_parts(located.manifest.dcp))
        if not remote or located.location != "local":
            return [located]
        if self.mirror_store is None:
            raise IsolaneError(
                f"snapshot '{located.manifest.name}' has parts written on other hosts "
                f"({', '.join(remote)}), which only its mirror holds: add the capacity "
                "group to this host's config")
        m = located.manifest
        here = replace(m, chunks=tuple(c for c in m.chunks if not c.key.startswith(remote)))
        there = mirror_manifest(replace(m, chunks=tuple(
            c for c in m.chunks if c.key.startswith(remote))), self.mirror_store)
        return [replace(located, manifest=here),
                Located([self.mirror_store], located.prefix, there, "mirror")]

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
            if not self.mirror_store.exists(f"{prefix_of(name, live.generation)}/{MANIFEST}"):
                self.start_mirror(live)
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
        found = [self._locate(name)]
        if found[0].manifest.dcp is not None:
            return load_through_dcp(self, name, into=into, keys=keys)

        def locate() -> Located:  # found above first: a second look costs a round trip
            return found.pop() if found else self._locate(name)

        return restore.load(locate, self._read_lane, self.staging, name,
                            map_location, keys, progress, into=into, mmap=mmap, shard=shard)

    def verify(self, name: str, progress: Progress | None = None) -> SnapshotInfo:
        """Read back every chunk of the snapshot and check it; raises IntegrityError."""
        check_snapshot_name(name)
        located = self._locate(name)
        for tier in self.tiers_of(located):
            SnapshotReader(tier.stores, self._read_lane).verify(
                tier.manifest, tier.prefix, progress)
        return self._info(located.manifest, located.stores, located.location)

    def info(self, name: str) -> SnapshotInfo:
        check_snapshot_name(name)
        located = self._locate(name)
        return self._info(located.manifest, located.stores, located.location)

    def manifest(self, name: str) -> Manifest:
        """The live manifest of ``name``, local first, then the mirror."""
        return self._locate(check_snapshot_name(name)).manifest

    def local_info(self, manifest: Manifest) -> SnapshotInfo:
        """The info of a manifest committed on this store's write group."""
        return self._info(manifest, self.stores, "local")

    def snapshot_files(self, name: str) -> Located:
        """Where the newest committed generation of ``name`` lies: its tier's blob
        stores, its prefix there and its manifest (to stream its chunk files)."""
        return self._locate(check_snapshot_name(name))

    def reader(self, located: Located) -> SnapshotReader:
        """A reader of ``located``'s tier on this store's restore lane and staging."""
        return SnapshotReader(located.stores, self._read_lane, self.staging)

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
        collect.delete(self._catalogs(), name, self.url)

    def gc(self, keep_last: int | None = None) -> GcReport:
        """Apply retention and sweep leftovers of failed or killed saves
        (``isolane.snapshot.collect``: never a damaged manifest, never a generation
        that may still commit)."""
        keep = keep_last if keep_last is not None else self.config.snapshot.keep_last
        return collect.collect(self._catalogs(), self.url, keep_last=keep,
                               grace_s=self.config.snapshot.gc_grace_s)

    # -- internals -------------------------------------------------------------------------
    def _warm_staging(self) -> None:
        """Start faulting in one staging buffer per write-lane thread in the background
        (``StagingPool.prefill``), unless the pool already holds them: called where a
        save starts, so a store that only reads never maps staging memory."""
        self.staging.prefill(self._prefill)

    def _catalogs(self) -> builtins.list[Catalog]:
        return [self._local] if self._mirror is None else [self._local, self._mirror]

    def _locate(self, name: str) -> Located:
        return locate(self._catalogs(), name, self.url)

    def _info(self, manifest: Manifest, stores: builtins.list[BlobStore], location: str
              ) -> SnapshotInfo:
        mirrored = None
        if self.mirror_store is not None and location == "local":
            try:
                mirrored = self.mirror_store.exists(
                    f"{prefix_of(manifest.name, manifest.generation)}/{MANIFEST}")
            except OSError:
                mirrored = None
        return SnapshotInfo.of(manifest, stores[0].url, location, mirrored)

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
