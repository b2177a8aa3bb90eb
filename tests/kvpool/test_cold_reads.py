"""Cold multi-block reads go O_DIRECT, cached ones through the page cache.

A ``cold`` segment log (the KV pool's default) reads a range of 256 KiB or more whose
pages are not all in the page cache with O_DIRECT, into a page-aligned buffer, and a
restore into a tensor then copies each checked value out of it; ranges in the page
cache, and small ones, are read through it. O_DIRECT leaves the page cache as it was,
which is how these tests see which way a read went (``cachestat``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from isolane.config import config_from_dict
from isolane.kvpool.log.coalesce import coalesce_ranges
from isolane.kvpool.log.reader import scatter_piece
from isolane.kvpool.log.segment_log import SegmentLog, direct_span
from isolane.kvpool.pool import KVPool
from isolane.lanes import LaneScheduler
from isolane.storage.aligned import AlignedBuffer
from isolane.storage.page_cache import cached_pages
from tests.storage.test_page_cache import evict
from tests.support.damage import flip_byte

BLOCK = 64 << 10
CT = 16


def _segment(folder: Path) -> Path:
    return next(p for p in folder.rglob("seg-*") if p.suffix != ".hint")


def _cached(path: Path, start: int, nbytes: int) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        pages = cached_pages(fd, start, nbytes)
    finally:
        os.close(fd)
    if pages is None:
        pytest.fail("cachestat(2) is missing on this kernel (Linux 6.5+ has it)")
    return pages


def _blocks(n: int) -> tuple[list[bytes], list[bytes]]:
    return [i.to_bytes(16, "little") for i in range(n)], [os.urandom(BLOCK) for _ in range(n)]


def test_a_cold_log_reads_uncached_ranges_with_o_direct(tmp_path: Path) -> None:
    keys, values = _blocks(8)  # 8 records of 65,600 bytes: a 512 KiB range
    with SegmentLog(tmp_path, direct_io="cold") as log:
        log.append_blocks(keys, values)
        piece = coalesce_ranges([log.locate(k) for k in keys])[0]
        path = _segment(tmp_path)
        bounce = AlignedBuffer(direct_span(piece.start, piece.end))
        try:
            # Just written: in the page cache, so read through it (nothing read here).
            assert log.read_direct(piece.segment_id, piece.start, piece.end,
                                   bounce.view) is None
            evict(path)
            run = log.read_direct(piece.segment_id, piece.start, piece.end, bounce.view)
            assert run is not None and len(run) == piece.nbytes
            assert _cached(path, piece.start, piece.nbytes) == 0  # it went O_DIRECT
            got = bytes(run)
        finally:
            del run
            bounce.close()
        lone = log.locate(keys[0])
        assert lone is not None
        assert log.read(lone) == values[0]  # one block: below the O_DIRECT size
        assert _cached(path, lone.record_offset, BLOCK) > 0
        evict(path)
        again = log.read_run(piece.segment_id, piece.start, piece.end)  # the default
        assert bytes(again) == got
        assert _cached(path, piece.start, piece.nbytes) == 0
        assert bytes(log.read_run(piece.segment_id, piece.start, piece.end,
                                  direct=False)) == got  # what the page cache holds
    with SegmentLog(tmp_path, direct_io="off") as log:
        evict(path)
        assert log.read_run(piece.segment_id, piece.start, piece.end) == got
        assert _cached(path, piece.start, piece.nbytes) > 0


def test_a_cold_piece_scatters_through_a_bounce_and_checks_every_record(
        tmp_path: Path) -> None:
    keys, values = _blocks(8)
    with SegmentLog(tmp_path, direct_io="cold") as log:
        log.append_blocks(keys, values)
        locs = [log.locate(k) for k in keys]
        piece = coalesce_ranges(locs)[0]
        path = _segment(tmp_path)
        dests = {i: [memoryview(bytearray(1000)), memoryview(bytearray(BLOCK - 1000))]
                 for i in range(8)}
        evict(path)
        outcome = scatter_piece(log, piece, dests)
        assert sorted(outcome.verified) == list(range(8)) and not outcome.damaged
        assert all(b"".join(bytes(p) for p in dests[i]) == values[i] for i in range(8))
        assert _cached(path, piece.start, piece.nbytes) == 0  # read with O_DIRECT
        loc = locs[3]
        assert loc is not None
        flip_byte(path, loc.value_offset + 7)
        evict(path)
        outcome = scatter_piece(log, piece, dests)
        # O_DIRECT again; the one page cached is the tail the drop's tombstone went to.
        assert _cached(path, piece.start, piece.nbytes) <= 1
        assert [i for i, _ in outcome.damaged] == [3]
        assert "checksum mismatch" in str(outcome.damaged[0][1])
        assert sorted(outcome.verified) == [0, 1, 2, 4, 5, 6, 7]
        assert log.locate(keys[3]) is None  # dropped by the read itself
        with pytest.raises(ValueError, match="holds 5 bytes"):
            scatter_piece(log, piece, {**dests, 0: [memoryview(bytearray(5))]})


def _config(tmp_path: Path):  # type: ignore[no-untyped-def]
    return config_from_dict({"device_groups": {"kv": {
        "role": "read", "devices": [str(tmp_path / "kv")], "threads": 4}}})


@pytest.mark.parametrize("direct_reads", [None, False])
def test_pool_restores_of_cold_blocks(tmp_path: Path, direct_reads: bool | None) -> None:
    """By default a cold restore of 64 blocks of 64 KiB reads O_DIRECT (get_into copies
    out of bounce buffers, get_blocks hands out views into them); ``direct_reads=False``
    reads through the page cache. Either way every byte comes back as stored."""
    ids = list(range(64 * CT))
    kv = torch.randn(1, 2, 64 * CT, 8, 128, dtype=torch.float32).to(torch.bfloat16)
    scheduler = LaneScheduler(_config(tmp_path))
    try:
        with KVPool(_config(tmp_path), namespace="cold", chunk_tokens=CT, memory_budget=0,
                    scheduler=scheduler) as pool:
            assert pool.put(ids, kv) == 64
        with KVPool(_config(tmp_path), namespace="cold", chunk_tokens=CT, memory_budget=0,
                    scheduler=scheduler, direct_reads=direct_reads) as pool:
            path = _segment(tmp_path / "kv")
            size = path.stat().st_size
            evict(path)
            out = torch.zeros_like(kv)
            assert pool.get_into(ids, out) == 64 * CT
            assert torch.equal(out, kv)
            warm = _cached(path, 0, size)
            assert (warm < 8) if direct_reads is None else (warm > size // 4096 // 2)
            evict(path)
            keys = pool.block_keys(ids)
            blocks = pool.get_blocks(keys)
            for i, block in enumerate(blocks):
                assert block is not None
                want = kv.narrow(2, i * CT, CT).contiguous().view(torch.uint8)
                assert bytes(block) == want.numpy().tobytes()
            warm = _cached(path, 0, size)
            assert (warm < 8) if direct_reads is None else (warm > size // 4096 // 2)
            out2 = torch.zeros_like(kv)  # cached now (buffered) or not: the same bytes
            assert pool.get_into(ids, out2) == 64 * CT and torch.equal(out2, kv)
    finally:
        scheduler.close()
