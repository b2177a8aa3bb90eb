"""Checkpoints: zarr v3 snapshots written through the write lane."""

from isolane.snapshot.sharding import Shard
from isolane.snapshot.store import GcReport, SaveHandle, SnapshotInfo, SnapshotStore

__all__ = ["GcReport", "SaveHandle", "Shard", "SnapshotInfo", "SnapshotStore"]
