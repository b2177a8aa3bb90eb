"""PEFT adapter detection in the transformers KV hook, against the real peft package on
a tiny random-init Llama: two LoRA adapters get different keys, an adapter's keys follow
its weights, and the same adapter gives the same keys (and finds its own KV).

Only peft's own ``PeftModel`` (``get_peft_model``) is tested: transformers 5.24's adapter
API (``model.add_adapter``, the ``_hf_peft_config_loaded`` path of ``adapter_identity``)
asks for peft >= 0.22, newer than the registry serves (0.21.2)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from isolane.integrations.transformers_kv import HFKVHook, adapter_identity, generate_with_pool
from isolane.kvpool.pool import KVPool

CHUNK = 32
PROMPT = torch.arange(3, 3 + 100).unsqueeze(0) % 256  # 3 pool blocks + a tail


def require_peft() -> Any:
    """The real peft package, or a loud failure (it is in the test extra)."""
    try:
        import peft
    except ImportError as exc:
        pytest.fail(f"peft is not importable ({exc}); it is in the test extra: "
                    "scripts/setup test", pytrace=False)
    return peft


def base_model(seed: int = 0) -> Any:
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    return transformers.LlamaForCausalLM(config).eval()


def lora(peft: Any) -> Any:
    # init_lora_weights=False: random A and B, so an adapter changes the model's KV
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["k_proj", "v_proj"],
                           init_lora_weights=False)


def two_adapters(seed: int = 0) -> Any:
    """A PeftModel with adapters "a" and "b" (different random weights), "a" active."""
    peft = require_peft()
    torch.manual_seed(seed + 1)
    model = peft.get_peft_model(base_model(seed), lora(peft), adapter_name="a")
    torch.manual_seed(seed + 2)
    model.add_adapter("b", lora(peft))
    model.set_adapter("a")
    return model.eval()


@pytest.fixture
def pool(tmp_path: Path) -> Any:
    with KVPool(tmp_path / "kv", namespace="tiny-llama", chunk_tokens=CHUNK) as p:
        yield p


def test_two_lora_adapters_get_different_keys_and_the_same_adapter_the_same(
        pool: KVPool) -> None:
    model = two_adapters()
    ids = PROMPT[0]
    generate_with_pool(model, pool, PROMPT, max_new_tokens=1)  # fixes the pool's layout
    assert adapter_identity(base_model()) is None  # no adapter: the old keys
    a = HFKVHook(pool, model).context
    assert a is not None and a.adapter is not None and a.adapter.startswith("a:")
    model.set_adapter("b")
    b = HFKVHook(pool, model).context
    assert b is not None and b.adapter is not None and b.adapter.startswith("b:")
    assert pool.block_keys(ids, a) != pool.block_keys(ids, b)
    assert pool.block_keys(ids, a) != pool.block_keys(ids, None)
    model.set_adapter("a")
    assert HFKVHook(pool, model).context == a  # the same adapter: the same keys
    assert HFKVHook(pool, two_adapters()).context == a  # a fresh copy of it too


def test_an_adapters_keys_follow_its_weights(pool: KVPool) -> None:
    model = two_adapters()
    before = adapter_identity(model)
    other_before = (model.set_adapter("b"), adapter_identity(model))[1]
    model.set_adapter("a")
    with torch.no_grad():  # retrain "a" a little: same name, other weights
        layer = model.base_model.model.model.layers[0].self_attn.k_proj
        layer.lora_B["a"].weight.add_(0.01)
    after = adapter_identity(model)
    assert before is not None and after is not None
    assert before.split(":")[0] == after.split(":")[0] == "a" and before != after
    model.set_adapter("b")
    assert adapter_identity(model) == other_before  # "b" untouched: its keys stay


def test_each_adapter_finds_only_its_own_kv_through_generate(pool: KVPool) -> None:
    model = two_adapters()
    expected_a = model.generate(PROMPT, attention_mask=torch.ones_like(PROMPT),
                                max_new_tokens=4, do_sample=False)
    generate_with_pool(model, pool, PROMPT, max_new_tokens=4, do_sample=False)
    a = HFKVHook(pool, model).context
    assert pool.lookup(PROMPT[0], context=a) == 96
    model.set_adapter("b")
    b = HFKVHook(pool, model).context
    assert pool.lookup(PROMPT[0], context=b) == 0  # "b" never sees "a"'s KV
    assert pool.lookup(PROMPT[0]) == 0  # nor does the base model
    model.set_adapter("a")
    got = generate_with_pool(model, pool, PROMPT, max_new_tokens=4, do_sample=False)
    assert torch.equal(got, expected_a)  # restored from "a"'s own blocks
