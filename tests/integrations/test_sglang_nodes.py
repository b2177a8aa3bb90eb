"""``IsolaneHiCacheStorage`` on three real storage nodes (``isolane serve``), built by
SGLang's own ``StorageBackendFactory`` (``dynamic``): a prompt's pages, stored in several
batches with SGLang's ``prefix_keys``, are placed and found as one chain across the
nodes, by a fresh backend too, bit for bit."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from isolane.wire import frames
from tests.integrations.sglang_host import HostPool
from tests.integrations.test_sglang_hicache import P, make_config, names, page_bytes, slots
from tests.support.node import NodeProcess, running_nodes, write_node_config

TOKEN = "sglang-nodes-token"
PAGES = 32
N = 48  # pages of a prompt: 12 segments of 4


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[NodeProcess]]:
    folder = tmp_path_factory.mktemp("sglang-nodes")
    with running_nodes([NodeProcess(write_node_config(folder / name), token=TOKEN,
                                    startup_timeout_s=120) for name in "abc"]) as started:
        yield started


@pytest.fixture
def backends(nodes: list[NodeProcess], monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Backends built from the storage-node extra config docs/INTEGRATIONS.md shows."""
    monkeypatch.setenv("ISOLANE_TOKEN", TOKEN)
    text = (Path(__file__).resolve().parents[2] / "docs" / "INTEGRATIONS.md").read_text()
    documented = [json.loads(m) for m in re.findall(
        r"--hicache-storage-backend-extra-config '(\{.*?\})'", text, re.S)]
    settings = next(s for s in documented if str(s.get("isolane_pool")).startswith("http"))
    # SGLang takes its own key out before the backend sees the rest
    assert settings.pop("hicache_storage_pass_prefix_keys") is True
    assert settings.pop("interface_v1") == 1
    settings.pop("isolane_pool")  # the documented hosts; here, the test's nodes
    made: list[Any] = []
    urls = ",".join(n.url for n in nodes)

    def create(host: HostPool, namespace: str) -> Any:
        backend = StorageBackendFactory.create_backend(
            "dynamic", make_config(urls, isolane_namespace=namespace, **settings), host)
        made.append(backend)
        backend.register_mem_pool_host(host)
        return backend

    yield create
    for backend in made:
        backend.close()


def after(prefix: list[str]) -> HiCacheStorageExtraInfo:
    return HiCacheStorageExtraInfo(prefix_keys=list(prefix))


def holders(nodes: list[NodeProcess], backend: Any, page_names: list[str]) -> list[int]:
    """How many of these pages each node stores."""
    keys = backend._keys(page_names, backend._format)
    counts = []
    for node in nodes:
        held = 0
        for key in keys:
            status, body = node.request(
                "POST", f"/v1/kv/{quote(backend.namespace, safe='')}/lookup",
                frames.encode_keys([key]))
            held += status == 200 and json.loads(body)["blocks"] == 1
        counts.append(held)
    return counts


def test_a_prompt_stored_in_batches_is_one_chain_across_the_nodes(
        nodes: list[NodeProcess], backends: Any) -> None:
    source = HostPool(layers=2, page_size=P, pages=2 * N)
    source.fill_random(21)
    namespace = f"sglang/nodes-{os.getpid()}"
    writer = backends(source, namespace)
    prompt = names(N, "a")
    # as SGLang's backup does: each radix node's pages after the stored prefix
    for start, stop in ((0, 1), (1, 7), (7, 20), (20, N)):
        assert writer.batch_set_v1(prompt[start:stop],
                                   slots(list(range(start, stop))),
                                   after(prompt[:start])) == [True] * (stop - start)
    spread = holders(nodes, writer, prompt)
    # one copy, the whole chain on its home node (its first page's owner); batches
    # placed as chains of their own would have homes of their own
    assert sum(spread) == N and max(spread) == N, spread
    assert writer.batch_exists(prompt, after([])) == N
    assert writer.batch_exists(prompt[5:], after(prompt[:5])) == N - 5
    writer.close()

    # a fresh backend (an engine restarted) finds it in batches cut elsewhere
    target = HostPool(layers=2, page_size=P, pages=2 * N)
    reader = backends(target, namespace)
    assert reader.batch_exists(prompt[:10], after([])) == 10
    assert reader.batch_get_v1(prompt[:10], slots(list(range(N, N + 10))), after([])) == \
        [True] * 10
    assert reader.batch_get_v1(prompt[10:], slots(list(range(N + 10, 2 * N))),
                               after(prompt[:10])) == [True] * (N - 10)
    assert [page_bytes(target, p) for p in range(N, 2 * N)] == \
        [page_bytes(source, p) for p in range(N)]
    # the generic path: the whole prompt from its first page, no prefix keys
    flat = reader.batch_get(prompt, [source.get_dummy_flat_data_page() for _ in prompt])
    assert all(page is not None and torch.equal(page, source.get_data_page(i * P))
               for i, page in enumerate(flat))
    stats = reader.stats()["isolane"]
    assert stats["hit_pages"] == 2 * N and stats["unreadable_pages"] == 0


def test_prompts_sharing_only_the_first_page_find_their_own_pages(
        nodes: list[NodeProcess], backends: Any) -> None:
    """SGLang stores a shared page once: each later prompt's pages follow its first
    page, wherever that page went (several prompts: not one node by chance)."""
    source = HostPool(layers=2, page_size=P, pages=PAGES)
    source.fill_random(22)
    backend = backends(source, f"sglang/shared-{os.getpid()}")
    first = names(6, "b")
    assert all(backend.batch_set_v1(first, slots(list(range(6))), after([])))
    branches = [first[:1] + names(7, tag)[1:] for tag in "cdef"]
    for i, branch in enumerate(branches):  # host pages 6 + 6i ..: each branch's own
        assert all(backend.batch_set_v1(branch[1:], slots(list(range(6 + 6 * i, 12 + 6 * i))),
                                        after(branch[:1])))
    assert backend.batch_exists(first, after([])) == 6
    target = HostPool(layers=2, page_size=P, pages=PAGES)
    backend.register_mem_pool_host(target)
    for i, branch in enumerate(branches):
        assert backend.batch_exists(branch, after([])) == 7
        assert backend.batch_get_v1(branch, slots(list(range(7))), after([])) == [True] * 7
        assert [page_bytes(target, p) for p in range(7)] == \
            [page_bytes(source, p) for p in [0, *range(6 + 6 * i, 12 + 6 * i)]]


def test_batches_without_prefix_keys_are_chains_of_their_own(
        nodes: list[NodeProcess], backends: Any, caplog: pytest.LogCaptureFixture) -> None:
    """What the documented ``hicache_storage_pass_prefix_keys`` is for: without it a
    batch is placed as a chain of its own, and the backend says so."""
    source = HostPool(layers=2, page_size=P, pages=48)
    source.fill_random(23)
    backend = backends(source, f"sglang/unchained-{os.getpid()}")
    prompt = names(48, "d")
    for start in range(0, 48, 4):
        assert all(backend.batch_set_v1(prompt[start:start + 4],
                                        slots(list(range(start, start + 4)))))
    assert "hicache_storage_pass_prefix_keys" in caplog.text
    assert all(backend.batch_exists(prompt[s:s + 4]) == 4 for s in range(0, 48, 4))
    # as one chain, each later segment is looked for where its batch did not put it:
    # found only if all 11 landed there by chance (1 in 3**11)
    assert backend.batch_exists(prompt, after([])) < 48
