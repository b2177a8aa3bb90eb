"""Checkpoints: zarr v3 snapshots written through the write lane."""

from isolane.snapshot.store import GcReport, SaveHandle, SnapshotInfo, SnapshotStore

__all__ = ["GcReport", "SaveHandle", "SnapshotInfo", "SnapshotStore"]
