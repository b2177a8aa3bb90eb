from __future__ import annotations

from pathlib import Path

import pytest
import torch

from isolane.kvpool.log.coalesce import coalesce_ranges
from isolane.kvpool.log.reader import (
    piece_bytes_for,
    read_piece,
    scatter_piece,
    tensor_chunks,
    verify_members,
)
from isolane.kvpool.log.records import RecordIntegrityError
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
    assert piece_bytes_for(1 << 30, 4) == 8 << 20


def test_a_restore_range_splits_into_even_pieces_without_a_small_remainder() -> None:
    """Records of 64 KiB blocks are 65,600 bytes: 16 of them are just over 1 MiB and 64
    just over 4 MiB. Pieces of exactly 1 MiB left one small piece more than the lane
    has threads (a second round of reads for one block); even pieces do not."""
    record = 65_600
    for blocks, pieces in ((16, 1), (64, 4), (256, 8)):
        total = blocks * record
        size = piece_bytes_for(total, 4)
        per_piece = size // record  # whole records a piece holds
        assert -(-blocks // per_piece) == pieces, (blocks, size)
        assert size <= 8 << 20


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
        assert log.locate(keys[2]) is None  # dropped by the read itself
        with pytest.raises(ValueError, match="holds 5 bytes"):
            scatter_piece(log, piece, {**dests, 0: [memoryview(bytearray(5))]})


def test_read_piece_returns_checked_values_and_drops_damaged_records(tmp_path: Path) -> None:
    values = [bytes([i]) * (1000 + 100 * i) for i in range(4)]
    keys = [i.to_bytes(16, "little") for i in range(4)]
    with SegmentLog(tmp_path, segment_bytes=1 << 20) as log:
        log.append_many(list(zip(keys, values, strict=True)))
        locs = [log.locate(k) for k in keys]
        piece = coalesce_ranges(locs)[0]
        outcome = read_piece(log, piece)
        assert sorted(outcome.verified) == [0, 1, 2, 3] and not outcome.damaged
        assert {i: bytes(v) for i, v in outcome.values.items()} == dict(enumerate(values))
        loc = locs[1]
        assert loc is not None
        segment = next(p for p in tmp_path.iterdir() if p.suffix == ".live")
        flip_byte(segment, loc.value_offset + 7)
        outcome = read_piece(log, piece)
        assert sorted(outcome.values) == [0, 2, 3]
        assert [i for i, _ in outcome.damaged] == [1]
        # the log dropped it itself: a miss from now on, named in the damage report
        assert log.locate(keys[1]) is None
        assert [(d.segment_id, d.offset) for d in log.damage_report()] == [
            (loc.segment_id, loc.record_offset)]
        log.rotate()
        sealed = log.segments()[0].segment_id
        log.compact(sealed)  # the piece's segment is gone: stale, nothing read
        assert read_piece(log, piece).stale


def test_verify_members_checks_a_run_read_elsewhere(tmp_path: Path) -> None:
    keys = [i.to_bytes(16, "little") for i in range(3)]
    with SegmentLog(tmp_path, segment_bytes=1 << 20) as log:
        log.append_many([(k, k * 100) for k in keys])
        piece = coalesce_ranges([log.locate(k) for k in keys])[0]
        run = bytearray(log.read_run(piece.segment_id, piece.start, piece.end))
    assert sorted(verify_members(memoryview(run), piece).values) == [0, 1, 2]
    loc = piece.members[2][1]
    run[loc.value_offset - piece.start] ^= 1
    outcome = verify_members(memoryview(run), piece)
    assert sorted(outcome.verified) == [0, 1] and [i for i, _ in outcome.damaged] == [2]


def test_drop_damaged_spares_a_key_written_anew(tmp_path: Path) -> None:
    """A damaged read reported late (another reader dropped it, the key was put again)
    must not delete the fresh value."""
    key = b"k" * 16
    with SegmentLog(tmp_path, segment_bytes=1 << 20) as log:
        log.put(key, b"old" * 100)
        segment = next(p for p in tmp_path.iterdir() if p.suffix == ".live")
        old = log.locate(key)
        assert old is not None
        flip_byte(segment, old.value_offset + 3)
        with pytest.raises(RecordIntegrityError) as info:
            log.read(old)
        log.put(key, b"new" * 100)
        log.drop_damaged(key, info.value)
        assert log.get(key) == b"new" * 100
        assert not log.damage_report()
        fresh = log.locate(key)
        assert fresh is not None
        flip_byte(segment, fresh.value_offset + 3)
        with pytest.raises(RecordIntegrityError) as info:
            log.read(fresh)
        log.drop_damaged(key, info.value)
        log.drop_damaged(key, info.value)  # twice (two readers): one drop, one report
        assert log.locate(key) is None and len(log.damage_report()) == 1
