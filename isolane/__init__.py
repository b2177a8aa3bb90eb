"""isolane: checkpoints and KV-cache blocks on one storage, each in its own lane.

``SnapshotStore(target)`` and ``KVPool(target)`` open either kind of target the same
way: a folder or a config file gives the embedded store/pool, ``http://`` node URLs
give the remote client (``RemoteSnapshotStore``/``RemoteKVPool``). Heavy imports
(torch) happen only when one of them is first touched, so that ``isolane --help``
stays fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from isolane.errors import (
    CapacityError,
    ConfigError,
    IntegrityError,
    InvalidNameError,
    IsolaneError,
    SnapshotExistsError,
    SnapshotNotFoundError,
)

if TYPE_CHECKING:
    from isolane.client.kv_pool import RemoteKVPool
    from isolane.client.snapshot_store import RemoteSnapshotStore
    from isolane.kvpool.keys import KVContext
    from isolane.kvpool.pool import KVPool
    from isolane.snapshot import SnapshotInfo, SnapshotStore

__version__ = "0.1.0"
__all__ = [
    "CapacityError", "ConfigError", "IntegrityError", "InvalidNameError", "IsolaneError",
    "KVContext", "KVPool", "RemoteKVPool", "RemoteSnapshotStore", "SnapshotExistsError",
    "SnapshotInfo", "SnapshotNotFoundError", "SnapshotStore",
]


def __getattr__(name: str) -> Any:
    if name in ("SnapshotStore", "SnapshotInfo"):
        from isolane import snapshot

        return getattr(snapshot, name)
    if name == "KVPool":
        from isolane.kvpool.pool import KVPool

        return KVPool
    if name == "KVContext":
        from isolane.kvpool.keys import KVContext

        return KVContext
    if name == "RemoteKVPool":
        from isolane.client.kv_pool import RemoteKVPool

        return RemoteKVPool
    if name == "RemoteSnapshotStore":
        from isolane.client.snapshot_store import RemoteSnapshotStore

        return RemoteSnapshotStore
    raise AttributeError(f"module 'isolane' has no attribute {name!r}")
