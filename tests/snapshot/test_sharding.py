"""Multi-rank planning without disks: row splits, merging parts, which chunk bytes hold rows."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from isolane.errors import IntegrityError, InvalidArgumentError
from isolane.snapshot.manifest import (
    ChunkRecord,
    Manifest,
    PackRef,
    ShardRef,
    SnapshotStats,
    TensorRecord,
)
from isolane.snapshot.mirror import mirror_manifest
from isolane.snapshot.sharding import (
    Shard,
    check_shards,
    global_view,
    merge_parts,
    plan_row_slices,
    rank_view,
    row_range,
)
from isolane.storage.fsspec_store import FsspecBlobStore


@given(st.integers(0, 300), st.integers(1, 9))
def test_row_range_splits_as_tensor_split(total: int, world: int) -> None:
    want = [len(p) for p in torch.arange(total).tensor_split(world)]
    ranges = [row_range(total, r, world) for r in range(world)]
    assert [b - a for a, b in ranges] == want
    assert [a for a, _ in ranges] == [0] + [b for _, b in ranges[:-1]]


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_row_slices_rebuild_exactly_the_wanted_rows(data: st.DataObject) -> None:
    rows = data.draw(st.integers(1, 40))
    row_bytes = data.draw(st.integers(1, 24))
    cuts = sorted(data.draw(st.lists(st.integers(0, rows), max_size=4)))
    bounds = [0, *cuts, rows]
    full = bytes(i % 251 for i in range(rows * row_bytes))
    pieces, chunk_data, chunks_of = [], {}, {}
    for tid, (a, b) in enumerate(itertools.pairwise(bounds)):
        packed = data.draw(st.booleans())
        pieces.append(TensorRecord(
            id=tid, key="w", dtype="uint8", shape=(b - a, row_bytes),
            pack=PackRef("_packs/0", 0, (b - a) * row_bytes, "") if packed else None,
            rank=tid, shard=ShardRef(a, rows)))
        nbytes = (b - a) * row_bytes
        sizes = data.draw(st.lists(st.integers(1, 64), min_size=1, max_size=8))
        offset, records = 0, []
        for i, size in enumerate(sizes * (nbytes // sum(sizes) + 1)):
            if offset >= nbytes:
                break
            size = min(size, nbytes - offset)
            record = ChunkRecord(key=f"{tid}/c.{i}", device=0, stored=size + 3, hash="",
                                 tensor=tid, offset=offset, nbytes=size)
            chunk_data[record.key] = full[a * row_bytes + offset:][:size] + b"\0\0\0"
            records.append(record)
            offset += size
        chunks_of[tid] = records
    lo = data.draw(st.integers(0, rows))
    hi = data.draw(st.integers(lo, rows))
    slices, packed = plan_row_slices(pieces, chunks_of, lo, hi, row_bytes)
    out = bytearray((hi - lo) * row_bytes)
    for s in slices:
        assert 0 <= s.start < s.stop <= s.chunk.nbytes  # never the zero padding
        out[s.dst_offset:s.dst_offset + s.stop - s.start] = chunk_data[s.chunk.key][s.start:s.stop]
    for p in packed:
        assert p.source.shard is not None and p.source.pack is not None
        src = full[p.source.shard.offset * row_bytes:][:p.source.pack.nbytes]
        out[p.dst_offset:p.dst_offset + p.stop - p.start] = src[p.start:p.stop]
    assert bytes(out) == full[lo * row_bytes:hi * row_bytes]
    assert len({s.chunk.key for s in slices}) == len(slices)  # each chunk read once


def _part(rank: int, rows: int, *, dtype: str = "float32") -> Manifest:
    tree = {"t": "dict", "items": [["w", {"t": "tensor", "id": 0}],
                                   ["b", {"t": "tensor", "id": 1}],
                                   ["rank", {"t": "int", "v": rank}]]}
    return Manifest(
        name="x", generation="g", committed_at=0.0, tree=tree,
        tensors=(TensorRecord(0, "w", dtype, (rows, 4), array="w"),
                 TensorRecord(1, "b", "float32", (4,), pack=PackRef("_packs/0", 0, 16, "h"))),
        chunks=(ChunkRecord("w/c.0.0", 0, rows * 16, "h0", tensor=0, nbytes=rows * 16),
                ChunkRecord("_packs/0/c.0", 1, 16, "h1", nbytes=16)),
        devices=("file:///d0", "file:///d1"), stats=SnapshotStats(rows * 16, 0, 0, 0, 0.0))


def _merge(parts: list[Manifest], shards: list[dict[str, ShardRef]]) -> Manifest:
    return merge_parts(parts, shards, name="x", generation="g", committed_at=1.0, seconds=2.0,
                       metadata={"m": 1}, parent=None, devices=("file:///d0", "file:///d1"))


def test_merged_manifest_keeps_ranks_apart_and_round_trips() -> None:
    merged = _merge([_part(0, 3), _part(1, 2)],
                    [{"w": ShardRef(0, 5)}, {"w": ShardRef(3, 5)}])
    assert sorted(t.id for t in merged.tensors) == [0, 1, 2, 3]
    assert [c.key for c in merged.chunks] == [
        "rank-00000/w/c.0.0", "rank-00000/_packs/0/c.0",
        "rank-00001/w/c.0.0", "rank-00001/_packs/0/c.0"]
    assert merged.chunks[2].tensor == 2  # renumbered with its tensor
    assert merged.stats.logical_bytes == 80
    body = json.loads(merged.to_json())
    assert body["version"] == 2
    assert Manifest.from_json(merged.to_json(), "here") == merged
    mine = rank_view(merged, 1)
    assert mine.tree["items"][0][1] == {"t": "tensor", "id": 2}
    assert {t.id for t in mine.tensors} == {2, 3}
    view, pieces = global_view(merged)
    assert {t.id: t.shape for t in view.tensors} == {0: (5, 4), 1: (4,)}
    assert [p.rank for p in pieces[0]] == [0, 1]


def test_single_process_manifest_stays_version_1() -> None:
    body = json.loads(_part(0, 2).to_json())
    assert body["version"] == 1
    assert "ranks" not in body and "shard" not in body["tensors"][0]


def _on_devices(part: Manifest, n: int) -> Manifest:
    """``part`` striped over ``n`` devices of another host's write group."""
    return replace(part, devices=tuple(f"file:///other/d{d}" for d in range(n)),
                   chunks=tuple(replace(c, device=i % n) for i, c in enumerate(part.chunks)))


def test_a_part_written_on_another_write_group_counts_devices_there() -> None:
    other = _on_devices(_part(1, 2), 2)  # the coordinator's host has one device
    merged = merge_parts([replace(_part(0, 3), devices=("file:///d0",),
                                  chunks=tuple(replace(c, device=0)
                                               for c in _part(0, 3).chunks)), other],
                         [{}, {}], name="x", generation="g", committed_at=1.0, seconds=2.0,
                         metadata={}, parent=None, devices=("file:///d0",),
                         part_devices={1: other.devices})
    merged = replace(merged, dcp={"remote_ranks": [1]})
    assert max(c.device for c in merged.chunks if c.key.startswith("rank-00001/")) == 1
    assert {c.key.split("/")[0]: merged.group_elsewhere(c) for c in merged.chunks} == {
        "rank-00000": None, "rank-00001": other.devices}
    assert json.loads(merged.to_json())["version"] == 3
    assert Manifest.from_json(merged.to_json(), "here") == merged
    mirrored = mirror_manifest(merged, FsspecBlobStore("memory://m"))
    assert json.loads(mirrored.to_json())["version"] == 2  # one write group again
    assert Manifest.from_json(mirrored.to_json(), "there") == mirrored


def test_a_chunk_beyond_its_parts_write_group_is_an_integrity_error() -> None:
    other = _on_devices(_part(1, 2), 2)
    merged = replace(merge_parts(
        [_part(0, 3), other], [{}, {}], name="x", generation="g", committed_at=1.0,
        seconds=2.0, metadata={}, parent=None, devices=("file:///a", "file:///b", "file:///c"),
        part_devices={1: other.devices[:1]}), dcp={"remote_ranks": [1]})
    with pytest.raises(IntegrityError, match=r"snapshots/x/g/isolane.json.*"
                       r"rank-00001/_packs/0/c.0' is on device 1, but its part was saved "
                       r"over 1 device"):
        Manifest.from_json(merged.to_json(), "snapshots/x/g/isolane.json")


def test_a_part_with_devices_of_its_own_must_be_a_remote_rank() -> None:
    """Its chunks are read from the mirror only: a manifest that would read them from
    its own devices is damaged."""
    other = _on_devices(_part(1, 2), 2)
    merged = merge_parts([_part(0, 3), other], [{}, {}], name="x", generation="g",
                         committed_at=1.0, seconds=2.0, metadata={}, parent=None,
                         devices=("file:///d0", "file:///d1"), part_devices={1: other.devices})
    with pytest.raises(IntegrityError, match=r"rank-00001.*remote_ranks"):
        Manifest.from_json(merged.to_json(), "m")


def test_a_version_2_manifest_without_part_devices_still_reads() -> None:
    merged = _merge([_part(0, 3), _part(1, 2)],
                    [{"w": ShardRef(0, 5)}, {"w": ShardRef(3, 5)}])
    body = json.loads(merged.to_json())
    assert body["version"] == 2 and all("devices" not in r for r in body["ranks"])
    body.pop("checksum")  # as written before the field existed
    assert Manifest.from_json(json.dumps(body).encode(), "old") == merged


@pytest.mark.parametrize(("shards", "problem"), [
    ([{"w": ShardRef(0, 5)}, {"w": ShardRef(2, 5)}], "gap or overlap at row 3"),
    ([{"w": ShardRef(0, 6)}, {"w": ShardRef(3, 6)}], "cover 5 of 6 rows"),
    ([{"w": ShardRef(0, 5)}, {"w": ShardRef(3, 6)}], "disagree"),
])
def test_pieces_that_do_not_tile_the_tensor_are_refused(
        shards: list[dict[str, ShardRef]], problem: str) -> None:
    with pytest.raises(InvalidArgumentError, match=problem):
        _merge([_part(0, 3), _part(1, 2)], shards)


def test_rank_specific_keys_only_load_with_the_saved_world_size() -> None:
    other = _part(1, 2)
    other = Manifest(**{**other.__dict__, "tensors": (
        *other.tensors, TensorRecord(2, "extra", "float32", (1,), pack=PackRef("p", 0, 4, "")))})
    merged = _merge([_part(0, 3), other], [{}, {}])
    with pytest.raises(InvalidArgumentError, match=r"'extra'.*world size 2"):
        global_view(merged)


def test_check_shards_names_the_bad_key() -> None:
    assert check_shards({"w": Shard(2, 5)}, {"w": (3, 4)}) == {"w": ShardRef(2, 5)}
    with pytest.raises(InvalidArgumentError, match="'v'"):
        check_shards({"v": Shard(0, 5)}, {"w": (3, 4)})
    with pytest.raises(InvalidArgumentError, match=r"rows \[3, 6\)"):
        check_shards({"w": Shard(3, 5)}, {"w": (3, 4)})
    assert Shard.even(1, 2, 5) == Shard(3, 5)
