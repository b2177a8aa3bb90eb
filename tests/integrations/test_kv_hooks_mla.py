"""The transformers KV hook on MLA models (tiny DeepSeek-V3 and V2 configs built here,
random weights): the cache holds the compressed latent, the pool one latent a token."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from isolane.integrations.transformers_kv import HFKVHook, cache_keyword, generate_with_pool
from isolane.kvpool.pool import KVPool

transformers = pytest.importorskip("transformers")
CHUNK = 16
RANK, ROPE = 16, 8  # kv_lora_rank, qk_rope_head_dim


def deepseek(version: int) -> Any:
    torch.manual_seed(0)
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96,
                  moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, kv_lora_rank=RANK, q_lora_rank=None,
                  qk_rope_head_dim=ROPE, qk_nope_head_dim=8, v_head_dim=12,
                  n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                  first_k_dense_replace=1, max_position_embeddings=512)
    if version == 3:
        config = transformers.DeepseekV3Config(n_group=1, topk_group=1, **common)
        return transformers.DeepseekV3ForCausalLM(config).eval()
    config = transformers.DeepseekV2Config(**common)
    return transformers.DeepseekV2ForCausalLM(config).eval()


@pytest.fixture(scope="module", params=[3, 2], ids=["deepseek-v3", "deepseek-v2"])
def model(request: pytest.FixtureRequest) -> Any:
    return deepseek(request.param)


def test_mla_prefix_restores_to_the_logits_of_a_full_prefill(model: Any, tmp_path: Path
                                                             ) -> None:
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(0, 128, (1, 4 * CHUNK), generator=g)
    first = torch.cat([prefix, torch.randint(0, 128, (1, 5), generator=g)], 1)
    second = torch.cat([prefix, torch.randint(0, 128, (1, 7), generator=g)], 1)
    with KVPool(tmp_path / "kv", namespace="tiny-mla", chunk_tokens=CHUNK) as pool:
        hook = HFKVHook(pool, model)
        assert hook.mla_split == (RANK, ROPE)
        with torch.no_grad():
            out = model(first, use_cache=True)
            assert hook.save(first, out.past_key_values) == 4
        assert pool.layout == ("float32", (2, 1, 1, RANK + ROPE))  # one latent a token
    with KVPool(tmp_path / "kv", namespace="tiny-mla", chunk_tokens=CHUNK,
                memory_budget=0) as pool:  # reopened: from disk
        hook = HFKVHook(pool, model)
        with torch.no_grad():
            cache, n = hook.restore(second)
            assert n == 4 * CHUNK and cache is not None
            stored = out.past_key_values.layers[1]
            assert torch.equal(cache.layers[1].keys, stored.keys[:, :, :n])  # bit for bit
            assert torch.equal(cache.layers[1].values, stored.values[:, :, :n])
            full = model(second).logits[:, -1]
            suffix = model(second[:, n:], **{cache_keyword(model): cache},
                           position_ids=torch.arange(n, second.shape[1]).unsqueeze(0)
                           ).logits[:, -1]
        torch.testing.assert_close(suffix, full, rtol=1e-4, atol=1e-4)
        expected = model.generate(second, attention_mask=torch.ones_like(second),
                                  max_new_tokens=4, do_sample=False)
        got = generate_with_pool(model, pool, second, max_new_tokens=4, do_sample=False)
        assert torch.equal(got, expected)
