"""The KV pool contract on ``RemoteKVPool`` against one real ``isolane serve`` node
(started once for the module, every test in a namespace of its own)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from isolane.service.kv_client import RemoteKVPool
from tests.contracts.kv_pool_contract import CT, KVPoolContract, OpenPool
from tests.support.node import NodeProcess, write_node_config

TOKEN = "contract-" + secrets.token_hex(8)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    config = write_node_config(tmp_path_factory.mktemp("kv-contract-node"))
    with NodeProcess(config, token=TOKEN) as proc:
        yield proc


class TestRemoteKVPool(KVPoolContract):
    @pytest.fixture
    def open_pool(self, node: NodeProcess, tmp_path: Path) -> Iterator[OpenPool]:
        opened: list[RemoteKVPool] = []

        def open_pool(**kwargs: Any) -> RemoteKVPool:
            kwargs.setdefault("chunk_tokens", CT)
            pool = RemoteKVPool([node.url], token=TOKEN, poll_s=None, **kwargs)
            opened.append(pool)
            return pool

        yield open_pool
        for pool in opened:
            pool.close()
