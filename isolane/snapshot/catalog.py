"""Names, generations and manifests of one tier, and the commit step.

A *tier* is the write group's devices (``local``) or the capacity group (``mirror``);
device 0 of a tier holds the manifests. For one snapshot name the catalog finds:

- the *committed* generations: a manifest exists and reads back (format, checksum,
  coverage: ``Manifest.from_json``);
- the *damaged* ones: a manifest exists but cannot be read. It may be the only copy of
  a committed snapshot, so it is reported (``ls``, ``verify``, ``gc``) and never
  swept; a name with a damaged generation fails alone with ``IntegrityError`` while
  every other name works;
- the *live* generation: the committed one with the latest commit time.

Commit order (``commit``): the manifest is written under the name's commit lock
(``BlobStore.lock``: an ``flock`` on local disks), after checking, under the same lock,
what is committed already. Without ``overwrite`` a committed (or damaged) generation
means ``SnapshotExistsError``, so of two writers racing on a new name exactly one
commits. With ``overwrite`` the commit stamps ``committed_at`` later than every
generation it replaces and removes their manifests before the lock is released:
the later *commit* wins, whichever save started first. Object stores have no such
lock (see docs/FORMATS.md): there the check narrows the race but does not close it.

Thread-safe; every method does I/O.
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

from isolane.errors import (
    IntegrityError,
    InvalidArgumentError,
    SnapshotExistsError,
    SnapshotNotFoundError,
)
from isolane.snapshot.manifest import MANIFEST, Manifest
from isolane.snapshot.marker import BUILDING, read_marker
from isolane.snapshot.names import GENERATION, ROOT, is_snapshot_name, prefix_of
from isolane.snapshot.retention import Generation
from isolane.storage.base import BlobStore

log = logging.getLogger(__name__)

LOCKS = "locks"  # beside ROOT: commit locks, one file per name, never deleted
DAMAGED_HINT = ("run 'isolane rm {name}' to drop it, or save it again with overwrite=True "
                "(CLI: --overwrite); 'isolane ls' lists the healthy snapshots")


@dataclass(frozen=True)
class DamagedSnapshot:
    """A generation whose manifest exists but cannot be read."""

    name: str
    generation: str
    location: str  # "local" or "mirror"
    problem: str  # names the manifest file and what is wrong with it

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def error(self) -> IntegrityError:
        return IntegrityError(f"snapshot '{self.name}' ({self.location})", self.problem,
                              DAMAGED_HINT.format(name=self.name))


@dataclass(frozen=True)
class NameState:
    """What one tier holds for one name (readable manifests sorted by commit time)."""

    name: str
    committed: tuple[Manifest, ...] = ()
    damaged: tuple[DamagedSnapshot, ...] = ()
    others: tuple[str, ...] = field(default=())  # generations without a manifest

    @property
    def live(self) -> Manifest | None:
        """The latest commit, or None (nothing committed, or the name is damaged)."""
        if self.damaged or not self.committed:
            return None
        return self.committed[-1]

    @property
    def exists(self) -> bool:
        return bool(self.committed or self.damaged)


class Catalog:
    """One tier's snapshot names and generations, with a manifest cache."""

    def __init__(self, stores: builtins.list[BlobStore], location: str) -> None:
        self.stores = stores
        self.location = location
        self._cache: dict[str, Manifest] = {}
        self._lock = threading.Lock()

    @property
    def primary(self) -> BlobStore:
        return self.stores[0]

    # -- walking ---------------------------------------------------------------------------
    def names(self, *, all_devices: bool = False) -> builtins.list[str]:
        """Snapshot names on device 0 (or any device); foreign entries are skipped."""
        found: set[str] = set()
        for store in self.stores if all_devices else self.stores[:1]:
            found.update(store.children(ROOT))
        return sorted(n for n in found if _is_name(n, f"{self.primary.url}/{ROOT}"))

    def generations(self, name: str, *, all_devices: bool = False) -> builtins.list[str]:
        found: set[str] = set()
        for store in self.stores if all_devices else self.stores[:1]:
            found.update(store.children(f"{ROOT}/{name}"))
        out = []
        for gen in sorted(found):
            if GENERATION.fullmatch(gen):
                out.append(gen)
            elif not BUILDING.fullmatch(gen):  # a save's folder not yet published
                log.warning("%s/%s/%s/%s is not a generation folder; left alone",
                            self.primary.url, ROOT, name, gen)
        return out

    # -- reading ---------------------------------------------------------------------------
    def manifest(self, name: str, generation: str) -> Manifest:
        """The generation's manifest; FileNotFoundError when it has none, IntegrityError
        when it cannot be read."""
        prefix = prefix_of(name, generation)
        with self._lock:
            cached = self._cache.get(prefix)
        if cached is not None:
            # Another process may have uncommitted it (overwrite, rm): one stat says.
            if self.primary.exists(f"{prefix}/{MANIFEST}"):
                return cached
            self.forget(name, generation)
            raise FileNotFoundError(f"{self.primary.url}/{prefix}/{MANIFEST}")
        where = f"{self.primary.url}/{prefix}/{MANIFEST}"
        try:
            data = self.primary.read(f"{prefix}/{MANIFEST}")
        except (IsADirectoryError, PermissionError) as exc:
            raise IntegrityError(f"manifest {where}", f"unreadable: {exc}") from None
        manifest = Manifest.from_json(data, where)
        if manifest.name != name or manifest.generation != generation:
            raise IntegrityError(f"manifest {where}", f"it names {manifest.name}/"
                                 f"{manifest.generation}, not the folder it is in")
        with self._lock:
            self._cache[prefix] = manifest
        return manifest

    def forget(self, name: str, generation: str) -> None:
        with self._lock:
            self._cache.pop(prefix_of(name, generation), None)

    def remember(self, manifest: Manifest) -> None:
        with self._lock:
            self._cache[prefix_of(manifest.name, manifest.generation)] = manifest

    def state(self, name: str, *, all_devices: bool = False) -> NameState:
        committed: list[Manifest] = []
        damaged: list[DamagedSnapshot] = []
        others: list[str] = []
        for gen in self.generations(name, all_devices=all_devices):
            try:
                committed.append(self.manifest(name, gen))
            except FileNotFoundError:
                others.append(gen)
            except IntegrityError as exc:
                damaged.append(DamagedSnapshot(name, gen, self.location,
                                               f"{exc.what}: {exc.detail}"))
        committed.sort(key=lambda m: (m.committed_at, m.generation))
        return NameState(name, tuple(committed), tuple(damaged), tuple(others))

    def generation_state(self, name: str, generation: str, committed: Manifest | None,
                         damaged: bool) -> Generation:
        """What gc needs to know of one generation (reads its marker)."""
        writer = read_marker(self.primary, prefix_of(name, generation))
        return Generation(name, generation,
                          committed.committed_at if committed is not None else None, writer,
                          damaged=damaged)

    # -- committing ------------------------------------------------------------------------
    def commit(self, manifest: Manifest, *, overwrite: bool) -> tuple[Manifest, list[str]]:
        """Write ``manifest`` (the commit) unless the name exists and not ``overwrite``;
        returns the manifest as committed and the generations it replaced (already
        uncommitted: their manifests are gone; the caller removes their data)."""
        name, own = manifest.name, manifest.generation
        with self.primary.lock(f"{LOCKS}/{ROOT}/{name}"):
            state = self.state(name)
            older = [m for m in state.committed if m.generation != own]
            replaced = [m.generation for m in older] + [
                d.generation for d in state.damaged if d.generation != own]
            if replaced and not overwrite:
                raise SnapshotExistsError(name, self.primary.url)
            floor = max((m.committed_at for m in older), default=0.0)
            manifest = replace(manifest, committed_at=max(time.time(), floor + 1e-6))
            self.primary.write_atomic(f"{prefix_of(name, own)}/{MANIFEST}",
                                      manifest.to_json())
            self.remember(manifest)
            for gen in replaced:
                self.primary.delete(f"{prefix_of(name, gen)}/{MANIFEST}")
                self.forget(name, gen)
        return manifest, replaced


    # -- removing --------------------------------------------------------------------------
    def remove(self, name: str, generation: str) -> None:
        """Remove a generation from every device: uncommitted first (its manifest), so
        that a crash halfway leaves leftovers gc sweeps, never a half snapshot."""
        prefix = prefix_of(name, generation)
        self.primary.delete(f"{prefix}/{MANIFEST}")
        self.forget(name, generation)
        for store in self.stores:
            store.delete_prefix(prefix)

    def discard(self, name: str, generation: str, part: str | None = None) -> None:
        """Remove what a failed save wrote (the generation, or only its folder ``part``,
        a rank's share) and the name's folder if that left it empty. What cannot be
        removed now has no manifest and a dead writer: gc sweeps it."""
        prefix = prefix_of(name, generation)
        if part is None:
            with contextlib.suppress(OSError):
                self.primary.delete(f"{prefix}/{MANIFEST}")
            self.forget(name, generation)
        else:
            prefix = f"{prefix}/{part}"
        for store in self.stores:
            with contextlib.suppress(OSError):
                store.delete_prefix(prefix)
            remove_if_empty(store, prefix.rsplit("/", 1)[0])


@dataclass(frozen=True)
class Located:
    """Where the live generation of a name lies: its tier's devices, its prefix there,
    its manifest and the tier (``local`` or ``mirror``)."""

    stores: builtins.list[BlobStore]
    prefix: str
    manifest: Manifest
    location: str


def locate(catalogs: builtins.list[Catalog], name: str, url: str) -> Located:
    """The live generation, local first, then the mirror; a damaged local copy falls
    back to a healthy mirror copy, else raises IntegrityError (``url``: the store's,
    for the not-found error)."""
    problem: DamagedSnapshot | None = None
    for catalog in catalogs:
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
            _check_devices(live, catalog)
            return Located(catalog.stores, prefix_of(name, live.generation), live,
                           catalog.location)
    if problem is not None:
        raise problem.error()
    raise SnapshotNotFoundError(name, url)


def _check_devices(manifest: Manifest, catalog: Catalog) -> None:
    used = max((c.device for c in manifest.chunks if manifest.group_elsewhere(c) is None),
               default=0)
    if catalog.location == "local" and used >= len(catalog.stores):
        raise InvalidArgumentError(
            f"snapshot '{manifest.name}' was saved over {len(manifest.devices)} devices "
            f"({', '.join(manifest.devices)}) but this store has {len(catalog.stores)}; "
            "open it with the config that saved it")


def remove_if_empty(store: BlobStore, prefix: str) -> None:
    """Remove the folder ``prefix`` only if it is empty, in one step (``rmdir``).

    Checking ``children`` and then removing the tree races a save of the same name in
    another process, which may create its generation folder in between: the tree
    removal then takes that folder (and the marker being renamed into it) along. An
    ``rmdir`` fails on a folder that is not empty, so a starting save always wins. The
    folder is removed relative to its parent opened without following a link; object
    stores have no folders (nothing to do)."""
    parent_key, _, leaf = prefix.rpartition("/")
    parent = store.local_path(parent_key) if parent_key else None
    if parent is None or not leaf:
        return
    try:
        fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return  # gone already, or a link: nothing of ours to remove
    try:
        os.rmdir(leaf, dir_fd=fd)
    except OSError:
        pass  # not empty (a save of this name is starting), or gone already
    finally:
        os.close(fd)


def _is_name(name: str, where: str) -> bool:
    if is_snapshot_name(name):
        return True
    log.warning("%s/%r is not a snapshot name; left alone", where, name)
    return False
