"""The KV pool contract on the embedded ``KVPool`` (one local folder for the module)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from isolane.kvpool.pool import KVPool
from tests.contracts.kv_pool_contract import CT, KVPoolContract, OpenPool


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kv-contract")


class TestEmbeddedKVPool(KVPoolContract):
    @pytest.fixture
    def open_pool(self, folder: Path) -> Iterator[OpenPool]:
        opened: list[KVPool] = []

        def open_pool(**kwargs: Any) -> KVPool:
            kwargs.setdefault("chunk_tokens", CT)
            kwargs.setdefault("memory_budget", 1 << 20)
            pool = KVPool(str(folder), **kwargs)
            opened.append(pool)
            return pool

        yield open_pool
        for pool in opened:
            pool.close()
