"""How ``get_into`` plans a disk restore: the pool finds the present prefix with each
tier's index probe (``contains_many``), then the disk tier's ``read_into`` locates and
plans inside the tier (``DiskTier.plan_read``): pieces cut from numpy columns
(``coalesce.column_ranges``: the same ranges and pieces as ``coalesce_ranges`` +
``split_ranges``, no ``Location`` a block) and handed to the read lane as they are cut.
The restore still returns exactly the newest bytes of the stored prefix: partial
prefixes, tombstones, re-puts, and blocks moved by compaction between plan and read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from isolane.kvpool.log import coalesce
from isolane.kvpool.log.coalesce import coalesce_ranges, column_ranges, split_ranges
from isolane.kvpool.log.keydir import LocatedColumns, Location
from isolane.kvpool.log.keytable import KeyDirectory
from isolane.kvpool.pool import KVPool
from isolane.lanes import LaneScheduler
from tests.support.kv_blocks import (
    CT,
    evict_segments,
    kv_config,
    random_kv,
    same_bits,
)


@pytest.fixture
def scheduler(tmp_path: Path):  # type: ignore[no-untyped-def]
    sched = LaneScheduler(kv_config(tmp_path))
    yield sched
    sched.close()


@pytest.fixture
def pool(tmp_path: Path, scheduler: LaneScheduler):  # type: ignore[no-untyped-def]
    with KVPool(kv_config(tmp_path), namespace="p", chunk_tokens=CT, memory_budget=0,
                scheduler=scheduler) as p:
        yield p


def test_get_into_locates_the_prefix_once(pool: KVPool, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    kv = random_kv(40, seed=1)
    ids = list(range(40 * CT))
    pool.put(ids, kv)
    probes: list[int] = []
    real = KeyDirectory.find_rows

    def counted(self: KeyDirectory, keys: list[bytes]) -> Any:
        probes.append(len(keys))
        return real(self, keys)

    monkeypatch.setattr(KeyDirectory, "find_rows", counted)
    evict_segments(tmp_path)
    out = torch.zeros_like(kv)
    assert pool.get_into(ids, out) == 40 * CT
    assert same_bits(out, kv)
    assert probes == [40, 40]  # the present-prefix probe, then the read's own locate


def test_pieces_are_handed_to_the_lane_as_they_are_cut(pool: KVPool, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    kv = random_kv(64, seed=2)
    ids = list(range(64 * CT))
    pool.put(ids, kv)
    events: list[str] = []
    real_pieces = coalesce.ColumnRanges.pieces

    def pieces(self: coalesce.ColumnRanges, piece_bytes: int) -> Any:
        for piece in real_pieces(self, piece_bytes):
            events.append("cut")
            yield piece

    lane = pool.disk._read_lane

    class Recording:
        def submit_sized(self, *args: Any, **kwargs: Any) -> Any:
            events.append("read")
            return lane.submit_sized(*args, **kwargs)

        def call_inline(self, *args: Any, **kwargs: Any) -> Any:
            events.append("read")
            return lane.call_inline(*args, **kwargs)

    monkeypatch.setattr(coalesce.ColumnRanges, "pieces", pieces)
    monkeypatch.setattr(pool.disk, "_read_lane", Recording())
    evict_segments(tmp_path)
    out = torch.zeros_like(kv)
    assert pool.get_into(ids, out) == 64 * CT
    assert same_bits(out, kv)
    cuts = events.count("cut")
    assert cuts >= 3 and events.count("read") == cuts
    assert events.index("read") < len(events) - 1 - events[::-1].index("cut")  # before the last cut


def test_partial_prefix_tombstone_and_reput_newest_bytes(pool: KVPool, tmp_path: Path) -> None:
    kv = random_kv(24, seed=3)
    ids = list(range(24 * CT))
    pool.put(ids, kv)
    keys = pool.block_keys(ids)
    assert pool.delete_blocks([keys[9]]) == 1  # a tombstone in the middle
    evict_segments(tmp_path)
    out = torch.zeros_like(kv)
    assert pool.get_into(ids, out) == 9 * CT  # the prefix before it, no more
    assert same_bits(out[:, :, :9 * CT], kv[:, :, :9 * CT])
    n, got = pool.get(ids)
    assert n == 9 * CT and got is not None and same_bits(got, kv[:, :, :9 * CT])
    # Store the whole prompt again with other bytes: the newest record of every key wins
    # (block 9 is new, the others keep their first record: put skips stored keys).
    newer = random_kv(24, seed=4)
    assert pool.put(ids, newer) == 1
    pool.delete_blocks(keys[:3])
    assert pool.put(ids[:3 * CT], newer[:, :, :3 * CT]) == 3
    evict_segments(tmp_path)
    out = torch.zeros_like(kv)
    assert pool.get_into(ids, out) == 24 * CT
    want = kv.clone()
    want[:, :, :3 * CT] = newer[:, :, :3 * CT]
    want[:, :, 9 * CT:10 * CT] = newer[:, :, 9 * CT:10 * CT]
    assert same_bits(out, want)
    # Not stored at all: nothing read, the destinations untouched.
    out = torch.zeros_like(kv)
    assert pool.get_into([7] * (24 * CT), out) == 0
    assert not out.view(torch.int16).any()


def test_blocks_compacted_between_plan_and_read_come_back_whole(
        pool: KVPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kv = random_kv(32, seed=5)
    ids = list(range(32 * CT))
    pool.put(ids, kv)
    pool.logs[0].rotate()
    filler = random_kv(8, seed=6)
    pool.put(list(range(10**6, 10**6 + 8 * CT)), filler)
    pool.delete_blocks(pool.block_keys(list(range(10**6, 10**6 + 8 * CT))))
    real = pool.logs[0].locate_columns

    def locate_then_compact(keys: Any) -> Any:
        located = real(keys)
        for info in pool.logs[0].segments():  # move every block the plan points at
            if info.state == "sealed":
                pool.logs[0].compact(info.segment_id)
        return located

    monkeypatch.setattr(pool.logs[0], "locate_columns", locate_then_compact)
    evict_segments(tmp_path)
    out = torch.zeros_like(kv)
    assert pool.get_into(ids, out) == 32 * CT
    assert same_bits(out, kv)


def _cols(specs: list[tuple[int, int, int]]) -> LocatedColumns:
    n = len(specs)
    sid = np.array([s for s, _, _ in specs], np.uint64)
    roff = np.array([o for _, o, _ in specs], np.uint64)
    size = np.array([z for _, _, z in specs], np.uint64)
    u = np.arange(n, dtype=np.uint64)
    return LocatedColumns([i.to_bytes(16, "little") for i in range(n)], np.ones(n, bool),
                          sid, roff, roff + 64, size - 64, roff + size, u, u)


@settings(max_examples=200)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 60), st.integers(1, 9)),
                max_size=40, unique_by=lambda t: (t[0], t[1])),
       st.integers(0, 2000), st.integers(100, 5000), st.integers(1, 6000), st.randoms())
def test_column_ranges_cut_the_same_pieces_as_the_locations(
        specs: list[tuple[int, int, int]], gap: int, cap: int, piece: int, rnd: Any) -> None:
    # Records never overlap in a log: slot * 1000 bytes apart, at most 900 long.
    recs = [(seg, slot * 1000, size * 100) for seg, slot, size in specs]
    cols = _cols(recs)
    positions = np.array([i for i in range(len(recs)) if rnd.random() < 0.8], np.intp)
    locs: list[Location | None] = [None] * len(recs)
    for p, loc in zip(positions.tolist(), cols.locations(positions), strict=True):
        locs[p] = loc
    want = split_ranges(coalesce_ranges(locs, max_gap_bytes=gap, max_range_bytes=cap), piece)
    ranges = column_ranges(cols, positions, max_gap_bytes=gap, max_range_bytes=cap)
    assert ranges.spans() == [(r.segment_id, r.start, r.end) for r in
                              coalesce_ranges(locs, max_gap_bytes=gap, max_range_bytes=cap)]
    got = list(ranges.pieces(piece))
    assert [(p.segment_id, p.start, p.end) for p in got] == [
        (p.segment_id, p.start, p.end) for p in want]
    assert [p.members for p in got] == [p.members for p in want]


def test_block_views_are_the_blocks_of_the_tensor() -> None:
    from isolane.kvpool.api import BlockViews

    t = torch.arange(2 * 5 * 3).reshape(2, 5 * 3)
    views = BlockViews(t, 1, 3, 4)  # 4 of the 5 blocks of 3 along dim 1
    assert len(views) == 4
    assert torch.equal(views[1], t[:, 3:6]) and torch.equal(views[-1], t[:, 9:12])
    assert [v.data_ptr() for v in views] == [t[:, 3 * i:].data_ptr() for i in range(4)]
    assert len(views[1:3]) == 2 and torch.equal(views[1:3][1], t[:, 6:9])
    with pytest.raises(IndexError):
        views[4]
    views[2].fill_(-1)  # views, not copies
    assert (t[:, 6:9] == -1).all()


def _addresses(chunks: list[memoryview]) -> list[tuple[int, int]]:
    return [(np.frombuffer(c, np.uint8).ctypes.data, len(c)) for c in chunks]


@pytest.mark.parametrize(("make", "dim"), [
    (lambda: torch.zeros(1, 2, 5 * 16, 8, 128, dtype=torch.bfloat16), 2),  # the KV layout
    (lambda: torch.zeros(3, 5 * 16, 512, dtype=torch.float32)[1:], 1),  # storage offset
    (lambda: torch.zeros(2, 5 * 16, 2048, dtype=torch.float32)[:, :, 1024:], 1),  # strided
])
def test_targets_of_block_views_are_the_chunks_of_each_block(make: Any, dim: int) -> None:
    """A restore's targets come from the block views' one stride (no torch call a
    block, which the read lane's threads would make at once): the same memory, chunk for
    chunk, as each block's own view."""
    from isolane.kvpool.api import BlockViews
    from isolane.kvpool.log.reader import TensorTargets, tensor_chunks

    t = make()
    targets = TensorTargets(BlockViews(t, dim, 16, 4))
    assert targets.strided is None  # nothing made on the caller before its first read
    for i in range(4):
        want = tensor_chunks(t.narrow(dim, i * 16, 16))
        assert want is not None
        assert _addresses(targets[i]) == _addresses(want)
    assert targets.strided  # no per-block views were made from tensors


def test_storage_bytes_are_the_tensors_memory_and_keep_it_alive() -> None:
    import gc

    from isolane.kvpool.log.reader import storage_bytes

    t = torch.arange(16, dtype=torch.int32)[4:]  # a view: the whole storage is seen
    view = storage_bytes(t)
    assert len(view) == 64 and not view.readonly
    view[16:20] = (7).to_bytes(4, "little")  # element 4 of the storage: t[0]
    assert int(t[0]) == 7
    del t
    gc.collect()
    assert bytes(view[:8]) == bytes(4) + (1).to_bytes(4, "little")  # still held
    assert len(storage_bytes(torch.empty(0))) == 0
