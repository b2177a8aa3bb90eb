"""The snapshot-store contract on ``RemoteSnapshotStore`` against one real node
(started once for the module; each test starts from an empty store: the previous
test's snapshots are deleted first)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from isolane.client.snapshot_store import RemoteSnapshotStore
from tests.contracts.snapshot_store_contract import SnapshotStoreContract
from tests.support.node import NodeProcess


class TestRemoteSnapshotStore(SnapshotStoreContract):
    @pytest.fixture
    def store(self, node: NodeProcess) -> Iterator[RemoteSnapshotStore]:
        store = RemoteSnapshotStore(node.url, token=node.token, timeout_s=60)
        for info in store.list():
            store.delete(info.name)
        store.gc()
        yield store
        store.close()
