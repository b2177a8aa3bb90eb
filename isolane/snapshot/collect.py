"""Deleting snapshots and collecting garbage over a store's tiers (local, mirror).

``delete`` removes every generation of a name, damaged or not. ``collect`` (gc) sweeps
only what provably never committed (``retention.should_sweep``) and generations an
overwrite superseded, then applies retention (``keep_last``) to the readable
snapshots; a damaged manifest is reported in ``GcReport.damaged`` and never swept.
Each committed generation is self-contained (shared chunks are hard links or
server-side copies), so removing one never touches another.
"""

from __future__ import annotations

import builtins
import logging
import os
import time

from isolane.errors import SnapshotNotFoundError
from isolane.snapshot.catalog import Catalog, DamagedSnapshot, remove_if_empty
from isolane.snapshot.marker import sweep_dead_builds
from isolane.snapshot.names import ROOT
from isolane.snapshot.results import GcReport
from isolane.snapshot.retention import plan_retention, should_sweep
from isolane.storage.base import BlobStore

log = logging.getLogger(__name__)


def delete(catalogs: builtins.list[Catalog], name: str, url: str) -> None:
    """Remove ``name`` from every tier; SnapshotNotFoundError (naming ``url``) when no
    tier has a generation of it."""
    found = False
    for catalog in catalogs:
        for gen in catalog.generations(name, all_devices=True):
            found = True
            catalog.remove(name, gen)
        for store in catalog.stores:
            if not store.children(f"{ROOT}/{name}"):
                store.delete_prefix(f"{ROOT}/{name}")
    if not found:
        raise SnapshotNotFoundError(name, url)


def collect(catalogs: builtins.list[Catalog], url: str, *, keep_last: int | None,
            grace_s: float) -> GcReport:
    """Sweep leftovers on every tier, then keep the ``keep_last`` newest snapshots (module
    docstring). A mirror that cannot be reached is skipped (logged)."""
    deleted: builtins.list[str] = []
    swept: builtins.list[str] = []
    damaged: builtins.list[DamagedSnapshot] = []
    committed: dict[str, float] = {}
    for catalog in catalogs:
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
            for store in catalog.stores:
                for entry in sweep_dead_builds(store, f"{ROOT}/{name}", grace_s):
                    swept.append(f"{catalog.location}:{name}/{entry}")
                    emptied = True
            for gen in gens:
                if should_sweep(gen, live.generation if live else None, grace_s=grace_s):
                    catalog.remove(name, gen.generation)
                    swept.append(f"{catalog.location}:{name}/{gen.generation}")
                    emptied = True
            # An empty name folder goes when this gc emptied it, or when nothing has
            # changed in it for the grace period (racers that failed together leave
            # one). One rmdir: it fails, and so spares the folder, once a starting
            # save has made its generation folder inside.
            for store in catalog.stores:
                if emptied or _quiet_for(store, f"{ROOT}/{name}", grace_s):
                    remove_if_empty(store, f"{ROOT}/{name}")
    broken = {d.name for d in damaged}
    for name in plan_retention(sorted((n, t) for n, t in committed.items()
                                      if n not in broken), keep_last):
        delete(catalogs, name, url)
        deleted.append(name)
    return GcReport(tuple(deleted), tuple(swept), tuple(damaged))


def _quiet_for(store: BlobStore, prefix: str, grace_s: float) -> bool:
    """True when the local folder ``prefix`` has not changed for ``grace_s`` seconds."""
    path = store.local_path(prefix)
    if path is None:
        return False
    try:
        return time.time() - os.lstat(path).st_mtime > grace_s
    except OSError:
        return False
