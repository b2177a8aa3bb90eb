"""The snapshot-store contract on the local ``SnapshotStore`` (a folder per test)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from isolane.snapshot import SnapshotStore
from tests.contracts.snapshot_store_contract import SnapshotStoreContract


class TestLocalSnapshotStore(SnapshotStoreContract):
    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[SnapshotStore]:
        store = SnapshotStore(str(tmp_path / "snapshots"))
        yield store
        store.close()
