from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from isolane.snapshot.plan import (
    PACKS_GROUP,
    ChunkPlan,
    TensorSpec,
    array_path,
    interleave_by_device,
    plan_chunk_shape,
    plan_save,
)

shapes = st.lists(st.integers(0, 300), min_size=0, max_size=4).map(tuple)


@given(shape=shapes, itemsize=st.sampled_from([1, 2, 4, 8]),
       chunk_bytes=st.sampled_from([64, 1000, 4096, 1 << 16]))
def test_chunks_hold_at_most_chunk_bytes_and_tile_the_tensor(
        shape: tuple[int, ...], itemsize: int, chunk_bytes: int) -> None:
    if 0 in shape or not shape:
        return
    chunk = plan_chunk_shape(shape, itemsize, chunk_bytes)
    assert len(chunk) == len(shape)
    assert all(1 <= c <= s for c, s in zip(chunk, shape, strict=True))
    assert math.prod(chunk) * itemsize <= max(chunk_bytes, itemsize)
    # C-contiguous: only one dim is split; every dim after it is whole, before it 1.
    split = [i for i, (c, s) in enumerate(zip(chunk, shape, strict=True)) if c != s]
    if split:
        d = split[-1]
        assert all(chunk[i] == shape[i] for i in range(d + 1, len(shape)))
        assert all(chunk[i] == 1 for i in range(d))


@settings(max_examples=60)
@given(sizes=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 40)), min_size=1,
                      max_size=30),
       n_devices=st.integers(1, 4), chunk_bytes=st.sampled_from([256, 1024, 4096]),
       pack_threshold=st.sampled_from([0, 64, 256]))
def test_every_tensor_byte_is_planned_exactly_once(
        sizes: list[tuple[int, int]], n_devices: int, chunk_bytes: int, pack_threshold: int
) -> None:
    specs = [TensorSpec(i, (f"t{i}",), "float32", (a, b), 4) for i, (a, b) in enumerate(sizes)]
    plan = plan_save(specs, n_devices=n_devices, chunk_bytes=chunk_bytes,
                     pack_threshold=min(pack_threshold, chunk_bytes))
    covered: dict[int, list[tuple[int, int]]] = {s.id: [] for s in specs}
    for chunk in plan.chunks:
        assert 0 <= chunk.device < n_devices
        assert chunk.data_nbytes <= chunk.stored_nbytes
        dst_end = 0
        for piece in sorted(chunk.pieces, key=lambda p: p.dst_offset):
            assert piece.dst_offset >= dst_end  # pieces never overlap inside a chunk
            dst_end = piece.dst_offset + piece.nbytes
            covered[piece.tensor_id].append((piece.src_offset, piece.nbytes))
        if chunk.is_pack:
            assert all(p.dst_offset % 64 == 0 for p in chunk.pieces)
    for spec in specs:
        runs = sorted(covered[spec.id])
        pos = 0
        for start, n in runs:
            assert start == pos
            pos += n
        assert pos == spec.nbytes
        assert (spec.id in plan.packed) != (spec.id in plan.array_of)


def test_small_tensors_are_packed_and_big_ones_get_arrays() -> None:
    specs = [TensorSpec(0, ("big",), "bfloat16", (1024, 1024), 2),
             *[TensorSpec(i, (f"bias{i}",), "float32", (16,), 4) for i in range(1, 200)],
             TensorSpec(200, ("scalar",), "float32", (), 4),
             TensorSpec(201, ("empty",), "float32", (0, 5), 4)]
    plan = plan_save(specs, n_devices=2, chunk_bytes=1 << 20, pack_threshold=4096)
    assert plan.array_of == {0: "big"}
    assert set(plan.packed) == set(range(1, 202))
    packs = [a for a in plan.arrays if a.path.startswith(PACKS_GROUP + "/")]
    assert len(packs) == 1  # 200 tiny tensors: one object, not 200
    big_chunks = [c for c in plan.chunks if c.array == "big"]
    assert len(big_chunks) == 2 and {c.device for c in big_chunks} == {0, 1}


def test_parent_devices_keep_chunks_where_the_parent_had_them() -> None:
    specs = [TensorSpec(0, ("w",), "float32", (4, 1024), 4)]
    first = plan_save(specs, n_devices=2, chunk_bytes=4096, pack_threshold=0)
    flipped = {c.key: 1 - c.device for c in first.chunks}
    second = plan_save(specs, n_devices=2, chunk_bytes=4096, pack_threshold=0,
                       parent_devices=flipped)
    assert {c.key: c.device for c in second.chunks} == flipped


def test_array_paths_are_escaped_and_unique() -> None:
    taken: set[str] = set()
    assert array_path(["model", "layers.0.weight"], taken) == "model/layers.0.weight"
    assert array_path(["a/b", ".."], taken) == "a%2Fb/%2E."
    assert array_path(["_packs"], taken) == "%5Fpacks"
    assert array_path(["c"], taken) == "%63"
    first = array_path([0], taken)
    assert array_path(["0"], taken) != first


def test_interleave_by_device_alternates_devices_and_keeps_each_devices_order() -> None:
    chunks = [ChunkPlan("a", (i,), 1, (), device) for i, device in enumerate([0, 0, 0, 1, 2])]
    order = interleave_by_device(chunks, 3)
    assert [(c.device, c.coords[0]) for c in order] == [(0, 0), (1, 3), (2, 4), (0, 1), (0, 2)]
    assert interleave_by_device(chunks, 1) == chunks


def test_packs_come_first_so_their_writes_overlap_the_hashing_of_big_chunks() -> None:
    """An incremental save links most big chunks but always writes its packs: the
    stager takes chunks in plan order, so the packs must lead."""
    specs = [TensorSpec(0, ("base",), "float32", (4096, 64), 4),
             TensorSpec(1, ("adapter",), "float32", (8, 64), 4),
             TensorSpec(2, ("base2",), "float32", (2048, 64), 4),
             TensorSpec(3, ("step",), "float32", (), 4)]
    plan = plan_save(specs, n_devices=2, chunk_bytes=1 << 16, pack_threshold=1 << 12)
    kinds = [c.is_pack for c in plan.chunks]
    assert kinds[0] and not all(kinds)
    assert kinds == sorted(kinds, reverse=True)  # every pack before every big chunk
    assert {c.pieces[0].tensor_id for c in plan.chunks if not c.is_pack} == {0, 2}
