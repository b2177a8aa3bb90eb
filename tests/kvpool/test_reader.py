from __future__ import annotations

from pathlib import Path

import pytest
import torch

from isolane.kvpool.log.coalesce import coalesce_ranges
from isolane.kvpool.log.reader import piece_bytes_for, scatter_piece, tensor_chunks
from isolane.kvpool.log.segment_log import SegmentLog
from tests.support.damage import flip_byte


def _joined(chunks: list[memoryview]) -> bytes:
    return b"".join(bytes(c) for c in chunks)


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("make", [
    lambda t: t,                               # contiguous: one chunk
    lambda t: t.narrow(2, 64, 64),             # a block of tokens: one chunk per (layer, k/v)
    lambda t: t[1:3].narrow(2, 0, 128),        # offset into the storage
])
def test_tensor_chunks_follow_row_major_order(make: object) -> None:
    base = torch.arange(4 * 2 * 256 * 4 * 64, dtype=torch.float32).view(4, 2, 256, 4, 64)
    view = make(base)  # type: ignore[operator]
    chunks = tensor_chunks(view)
    assert chunks is not None
    assert _joined(chunks) == _bytes(view)
    for chunk in chunks:  # writable views of the tensor's own memory
        chunk[0] ^= 0xFF
    assert not torch.equal(view, make(torch.arange(base.numel(),  # type: ignore[operator]
                                                   dtype=torch.float32).view(base.shape)))


def test_tensor_chunks_refuse_fragmented_views() -> None:
    t = torch.zeros(64, 64, dtype=torch.float16)
    assert tensor_chunks(t.t()) is None  # column-major: 2-byte runs
    assert tensor_chunks(t[:, :8]) is None  # 16-byte runs: a bounce copy is cheaper
    assert tensor_chunks(torch.zeros(0)) is None


def test_piece_size_stays_within_bounds() -> None:
    assert piece_bytes_for(1 << 20, 4) == 1 << 20
    assert piece_bytes_for(64 << 20, 4) == 8 << 20
    assert piece_bytes_for(32 << 20, 4) == 4 << 20


def test_scatter_piece_reads_into_destinations_and_verifies(tmp_path: Path) -> None:
    values = [bytes([i]) * (1000 + 100 * i) for i in range(6)]
    keys = [i.to_bytes(16, "little") for i in range(6)]
    with SegmentLog(tmp_path, segment_bytes=1 << 20) as log:
        log.append_many(list(zip(keys, values, strict=True)))
        locs = [log.locate(k) for k in keys]
        assert all(locs)
        piece = coalesce_ranges([locs[0], None, locs[2], locs[3]])[0]  # gaps: 1 is skipped
        dests = {i: [memoryview(bytearray(len(values[i]) - 10)), memoryview(bytearray(10))]
                 for i in (0, 2, 3)}
        outcome = scatter_piece(log, piece, dests)
        assert sorted(outcome.verified) == [0, 2, 3] and not outcome.damaged
        for i, parts in dests.items():
            assert _joined(parts) == values[i]
        loc = locs[2]
        assert loc is not None
        segment = next(p for p in tmp_path.iterdir() if p.suffix == ".live")
        flip_byte(segment, loc.value_offset + 5)
        outcome = scatter_piece(log, piece, dests)
        assert sorted(outcome.verified) == [0, 3]
        assert [i for i, _ in outcome.damaged] == [2]
        assert "checksum mismatch" in str(outcome.damaged[0][1])
        with pytest.raises(ValueError, match="holds 5 bytes"):
            scatter_piece(log, piece, {**dests, 0: [memoryview(bytearray(5))]})
