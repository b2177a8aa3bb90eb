"""Snapshot stream format (pure): headers are checked, tensors survive bit for bit."""

from __future__ import annotations

import json
from collections import OrderedDict

import pytest
import torch

from isolane.errors import PayloadTooLargeError, WireFormatError
from isolane.snapshot.tree import flatten_state
from isolane.wire import snapshot_stream as ss

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
          torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
          torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16]


def _sample(dtype: torch.dtype) -> torch.Tensor:
    base = torch.linspace(-3, 3, 24)
    if dtype == torch.bool:
        return base.reshape(2, 3, 4) > 0
    if dtype.is_complex:
        return torch.complex(base, -base).to(dtype).reshape(2, 3, 4)
    return base.to(dtype).reshape(2, 3, 4) if dtype.is_floating_point else \
        torch.arange(24).to(dtype).reshape(2, 3, 4)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tensor_bytes_round_trip_bit_exact(dtype: torch.dtype) -> None:
    tensor = _sample(dtype)
    tree, leaves = flatten_state({"t": tensor, "view": tensor[:, 1]})  # a strided view too
    plain = ss.header_for("n", tree, leaves, {})
    header = ss.decode_header(plain.with_chunks(ss.tensor_chunks(plain.tensors, 5)).encode())
    views = {leaf.id: ss.tensor_bytes(leaf.tensor) for leaf in leaves}
    back = {e.id: ss.empty_tensor(e) for e in header.tensors}
    for chunk in header.chunks:
        data = bytes(ss.chunk_view(chunk, views))
        assert len(data) == chunk.nbytes <= 5
        piece = chunk.pieces[0]
        dst = ss.writable_bytes(back[piece.tensor])
        dst[piece.src_offset:piece.src_offset + piece.nbytes] = data
    for leaf in leaves:
        got = back[leaf.id]
        assert got.dtype == dtype and got.shape == leaf.tensor.shape
        assert ss.tensor_bytes(got).tobytes() == ss.tensor_bytes(leaf.tensor).tobytes()


def test_packed_chunks_carry_gaps_and_hash_with_padding() -> None:
    tree, leaves = flatten_state({"a": torch.arange(3, dtype=torch.uint8),
                                  "b": torch.arange(5, dtype=torch.uint8)})
    pack = ss.ChunkEntry("_packs/0/c.0", 80, 69, (ss.PieceEntry(0, 0, 0, 3),
                                                  ss.PieceEntry(1, 0, 64, 5)))
    header = ss.decode_header(ss.header_for("p", tree, leaves, {}, [pack]).encode())
    views = {leaf.id: ss.tensor_bytes(leaf.tensor) for leaf in leaves}
    data = bytes(ss.chunk_view(header.chunks[0], views))
    assert data == bytes([0, 1, 2]) + bytes(61) + bytes([0, 1, 2, 3, 4])
    assert ss.chunk_digest(data, 80) == ss.chunk_digest(data + bytes(11), 80)
    assert ss.hash_hex(ss.hash_bytes(ss.chunk_digest(data, 80))) == ss.chunk_digest(data, 80)


@pytest.mark.parametrize(("chunks", "message"), [
    ([], "exactly once"),
    ([{"key": "w/c.0", "stored": 16, "nbytes": 16, "pieces": [[0, 0, 0, 8]]}],
     "exactly once"),
    ([{"key": "w/c.0", "stored": 16, "nbytes": 16, "pieces": [[0, 0, 0, 16]]},
      {"key": "w/c.1", "stored": 16, "nbytes": 16, "pieces": [[0, 8, 0, 8]]}],
     "exactly once"),
    ([{"key": "w/c.0", "stored": 16, "nbytes": 16, "pieces": [[7, 0, 0, 16]]}],
     "does not have"),
    ([{"key": "w/c.0", "stored": 8, "nbytes": 16, "pieces": [[0, 0, 0, 16]]}],
     "malformed chunk"),
    ([{"key": "../x", "stored": 16, "nbytes": 16, "pieces": [[0, 0, 0, 16]]}],
     "malformed chunk"),
    ([{"key": "w/c.0", "stored": 16, "nbytes": 8, "pieces": [[0, 0, 0, 16]]}],
     "sends 8"),
])
def test_chunks_must_hold_every_tensor_byte_once(chunks: list[object], message: str) -> None:
    with pytest.raises(WireFormatError, match=message):
        ss.decode_header(_raw_header(chunks=chunks))


def test_header_keeps_tree_metadata_and_shapes() -> None:
    state = {"model": OrderedDict(w=torch.zeros(3, 2)), "step": 5, "empty": torch.zeros(0, 4),
             "scalar": torch.tensor(1.5)}
    tree, leaves = flatten_state(state)
    header = ss.header_for("step-5", tree, leaves, {"loss": 0.5})
    back = ss.decode_header(header.encode(), need_chunks=False)
    assert back.tree == tree and back.metadata == {"loss": 0.5} and back.name == "step-5"
    assert [(t.key, t.dtype, t.shape, t.nbytes) for t in back.tensors] == [
        ("model.w", "float32", (3, 2), 24), ("empty", "float32", (0, 4), 0),
        ("scalar", "float32", (), 4)]
    length = ss.decode_preamble(ss.encode_preamble(header.encode()))
    assert length == len(header.encode())
    chunked = header.with_chunks(ss.tensor_chunks(header.tensors))
    assert [c.nbytes for c in chunked.chunks] == [24, 0, 4]
    encoded = chunked.encode()
    assert chunked.stream_bytes() == (ss.PREAMBLE.size + len(encoded) + ss.END.size
                                      + 3 * (ss.CHUNK_HEADER.size + ss.HASH_BYTES) + 28)
    assert chunked.stream_bytes(linked={0}) == chunked.stream_bytes() - 24


def _raw_header(**changes: object) -> bytes:
    tree, leaves = flatten_state({"w": torch.zeros(2, 2)})
    plain = ss.header_for("x", tree, leaves, {})
    data = json.loads(plain.with_chunks(ss.tensor_chunks(plain.tensors)).encode())
    data.update(changes)
    return json.dumps(data).encode()


@pytest.mark.parametrize(("changes", "message"), [
    ({"version": 1}, "version 2"),
    ({"tensors": [{"id": 0, "key": "w", "dtype": "float32", "shape": [2, 2], "nbytes": 15}]},
     "16 bytes, but the stream says 15"),
    ({"tensors": [{"id": 0, "key": "w", "dtype": "__class__", "shape": [2], "nbytes": 8}]},
     "unknown dtype"),
    ({"tensors": [{"id": 0, "key": "w", "dtype": "Tensor", "shape": [2], "nbytes": 8}]},
     "unknown dtype"),
    ({"tensors": []}, "other tensors"),
    ({"tree": {"t": "tensor"}}, "malformed tree"),
    ({"tree": {"t": "pickle", "v": "gASV"}}, "malformed tree"),
])
def test_malformed_headers_are_refused(changes: dict[str, object], message: str) -> None:
    with pytest.raises(WireFormatError, match=message):
        ss.decode_header(_raw_header(**changes))


def test_preamble_and_end_marker_are_checked() -> None:
    with pytest.raises(WireFormatError, match="not a snapshot stream"):
        ss.decode_preamble(b"ISOKVBAT" + bytes(8))
    with pytest.raises(WireFormatError, match=r"version 1 .* not supported"):
        ss.decode_preamble(ss.PREAMBLE.pack(ss.STREAM_MAGIC, 1, 0, 10))
    too_long = ss.PREAMBLE.pack(ss.STREAM_MAGIC, 2, 0, ss.MAX_HEADER_BYTES + 1)
    with pytest.raises(PayloadTooLargeError, match=r"node\.max_header_bytes"):
        ss.decode_preamble(too_long)
    ss.check_end(ss.encode_end(1, 8), 1, 8)
    with pytest.raises(WireFormatError, match="end marker"):
        ss.check_end(ss.END.pack(ss.END_MAGIC, 1, 7), 1, 8)
    chunk = ss.ChunkEntry("w/c.0", 8, 8, (ss.PieceEntry(0, 0, 0, 8),))
    assert ss.check_chunk_header(ss.encode_chunk_header(0, 8), 0, chunk) is False
    assert ss.check_chunk_header(ss.encode_chunk_header(0, 8, linked=True), 0, chunk) is True
    with pytest.raises(WireFormatError, match="out of order"):
        ss.check_chunk_header(ss.encode_chunk_header(1, 8), 0, chunk)
    with pytest.raises(WireFormatError, match="out of order"):
        ss.check_chunk_header(ss.CHUNK_HEADER.pack(0, 4, 8), 0, chunk)
