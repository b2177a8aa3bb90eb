"""isolane: checkpoints and KV-cache blocks on one storage, each in its own lane.

Heavy imports (torch) happen only when ``SnapshotStore`` or ``KVPool`` is first
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

if TYPE_CHECKING:
    from isolane.kvpool.keys import KVContext
    from isolane.kvpool.pool import KVPool
    from isolane.snapshot import SnapshotInfo, SnapshotStore

__version__ = "0.1.0"
__all__ = [
    "CapacityError", "ConfigError", "IntegrityError", "InvalidNameError", "IsolaneError",
    "KVContext", "KVPool", "SnapshotExistsError", "SnapshotInfo", "SnapshotNotFoundError",
    "SnapshotStore",
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
    raise AttributeError(f"module 'isolane' has no attribute {name!r}")
