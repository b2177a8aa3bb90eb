"""Hugging Face transformers causal LMs: restore a prompt's cached prefix from a KV pool.

``HFKVHook(pool, model)``:

- ``restore(input_ids) -> (cache, n_cached)``: reads the longest cached prefix of the
  prompt from the pool into a ``DynamicCache`` (``None, 0`` on a miss), so that
  ``model.generate(input_ids, past_key_values=cache)`` prefills only the tokens after
  ``n_cached``. At least the last prompt token is always left to prefill (the model needs
  its logits), and only whole pool blocks (``chunk_tokens``) are ever cached.
- ``save(input_ids, cache) -> int``: after a prefill (or a whole ``generate``), stores the
  KV of the prompt's full blocks that the pool lacks; returns how many new blocks.
- ``generate_with_pool(model, pool, input_ids, **kw)``: restore, generate, save.

Pool layout: ``[layers, 2, tokens, kv_heads, head_dim]`` (the KVPool default,
``token_dim=2``) in the model's dtype; a ``DynamicCache`` layer holds
``[batch, kv_heads, tokens, head_dim]``. MLA models (DeepSeek-V2/V3, Kimi, ...: a config
with ``kv_lora_rank``) cache the compressed latent instead, keys ``[batch, 1, tokens,
kv_lora_rank]`` and values ``[batch, 1, tokens, qk_rope_head_dim]`` a layer; the pool
holds one latent a token, ``[layers, 1, tokens, 1, kv_lora_rank + qk_rope_head_dim]``
(the layout the vLLM connector stores MLA in). One prompt at a time (batch 1). Only models
whose every layer is full attention are supported; anything else (sliding-window or
chunked layers, which keep only a window; linear attention, SSM/Mamba or conv layers,
which keep a state instead of keys and values; layers without a cache) is refused when
the hook is made, before anything is generated.

A model with an active PEFT adapter gets keys of its own: the adapter's names and a
digest of its weights join every block's key (``KVContext.adapter``), so two adapters
on one base model never share KV; ``adapter=`` names it explicitly instead. The pool is
any ``isolane.kvpool.api.KVPoolAPI``: the embedded ``KVPool`` or the remote client.
Thread-safe if the pool is; a hook holds no per-request state. Needs
``transformers>=4.56`` (the ``DynamicCache`` with ``layers``).
"""

from __future__ import annotations

import hashlib
import inspect
from typing import TYPE_CHECKING, Any

import torch

from isolane.errors import InvalidArgumentError
from isolane.kvpool.api import KVPoolAPI
from isolane.kvpool.keys import KVContext

if TYPE_CHECKING:
    from transformers import DynamicCache


_SUPPORTED_LAYER_TYPES = frozenset({"full_attention"})


def check_full_attention(config: Any, cache: Any) -> None:
    """Raise ``InvalidArgumentError`` unless every layer of the model keeps the keys and
    values of every token (full attention)."""
    layer_types = getattr(config, "layer_types", None) or ()
    odd = sorted({str(t) for t in layer_types} - _SUPPORTED_LAYER_TYPES)
    bad: list[str] = []
    for i, layer in enumerate(cache.layers):
        kind = type(layer).__name__
        if (getattr(layer, "is_sliding", False) or "Linear" in kind or "Dummy" in kind
                or not hasattr(layer, "keys") or not hasattr(layer, "values")):
            bad.append(f"{i} ({kind})")
    if odd or bad:
        raise InvalidArgumentError(
            "the KV hook supports models whose every layer is full attention; this one has "
            + (f"layer types {', '.join(odd)}" if odd else "")
            + ("; " if odd and bad else "")
            + (f"layers {', '.join(bad[:8])}{' ...' if len(bad) > 8 else ''}" if bad else "")
            + " (sliding-window or chunked attention keeps only a window; linear attention, "
            "SSM/Mamba and conv layers keep a state, not per-token keys and values): "
            "generate without the pool for this model")


def adapter_identity(model: Any) -> str | None:
    """The active PEFT adapters of ``model`` as ``name[,name...]:<digest of their
    weights>``, or None when none is active."""
    names: list[str] = []
    active = getattr(model, "active_adapters", None)
    if getattr(model, "_hf_peft_config_loaded", False) and callable(active):
        names = [str(n) for n in active()]
    elif isinstance(getattr(model, "active_adapter", None), str) and hasattr(model,
                                                                             "peft_config"):
        names = [model.active_adapter]
    if not names:
        return None
    digest = hashlib.blake2b(digest_size=16)
    for pname, param in sorted(model.named_parameters()):
        if any(f".{n}." in f".{pname}." for n in names):
            digest.update(pname.encode("utf-8"))
            digest.update(param.detach().to("cpu").contiguous().view(torch.uint8)
                          .numpy().tobytes())
    return f"{','.join(names)}:{digest.hexdigest()}"


def _prompt_row(input_ids: torch.Tensor) -> torch.Tensor:
    if input_ids.dim() == 2:
        if input_ids.shape[0] != 1:
            raise InvalidArgumentError(
                f"input_ids has a batch of {input_ids.shape[0]} prompts; the KV hook restores "
                "one prompt at a time: call it per prompt")
        input_ids = input_ids[0]
    if input_ids.dim() != 1:
        raise InvalidArgumentError(f"input_ids must be [tokens] or [1, tokens], got shape "
                                   f"{list(input_ids.shape)}")
    return input_ids.detach().to("cpu", torch.int64)


class HFKVHook:
    """Restores and saves the KV cache of one model's prompts; see the module docstring."""

    def __init__(self, pool: KVPoolAPI, model: Any, *, adapter: str | None = None) -> None:
        self.pool = pool
        self.model = model
        config = model.config
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") \
            else config
        self.config = config
        self.text_config = text
        self.new_cache()  # refuses unsupported models now, before any generation
        name = adapter if adapter is not None else adapter_identity(model)
        self.context: KVContext | None = KVContext(adapter=name) if name else None
        self.layers = int(text.num_hidden_layers)
        # MLA: one latent a token, split in the cache as keys (the compressed KV) and
        # values (the rotary part); None for attention that caches per-head K and V
        rank = getattr(text, "kv_lora_rank", None)
        self.mla_split: tuple[int, int] | None = (
            (int(rank), int(text.qk_rope_head_dim)) if rank else None)
        self.kv_heads = int(getattr(text, "num_key_value_heads", None)
                            or text.num_attention_heads)
        self.head_dim = int(getattr(text, "head_dim", None)
                            or text.hidden_size // text.num_attention_heads)
        self.dtype: torch.dtype = next(model.parameters()).dtype
        self.device: torch.device = next(model.parameters()).device

    def _pool_shape(self, tokens: int) -> tuple[int, ...]:
        if self.mla_split is not None:
            return (self.layers, 1, tokens, 1, sum(self.mla_split))
        return (self.layers, 2, tokens, self.kv_heads, self.head_dim)

    def _to_cache(self, kv: torch.Tensor, layer: int, n: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's first ``n`` pool tokens as the cache's (keys, values), views."""
        if self.mla_split is not None:
            latent = kv[layer, 0, :n, 0].unsqueeze(0).unsqueeze(0)  # [1, 1, n, latent]
            rank = self.mla_split[0]
            return latent[..., :rank], latent[..., rank:]
        # [tokens, heads, dim] -> [1, heads, tokens, dim]
        return (kv[layer, 0, :n].transpose(0, 1).unsqueeze(0),
                kv[layer, 1, :n].transpose(0, 1).unsqueeze(0))

    def new_cache(self) -> DynamicCache:
        """An empty ``DynamicCache`` laid out for this model."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.config)
        check_full_attention(self.text_config, cache)
        return cache

    def restore(self, input_ids: torch.Tensor) -> tuple[DynamicCache | None, int]:
        """The cached prefix as a ``DynamicCache`` and its length; ``(None, 0)`` on a miss."""
        ids = _prompt_row(input_ids)
        if ids.numel() < 2 or self.pool.lookup(ids, context=self.context) == 0:
            return None, 0
        # Room for the whole prompt: blocks put meanwhile by another request may extend the
        # cached prefix between lookup and get_into. Untouched pages are never faulted in.
        out = torch.empty(self._pool_shape(ids.numel()), dtype=self.dtype)
        n = min(self.pool.get_into(ids, out, context=self.context), ids.numel() - 1)
        if n <= 0:
            return None, 0
        cache = self.new_cache()
        for layer in range(self.layers):
            keys, values = self._to_cache(out, layer, n)  # views; the cache copies them
            cache.update(keys.to(self.device), values.to(self.device), layer)
        return cache, n

    def save(self, input_ids: torch.Tensor, cache: Any) -> int:
        """Store the KV of the prompt's full blocks the pool lacks; returns new blocks.
        ``cache`` may hold more tokens than the prompt (after ``generate``): only the
        prompt's are stored, since decoded tokens' KV may differ in the last bits from
        what a prefill of the same tokens computes."""
        ids = _prompt_row(input_ids)
        layers = cache.layers
        if len(layers) != self.layers:
            raise InvalidArgumentError(f"the cache has {len(layers)} layers, the model "
                                       f"{self.layers}; pass this model's cache")
        ct = self.pool.chunk_tokens
        n = min(ids.numel(), cache.get_seq_length()) // ct * ct
        if n == 0 or self.pool.lookup(ids[:n], context=self.context) >= n:
            return 0  # nothing new: skip the copy out of the cache
        kv = torch.empty(self._pool_shape(n), dtype=self.dtype)
        for i, layer in enumerate(layers):
            if layer.keys is None or layer.keys.shape[-2] < n:
                raise InvalidArgumentError(
                    f"cache layer {i} holds {0 if layer.keys is None else layer.keys.shape[-2]} "
                    f"tokens, fewer than the {n} to store; save after the prefill")
            keys, values = self._to_cache(kv, i, n)
            if keys.shape[-1] != layer.keys.shape[-1] or values.shape[-1] != layer.values.shape[-1]:
                raise InvalidArgumentError(
                    f"cache layer {i} holds keys of {layer.keys.shape[-1]} and values of "
                    f"{layer.values.shape[-1]} a head; this model's config says "
                    f"{keys.shape[-1]} and {values.shape[-1]}: pass this model's cache")
            keys.copy_(layer.keys[:1, :, :n])
            values.copy_(layer.values[:1, :, :n])
        return self.pool.put(ids[:n], kv, context=self.context)


def cache_keyword(model: Any) -> str:
    """``generate``'s name for the cache argument: ``cache`` in newer transformers 5.x,
    ``past_key_values`` before (newer versions still take it, with a warning)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters \
        else "past_key_values"


def generate_with_pool(model: Any, pool: KVPoolAPI, input_ids: torch.Tensor, *,
                       save: bool = True, adapter: str | None = None,
                       **generate_kwargs: Any) -> Any:
    """``model.generate`` that prefills only the prompt's uncached suffix, then stores the
    prompt's new blocks (``save=False``: read only). Returns what ``generate`` returns.
    ``adapter``: see ``HFKVHook``."""
    hook = HFKVHook(pool, model, adapter=adapter)
    cache, _n = hook.restore(input_ids)
    if cache is None:
        cache = hook.new_cache()
    ids = input_ids if input_ids.dim() == 2 else input_ids.unsqueeze(0)
    generate_kwargs.setdefault("attention_mask", torch.ones_like(ids))
    out = model.generate(ids, **{cache_keyword(model): cache}, **generate_kwargs)
    if save:
        hook.save(ids, cache)
    return out
