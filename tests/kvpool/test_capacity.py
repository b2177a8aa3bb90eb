"""The KV capacity tier on a real SeaweedFS: demotion, range reads, promotion, outages."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from isolane.config import config_from_dict
from isolane.kvpool.pool import KVPool
from tests.support.seaweedfs import SeaweedServer

pytestmark = pytest.mark.s3
CT = 16


def _config(local: Path, url: str, options: dict[str, Any]) -> Any:
    return config_from_dict({"device_groups": {
        "kv": {"role": "read", "devices": [str(local)]},
        "cold": {"role": "capacity", "devices": [url], "storage_options": options}}})


def _kv(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, 64, 4, 32, generator=gen)  # 4 blocks of 16 KiB


def _pool(config: Any) -> KVPool:
    return KVPool(config, namespace="cap", chunk_tokens=CT, memory_budget=0,
                  segment_bytes=64 << 10, disk_budget=256 << 10)


def _tokens(i: int) -> list[int]:
    return list(range(1000 * i, 1000 * i + 64))


def test_demoted_blocks_read_back_by_range_and_are_promoted(
        tmp_path: Path, s3_url: tuple[str, dict[str, Any]]) -> None:
    url, options = s3_url
    pool = _pool(_config(tmp_path / "local", url, options))
    for i in range(12):  # 768 KiB on a 256 KiB local budget
        pool.put(_tokens(i), _kv(i))
    pool.logs[0].rotate()
    pool.demote(target_bytes=128 << 10)  # on top of what the budget already demoted
    stats = pool.stats()
    assert stats["capacity"]["blocks"] >= 8 and stats["disk"][0]["bytes"] <= 128 << 10
    assert pool.lookup(_tokens(0)) == 64  # known remotely, no data read
    n, out = pool.get(_tokens(0))  # oldest: fetched from S3 by byte range
    assert n == 64 and out is not None and torch.equal(out, _kv(0))
    assert all(k in pool.logs[0] for k in pool.block_keys(_tokens(0)))  # promoted
    pool.close()
    reopened = _pool(_config(tmp_path / "local", url, options))  # remote index persisted
    for i in range(12):
        n, out = reopened.get(_tokens(i))
        assert n == 64 and out is not None and torch.equal(out, _kv(i))
    assert reopened.delete(_tokens(1)) == 4
    reopened.close()
    again = _pool(_config(tmp_path / "local", url, options))
    assert again.lookup(_tokens(1)) == 0  # a deleted block stays deleted remotely too
    again.close()


def test_unreachable_capacity_keeps_local_tiers_serving(
        tmp_path: Path, fresh_s3_server: SeaweedServer) -> None:
    server = fresh_s3_server
    bucket = server.create_bucket()
    config = _config(tmp_path / "local", f"s3://{bucket}/kv", server.storage_options)
    pool = _pool(config)
    for i in range(6):
        pool.put(_tokens(i), _kv(i))
    pool.logs[0].rotate()
    pool.demote(target_bytes=200 << 10)
    server.kill()
    for i in range(6, 9):  # local puts keep working; background demotion fails quietly
        assert pool.put(_tokens(i), _kv(i)) == 4
    n, out = pool.get(_tokens(8))
    assert n == 64 and out is not None and torch.equal(out, _kv(8))
    remote_only = next(i for i in range(6)
                       if not all(k in pool.logs[0] for k in pool.block_keys(_tokens(i))))
    assert pool.get(_tokens(remote_only))[0] < 64  # a miss, not an exception
    with pytest.raises(OSError):
        pool.demote(target_bytes=0)  # explicit demotion reports the outage
    server.start()
    n, out = pool.get(_tokens(remote_only))
    assert n == 64 and out is not None and torch.equal(out, _kv(remote_only))
    pool.close()


def test_puts_past_the_disk_budget_demote_in_the_background_with_no_memory_tier(
        tmp_path: Path, s3_url: tuple[str, dict[str, Any]]) -> None:
    import time

    url, options = s3_url
    pool = _pool(_config(tmp_path / "local", url, options))  # memory_budget=0
    for i in range(12):  # 768 KiB on a 256 KiB local budget; no demote() call here
        pool.put(_tokens(i), _kv(i))
    deadline = time.monotonic() + 20
    while pool.stats()["capacity"]["blocks"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.stats()["capacity"]["blocks"] > 0  # the put itself asked for demotion
    pool.close()
