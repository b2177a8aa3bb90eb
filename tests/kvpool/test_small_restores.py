"""``get_into`` of a few blocks plans its disk read key by key (``DiskTier.plan_read`` up
to ``scalar_batch`` keys: a ``Location`` each, no numpy columns), the per-call cost of a
small-prompt restore. It must read exactly what the column probe reads: the same bytes
and counts, cold and warm, partial prefixes, strided destinations, several devices; a
damaged record ends the restore there, dropped and reported, never claimed; a stored
block of the wrong size is a miss."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from isolane.config import config_from_dict
from isolane.kvpool.log.keytable import SCALAR_BATCH
from isolane.kvpool.log.segment_log import SegmentLog
from isolane.kvpool.pool import KVPool
from isolane.kvpool.tiers.disk import DiskTier
from isolane.lanes import LaneScheduler
from tests.support.damage import flip_byte
from tests.support.kv_blocks import (
    CT,
    evict_segments,
    kv_config,
    random_kv,
    same_bits,
    segment_files,
)

SIZES = (1, 2, 5, 16, SCALAR_BATCH)


@pytest.fixture
def scheduler(tmp_path: Path):  # type: ignore[no-untyped-def]
    sched = LaneScheduler(kv_config(tmp_path))
    yield sched
    sched.close()


@pytest.fixture(params=["small", "columns"])
def plan_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """How ``plan_read`` probes: key by key, or columns for any batch (checked on every
    device it probes)."""
    kind: str = request.param
    real_init = DiskTier.__init__

    def init(self: DiskTier, *args: Any, **kwargs: Any) -> None:
        real_init(self, *args, **kwargs)
        if kind == "columns":
            self.scalar_batch = 0

    monkeypatch.setattr(DiskTier, "__init__", init)
    calls = {"locate_many": 0, "locate_columns": 0}
    for name in calls:
        real = getattr(SegmentLog, name)

        def counted(self: SegmentLog, keys: Any, _real: Any = real, _name: str = name) -> Any:
            calls[_name] += 1
            return _real(self, keys)

        monkeypatch.setattr(SegmentLog, name, counted)
    request.addfinalizer(lambda: _check_probes(kind, calls))
    return kind


def _check_probes(kind: str, calls: dict[str, int]) -> None:
    if kind == "small":  # (get_blocks, after a damaged block, locates key by key too)
        assert calls["locate_many"] and not calls["locate_columns"], calls
    else:
        assert calls["locate_columns"], calls


def _pool(tmp_path: Path, scheduler: LaneScheduler, config: Any = None) -> KVPool:
    return KVPool(config or kv_config(tmp_path), namespace="p", chunk_tokens=CT,
                  memory_budget=0, scheduler=scheduler)


@pytest.mark.parametrize("warm", [False, True])
def test_a_few_blocks_read_bit_exact_either_plan(tmp_path: Path, scheduler: LaneScheduler,
                                                 plan_kind: str, warm: bool) -> None:
    kv = random_kv(max(SIZES), seed=1)
    ids = list(range(max(SIZES) * CT))
    with _pool(tmp_path, scheduler) as pool:
        assert pool.put(ids, kv) == max(SIZES)
        for n in SIZES:
            if not warm:
                evict_segments(tmp_path)
            out = torch.full_like(kv[:, :, :n * CT], float("nan"))
            assert pool.get_into(ids[:n * CT], out) == n * CT
            assert same_bits(out, kv[:, :, :n * CT]), n
            # out with room for more than is asked: only the asked prefix is read
            roomy = torch.zeros_like(kv)
            assert pool.get_into(ids[:n * CT], roomy) == n * CT
            assert same_bits(roomy[:, :, :n * CT], kv[:, :, :n * CT])
            assert not roomy[:, :, n * CT:].view(torch.int16).any()
        # A strided view of a larger tensor as the destination.
        big = torch.zeros(1, 2, 3 * CT, 8, 256, dtype=torch.bfloat16)
        view = big[..., 64:192]
        assert pool.get_into(ids[:3 * CT], view) == 3 * CT
        assert same_bits(view, kv[:, :, :3 * CT])
        assert not big[..., :64].view(torch.int16).any()
        assert not big[..., 192:].view(torch.int16).any()


def test_a_partial_prefix_stops_at_the_first_missing_block(
        tmp_path: Path, scheduler: LaneScheduler, plan_kind: str) -> None:
    kv = random_kv(6, seed=2)
    ids = list(range(6 * CT))
    with _pool(tmp_path, scheduler) as pool:
        pool.put(ids, kv)
        keys = pool.block_keys(ids)
        assert pool.delete_blocks([keys[3]]) == 1
        out = torch.zeros_like(kv)
        assert pool.get_into(ids, out) == 3 * CT
        assert same_bits(out[:, :, :3 * CT], kv[:, :, :3 * CT])
        assert pool.get_into([9] * (6 * CT), torch.zeros_like(kv)) == 0


def test_a_damaged_record_ends_a_small_restore_and_is_dropped(
        tmp_path: Path, scheduler: LaneScheduler, plan_kind: str,
        caplog: pytest.LogCaptureFixture) -> None:
    kv = random_kv(5, seed=3)
    ids = list(range(5 * CT))
    with _pool(tmp_path, scheduler) as pool:
        pool.put(ids, kv)
        keys = pool.block_keys(ids)
        for bad, n in ((0, 1), (2, 5)):  # a one-block restore, and one in the middle
            loc = pool.logs[0].locate(keys[bad])
            assert loc is not None
            segment = next(p for p in segment_files(tmp_path)
                           if p.name.startswith(f"seg-{loc.segment_id:08d}"))
            flip_byte(segment, loc.value_offset + 100)
            out = torch.zeros_like(kv[:, :, :n * CT])
            with caplog.at_level(logging.WARNING):
                assert pool.get_into(ids[:n * CT], out) == bad * CT
            assert same_bits(out[:, :, :bad * CT], kv[:, :, :bad * CT])
            assert pool.logs[0].locate(keys[bad]) is None  # dropped by the read
            assert (loc.segment_id, loc.record_offset) in [
                (d.segment_id, d.offset) for d in pool.logs[0].damage_report()]
            flip_byte(segment, loc.value_offset + 100)  # repaired, but no longer indexed
            pool.put(ids[:CT], kv[:, :, :CT])  # block 0 stored anew for the next round
        assert sum("dropping damaged KV block" in r.getMessage() for r in caplog.records) == 2


def test_a_stored_block_of_the_wrong_size_is_a_miss(tmp_path: Path, scheduler: LaneScheduler,
                                                    plan_kind: str) -> None:
    kv = random_kv(3, seed=4)
    ids = list(range(3 * CT))
    with _pool(tmp_path, scheduler) as pool:
        pool.put(ids[:CT], kv[:, :, :CT])
        keys = pool.block_keys(ids)
        pool.logs[0].append_blocks(keys[1:2], [memoryview(b"x" * 100)])  # below the checks
        pool.put(ids, kv)  # block 2 (block 1 is "stored" already)
        out = torch.zeros_like(kv)
        assert pool.get_into(ids, out) == CT
        assert pool.logs[0].locate(keys[1]) is None  # dropped as the wrong size


def test_blocks_on_several_devices(tmp_path: Path, plan_kind: str) -> None:
    config = config_from_dict({"device_groups": {"kv": {
        "role": "read", "devices": [str(tmp_path / "d0"), str(tmp_path / "d1")]}}})
    n = min(3 * config.cluster.segment_blocks, max(SIZES))  # SIZES: before any patch
    kv = random_kv(n, seed=5)
    scheduler = LaneScheduler(config)
    with _pool(tmp_path, scheduler, config) as pool:
        for prompt in range(8):  # one whose chain segments went to both devices
            ids = list(range(prompt * 10**5, prompt * 10**5 + n * CT))
            pool.put(ids, kv)
            keys = pool.block_keys(ids)
            if len({d for d, lg in enumerate(pool.logs) for k in keys if k in lg}) == 2:
                break
        else:
            pytest.fail("no prompt spread over both devices")
        out = torch.zeros_like(kv)
        assert pool.get_into(ids, out) == n * CT
        assert same_bits(out, kv)
    scheduler.close()


def test_memory_tier_hits_and_misses_of_a_small_restore(
        tmp_path: Path, scheduler: LaneScheduler, plan_kind: str) -> None:
    kv = random_kv(4, seed=6)
    ids = list(range(4 * CT))
    with KVPool(kv_config(tmp_path), namespace="p", chunk_tokens=CT,
                memory_budget=1 << 20, scheduler=scheduler) as pool:
        pool.put(ids, kv)
        keys = pool.block_keys(ids)
        pool.memory.remove(keys[1])  # memory holds blocks 0, 2 and 3
        out = torch.zeros_like(kv)
        hits = pool.memory.stats.hits
        assert pool.get_into(ids, out) == 4 * CT
        assert same_bits(out, kv)
        assert pool.memory.stats.hits - hits == 3  # block 1 from disk
        assert keys[1] in pool.memory  # and admitted
        pool.memory.clear()  # memory holds none: it is not read, the disk is
        out = torch.zeros_like(kv)
        hits, misses = pool.memory.stats.hits, pool.memory.stats.misses
        assert pool.get_into(ids, out) == 4 * CT
        assert same_bits(out, kv)
        assert (pool.memory.stats.hits, pool.memory.stats.misses) == (hits, misses)
        assert all(k in pool.memory for k in keys)  # admitted from the disk read
