"""Raw-byte KV blocks in an embedded ``KVPool``: a pool opened with ``BYTE_BLOCKS`` (one
token a block, token dimension first: a block of ``n`` bytes is a ``[1, n]`` uint8 tensor)
takes ``put_blocks`` once ``fix_layout`` has put one zero block (under token 0's key)."""

from __future__ import annotations

from typing import Any

BYTE_BLOCKS: dict[str, int] = {"chunk_tokens": 1, "token_dim": 0}


def fix_layout(pool: Any, block_bytes: int) -> None:
    """Fix the layout of ``pool``'s namespace to blocks of ``block_bytes``; once only."""
    import torch

    if pool.layout is None:
        pool.put([0], torch.zeros(1, block_bytes, dtype=torch.uint8))
