"""Raw-byte KV blocks in an embedded ``KVPool``, as the block-level benchmarks store them.

``put_blocks`` checks every block's size against the namespace's layout and refuses
blocks while there is none (the first ``put`` of a KV tensor fixes it). A pool of raw
blocks is opened with ``BYTE_BLOCKS`` (one token a block, the token dimension first:
a block of ``n`` bytes is a ``[1, n]`` uint8 tensor) by every process that opens the
namespace, and ``fix_layout`` puts one zero block to fix the layout (one extra block,
under the key of token 0).
"""

from __future__ import annotations

from typing import Any

BYTE_BLOCKS: dict[str, int] = {"chunk_tokens": 1, "token_dim": 0}


def fix_layout(pool: Any, block_bytes: int) -> None:
    """Fix the layout of ``pool``'s namespace (opened with ``BYTE_BLOCKS``) to blocks of
    ``block_bytes`` bytes; a no-op once it is fixed."""
    import torch

    if pool.layout is None:
        pool.put([0], torch.zeros(1, block_bytes, dtype=torch.uint8))
