"""Snapshot stream format (pure): headers are checked, tensors survive bit for bit."""

from __future__ import annotations

import json
from collections import OrderedDict

import pytest
import torch

from isolane.errors import WireFormatError
from isolane.service import snapstream as ss
from isolane.service.spool import plan_offsets
from isolane.snapshot.tree import flatten_state

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
    header = ss.decode_header(ss.header_for("n", tree, leaves, {}).encode())
    offsets, size = plan_offsets(header.tensors)
    spool = bytearray(size)
    for leaf, entry in zip(leaves, header.tensors, strict=True):
        data = ss.tensor_bytes(leaf.tensor)
        spool[offsets[entry.id]:offsets[entry.id] + len(data)] = data
    for leaf, entry in zip(leaves, header.tensors, strict=True):
        back = ss.tensor_from_buffer(spool, offsets[entry.id], entry)
        assert back.dtype == dtype and back.shape == leaf.tensor.shape
        assert ss.tensor_bytes(back).tobytes() == ss.tensor_bytes(leaf.tensor).tobytes()
        assert offsets[entry.id] % 64 == 0


def test_header_keeps_tree_metadata_and_shapes() -> None:
    state = {"model": OrderedDict(w=torch.zeros(3, 2)), "step": 5, "empty": torch.zeros(0, 4),
             "scalar": torch.tensor(1.5)}
    tree, leaves = flatten_state(state)
    header = ss.header_for("step-5", tree, leaves, {"loss": 0.5})
    back = ss.decode_header(header.encode())
    assert back.tree == tree and back.metadata == {"loss": 0.5} and back.name == "step-5"
    assert [(t.key, t.dtype, t.shape, t.nbytes) for t in back.tensors] == [
        ("model.w", "float32", (3, 2), 24), ("empty", "float32", (0, 4), 0),
        ("scalar", "float32", (), 4)]
    length = ss.decode_preamble(ss.encode_preamble(header.encode()))
    assert length == len(header.encode())
    assert header.stream_bytes() == (ss.PREAMBLE.size + length + ss.END.size
                                     + 3 * (ss.TENSOR_HEADER.size + ss.CHECKSUM.size) + 28)


def _raw_header(**changes: object) -> bytes:
    tree, leaves = flatten_state({"w": torch.zeros(2, 2)})
    data = json.loads(ss.header_for("x", tree, leaves, {}).encode())
    data.update(changes)
    return json.dumps(data).encode()


@pytest.mark.parametrize(("changes", "message"), [
    ({"version": 2}, "version 1"),
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
    too_long = ss.PREAMBLE.pack(ss.STREAM_MAGIC, 1, 0, ss.MAX_HEADER_BYTES + 1)
    with pytest.raises(WireFormatError, match="over the limit"):
        ss.decode_preamble(too_long)
    tree, leaves = flatten_state({"w": torch.zeros(2)})
    header = ss.header_for("x", tree, leaves, {})
    ss.check_end(ss.encode_end(header), header)
    with pytest.raises(WireFormatError, match="end marker"):
        ss.check_end(ss.END.pack(ss.END_MAGIC, 1, 7), header)
    with pytest.raises(WireFormatError, match="out of order"):
        ss.check_tensor_header(ss.TENSOR_HEADER.pack(1, 0, 8), header.tensors[0])
