"""The integrations against a real storage node (``isolane serve`` in a child process):
the remote clients have the methods the callbacks and hooks use."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from isolane import open_store
from isolane.client.kv_pool import RemoteKVPool
from isolane.errors import InvalidArgumentError
from isolane.integrations.callbacks import PeriodicSnapshot
from isolane.integrations.transformers_kv import HFKVHook, generate_with_pool
from tests.integrations import training as T
from tests.support.node import NodeProcess, write_node_config

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    with NodeProcess(write_node_config(tmp_path_factory.mktemp("node")),
                     token="integrations") as proc:
        yield proc


@pytest.mark.parametrize("async_", [True, False], ids=["async", "sync"])
def test_periodic_snapshot_on_a_node_resumes(node: NodeProcess, monkeypatch: Any,
                                             async_: bool) -> None:
    monkeypatch.setenv("ISOLANE_TOKEN", "integrations")
    store = open_store(node.url)
    prefix = f"remote-{'a' if async_ else 's'}-"
    T.seed_all()
    model = T.tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with PeriodicSnapshot(store, 2, keep_last=1, async_=async_, prefix=prefix) as ckpt:
        for step in range(1, 5):
            ids = torch.randint(0, T.VOCAB, (2, T.SEQ))
            model(ids, labels=ids).loss.backward()
            opt.step()  # async: changes the weights while the upload of step 2 runs
            opt.zero_grad()
            ckpt.step(step, model, opt)
    assert [i.name for i in store.list() if i.name.startswith(prefix)] == [f"{prefix}4"]
    fresh = T.tiny_llama(seed=1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    assert PeriodicSnapshot(store, 2, async_=False, prefix=prefix).resume(
        fresh, fresh_opt) == 4
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_async_callbacks_refuse_a_store_without_save_async() -> None:
    class SyncOnly:
        def save(self, *args: Any, **kwargs: Any) -> None: ...
        def load(self, name: str) -> Any: ...
        def list(self) -> list[Any]:
            return []
        def delete(self, name: str) -> None: ...

    with pytest.raises(InvalidArgumentError, match="async_=False"):
        PeriodicSnapshot(SyncOnly(), 2)


def test_kv_hook_on_a_node(node: NodeProcess, tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model = transformers.LlamaForCausalLM(config).eval()
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, 256, (1, 100), generator=g)
    first = torch.cat([prefix, torch.randint(0, 256, (1, 5), generator=g)], 1)
    second = torch.cat([prefix, torch.randint(0, 256, (1, 9), generator=g)], 1)
    expected = model.generate(second, attention_mask=torch.ones_like(second),
                              max_new_tokens=6, do_sample=False)
    pool = RemoteKVPool([node.url], namespace="hook-llama", chunk_tokens=16,
                        token="integrations")
    try:
        generate_with_pool(model, pool, first, max_new_tokens=2, do_sample=False)
        cache, n = HFKVHook(pool, model).restore(second)
        assert n == 96 and cache is not None
        got = generate_with_pool(model, pool, second, max_new_tokens=6, do_sample=False)
    finally:
        pool.close()
    assert torch.equal(got, expected)
