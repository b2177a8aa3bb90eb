"""The one save driver: every save, from one process or from many ranks, is a
transaction over one generation folder (``snapshots/<name>/<generation>``).

1. begin (``SaveDriver.begin``, holding the store's save slot: one save at a time):
   the name is checked; an async save's failure nobody asked for is raised; without
   ``overwrite`` an existing name is refused (early: the commit checks again under the
   name's lock); the parent is chosen; a new generation is named. ``mark=True`` writes the
   ``_writing.json`` marker and the root zarr group at once (a multi-rank save does,
   before any rank writes); otherwise the writer writes them as its first step.
2. write (``SaveTransaction.request`` + ``write``): the writer executes the plan of one
   part: the whole state dict of a single process, or one rank's share under
   ``rank-<r>/`` ending in its partial manifest (``part=``).
3. commit (``SaveTransaction.commit``): the manifest, under the name's commit lock
   (``Catalog.commit``); a single-process save's writer calls it as its last step.
4. discard (``SaveTransaction.discard``): a failure before the commit removes what the
   save wrote (what it cannot remove, gc sweeps: no manifest, a dead marker).
5. after-commit (``SaveTransaction.after_commit``): the generations an overwrite
   replaced are removed, retention applied, the mirror started; the ``SnapshotInfo``
   names the live generation.

A single-process save (``SaveDriver.start``: ``SnapshotStore.save``, ``save_async``
and a node's streamed upload, whose chunks come from a ``feed``) is the world-size-1
case; ``isolane.snapshot.distributed`` runs the same steps over ranks and adds only
the collectives (who writes what, the barrier, rank 0's merge and commit).
"""

from __future__ import annotations

import builtins
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any, Protocol

from isolane.config import SnapshotConfig
from isolane.errors import SnapshotExistsError
from isolane.snapshot.catalog import Catalog
from isolane.snapshot.dtypes import dtype_name, itemsize
from isolane.snapshot.feed import ChunkFeed, UploadPlan
from isolane.snapshot.manifest import (
    MANIFEST,
    PART_MANIFEST,
    ChunkRecord,
    Manifest,
    zarr_group_meta,
)
from isolane.snapshot.marker import mark_writing, marked_on_this_host, read_marker
from isolane.snapshot.names import (
    ChangeDetection,
    check_snapshot_name,
    new_generation,
    prefix_of,
)
from isolane.snapshot.plan import PACKS_GROUP, ChunkPlan, SavePlan, TensorSpec, plan_save
from isolane.snapshot.results import AsyncSaves, GcReport, SnapshotInfo
from isolane.snapshot.tree import TensorLeaf
from isolane.snapshot.versions import Signature, TensorVersions
from isolane.snapshot.writer import ParentChunk, SaveJob, SaveRequest, SnapshotWriter
from isolane.storage.base import BlobStore

log = logging.getLogger(__name__)

Progress = Callable[[int, int], None]


class SaveOwner(Protocol):
    """What a save needs of the store it saves for beyond its write group: the tiers
    and policies only the store knows (``SnapshotStore`` implements it)."""

    def manifest(self, name: str) -> Manifest:
        """The live manifest of ``name``, local or on the mirror (a named parent)."""
        ...

    def gc(self, keep_last: int | None = None) -> GcReport:
        """Apply retention (after a commit, when ``keep_last`` is configured)."""
        ...

    def start_mirror(self, manifest: Manifest) -> None:
        """Start mirroring a committed manifest in the background."""
        ...

    def local_info(self, manifest: Manifest) -> SnapshotInfo:
        """The info of a manifest committed on the write group."""
        ...


@dataclass(frozen=True)
class ParentLinks:
    """What a save needs of its parent: which snapshot it is and the chunks it may link
    (a rank given them by its coordinator, which read the parent's manifest)."""

    name: str
    generation: str
    chunks: tuple[ChunkRecord, ...]


Parent = Manifest | ParentLinks


class SaveDriver:
    """The saves of one store (``owner``): one at a time, through ``writer``."""

    def __init__(self, owner: SaveOwner, *, stores: builtins.list[BlobStore],
                 catalog: Catalog, writer: SnapshotWriter, settings: SnapshotConfig) -> None:
        self.owner = owner
        self.stores = stores
        self.catalog = catalog
        self.writer = writer
        self.settings = settings
        self.async_saves = AsyncSaves()
        self.versions = TensorVersions()
        self._slot = threading.Semaphore(1)

    @property
    def url(self) -> str:
        return self.stores[0].url

    # -- the save slot -----------------------------------------------------------------------
    def claim(self) -> None:
        """Take the store's save slot (waits for a save in flight)."""
        self._slot.acquire()

    def release(self) -> None:
        self._slot.release()

    def wait(self) -> None:
        """Wait for a save in flight (an async one's errors stay on its handle)."""
        self.claim()
        self.release()

    # -- begin -------------------------------------------------------------------------------
    def begin(self, name: str, *, overwrite: bool, parent: str | bool | None,
              mark: bool = False) -> SaveTransaction:
        """Step 1 (the caller holds the slot): checks, parent, a new generation."""
        check_snapshot_name(name)
        self.async_saves.raise_unreported_error()
        if not overwrite and self.catalog.state(name).exists:
            raise SnapshotExistsError(name, self.url)  # early; the commit checks again
        tx = SaveTransaction(self, name, new_generation(), self.parent_of(parent),
                             overwrite=overwrite)
        if mark:
            try:
                tx.mark()
            except BaseException:
                tx.discard()
                raise
        return tx

    def join(self, name: str, generation: str, parent: Sequence[str] | ParentLinks | None,
             *, overwrite: bool) -> SaveTransaction:
        """The transaction another process began (a rank of a multi-rank save); its
        parent named ``[name, generation]`` (its manifest is read) or given."""
        linked: Parent | None
        if parent is None or isinstance(parent, ParentLinks):
            linked = parent
        else:
            linked = self.catalog.manifest(parent[0], parent[1])
        return SaveTransaction(self, name, generation, linked, overwrite=overwrite)

    def parent_of(self, parent: str | bool | None) -> Manifest | None:
        """The parent to link from: none (False), the named snapshot, or the newest."""
        if parent is False:
            return None
        if isinstance(parent, str):
            return self.owner.manifest(parent)
        newest = None
        for snap_name in self.catalog.names():
            manifest = self.catalog.state(snap_name).live  # damaged names are skipped
            if manifest is not None and (newest is None
                                         or manifest.committed_at > newest.committed_at):
                newest = manifest
        return newest

    # -- a single-process save: all the steps ------------------------------------------------
    def start(self, tree: Any, leaves: Sequence[TensorLeaf],
              signatures: Mapping[int, Signature | None], name: str,
              metadata: dict[str, Any], *, overwrite: bool, parent: str | bool | None,
              mirror: bool | None, progress: Progress | None, stage_all: bool,
              change_detection: ChangeDetection = "hash", feed: ChunkFeed | None = None,
              planned: UploadPlan | None = None
              ) -> tuple[SaveJob, Future[SnapshotInfo], SaveRequest]:
        """Begin, start the writer (which commits), then after-commit; the slot is held
        until the save ends. The future holds the ``SnapshotInfo``. ``planned``: a plan
        ``plan_upload`` made for these leaves, followed if made for the same parent."""
        self.claim()
        try:
            tx = self.begin(name, overwrite=overwrite, parent=parent)
            request = tx.request(tree, leaves, signatures, metadata, stage_all=stage_all,
                                 change_detection=change_detection, feed=feed,
                                 planned=planned)
            request = replace(request, commit=tx.commit)
            job = tx.write(request, progress)
        except BaseException:
            self.release()
            raise
        finish: Future[SnapshotInfo] = Future()

        def committed(fut: Future[Manifest]) -> None:
            try:
                manifest = fut.result()
                self.remember_versions(manifest, leaves, signatures)
                info = tx.after_commit(manifest, mirror=mirror)
            except BaseException as exc:
                self.release()
                finish.set_exception(exc)
            else:
                self.release()
                finish.set_result(info)

        job.future.add_done_callback(committed)
        return job, finish, request

    def plan_upload(self, leaves: Sequence[TensorLeaf], name: str, *,
                    parent: str | bool | None = None) -> UploadPlan:
        """The plan a save of ``leaves`` would follow now, the parent's chunk hashes it
        could link and that parent (no I/O beyond finding the parent)."""
        request = self.plan(name, "plan", prefix_of(name, "plan"), None, leaves,
                            {leaf.id: None for leaf in leaves}, {}, self.parent_of(parent),
                            stage_all=False)
        return UploadPlan(request.plan, linkable(request), request.parent)

    # -- planning ----------------------------------------------------------------------------
    def plan(self, name: str, generation: str, prefix: str, tree: Any,
             leaves: Sequence[TensorLeaf], signatures: Mapping[int, Signature | None],
             metadata: dict[str, Any], parent: Parent | None, *, stage_all: bool,
             change_detection: ChangeDetection = "hash", part: str | None = None,
             planned: UploadPlan | None = None) -> SaveRequest:
        """The writer's request for a save into ``prefix``; ``part`` is a rank's folder
        in a multi-rank save (its chunk keys are the parent's with that folder
        stripped). ``planned``: the plan ``plan_upload`` made for the same ``leaves``
        (the caller's word: a node checks the stream header), followed instead of
        planning again when it was made for this parent (else planned again)."""
        parent_devices: dict[str, int] = {}
        parent_chunks: dict[str, ParentChunk] = {}
        parent_ref = None
        if parent is not None:
            pprefix = prefix_of(parent.name, parent.generation)
            parent_ref = {"name": parent.name, "generation": parent.generation}
            for c in parent.chunks:
                key = c.key if part is None else c.key.removeprefix(f"{part}/")
                parent_devices[key] = c.device
                parent_chunks[c.hash] = ParentChunk(c.device, f"{pprefix}/{c.key}", c.stored)
        snap = self.settings
        if planned is not None and planned.parent == parent_ref and part is None:
            plan = planned.plan
        else:
            specs = [TensorSpec(leaf.id, tuple(str(p) for p in leaf.path),
                                dtype_name(leaf.tensor.dtype), tuple(leaf.tensor.shape),
                                itemsize(leaf.tensor.dtype)) for leaf in leaves]
            plan = plan_save(specs, n_devices=len(self.stores), chunk_bytes=snap.chunk_bytes,
                             pack_threshold=snap.pack_threshold,
                             parent_devices=parent_devices)
        known: dict[str, str] = {}
        if change_detection == "version" and parent is not None:
            known = self._known_hashes(plan, leaves, signatures, parent, parent_chunks)
        return SaveRequest(
            name=name, generation=generation, prefix=prefix, plan=plan, tree=tree,
            leaves=leaves, metadata=metadata, parent=parent_ref, parent_chunks=parent_chunks,
            stage_all=stage_all, known_hashes=known,
            manifest_key=MANIFEST if part is None else PART_MANIFEST)

    def _known_hashes(self, plan: SavePlan, leaves: Sequence[TensorLeaf],
                      signatures: Mapping[int, Signature | None], parent: Parent,
                      parent_chunks: Mapping[str, ParentChunk]) -> dict[str, str]:
        """Chunks of tensors untouched since ``parent`` saved them, linkable as they lie."""
        chunks_of: dict[int, builtins.list[ChunkPlan]] = {}
        for chunk in plan.chunks:
            if not chunk.is_pack:
                chunks_of.setdefault(chunk.pieces[0].tensor_id, []).append(chunk)
        known: dict[str, str] = {}
        for leaf in leaves:
            hashes = self.versions.unchanged(leaf.tensor, signatures[leaf.id],
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

    def remember_versions(self, manifest: Manifest, leaves: Sequence[TensorLeaf],
                          signatures: Mapping[int, Signature | None]) -> None:
        """Record the chunk hashes of the tensors just saved (``change_detection``)."""
        hashes: dict[int, builtins.list[str]] = {}
        for record in manifest.chunks:
            if record.tensor is not None:
                hashes.setdefault(record.tensor, []).append(record.hash)
        for leaf in leaves:
            if leaf.id in hashes:
                self.versions.remember(leaf.tensor, signatures[leaf.id],
                                       manifest.generation, tuple(hashes[leaf.id]))

    # -- after the commit ----------------------------------------------------------------------
    def after_commit(self, manifest: Manifest, replaced: Sequence[str], *,
                     mirror: bool | None) -> SnapshotInfo:
        """Step 5: drop the generations an overwrite replaced (their manifests are gone
        already), apply retention, start the mirror; the info names the live
        generation."""
        self.catalog.remember(manifest)
        for gen in replaced:
            self.catalog.remove(manifest.name, gen)
        if self.settings.keep_last is not None:
            self.owner.gc(keep_last=self.settings.keep_last)
        if self.settings.mirror if mirror is None else mirror:
            self.owner.start_mirror(manifest)
        info = self.owner.local_info(manifest)
        try:
            live = self.catalog.state(manifest.name).live
        except OSError as exc:
            log.warning("cannot tell which generation of '%s' is live: %s", manifest.name, exc)
            live = manifest
        return replace(info, live_generation=live.generation if live else None)


class SaveTransaction:
    """One save of one generation: steps 2 to 5 of the module docstring."""

    def __init__(self, driver: SaveDriver, name: str, generation: str,
                 parent: Parent | None, *, overwrite: bool) -> None:
        self.driver = driver
        self.name = name
        self.generation = generation
        self.prefix = prefix_of(name, generation)
        self.parent = parent
        self.overwrite = overwrite
        self.replaced: builtins.list[str] = []  # generations the commit replaced
        self._part_json: dict[str, bytes] = {}  # part folder -> its manifest as written
        self._lock = threading.Lock()

    @property
    def parent_ref(self) -> builtins.list[str] | None:
        """``[name, generation]`` of the parent, or None (JSON for the other ranks)."""
        return [self.parent.name, self.parent.generation] if self.parent else None

    def mark(self) -> None:
        """The writing marker and the root zarr group on every device, before any part
        is written (the writer of a single-process save does this itself)."""
        stores = self.driver.stores
        mark_writing(stores[0], self.prefix)
        for blob in stores:
            blob.write(f"{self.prefix}/zarr.json",
                       zarr_group_meta({"isolane": {"manifest": MANIFEST}}), durable=False)

    def request(self, tree: Any, leaves: Sequence[TensorLeaf],
                signatures: Mapping[int, Signature | None], metadata: dict[str, Any], *,
                stage_all: bool, change_detection: ChangeDetection = "hash",
                feed: ChunkFeed | None = None, part: str | None = None,
                planned: UploadPlan | None = None) -> SaveRequest:
        """The writer's request for the whole save, or for the part in folder ``part``;
        a failed write discards what it wrote."""
        prefix = self.prefix if part is None else f"{self.prefix}/{part}"
        request = self.driver.plan(self.name, self.generation, prefix, tree, leaves,
                                   signatures, metadata, self.parent, stage_all=stage_all,
                                   change_detection=change_detection, part=part,
                                   planned=planned)
        request = replace(request, feed=feed, discard=lambda: self.discard(part))
        if part is not None:
            # The coordinator's marker on this write group guards the part's folder
            # from gc while it lives; a coordinator on this host syncs the whole write
            # group before its commit. A part on another host's write group has neither.
            marker = read_marker(self.driver.stores[0], self.prefix)
            request = replace(request, commit=lambda manifest: self._write_part(part,
                                                                                manifest),
                              mark=marker is None, sync=not marked_on_this_host(marker))
        return request

    def _write_part(self, part: str, manifest: Manifest) -> Manifest:
        """A rank's partial manifest, written after its data and not synced: the
        coordinator's commit (``commit_parts``) syncs the write group once before the
        manifest, so a rank on its host waits for no journal commit of its own. Its
        JSON is kept for the rank's report (``part_json``)."""
        text = manifest.to_json()
        self.driver.stores[0].write(f"{self.prefix}/{part}/{PART_MANIFEST}", text,
                                    durable=False)
        with self._lock:
            self._part_json[part] = text
        return manifest

    def part_json(self, part: str) -> str:
        """The JSON text of the partial manifest this process wrote for ``part``."""
        with self._lock:
            return self._part_json[part].decode()

    def write(self, request: SaveRequest, progress: Progress | None = None) -> SaveJob:
        """Start the writer on ``request``; its future holds the manifest it wrote."""
        return self.driver.writer.start(request, progress)

    def commit(self, manifest: Manifest) -> Manifest:
        """Write the manifest under the name's commit lock; returns it as committed."""
        committed, replaced = self.driver.catalog.commit(manifest, overwrite=self.overwrite)
        self.replaced.extend(replaced)
        return committed

    def discard(self, part: str | None = None) -> None:
        """Remove what this save wrote (only the folder ``part``, when given)."""
        self.driver.catalog.discard(self.name, self.generation, part)

    def after_commit(self, manifest: Manifest, *, mirror: bool | None) -> SnapshotInfo:
        return self.driver.after_commit(manifest, self.replaced, mirror=mirror)


def linkable(request: SaveRequest) -> frozenset[str]:
    """Parent chunk hashes some tensor chunk of the plan could be linked to (same
    device, same stored size; packs are small and always sent, since their manifest
    records need every member's own hash)."""
    slots = {(c.device, c.stored_nbytes) for c in request.plan.chunks if not c.is_pack}
    return frozenset(h for h, p in request.parent_chunks.items()
                     if (p.device, p.stored) in slots and f"/{PACKS_GROUP}/" not in p.key)
