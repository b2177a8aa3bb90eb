"""KV benchmark data: block geometries, the corpus as data, block contents, Zipf ids.

Pure numpy and stdlib (no torch, no isolane): the LMCache child imports it from its own
virtual environment, so that both processes derive the same bytes for block ``j``.

A corpus is ``prompts`` prompts of ``blocks_per_prompt`` blocks each; block ``j``
(global index ``prompt * blocks_per_prompt + i``) is ``block_bytes`` bytes cut out of
one random *base* buffer at offset ``8 * (j * STRIDE mod SPREAD / 8)`` — a zero-copy
view, distinct for every ``j`` below ``SPREAD / 8`` (2 M blocks), so a swapped or
misplaced block fails the comparison. The base is written to a file once and read back
by the child.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

MiB = 1 << 20
KiB = 1 << 10
SPREAD = 16 * MiB
"""Offsets of block views fall in [0, SPREAD) of the base buffer, on an 8-byte grid."""
STRIDE = 104729  # odd: j -> j * STRIDE mod (SPREAD / 8) is a bijection
SEED = 20261129

Bytes = npt.NDArray[np.uint8]


@dataclass(frozen=True)
class Geometry:
    """One KV block geometry. ``kv_shape`` is the KV tensor of a prompt with ``T`` at
    ``token_dim`` (what ``KVPool.get_into`` fills); ``lmcache_shape`` is LMCache's
    ``KV_2LTD`` memory object of one chunk (``[2, layers, tokens, hidden]``)."""

    name: str
    label: str
    chunk_tokens: int
    layers: int
    kv_heads: int = 8
    head_dim: int = 128
    dtype_bytes: int = 2  # bf16
    token_dim: int = 2

    @property
    def block_bytes(self) -> int:
        return (self.layers * 2 * self.chunk_tokens * self.kv_heads * self.head_dim
                * self.dtype_bytes)

    def kv_shape(self, tokens: int) -> tuple[int, ...]:
        """[layers, K/V, tokens, kv_heads, head_dim] (token_dim 2)."""
        return (self.layers, 2, tokens, self.kv_heads, self.head_dim)

    @property
    def lmcache_shape(self) -> tuple[int, ...]:
        return (2, self.layers, self.chunk_tokens, self.kv_heads * self.head_dim)


# Llama-3-8B: 32 layers x (K, V) x 8 KV heads x 128 dims x 2 bytes = 128 KiB per token.
LLAMA3_8B_BLOCK = Geometry("32MiB", "Llama-3-8B, 256-token block, all 32 layers (32 MiB)",
                           chunk_tokens=256, layers=32)
LLAMA3_8B_LAYER = Geometry("64KiB", "Llama-3-8B, 16-token block, one layer (64 KiB)",
                           chunk_tokens=16, layers=1)
GEOMETRIES = {g.name: g for g in (LLAMA3_8B_LAYER, LLAMA3_8B_BLOCK)}


@dataclass(frozen=True)
class Corpus:
    geometry: Geometry
    prompts: int
    blocks_per_prompt: int

    @property
    def blocks(self) -> int:
        return self.prompts * self.blocks_per_prompt

    @property
    def nbytes(self) -> int:
        return self.blocks * self.geometry.block_bytes

    @property
    def prompt_tokens(self) -> int:
        return self.blocks_per_prompt * self.geometry.chunk_tokens

    def block_id(self, prompt: int, index: int) -> int:
        return prompt * self.blocks_per_prompt + index

    def prompt_ids(self, prompt: int, n: int | None = None) -> list[int]:
        n = self.blocks_per_prompt if n is None else n
        return [self.block_id(prompt, i) for i in range(n)]

    def tokens(self, prompt: int) -> npt.NDArray[np.int64]:
        """Token ids of a prompt: distinct from every other prompt's from the first one."""
        start = prompt * self.prompt_tokens
        return np.arange(start, start + self.prompt_tokens, dtype=np.int64)


def plan_corpus(geometry: Geometry, min_bytes: int, blocks_per_prompt: int) -> Corpus:
    """Whole prompts of ``blocks_per_prompt`` blocks holding at least ``min_bytes``."""
    prompt_bytes = blocks_per_prompt * geometry.block_bytes
    return Corpus(geometry, max(1, math.ceil(min_bytes / prompt_bytes)), blocks_per_prompt)


def block_offset(block_id: int) -> int:
    return (block_id * STRIDE) % (SPREAD // 8) * 8


def make_base(block_bytes: int, path: Path | None = None) -> Bytes:
    """The random base buffer (``block_bytes + SPREAD`` bytes); also written to ``path``."""
    rng = np.random.default_rng(SEED)
    base = rng.integers(0, 256, size=block_bytes + SPREAD, dtype=np.uint8)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        base.tofile(path)
    return base


def load_base(path: Path) -> Bytes:
    return np.fromfile(path, dtype=np.uint8)


def block_view(base: Bytes, block_id: int, block_bytes: int) -> Bytes:
    """Block ``block_id``'s bytes: a read-only-by-convention view into ``base``."""
    off = block_offset(block_id)
    return base[off:off + block_bytes]


def aligned_buffer(nbytes: int, *, touch: bool = True) -> tuple[mmap.mmap, Bytes]:
    """A page-aligned anonymous buffer (usable for O_DIRECT) and a numpy view of it,
    every page touched once so timings never pay first-touch page faults."""
    m = mmap.mmap(-1, max(nbytes, 1))
    arr = np.frombuffer(m, dtype=np.uint8)[:nbytes]
    if touch:
        arr.fill(0)
    return m, arr


def check_blocks(dest: Bytes, base: Bytes, ids: list[int], block_bytes: int, *,
                 sample: int | None = None) -> str | None:
    """None when ``dest`` holds blocks ``ids`` back to back, else what differs.
    ``sample``: check only the first, last and ``sample - 2`` evenly spread blocks."""
    positions = range(len(ids))
    if sample is not None and len(ids) > sample:
        step = (len(ids) - 1) / max(sample - 1, 1)
        positions = sorted({round(k * step) for k in range(sample)})
    for pos in positions:
        got = dest[pos * block_bytes:(pos + 1) * block_bytes]
        if not np.array_equal(got, block_view(base, ids[pos], block_bytes)):
            return f"block {pos} (id {ids[pos]}) differs from what was stored"
    return None


# -- Zipf ids -------------------------------------------------------------------------
def zipf_ids(n_blocks: int, count: int, *, s: float = 1.0, seed: int = 0) -> list[int]:
    """``count`` block ids drawn from a Zipf(``s``) law over ``n_blocks`` ranks (bounded,
    so s = 1.0 is allowed; numpy's ``zipf`` needs s > 1); rank r has probability
    ``r**-s / H``. Ranks map to ids through a fixed random permutation, so hot blocks
    are spread over the corpus instead of sitting in its first prompt."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, n_blocks + 1, dtype=np.float64) ** s
    cdf = np.cumsum(weights)
    cdf /= cdf[-1]
    ranks = np.searchsorted(cdf, rng.random(count), side="right")
    ranks = np.minimum(ranks, n_blocks - 1)
    perm = np.random.default_rng(SEED).permutation(n_blocks)
    return [int(x) for x in perm[ranks]]
