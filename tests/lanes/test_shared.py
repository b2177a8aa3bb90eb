"""One scheduler per host: a SnapshotStore and a KVPool on one config share it, and its
governor sees the read lane's latency from KV gets."""

from __future__ import annotations

from pathlib import Path

import torch

from isolane import SnapshotStore
from isolane.config import config_from_dict
from isolane.kvpool.pool import KVPool
from isolane.lanes import LaneScheduler


def test_store_and_pool_on_one_config_share_the_scheduler_and_its_governor(
        tmp_path: Path) -> None:
    config = config_from_dict({"device_groups": {
        "ckpt": {"role": "write", "devices": [str(tmp_path / "ckpt")]},
        "kv": {"role": "read", "devices": [str(tmp_path / "kv")]},
    }})
    store = SnapshotStore(config)
    pool = KVPool(config, namespace="llama", chunk_tokens=16, memory_budget=0)
    try:
        assert store.scheduler is pool.scheduler
        scheduler = store.scheduler
        assert scheduler.governor is not None
        store.save({"w": torch.arange(4096, dtype=torch.float32)}, "step-1")
        tokens = list(range(64))
        pool.put(tokens, torch.randn(2, 2, 64, 4, 8))
        before = scheduler.stats()["read"]["latency_ms"]["count"]
        n, kv = pool.get(tokens)  # no memory tier: the blocks come off disk
        assert n == 64 and kv is not None
        stats = scheduler.stats()
        assert stats["read"]["latency_ms"]["count"] > before
        assert stats["write"]["ops"] > 0  # the save went through the same scheduler
        scheduler.governor.step()
        assert scheduler.stats()["governor"]["read_p99_ms"] is not None
    finally:
        pool.close()
        store.close()


def test_an_explicit_scheduler_is_used_instead_of_the_shared_one(tmp_path: Path) -> None:
    config = config_from_dict({"device_groups": {
        "ckpt": {"role": "write", "devices": [str(tmp_path / "ckpt")]},
        "kv": {"role": "read", "devices": [str(tmp_path / "kv")]},
    }})
    baseline = LaneScheduler(config, isolation=False)
    store = SnapshotStore(config, scheduler=baseline)
    pool = KVPool(config, namespace="llama", chunk_tokens=16, scheduler=baseline)
    try:
        assert store.scheduler is baseline and pool.scheduler is baseline
        store.save({"w": torch.ones(1024)}, "step-1")
        assert store.load("step-1")["w"].sum().item() == 1024
        assert baseline.stats()["write"]["ops"] > 0
    finally:
        pool.close()
        store.close()
        baseline.close()
