"""What the DCP storage layer needs of a snapshot store (a ``Protocol``).

``SnapshotStore`` satisfies it; the DCP writer and reader are typed against it so that
the store, which hands DTensor state dicts to them, and they do not import each other.
"""

from __future__ import annotations

import builtins
from typing import Protocol

from isolane.snapshot.catalog import Located
from isolane.snapshot.manifest import Manifest
from isolane.snapshot.reader import SnapshotReader
from isolane.snapshot.staging import StagingPool
from isolane.snapshot.transaction import SaveDriver
from isolane.storage.base import BlobStore


class DCPTarget(Protocol):
    """The store a DCP checkpoint is written to and read from."""

    saves: SaveDriver
    stores: builtins.list[BlobStore]
    mirror_store: BlobStore | None
    staging: StagingPool  # the bounded staging memory of its saves

    def mirror_part(self, part: Manifest, prefix: str) -> None: ...

    def snapshot_files(self, name: str) -> Located: ...

    def tiers_of(self, located: Located) -> builtins.list[Located]: ...

    def reader(self, located: Located) -> SnapshotReader: ...
