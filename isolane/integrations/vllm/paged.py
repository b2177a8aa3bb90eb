"""Copying token KV between vLLM's paged KV buffers and the pool's layout (pure, no I/O,
no vLLM import).

vLLM keeps each attention layer's KV in one paged buffer of fixed-size blocks; a request
owns a list of block ids, and token position ``p`` lives in slot
``block_ids[p // block_size] * block_size + p % block_size``. Logical shapes of one
layer's buffer as vLLM hands it to a connector (the memory may be permuted — e.g. "HND",
heads before block offsets, or vLLM 0.26+'s ``LBNHC``/``LBHNC`` stride orders — behind
the view: indexing here goes through the view, so any strides work)::

    +------------+--------------------------------------------------+----------------+
    | layout     | logical shape of one layer                       | vLLM versions  |
    +------------+--------------------------------------------------+----------------+
    | packed     | (num_blocks, kv_heads, block_size, 2 * head_dim) | 0.26 and later |
    |            | K in [..., :head_dim], V in [..., head_dim:]     |                |
    | flashinfer | (num_blocks, 2, block_size, kv_heads, head_dim)  | 0.24 - 0.25    |
    | flash      | (2, num_blocks, block_size, kv_heads, head_dim)  | up to 0.22     |
    | mla        | (num_blocks, 1, block_size, latent)              | 0.26 and later |
    |            | one latent a token (MLAAttentionSpec), no K/V    |                |
    +------------+--------------------------------------------------+----------------+

``mla`` is never guessed from a shape (it looks like ``packed`` with one head): the
connector names it when vLLM's KV cache spec is an ``MLAAttentionSpec``. Anything else
(Mamba state, K and V of different sizes) is refused.

The pool stores a request's KV as ``[layers, 2, tokens, kv_heads, head_dim]`` (token
dimension 2, the KVPool default), MLA's as ``[layers, 1, tokens, 1, latent]``;
``gather_layer``/``scatter_layer`` move one layer's ``[2, tokens, kv_heads, head_dim]``
(MLA: ``[1, tokens, 1, latent]``) slice out of / into the paged buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from isolane.errors import InvalidArgumentError

PagedLayout = Literal["flash", "flashinfer", "packed", "mla"]
LAYOUTS: tuple[PagedLayout, ...] = ("flash", "flashinfer", "packed", "mla")
SUPPORTED = ("vLLM 0.26+ (num_blocks, kv_heads, block_size, 2*head_dim), 0.24-0.25 "
             "(num_blocks, 2, block_size, kv_heads, head_dim) and up to 0.22 "
             "(2, num_blocks, block_size, kv_heads, head_dim)")


def detect_layout(kv_layer: torch.Tensor) -> PagedLayout:
    """The layout a buffer's shape implies; ambiguous shapes must be named explicitly."""
    if kv_layer.dim() == 4:
        if kv_layer.shape[3] % 2:
            raise InvalidArgumentError(
                f"paged KV buffer of shape {list(kv_layer.shape)}: its last dimension "
                "must hold K and V of one size (2 * head_dim); K and V of different sizes "
                f"are not supported. Supported: {SUPPORTED}")
        return "packed"
    if kv_layer.dim() != 5:
        raise InvalidArgumentError(
            f"paged KV buffer of shape {list(kv_layer.shape)} is not a layout the "
            f"connector supports (MLA's latent cache and Mamba state are not). "
            f"Supported: {SUPPORTED}")
    first, second = kv_layer.shape[0] == 2, kv_layer.shape[1] == 2
    if first and not second:
        return "flash"
    if second and not first:
        return "flashinfer"
    raise InvalidArgumentError(
        f"cannot tell the layout of a paged KV buffer of shape {list(kv_layer.shape)}; "
        f"name it ({' or '.join(LAYOUTS)})")


def check_mla_buffer(kv_layer: torch.Tensor) -> None:
    """An MLA paged buffer as vLLM 0.26+ allocates it, or InvalidArgumentError."""
    if kv_layer.dim() != 4 or kv_layer.shape[1] != 1:
        raise InvalidArgumentError(
            f"MLA paged KV buffer of shape {list(kv_layer.shape)}: expected vLLM 0.26+'s "
            "(num_blocks, 1, block_size, latent) view of an MLAAttentionSpec")


def block_size_of(kv_layer: torch.Tensor) -> int:
    return int(kv_layer.shape[2])


def slot_mapping(block_ids: Sequence[int], block_size: int, start: int, stop: int
                 ) -> torch.Tensor:
    """Slots (int64) of token positions ``[start, stop)`` of a request owning ``block_ids``."""
    if not 0 <= start <= stop:
        raise InvalidArgumentError(f"token range [{start}, {stop}) is not a range")
    if stop > len(block_ids) * block_size:
        raise InvalidArgumentError(
            f"tokens up to {stop} need {-(-stop // block_size)} blocks of {block_size}; the "
            f"request has {len(block_ids)}")
    positions = torch.arange(start, stop, dtype=torch.int64)
    blocks = torch.as_tensor(list(block_ids), dtype=torch.int64)
    return blocks[positions // block_size] * block_size + positions % block_size


def gather_layer(kv_layer: torch.Tensor, slots: torch.Tensor,
                 layout: PagedLayout) -> torch.Tensor:
    """A copy of the slots' KV, ``[2, len(slots), kv_heads, head_dim]``, on kv_layer's device."""
    block_size = block_size_of(kv_layer)
    slots = slots.to(kv_layer.device)
    blocks, offsets = slots // block_size, slots % block_size
    if layout == "flash":
        return kv_layer[:, blocks, offsets]
    if layout == "mla":
        return kv_layer[blocks, :, offsets].unsqueeze(0)  # [1, tokens, 1, latent]
    if layout == "packed":
        packed = kv_layer[blocks, :, offsets]  # [tokens, heads, 2 * head_dim]
        return torch.stack(packed.chunk(2, dim=-1))
    return kv_layer[blocks, :, offsets].transpose(0, 1)


def scatter_layer(kv_layer: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor,
                  layout: PagedLayout) -> None:
    """Write ``kv`` (``[2, len(slots), kv_heads, head_dim]``) into the slots, in place."""
    if layout == "packed":
        expected: tuple[int, ...] = (2, slots.numel(), kv_layer.shape[1],
                                     kv_layer.shape[3] // 2)
    elif layout == "mla":
        expected = (1, slots.numel(), kv_layer.shape[1], kv_layer.shape[3])
    else:
        expected = (2, slots.numel(), *kv_layer.shape[3:])
    if tuple(kv.shape) != expected:
        raise InvalidArgumentError(f"KV of shape {list(kv.shape)} does not fit {slots.numel()} "
                                   f"slots of this buffer; expected {list(expected)}")
    block_size = block_size_of(kv_layer)
    slots = slots.to(kv_layer.device)
    blocks, offsets = slots // block_size, slots % block_size
    src = kv.to(device=kv_layer.device, dtype=kv_layer.dtype)
    if layout == "flash":
        kv_layer[:, blocks, offsets] = src
    elif layout == "mla":
        kv_layer[blocks, :, offsets] = src[0]
    elif layout == "packed":
        kv_layer[blocks, :, offsets] = torch.cat((src[0], src[1]), dim=-1)
    else:
        kv_layer[blocks, :, offsets] = src.transpose(0, 1)


def plan_load(prompt_tokens: int, pool_tokens: int, computed_tokens: int,
              block_size: int) -> int:
    """Tokens to load from the pool beyond the ``computed_tokens`` the engine already has:
    the pool's cached prefix, less the prompt's last token (the engine must compute it to
    get logits), rounded down to whole engine blocks."""
    usable = min(pool_tokens, prompt_tokens - 1) // block_size * block_size
    return max(0, usable - computed_tokens)


def plan_save(done_tokens: int, pool_tokens: int, chunk_tokens: int) -> int:
    """Tokens of a request to store after a step that computed its first ``done_tokens``:
    its full pool blocks, 0 when the pool already holds them all."""
    full = done_tokens // chunk_tokens * chunk_tokens
    return full if full > pool_tokens else 0
