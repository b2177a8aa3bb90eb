"""The tier seam: memory, disk and capacity answer one interface the same way, a get walks
them fastest first and writes hits back, and nothing on that path calls back into the pool."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from isolane.config import config_from_dict
from isolane.kvpool.api import block_bytes_of
from isolane.kvpool.pool import KVPool
from isolane.kvpool.tiers.base import Tier, WritableTier
from tests.test_architecture import ROOT, import_edges

CT = 16
TIERS = ["memory", "disk", "capacity"]


def _kv(n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, n, 2, 8, generator=gen)


def _open(tmp_path: Path) -> KVPool:
    # A capacity group on a local folder: the tier works on any BlobStore.
    config = config_from_dict({"device_groups": {
        "kv": {"role": "read", "devices": [str(tmp_path / "local")]},
        "cold": {"role": "capacity", "devices": [str(tmp_path / "cold")]}}})
    return KVPool(config, namespace="tiers", chunk_tokens=CT, memory_budget=1 << 20)


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[KVPool]:
    pool = _open(tmp_path)
    yield pool
    pool.close()


def _stored(pool: KVPool, name: str) -> tuple[Tier, list[bytes], list[bytes]]:
    """Four blocks held by the tier called ``name`` (and only there, for capacity)."""
    tokens, kv = list(range(4 * CT)), _kv(4 * CT)
    assert pool.put(tokens, kv) == 4
    keys = pool.block_keys(tokens)
    values = [bytes(block_bytes_of(kv.narrow(2, i * CT, CT))) for i in range(4)]
    if name == "capacity":
        pool.logs[0].rotate()
        assert pool.demote(target_bytes=0) >= 1
        assert not pool.disk.contains_many(keys).any()
    tier: Tier = getattr(pool, name)
    return tier, keys, values


@pytest.mark.parametrize("name", TIERS)
def test_every_tier_answers_the_tier_interface(pool: KVPool, name: str) -> None:
    tier, keys, values = _stored(pool, name)
    missing = b"\x01" * 16
    assert tier.contains_many([*keys, missing]).tolist() == [True] * 4 + [False]
    got = tier.get_many([keys[2], missing, keys[0]])
    assert [None if g is None else bytes(g) for g in got] == [values[2], None, values[0]]
    dests = [torch.zeros(2, 2, CT, 2, 8) for _ in range(3)]
    strided = torch.zeros(2, 2, 2 * CT, 2, 8).narrow(2, CT, CT)  # a view, not contiguous
    done = tier.read_into([keys[1], missing, keys[3], keys[0]], [*dests, strided])
    assert done == [True, False, True, True]
    assert bytes(block_bytes_of(dests[0])) == values[1]
    assert bytes(block_bytes_of(dests[2])) == values[3]
    assert bytes(block_bytes_of(strided)) == values[0]
    assert len(tier) >= 4 and tier.nbytes >= sum(len(v) for v in values)
    assert tier.delete_many([keys[0], missing]) == [True, False]
    assert tier.contains_many(keys).tolist() == [False, True, True, True]
    assert isinstance(tier, WritableTier) == (name != "capacity")


def test_a_get_walks_the_tiers_fastest_first_and_writes_hits_back(pool: KVPool) -> None:
    _, keys, values = _stored(pool, "capacity")
    assert pool.tiers == [pool.memory, pool.disk, pool.capacity]
    pool.memory.clear()
    got = pool.get_blocks(keys)
    assert [bytes(g) for g in got if g is not None] == values
    assert pool.disk.contains_many(keys).all() and pool.memory.contains_many(keys).all()
    pool.memory.clear()  # now the disk tier serves them, and the memory tier takes them
    n, kv = pool.get(list(range(4 * CT)))
    assert n == 4 * CT and kv is not None and torch.equal(kv, _kv(4 * CT))
    assert pool.memory.contains_many(keys).all()


def test_nothing_on_the_get_path_imports_the_pool() -> None:
    # A KV get goes pool -> tiers -> log in one direction: no module it passes through
    # imports pool.py (or catalog.py, which builds pools); the remote client does not either.
    below = ("isolane.kvpool.tiers", "isolane.kvpool.log", "isolane.kvpool.api",
             "isolane.kvpool.keys", "isolane.kvpool.token_dim", "isolane.kvpool.namespace",
             "isolane.client")
    back = [(e.importer, e.imported) for e in import_edges(ROOT)
            if e.importer.startswith(below)
            and e.imported in ("isolane.kvpool.pool", "isolane.kvpool.catalog")]
    assert back == []
    into_client = [(e.importer, e.imported) for e in import_edges(ROOT)
                   if e.importer.startswith("isolane.kvpool")
                   and e.importer != "isolane.kvpool.pool"
                   and e.imported.startswith("isolane.client")]
    assert into_client == []  # only open_kv_pool(url) opens the client, lazily
