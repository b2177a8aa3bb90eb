"""Keys and tensors are checked at the door of the KV pool: a key that is not 16
bytes-like bytes, and a KV tensor whose bytes cannot be read here, are refused with an
InvalidArgumentError before anything is stored or any layout is fixed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from isolane import KVPool
from isolane.errors import InvalidArgumentError

CT = 4
BAD_KEYS: list[Any] = [16, "0123456789abcdef", b"short", bytes(17), None, 3.5]


@pytest.fixture
def pool(tmp_path: Path) -> Any:
    with KVPool(str(tmp_path), namespace="keys", chunk_tokens=CT, token_dim=0) as opened:
        yield opened


@pytest.mark.parametrize("bad", BAD_KEYS, ids=repr)
def test_a_key_that_is_not_16_bytes_is_refused_by_every_block_call(pool: KVPool, bad: Any
                                                                    ) -> None:
    pool.put(list(range(CT)), torch.ones(CT, 2))
    size = pool.block_bytes or 0
    with pytest.raises(InvalidArgumentError, match="16 bytes"):
        pool.put_blocks([bad], [bytes(size)])
    for call in (pool.get_blocks, pool.lookup_blocks, pool.delete_blocks):
        with pytest.raises(InvalidArgumentError, match="16 bytes"):
            call([bad])


def test_int_keys_never_collide_as_zero_bytes(pool: KVPool) -> None:
    pool.put(list(range(CT)), torch.ones(CT, 2))
    size = pool.block_bytes or 0
    with pytest.raises(InvalidArgumentError):
        pool.put_blocks([16], [bytes(size)])
    assert pool.get_blocks([bytes(16)]) == [None]  # nothing was stored under zeros


def test_bytes_like_keys_of_16_bytes_work(pool: KVPool) -> None:
    pool.put(list(range(CT)), torch.ones(CT, 2))
    size = pool.block_bytes or 0
    key = bytes(range(16))
    assert pool.put_blocks([bytearray(key)], [bytes(size)]) == 1
    assert pool.lookup_blocks([memoryview(key)]) == 1


def test_a_meta_tensor_is_refused_and_fixes_no_layout(pool: KVPool) -> None:
    with pytest.raises(InvalidArgumentError, match="meta tensor"):
        pool.put(list(range(CT)), torch.empty(CT, 8, device="meta"))
    assert pool.layout is None
    assert pool.put(list(range(CT)), torch.ones(CT, 2)) == 1  # another shape is fine
