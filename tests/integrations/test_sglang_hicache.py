"""``IsolaneHiCacheStorage`` built by SGLang's own ``StorageBackendFactory`` (``dynamic``)
from SGLang's ``HiCacheStorageConfig``: flat pages, zero-copy pages of each host layout
(MHA and MLA), v2 transfers, tensor parallelism, restarts and faults."""

from __future__ import annotations

import json
import os
import re
import secrets
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorageConfig,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from isolane.errors import ConfigError
from isolane.kvpool.pool import KVPool
from tests.integrations.sglang_host import CopiedPagesHostPool, HostPool
from tests.support.damage import flip_byte
from tests.support.node import NodeProcess, write_node_config

P = 4  # tokens a page


def make_config(pool: Path | str | None, *, model: str = "tiny/llama", tp_rank: int = 0,
                tp_size: int = 1, mla: bool = False, page_first: bool = True,
                **extra: Any) -> HiCacheStorageConfig:
    settings = {"backend_name": "isolane", "module_path": "isolane.integrations.sglang",
                "class_name": "IsolaneHiCacheStorage", "interface_v1": 1, **extra}
    if pool is not None:
        settings["isolane_pool"] = str(pool)
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
        attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=True,
        is_page_first_layout=page_first, model_name=model, extra_config=settings)


@pytest.fixture
def backends() -> Any:
    made: list[Any] = []

    def create(pool: Path | str | None, host: HostPool | None = None, **kwargs: Any) -> Any:
        backend = StorageBackendFactory.create_backend("dynamic", make_config(pool, **kwargs),
                                                       host)
        made.append(backend)
        if host is not None:  # as SGLang's cache controller does right after creating it
            backend.register_mem_pool_host(host)
        return backend

    yield create
    for backend in made:
        backend.close()


def slots(pages: list[int]) -> torch.Tensor:
    """Host indices of these host pages, every slot (as SGLang passes them)."""
    return torch.tensor([p * P + t for p in pages for t in range(P)], dtype=torch.int64)


def page_bytes(host: HostPool, page: int) -> bytes:
    return host.get_data_page(page * P).contiguous().view(torch.uint8).numpy().tobytes()


def names(n: int, tag: str = "p") -> list[str]:
    return [f"{tag}{i:04d}" * 4 for i in range(n)]


def test_flat_pages_before_any_host_pool(backends: Any, tmp_path: Path) -> None:
    backend = backends(tmp_path)
    pages = [torch.randn(2 * 2 * P * 2 * 8).to(torch.bfloat16) for _ in range(5)]
    keys = names(5)
    assert backend.batch_exists(keys) == 0 and backend.get(keys[0]) is None
    assert backend.set(keys[0], pages[0])
    assert backend.batch_set(keys[1:3], pages[1:3])
    assert backend.set(keys[4], pages[4])
    assert backend.exists(keys[2]) and not backend.exists(keys[3])
    assert backend.batch_exists(keys) == 3  # the present prefix
    got = backend.batch_get(keys, [torch.empty_like(p) for p in pages])
    assert got[3] is None
    for i in (0, 1, 2, 4):
        assert torch.equal(got[i].view(torch.int16), pages[i].view(torch.int16))
    fresh = backend.get(keys[4])  # no target: a new tensor of the page's dtype
    assert fresh.dtype == torch.bfloat16 and torch.equal(fresh, pages[4])
    assert backend.batch_set(keys[:2], pages[:2])  # already stored: still a success


@pytest.mark.parametrize(("layout", "mla"), [
    ("layer_first", False), ("page_first", False), ("page_first_direct", False),
    ("layer_first", True), ("page_first", True), ("page_first_direct", True)])
def test_zero_copy_pages_of_each_host_layout(backends: Any, tmp_path: Path, layout: str,
                                             mla: bool) -> None:
    source = HostPool(layers=3, page_size=P, pages=12, layout=layout, mla=mla)
    source.fill_random(1)
    backend = backends(tmp_path, source, mla=mla, page_first=layout == "page_first")
    keys = names(6)
    stored_from = [7, 2, 9, 0, 11, 5]
    assert backend.batch_set_v1(keys, slots(stored_from)) == [True] * 6
    target = HostPool(layers=3, page_size=P, pages=12, layout=layout, mla=mla)
    backend.register_mem_pool_host(target)
    read_into = [1, 3, 4, 6, 8, 10]
    assert backend.batch_exists(keys) == 6
    assert backend.batch_get_v1(keys, slots(read_into)) == [True] * 6
    for src, dst in zip(stored_from, read_into, strict=True):
        assert page_bytes(target, dst) == page_bytes(source, src)
    assert not target.get_data_page(0).any()  # nothing written outside the pages read
    stats = backend.stats()  # get_stats() wraps these in SGLang's StorageMetrics
    assert stats["prefetch_pgs"] == [6] and stats["backup_pgs"] == [6]
    assert stats["isolane"]["hit_pages"] == 6 and stats["isolane"]["unreadable_pages"] == 0
    assert backend.stats()["prefetch_pgs"] == []  # per interval, as SGLang logs them


def test_flat_and_zero_copy_paths_share_pages(backends: Any, tmp_path: Path) -> None:
    host = HostPool(layers=2, page_size=P, pages=8)
    host.fill_random(2)
    backend = backends(tmp_path, host)
    keys = names(3)
    # SGLang's generic path: flat pages from get_data_page, into dummy flat pages
    assert backend.batch_set(keys, [host.get_data_page(p * P) for p in (1, 2, 3)])
    target = HostPool(layers=2, page_size=P, pages=8)
    backend.register_mem_pool_host(target)
    assert backend.batch_get_v1(keys, slots([5, 6, 7])) == [True] * 3
    assert [page_bytes(target, p) for p in (5, 6, 7)] == [page_bytes(host, p) for p in (1, 2, 3)]
    dummies = backend.batch_get(keys, [host.get_dummy_flat_data_page() for _ in keys])
    assert all(torch.equal(d, host.get_data_page(p * P)) for d, p in zip(dummies, (1, 2, 3),
                                                                          strict=True))


def test_restart_keeps_pages_bit_exact(backends: Any, tmp_path: Path) -> None:
    host = HostPool(layers=2, page_size=P, pages=16, layout="layer_first")
    host.fill_random(3)
    first = backends(tmp_path, host, page_first=False)
    keys = names(10)
    assert all(first.batch_set_v1(keys, slots(list(range(10)))))
    first.close()
    target = HostPool(layers=2, page_size=P, pages=16, layout="layer_first")
    second = backends(tmp_path, target, page_first=False)
    assert second.batch_exists(keys) == 10
    assert second.batch_get_v1(keys, slots(list(range(6, 16)))) == [True] * 10
    assert [page_bytes(target, p) for p in range(6, 16)] == [page_bytes(host, p)
                                                             for p in range(10)]
    flat = backends(tmp_path, page_first=False)  # no host pool: layout from the namespace
    second.close()
    assert flat.batch_exists(keys) == 10


def test_damaged_page_reads_as_miss_and_is_counted(backends: Any, tmp_path: Path) -> None:
    host = HostPool(layers=2, page_size=P, pages=8)
    host.fill_random(4)
    backend = backends(tmp_path, host, isolane_memory_budget=0)  # every read from disk
    keys = names(4)
    assert all(backend.batch_set_v1(keys, slots([0, 1, 2, 3])))
    damaged = page_bytes(host, 2)
    hits = [(f, f.read_bytes().find(damaged)) for f in tmp_path.rglob("seg-*") if f.is_file()]
    path, offset = next((f, at) for f, at in hits if at >= 0)
    flip_byte(path, offset + 17)
    target = HostPool(layers=2, page_size=P, pages=8)
    backend.register_mem_pool_host(target)
    assert backend.batch_get_v1(keys, slots([4, 5, 6, 7])) == [True, True, False, True]
    assert [page_bytes(target, p) for p in (4, 5, 7)] == [page_bytes(host, p) for p in (0, 1, 3)]
    assert backend.stats()["isolane"]["unreadable_pages"] == 1
    assert backend.batch_exists(keys) == 2  # dropped: a miss from now on
    assert backend.get(keys[2], torch.empty(len(damaged) // 2,
                                            dtype=torch.bfloat16)) is None


def test_pages_of_another_model_layout_or_rank_miss(backends: Any, tmp_path: Path) -> None:
    host = HostPool(layers=2, page_size=P, pages=8)
    host.fill_random(5)
    keys = names(4)
    writer = backends(tmp_path, host, isolane_namespace="shared", tp_size=2, tp_rank=0)
    assert all(writer.batch_set_v1(keys, slots([0, 1, 2, 3])))
    assert writer.batch_exists(keys) == 4
    writer.close()
    other_model = backends(tmp_path, HostPool(layers=2, page_size=P, pages=8),
                           isolane_namespace="shared@tp0of2", model="other/model")
    assert other_model.batch_exists(keys) == 0
    other_model.close()
    layer_first = backends(tmp_path, HostPool(layers=2, page_size=P, pages=8,
                                              layout="layer_first"),
                           isolane_namespace="shared", tp_size=2, tp_rank=0)
    assert layer_first.batch_exists(keys) == 0  # same bytes count, another byte order


def test_mla_pages_are_stored_once_for_every_rank(backends: Any, tmp_path: Path) -> None:
    hosts = [HostPool(layers=2, page_size=P, pages=8, mla=True) for _ in range(2)]
    hosts[0].fill_random(6)
    hosts[1].kv_buffer.copy_(hosts[0].kv_buffer)  # the latent is the same on every rank
    rank0 = backends(tmp_path, hosts[0], mla=True, tp_size=2, tp_rank=0)
    rank1 = backends(tmp_path, hosts[1], mla=True, tp_size=2, tp_rank=1)
    keys = names(4)
    assert rank1.batch_set_v1(keys, slots([0, 1, 2, 3])) == [True] * 4  # not the writer
    assert rank1.batch_exists(keys) == 0
    assert all(rank0.batch_set_v1(keys, slots([0, 1, 2, 3])))
    assert rank1.batch_exists(keys) == 4  # the writer's copy, same keys on every rank
    target = HostPool(layers=2, page_size=P, pages=8, mla=True)
    rank1.register_mem_pool_host(target)
    assert rank1.batch_get_v1(keys, slots([4, 5, 6, 7])) == [True] * 4
    assert [page_bytes(target, p) for p in (4, 5, 6, 7)] == [page_bytes(hosts[0], p)
                                                             for p in range(4)]
    assert rank0.pool is rank1.pool and rank0.pool.stats()["disk"][0]["blocks"] == 4


def test_embedded_namespace_open_elsewhere_is_a_clear_error(backends: Any,
                                                            tmp_path: Path) -> None:
    holder = KVPool(tmp_path, namespace="sglang/tiny/llama", chunk_tokens=1, token_dim=0)
    try:
        with pytest.raises(ConfigError, match="storage node URLs"):
            backends(tmp_path)
    finally:
        holder.close()


def test_missing_or_read_only_pool_folder_fails_at_creation(backends: Any,
                                                            tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        backends(tmp_path / "not-mounted")
    read_only = tmp_path / "ro"
    read_only.mkdir()
    os.chmod(read_only, 0o555)
    try:
        with pytest.raises(ConfigError, match="read-only"):
            backends(read_only)
    finally:
        os.chmod(read_only, 0o755)


def test_page_size_or_dtype_other_than_the_namespace_is_refused(backends: Any,
                                                                tmp_path: Path) -> None:
    first = backends(tmp_path, HostPool(layers=2, page_size=P, pages=8))
    first.close()
    with pytest.raises(ConfigError, match="page size"):
        backends(tmp_path, HostPool(layers=2, page_size=2 * P, pages=8))
    with pytest.raises(ConfigError, match="float16"):
        backends(tmp_path, HostPool(layers=2, page_size=P, pages=8, dtype=torch.float16))
    flat = backends(tmp_path)
    with pytest.raises(ConfigError, match="page size"):
        flat.set("k", torch.zeros(7, dtype=torch.bfloat16))


def test_v2_transfers_with_an_extra_pool(backends: Any, tmp_path: Path) -> None:
    kv = HostPool(layers=2, page_size=P, pages=8)
    swa = HostPool(layers=1, page_size=P, pages=8, heads=1, head_dim=4, dtype=torch.float32)
    kv.fill_random(7)
    swa.fill_random(8)
    backend = backends(tmp_path, kv)
    backend.register_mem_host_pool_v2(kv, PoolName.KV)
    backend.register_mem_host_pool_v2(swa, PoolName.SWA)
    keys = names(4)
    stored = backend.batch_set_v2([
        PoolTransfer(PoolName.KV, host_indices=slots([0, 1, 2, 3]), keys=keys),
        PoolTransfer(PoolName.SWA, host_indices=slots([2, 3]), keys=keys[2:])])
    assert stored == {"kv": [True] * 4, "swa": [True, True]}
    trailing = [PoolTransfer(PoolName.SWA, keys=keys[2:],
                             hit_policy=PoolHitPolicy.TRAILING_PAGES)]
    assert backend.batch_exists_v2(keys, trailing).kv_hit_pages == 4
    every = [PoolTransfer(PoolName.SWA, hit_policy=PoolHitPolicy.ALL_PAGES)]
    assert backend.batch_exists_v2(keys, every).kv_hit_pages == 0
    kv2 = HostPool(layers=2, page_size=P, pages=8)
    swa2 = HostPool(layers=1, page_size=P, pages=8, heads=1, head_dim=4, dtype=torch.float32)
    backend.register_mem_host_pool_v2(kv2, PoolName.KV)
    backend.register_mem_host_pool_v2(swa2, PoolName.SWA)
    got = backend.batch_get_v2([
        PoolTransfer(PoolName.KV, host_indices=slots([4, 5, 6, 7]), keys=keys),
        PoolTransfer(PoolName.SWA, host_indices=slots([6, 7]), keys=keys[2:])])
    assert got == {"kv": [True] * 4, "swa": [True, True]}
    assert [page_bytes(kv2, p) for p in (4, 5, 6, 7)] == [page_bytes(kv, p) for p in range(4)]
    assert [page_bytes(swa2, p) for p in (6, 7)] == [page_bytes(swa, p) for p in (2, 3)]


def test_the_documented_flags_build_the_backend(tmp_path: Path) -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "INTEGRATIONS.md").read_text()
    match = re.search(r"python -m sglang\.launch_server [^`]*?"
                      r"--hicache-storage-backend dynamic \\\s*"
                      r"--hicache-storage-backend-extra-config '(\{.*?\})'", text, re.S)
    assert match, "docs/INTEGRATIONS.md has no sglang.launch_server ... dynamic line"
    settings = json.loads(match.group(1))
    assert settings["interface_v1"] == 1  # SGLang calls the zero-copy paths only then
    settings["isolane_pool"] = str(tmp_path)  # the documented /mnt/nvme2/kv, here
    config = make_config(None)
    config.extra_config = settings
    backend = StorageBackendFactory.create_backend("dynamic", config, None)
    try:
        assert type(backend).__name__ == "IsolaneHiCacheStorage"
        assert backend.set("k" * 64, torch.ones(8, dtype=torch.bfloat16))
        assert backend.exists("k" * 64)
    finally:
        backend.close()


def test_mla_ranks_in_separate_processes_share_one_copy_on_a_node(tmp_path: Path) -> None:
    """At TP > 1 the ranks are processes: with storage node URLs each opens its own
    client, rank 1 reads the pages only rank 0 wrote."""
    config_path = write_node_config(tmp_path / "node")
    with NodeProcess(config_path, token="sglang-" + secrets.token_hex(8)) as node:
        os.environ["ISOLANE_TOKEN"] = node.token or ""
        made = []
        try:
            host = HostPool(layers=2, page_size=P, pages=8, mla=True)
            host.fill_random(9)
            keys = names(4)
            for rank in (0, 1):
                backend = StorageBackendFactory.create_backend(
                    "dynamic", make_config(node.url, mla=True, tp_size=2, tp_rank=rank), None)
                made.append(backend)
                backend.register_mem_pool_host(host if rank == 0 else
                                               HostPool(layers=2, page_size=P, pages=8,
                                                        mla=True))
            assert made[1].batch_set_v1(keys, slots([0, 1, 2, 3])) == [True] * 4  # no-op
            assert made[1].batch_exists(keys) == 0
            assert all(made[0].batch_set_v1(keys, slots([0, 1, 2, 3])))
            assert made[1].batch_exists(keys) == 4
            assert made[1].batch_get_v1(keys, slots([4, 5, 6, 7])) == [True] * 4
            target = made[1].mem_pool_host
            assert [page_bytes(target, p) for p in (4, 5, 6, 7)] == \
                [page_bytes(host, p) for p in range(4)]
        finally:
            for backend in made:
                backend.close()
            os.environ.pop("ISOLANE_TOKEN", None)


def test_tp_ranks_keep_their_own_pages_and_share_the_hosts_lanes(backends: Any,
                                                                  tmp_path: Path) -> None:
    hosts = [HostPool(layers=2, page_size=P, pages=8) for _ in range(2)]
    for rank, host in enumerate(hosts):
        host.fill_random(10 + rank)  # each rank holds its own heads
    ranks = [backends(tmp_path, hosts[r], tp_size=2, tp_rank=r) for r in range(2)]
    assert [r.namespace for r in ranks] == ["sglang/tiny/llama@tp0of2",
                                            "sglang/tiny/llama@tp1of2"]
    assert ranks[0].pool.scheduler is ranks[1].pool.scheduler  # one set of lanes
    keys = names(3)
    for r in ranks:
        assert all(r.batch_set_v1(keys, slots([0, 1, 2])))
    for rank, r in enumerate(ranks):
        target = HostPool(layers=2, page_size=P, pages=8)
        r.register_mem_pool_host(target)
        assert r.batch_get_v1(keys, slots([5, 6, 7])) == [True] * 3
        assert [page_bytes(target, p) for p in (5, 6, 7)] == \
            [page_bytes(hosts[rank], p) for p in (0, 1, 2)]


def test_v2_pool_whose_pages_are_copies_goes_through_its_own_methods(backends: Any,
                                                                     tmp_path: Path) -> None:
    kv = HostPool(layers=2, page_size=P, pages=8, mla=True)
    mamba = CopiedPagesHostPool(layers=1, page_size=P, pages=8, heads=1, head_dim=6,
                                dtype=torch.float32)
    kv.fill_random(11)
    mamba.fill_random(12)
    backend = backends(tmp_path, kv, mla=True)
    backend.register_mem_host_pool_v2(kv, PoolName.KV)
    backend.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    keys = names(3)
    assert backend.batch_set_v2([
        PoolTransfer(PoolName.KV, host_indices=slots([0, 1, 2]), keys=keys),
        PoolTransfer(PoolName.MAMBA, host_indices=slots([2]), keys=keys[2:])]) == \
        {"kv": [True] * 3, "mamba": [True]}
    target = CopiedPagesHostPool(layers=1, page_size=P, pages=8, heads=1, head_dim=6,
                                 dtype=torch.float32)
    backend.register_mem_host_pool_v2(target, PoolName.MAMBA)
    assert backend.batch_get_v2([PoolTransfer(PoolName.MAMBA, host_indices=slots([5]),
                                              keys=keys[2:])]) == {"mamba": [True]}
    assert page_bytes(target, 5) == page_bytes(mamba, 2)
    assert backend.batch_exists_v2(keys, [PoolTransfer(
        PoolName.MAMBA, keys=keys[2:], hit_policy=PoolHitPolicy.TRAILING_PAGES)]
        ).kv_hit_pages == 3


def test_stats_count_hits_misses_damaged_pages_and_bytes(backends: Any, tmp_path: Path) -> None:
    """What get_stats() hands SGLang (``stats()``, wrapped in its StorageMetrics)."""
    host = HostPool(layers=2, page_size=P, pages=16)
    host.fill_random(13)
    backend = backends(tmp_path, host)
    size = len(page_bytes(host, 0))
    stored = names(6)
    assert all(backend.batch_set_v1(stored, slots(list(range(6)))))
    assert all(backend.batch_set_v1(stored[:3], slots([0, 1, 2])))  # stored before: 0 new
    damaged = page_bytes(host, 4)
    path, offset = next((f, f.read_bytes().find(damaged)) for f in tmp_path.rglob("seg-*")
                        if f.is_file() and f.read_bytes().find(damaged) >= 0)
    flip_byte(path, offset + 5)
    asked = [*stored[:2], "never-stored" * 4, *stored[3:]]  # a miss, then a damaged page
    assert backend.batch_get_v1(asked, slots(list(range(8, 14)))) == \
        [True, True, False, True, False, True]
    flat = backend.batch_get([stored[0], "also-never" * 4])
    assert flat[0] is not None and flat[1] is None
    counts = backend.stats()
    assert counts["backup_pgs"] == [6, 3] and counts["prefetch_pgs"] == [4]
    assert len(counts["prefetch_bandwidth"]) == 1 and counts["prefetch_bandwidth"][0] > 0
    assert counts["isolane"] == {
        "get_pages": 8, "hit_pages": 5, "miss_pages": 3, "unreadable_pages": 1,
        "read_bytes": 5 * size, "set_pages": 6, "written_bytes": 6 * size}
    again = backend.stats()
    assert again["backup_pgs"] == [] and again["prefetch_pgs"] == []  # per interval
    assert again["isolane"]["unreadable_pages"] == 1  # since start
