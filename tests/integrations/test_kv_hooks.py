"""The transformers KV hook against a real tiny Llama and a real KVPool."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from isolane.errors import InvalidArgumentError
from isolane.integrations.transformers_kv import HFKVHook, cache_keyword, generate_with_pool
from isolane.kvpool.pool import KVPool

transformers = pytest.importorskip("transformers")
CHUNK = 32


@pytest.fixture(scope="module")
def model() -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture
def pool(tmp_path: Path) -> Any:
    with KVPool(tmp_path / "kv", namespace="tiny-llama", chunk_tokens=CHUNK) as p:
        yield p


def prompts(prefix_len: int = 200) -> tuple[torch.Tensor, torch.Tensor]:
    """Two turns of one chat: a long shared prefix, different last messages."""
    g = torch.Generator().manual_seed(7)
    prefix = torch.randint(0, 256, (1, prefix_len), generator=g)
    first = torch.cat([prefix, torch.randint(0, 256, (1, 10), generator=g)], 1)
    second = torch.cat([prefix, torch.randint(0, 256, (1, 20), generator=g)], 1)
    return first, second


def prefill_lengths(model: Any) -> tuple[list[int], Any]:
    """Records the number of tokens of each forward pass of the decoder."""
    seen: list[int] = []
    handle = model.model.register_forward_pre_hook(
        lambda _m, args, kwargs: seen.append((kwargs.get("input_ids") if kwargs.get(
            "input_ids") is not None else args[0]).shape[1]), with_kwargs=True)
    return seen, handle


def test_second_turn_prefills_only_the_uncached_suffix_with_identical_tokens(
        model: Any, pool: KVPool) -> None:
    first, second = prompts()
    expected = model.generate(second, attention_mask=torch.ones_like(second),
                              max_new_tokens=8, do_sample=False)
    generate_with_pool(model, pool, first, max_new_tokens=4, do_sample=False)
    assert pool.lookup(first[0]) == 192  # six full blocks; the 18-token tail is not cached
    seen, handle = prefill_lengths(model)
    try:
        got = generate_with_pool(model, pool, second, max_new_tokens=8, do_sample=False)
    finally:
        handle.remove()
    assert seen[0] == second.shape[1] - 192  # the prefill skipped the cached prefix
    assert seen[1:] == [1] * 7
    assert torch.equal(got, expected)


def test_restored_cache_gives_the_logits_of_a_full_prefill(model: Any, pool: KVPool) -> None:
    first, second = prompts()
    hook = HFKVHook(pool, model)
    with torch.no_grad():
        out = model(first, use_cache=True)
        assert hook.save(first, out.past_key_values) == 6
        assert hook.save(first, out.past_key_values) == 0  # nothing new the second time
        cache, n = hook.restore(second)
        assert n == 192 and cache is not None and cache.get_seq_length() == 192
        full = model(second).logits[:, -1]
        suffix = model(second[:, n:], **{cache_keyword(model): cache},
                       position_ids=torch.arange(n, second.shape[1]).unsqueeze(0)).logits[:, -1]
    torch.testing.assert_close(suffix, full, rtol=1e-4, atol=1e-4)


def test_a_fully_cached_prompt_still_prefills_its_last_token(model: Any, pool: KVPool) -> None:
    ids = torch.randint(0, 256, (1, 4 * CHUNK), generator=torch.Generator().manual_seed(3))
    generate_with_pool(model, pool, ids, max_new_tokens=1, do_sample=False)
    assert pool.lookup(ids[0]) == 4 * CHUNK
    cache, n = HFKVHook(pool, model).restore(ids)
    assert n == 4 * CHUNK - 1 and cache is not None and cache.get_seq_length() == n
    seen, handle = prefill_lengths(model)
    try:
        generate_with_pool(model, pool, ids, max_new_tokens=1, do_sample=False)
    finally:
        handle.remove()
    assert seen == [1]


def test_restore_misses_and_short_prompts(model: Any, pool: KVPool) -> None:
    hook = HFKVHook(pool, model)
    assert hook.restore(torch.randint(0, 256, (1, 100))) == (None, 0)  # empty pool
    assert hook.restore(torch.tensor([[5]])) == (None, 0)


def test_blocks_survive_reopening_the_pool(model: Any, tmp_path: Path) -> None:
    first, second = prompts()
    with KVPool(tmp_path / "kv", namespace="tiny-llama", chunk_tokens=CHUNK) as p:
        generate_with_pool(model, p, first, max_new_tokens=1, do_sample=False)
    with KVPool(tmp_path / "kv", namespace="tiny-llama", chunk_tokens=CHUNK,
                memory_budget=0) as p:
        cache, n = HFKVHook(p, model).restore(second)
        assert n == 192 and cache is not None


def test_batches_and_sliding_window_models_are_refused(model: Any, pool: KVPool) -> None:
    hook = HFKVHook(pool, model)
    with pytest.raises(InvalidArgumentError, match="one prompt at a time"):
        hook.restore(torch.zeros((2, 40), dtype=torch.long))
    config = transformers.MistralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=16)
    mistral = transformers.MistralForCausalLM(config)
    with pytest.raises(InvalidArgumentError, match="sliding-window"):
        HFKVHook(pool, mistral).new_cache()


def _hybrid_models() -> dict[str, Any]:
    """Tiny random-init models of the installed transformers whose layers are not all
    full attention: linear attention, Mamba (SSM), short conv."""
    small = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 64,
             "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1}
    return {
        "linear-attention": transformers.Qwen3NextConfig(
            **small, head_dim=32, linear_num_value_heads=2, linear_num_key_heads=1,
            linear_key_head_dim=16, linear_value_head_dim=16, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, num_experts=2, num_experts_per_tok=1,
            layer_types=["linear_attention", "full_attention"]),
        "mamba": transformers.BambaConfig(**small, attn_layer_indices=[1], mamba_n_heads=4,
                                          mamba_d_head=32, mamba_n_groups=1,
                                          mamba_d_state=16, mamba_expand=2),
        "conv": transformers.Lfm2Config(**small, layer_types=["conv", "full_attention"]),
    }


@pytest.mark.parametrize("kind", ["linear-attention", "mamba", "conv"])
def test_hybrid_models_are_refused_before_anything_is_generated(pool: KVPool,
                                                                kind: str) -> None:
    torch.manual_seed(0)
    hybrid = transformers.AutoModelForCausalLM.from_config(_hybrid_models()[kind]).eval()
    ids = torch.randint(0, 128, (1, 70))
    with pytest.raises(InvalidArgumentError, match="every layer is full attention") as err:
        generate_with_pool(hybrid, pool, ids, max_new_tokens=2, do_sample=False)
    assert "layer" in str(err.value) and "without the pool" in str(err.value)
    with pytest.raises(InvalidArgumentError, match="every layer is full attention"):
        HFKVHook(pool, hybrid)
    assert pool.lookup(ids[0]) == 0  # nothing stored


def test_adapters_get_keys_of_their_own(model: Any, pool: KVPool) -> None:
    first, second = prompts()
    generate_with_pool(model, pool, first, max_new_tokens=2, do_sample=False,
                       adapter="sql-lora")
    assert HFKVHook(pool, model).restore(second) == (None, 0)  # the base model: a miss
    assert HFKVHook(pool, model, adapter="chat-lora").restore(second) == (None, 0)
    cache, n = HFKVHook(pool, model, adapter="sql-lora").restore(second)
    assert cache is not None and n == 192
