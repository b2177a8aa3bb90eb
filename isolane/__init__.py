"""isolane: checkpoints and KV-cache blocks on one storage, each in its own lane.

``open_store(target)`` and ``open_kv_pool(target)`` open either kind of target the same
way: a folder or a config file gives the embedded ``SnapshotStore``/``KVPool``,
``http://`` node URLs the client (``RemoteSnapshotStore``/``RemoteKVPool``); each class
opens its own kind. Heavy imports (torch) happen only when one of them is first
touched, so that ``isolane --help`` stays fast.
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
from isolane.opening import open_kv_pool, open_store

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
    "SnapshotInfo", "SnapshotNotFoundError", "SnapshotStore", "open_kv_pool", "open_store",
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
