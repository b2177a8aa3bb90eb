"""Open a store or a pool by its target, as fsspec's ``url_to_fs`` picks a filesystem.

``open_store(target)`` and ``open_kv_pool(target)`` give the embedded ``SnapshotStore``
/ ``KVPool`` for a folder, a YAML config, a ``Config``, an ``s3://`` URL (stores) or
nothing (``$ISOLANE_HOME``), and the client (``RemoteSnapshotStore`` /
``RemoteKVPool``) for ``http(s)://`` node URLs: one URL, several joined by commas, or
a list (and, for pools, an ``etcd://HOST:PORT/PREFIX`` URL: the nodes registered there).
Keyword arguments go to the class chosen. The classes themselves open one
kind each, so ``SnapshotStore(...)`` is always a ``SnapshotStore``. The client is
imported only for node targets, torch only when the embedded one is opened.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from isolane.config import (
    Config,
    is_etcd_target,
    is_node_target,
    node_url_list,
    refuse_etcd_store,
)

if TYPE_CHECKING:
    from isolane.client.kv_pool import RemoteKVPool
    from isolane.client.snapshot_store import RemoteSnapshotStore
    from isolane.kvpool.pool import KVPool
    from isolane.snapshot.store import SnapshotStore

Target = str | os.PathLike[str] | Sequence[str] | Config | None


def open_store(target: Target = None, **kwargs: Any) -> SnapshotStore | RemoteSnapshotStore:
    """The snapshot store ``target`` names (see the module docstring)."""
    if is_etcd_target(target):
        refuse_etcd_store(target)
    if is_node_target(target):
        from isolane.client.snapshot_store import RemoteSnapshotStore

        return RemoteSnapshotStore(node_url_list(target), **kwargs)  # type: ignore[arg-type]
    from isolane.snapshot.store import SnapshotStore

    return SnapshotStore(target, **kwargs)  # type: ignore[arg-type]


def open_kv_pool(target: Target = None, **kwargs: Any) -> KVPool | RemoteKVPool:
    """The KV pool ``target`` names (see the module docstring)."""
    if is_node_target(target) or is_etcd_target(target):
        from isolane.client.kv_pool import connect

        return connect(target, **kwargs)  # type: ignore[arg-type]
    from isolane.kvpool.pool import KVPool

    return KVPool(target, **kwargs)  # type: ignore[arg-type]

