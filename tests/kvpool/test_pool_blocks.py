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


def test_a_block_of_the_wrong_size_is_refused_on_put_and_a_miss_on_get(tmp_path: Path) -> None:
    import pytest

    from isolane.errors import InvalidArgumentError
    from isolane.kvpool.log.segment_log import SegmentLog

    pool = KVPool(str(tmp_path), namespace="blocks", chunk_tokens=CT)
    kv = torch.arange(2 * 4 * 2 * CT * 3, dtype=torch.float32).view(2, 4, 2 * CT, 3)
    tokens = list(range(2 * CT))
    assert pool.put(tokens[:CT], kv[:, :, :CT]) == 1  # fixes the layout: 768-byte blocks
    keys = pool.block_keys(tokens)
    with pytest.raises(InvalidArgumentError, match="768 bytes"):
        pool.put_blocks([keys[1]], [b"short"])
    assert pool.lookup_blocks(keys) == 1
    pool.close()
    # a block of the wrong size already stored (e.g. by an older isolane without the check)
    folder = tmp_path / "kvpool" / "blocks" / "segments"
    with SegmentLog(folder) as log:
        log.put(keys[1], b"\0" * 100)
    with KVPool(str(tmp_path), namespace="blocks", chunk_tokens=CT) as pool:
        n, out = pool.get(tokens)  # the first block only: the second reads as a miss
        assert n == CT and out is not None and torch.equal(out, kv[:, :, :CT])
        into = torch.zeros(2, 4, 2 * CT, 3)
        assert pool.get_into(tokens, into) == CT
        assert pool.get_blocks(keys)[1] is None
        assert pool.lookup_blocks(keys) == 1  # dropped
