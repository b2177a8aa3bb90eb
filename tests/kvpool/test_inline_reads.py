"""The KV pool's small reads run on the caller's thread when the read lane has room
(``Lane.call_inline``): no worker thread is involved, yet every read is counted in the
read lane's ops, bytes and KV-get latencies; with the lane's threads all busy, a get
queues behind them and still returns the right bytes."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from isolane.config import config_from_dict
from isolane.kvpool.pool import KVPool
from isolane.lanes import JobKind, LaneScheduler

CT = 16


def _config(tmp_path: Path):  # type: ignore[no-untyped-def]
    return config_from_dict({"device_groups": {"kv": {
        "role": "read", "devices": [str(tmp_path / "kv")], "threads": 2}}})


def _stored(tmp_path: Path, prompts: int = 3) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Prompts of 4 blocks of 4 KiB (2 x 8 x 16 float32 a token... per block), stored
    and closed, so a fresh pool and scheduler read them."""
    tokens, kvs = [], []
    scheduler = LaneScheduler(_config(tmp_path))
    with KVPool(_config(tmp_path), namespace="inline", chunk_tokens=CT, memory_budget=0,
                scheduler=scheduler) as pool:
        for p in range(prompts):
            ids = [p * 1000 + t for t in range(4 * CT)]
            kv = torch.randn(2, 8, 4 * CT, 8)
            assert pool.put(ids, kv) == 4
            tokens.append(ids)
            kvs.append(kv)
    scheduler.close()
    return tokens, kvs


def test_small_gets_run_on_the_callers_thread_and_count_as_reads(tmp_path: Path) -> None:
    tokens, kvs = _stored(tmp_path)
    scheduler = LaneScheduler(_config(tmp_path))
    read = scheduler.lane_named("read")
    with KVPool(_config(tmp_path), namespace="inline", chunk_tokens=CT, memory_budget=0,
                scheduler=scheduler) as pool:
        keys = pool.block_keys(tokens[0])
        got = pool.get_blocks(keys[:1])[0]
        assert got is not None
        expected = kvs[0][:, :, :CT].contiguous().view(torch.uint8).numpy().tobytes()
        assert bytes(got) == expected
        out = torch.empty_like(kvs[1])
        assert pool.get_into(tokens[1], out) == 4 * CT
        assert torch.equal(out, kvs[1])
        n, whole = pool.get(tokens[2])
        assert n == 4 * CT and whole is not None and torch.equal(whole, kvs[2])
        assert read.pool.started_threads == 0  # no read went through a worker
        stats = scheduler.stats()["read"]
        assert stats["ops"] == 3 and stats["failed"] == 0 and stats["queued"] == 0
        assert stats["bytes"] > 9 * len(expected)  # 9 blocks and their headers
        assert stats["kv_get_latency_ms"]["count"] == 3
    scheduler.close()


def test_a_get_queues_while_every_read_thread_is_busy(tmp_path: Path) -> None:
    tokens, kvs = _stored(tmp_path, prompts=1)
    scheduler = LaneScheduler(_config(tmp_path))
    lane = scheduler.lane(JobKind.KV_GET)
    with KVPool(_config(tmp_path), namespace="inline", chunk_tokens=CT, memory_budget=0,
                scheduler=scheduler) as pool:
        release = threading.Event()
        busy = [lane.submit(release.wait) for _ in range(2)]
        while scheduler.stats()["read"]["running"] < 2:
            threading.Event().wait(0.001)
        results: list[tuple[int, torch.Tensor | None]] = []
        getter = threading.Thread(target=lambda: results.append(pool.get(tokens[0])))
        getter.start()
        getter.join(timeout=0.3)
        assert getter.is_alive() and not results  # queued behind the busy threads
        assert scheduler.stats()["read"]["queue_depth"] >= 1
        release.set()
        getter.join(timeout=10)
        for fut in busy:
            fut.result(timeout=10)
        n, out = results[0]
        assert n == 4 * CT and out is not None and torch.equal(out, kvs[0])
    scheduler.close()
