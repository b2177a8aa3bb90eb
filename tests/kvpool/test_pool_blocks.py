"""The block-level calls a storage node serves: layout, lookup_blocks, delete_blocks."""

from __future__ import annotations

from pathlib import Path

import torch

from isolane.kvpool.pool import KVPool

CT = 8


def test_layout_lookup_and_delete_by_key(tmp_path: Path) -> None:
    pool = KVPool(str(tmp_path), namespace="blocks", chunk_tokens=CT)
    assert pool.layout is None
    kv = torch.arange(2 * 4 * CT * 3, dtype=torch.float32).view(2, 4, CT, 3)  # token_dim 2
    tokens = list(range(kv.shape[2]))
    assert pool.put(tokens, kv) == 1
    assert pool.layout == ("float32", (2, 4, 3))
    keys = pool.block_keys(list(range(3 * CT)))
    assert pool.lookup_blocks(keys) == 1  # only the first block is stored
    assert pool.lookup_blocks([keys[1], keys[0]]) == 0  # a prefix count, not a member count
    assert pool.delete_blocks(keys) == 1
    assert pool.lookup_blocks(keys) == 0 and pool.get(tokens) == (0, None)
    pool.close()
    with KVPool(str(tmp_path), namespace="blocks", chunk_tokens=CT) as again:
        assert again.layout == ("float32", (2, 4, 3))  # persisted with the namespace
