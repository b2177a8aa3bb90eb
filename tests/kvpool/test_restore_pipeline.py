"""``get_into`` of cold 64 KiB blocks, each lane thread reading and checking its piece:
bit-exact, a damaged record ends the restore there (dropped, reported, never claimed),
and compaction moving blocks under a restore never yields a wrong byte."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
import torch

from isolane.kvpool.log import reader
from isolane.kvpool.pool import KVPool
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


@pytest.fixture
def scheduler(tmp_path: Path):  # type: ignore[no-untyped-def]
    sched = LaneScheduler(kv_config(tmp_path))
    yield sched
    sched.close()


def test_cold_get_into_is_bit_exact_at_every_size(tmp_path: Path,
                                                  scheduler: LaneScheduler) -> None:
    kv = random_kv(96, seed=1)
    ids = list(range(96 * CT))
    with KVPool(kv_config(tmp_path), namespace="p", chunk_tokens=CT, memory_budget=0,
                scheduler=scheduler) as pool:
        assert pool.put(ids, kv) == 96
        for n in (1, 3, 4, 5, 16, 17, 64, 96):  # one block .. more pieces than threads
            evict_segments(tmp_path)
            out = torch.full_like(kv[:, :, :n * CT], float("nan"))
            assert pool.get_into(ids[:n * CT], out) == n * CT
            assert same_bits(out, kv[:, :, :n * CT]), n
        # A destination that is a strided view of a larger tensor (not one run a block).
        evict_segments(tmp_path)
        big = torch.zeros(1, 2, 96 * CT, 8, 256, dtype=torch.bfloat16)
        view = big[..., 64:192]
        assert pool.get_into(ids, view) == 96 * CT
        assert same_bits(view, kv)
        assert not big[..., :64].view(torch.int16).any()  # nothing written outside
        assert not big[..., 192:].view(torch.int16).any()
    assert len(reader.BOUNCES._free) <= reader.BOUNCES_KEPT  # every bounce given back


def test_a_damaged_record_ends_the_restore_there_and_is_never_claimed(
        tmp_path: Path, scheduler: LaneScheduler, caplog: pytest.LogCaptureFixture) -> None:
    kv = random_kv(48, seed=2)
    ids = list(range(48 * CT))
    with KVPool(kv_config(tmp_path), namespace="p", chunk_tokens=CT, memory_budget=0,
                scheduler=scheduler) as pool:
        pool.put(ids, kv)
        keys = pool.block_keys(ids)
        bad = 21  # in the middle of a piece, past the first
        loc = pool.logs[0].locate(keys[bad])
        assert loc is not None
        segment = next(p for p in segment_files(tmp_path)
                       if p.name.startswith(f"seg-{loc.segment_id:08d}"))
        flip_byte(segment, loc.value_offset + 1000)
        evict_segments(tmp_path)
        out = torch.zeros_like(kv)
        with caplog.at_level(logging.WARNING):
            assert pool.get_into(ids, out) == bad * CT  # the blocks before it, no more
        assert same_bits(out[:, :, :bad * CT], kv[:, :, :bad * CT])
        assert any("dropping damaged KV block" in r.getMessage()
                   and "checksum mismatch" in r.getMessage() for r in caplog.records)
        assert pool.logs[0].locate(keys[bad]) is None  # dropped by the read
        report = pool.logs[0].damage_report()
        assert [(d.segment_id, d.offset) for d in report] == [
            (loc.segment_id, loc.record_offset)]
        assert "checksum mismatch" in report[0].reason
        assert pool.lookup(ids) == bad * CT
        # The blocks after it are still stored and good (keys chain: read them by key).
        for i, block in enumerate(pool.get_blocks(keys[bad + 1:]), start=bad + 1):
            assert block is not None
            want = kv[:, :, i * CT:(i + 1) * CT].contiguous().view(torch.uint8)
            assert bytes(block) == want.numpy().tobytes()


def test_a_failed_check_gives_every_bounce_back(tmp_path: Path, scheduler: LaneScheduler,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """An error while checking one piece raises, claims nothing, and every piece's
    bounce goes back (no bounce leaks)."""
    kv = random_kv(64, seed=3)
    ids = list(range(64 * CT))
    with KVPool(kv_config(tmp_path), namespace="p", chunk_tokens=CT, memory_budget=0,
                scheduler=scheduler) as pool:
        pool.put(ids, kv)
        given: list[int] = []
        real_give = reader.BOUNCES.give
        monkeypatch.setattr(reader.BOUNCES, "give",
                            lambda buf: (given.append(1), real_give(buf))[1])
        taken: list[int] = []
        real_take = reader.BOUNCES.take
        monkeypatch.setattr(reader.BOUNCES, "take",
                            lambda n: (taken.append(1), real_take(n))[1])
        calls = []

        def failing(run, piece, targets):  # type: ignore[no-untyped-def]
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("boom")
            return real_copy(run, piece, targets)

        real_copy = reader._copy_out
        monkeypatch.setattr(reader, "_copy_out", failing)
        evict_segments(tmp_path)
        with pytest.raises(RuntimeError, match="boom"):
            pool.disk.read_into(pool.block_keys(ids), [torch.empty(1, 2, CT, 8, 128,
                                                                   dtype=torch.bfloat16)
                                                       for _ in range(64)])
        assert len(taken) >= 4 and len(given) == len(taken)


def test_compaction_under_cold_restores_never_yields_a_wrong_byte(
        tmp_path: Path) -> None:
    """Restores of stored prompts on 2 threads while a third deletes filler blocks and
    compacts the sealed segments (moving the prompts' blocks to new segments under the
    reads) and drops the page cache of the segments: every restore is whole and exact."""
    config = kv_config(tmp_path)
    sched = LaneScheduler(config)
    prompts = 6
    full = [random_kv(40, seed=10 + p) for p in range(prompts)]
    kv = [t[:, :, :24 * CT] for t in full]
    ids = [list(range(p * 10**6, p * 10**6 + 40 * CT)) for p in range(prompts)]
    errors: list[BaseException] = []
    stop = threading.Event()
    counts = {"restores": 0}
    try:
        with KVPool(config, namespace="p", chunk_tokens=CT, memory_budget=0,
                    segment_bytes=4 << 20, scheduler=sched) as pool:
            fillers, before = [], []
            for p in range(prompts):  # 24 blocks kept, then 16 filler, in one segment
                pool.put(ids[p], full[p])
                keys = pool.block_keys(ids[p])
                fillers.append(keys[24:])
                before.append({pool.logs[0].locate(k).segment_id  # type: ignore[union-attr]
                               for k in keys[:24]})
            ids = [i[:24 * CT] for i in ids]

            def restorer(seed: int) -> None:
                try:
                    k = seed
                    while not stop.is_set():
                        p = k % prompts
                        out = torch.zeros_like(kv[p])
                        got = pool.get_into(ids[p], out)
                        assert got == 24 * CT, f"restored {got} tokens of prompt {p}"
                        assert same_bits(out, kv[p]), f"prompt {p}: wrong bytes"
                        counts["restores"] += 1
                        k += 1
                except BaseException as exc:
                    errors.append(exc)
                    stop.set()

            threads = [threading.Thread(target=restorer, args=(s,)) for s in range(2)]
            for t in threads:
                t.start()
            try:
                for p in range(prompts):
                    if stop.is_set():
                        break
                    pool.delete_blocks(fillers[p])  # 40 % of its segment dead
                    pool.compact(0.9)  # (or the compaction it queued did it already)
                    for _ in range(3):  # let restores run over the new layout
                        evict_segments(tmp_path)
                        if stop.wait(0.05):
                            break
            finally:
                stop.set()
                for t in threads:
                    t.join()
            assert not errors, errors[0]
            assert counts["restores"] >= 4, counts
            pool.compact(0.9)
            moved = [p for p in range(prompts) if not before[p] & {
                pool.logs[0].locate(k).segment_id  # type: ignore[union-attr]
                for k in pool.block_keys(ids[p])}]
            assert len(moved) == prompts  # every prompt's blocks moved by a compaction
            for p in range(prompts):  # and all still there afterwards
                evict_segments(tmp_path)
                out = torch.zeros_like(kv[p])
                assert pool.get_into(ids[p], out) == 24 * CT and same_bits(out, kv[p])
    finally:
        sched.close()


@pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists()
                    or "[never]" in Path("/sys/kernel/mm/transparent_hugepage/enabled"
                                         ).read_text(),
                    reason="transparent huge pages disabled")
def test_bounce_buffers_are_advised_huge_pages() -> None:
    """An O_DIRECT read into 4 KiB pages reaches the device in requests of at most
    max_segments pages (254 here: ~1 MiB); the bounces ask for huge pages, so a piece's
    read goes out whole (up to max_sectors_kb)."""
    from tests.snapshot.test_bounce import _smaps_of

    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    cases = [(True, "1")] + ([(False, "0")] if "[madvise]" in mode else [])
    for huge, eligible in cases:
        pool = reader.BouncePool(huge_pages=huge)
        buf = pool.take(5 << 20)
        try:
            assert _smaps_of(buf.address + (2 << 20)).get("THPeligible") == eligible
        finally:
            buf.close()
    assert reader.BOUNCES._huge  # the pool restores use


def test_a_cold_get_into_scatters_through_the_strided_views_of_out(
        tmp_path: Path, scheduler: LaneScheduler, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool hands the disk tier ``out``'s block views as they are (not a list of
    per-block tensors), so the read makes every block's targets from block 0's layout
    without a torch call a block."""
    kv = random_kv(16, seed=4)
    ids = list(range(16 * CT))
    calls: list[int] = []
    real = reader.tensor_chunks
    monkeypatch.setattr(reader, "tensor_chunks",
                        lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    with KVPool(kv_config(tmp_path), namespace="p", chunk_tokens=CT, memory_budget=0,
                scheduler=scheduler) as pool:
        pool.put(ids, kv)
        evict_segments(tmp_path)
        out = torch.zeros_like(kv)
        assert pool.get_into(ids, out) == 16 * CT and same_bits(out, kv)
    assert calls == []
