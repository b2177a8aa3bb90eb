"""The KV pool contract on ``RemoteKVPool`` against one real ``isolane serve`` node
(started once for the module, every test in a namespace of its own)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from isolane.client.kv_pool import RemoteKVPool
from tests.contracts.kv_pool_contract import CT, KVPoolContract, OpenPool
from tests.support.node import NodeProcess


class TestRemoteKVPool(KVPoolContract):
    @pytest.fixture
    def open_pool(self, node: NodeProcess, tmp_path: Path) -> Iterator[OpenPool]:
        opened: list[RemoteKVPool] = []

        def open_pool(**kwargs: Any) -> RemoteKVPool:
            kwargs.setdefault("chunk_tokens", CT)
            pool = RemoteKVPool([node.url], token=node.token, poll_s=None, **kwargs)
            opened.append(pool)
            return pool

        yield open_pool
        for pool in opened:
            pool.close()
