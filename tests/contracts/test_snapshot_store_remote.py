"""The snapshot-store contract on ``RemoteSnapshotStore`` against one real node
(started once for the module; each test starts from an empty store: the previous
test's snapshots are deleted first)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest

from isolane.service.snapshot_client import RemoteSnapshotStore
from tests.contracts.snapshot_store_contract import SnapshotStoreContract
from tests.support.node import NodeProcess, write_node_config

TOKEN = "contract-" + secrets.token_hex(8)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    config = write_node_config(tmp_path_factory.mktemp("snapshot-contract-node"))
    with NodeProcess(config, token=TOKEN) as proc:
        yield proc


class TestRemoteSnapshotStore(SnapshotStoreContract):
    @pytest.fixture
    def store(self, node: NodeProcess) -> Iterator[RemoteSnapshotStore]:
        store = RemoteSnapshotStore(node.url, token=TOKEN, timeout_s=60)
        for info in store.list():
            store.delete(info.name)
        store.gc()
        yield store
        store.close()
