"""Batch framing (framing.py) and the vectorised batch paths of the segment log: the bytes
equal the record-by-record encoding, the index equals a dict model, hints built from
the columns equal the per-key encoding."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from isolane.errors import InvalidArgumentError
from isolane.kvpool.log.framing import INLINE_VALUE_BYTES, frame_puts
from isolane.kvpool.log.hint_columns import decode_share
from isolane.kvpool.log.key_slots import key_words
from isolane.kvpool.log.keydir import FLAG_PUT, encode_hint
from isolane.kvpool.log.keytable import KeyDirectory
from isolane.kvpool.log.records import PendingRecord, parse_run
from isolane.kvpool.log.segment_log import SegmentLog

KiB = 1024


def _joined(parts: list[object]) -> bytes:
    return b"".join(bytes(memoryview(p).cast("B")) for p in parts)  # type: ignore[arg-type]


def _reference(keys: list[bytes], values: list[bytes], ts: int, salt: int) -> bytes:
    out = []
    for k, v in zip(keys, values, strict=True):
        p = PendingRecord.encode(k, FLAG_PUT, memoryview(v), ts)
        p.bind(salt)
        out.append(bytes(p.head) + b"".join(bytes(x) for x in p.parts))
    return b"".join(out)


@pytest.mark.parametrize("sizes", [[4096] * 7, [0, 1, 63, 64, 65, 4095, 5000],
                                   [INLINE_VALUE_BYTES, 100, 70_000, 0]])
@pytest.mark.parametrize("klens", [[16], [1, 5, 16, 17, 40, 1024]])
def test_framed_bytes_equal_the_record_by_record_encoding(sizes: list[int],
                                                          klens: list[int]) -> None:
    rng = np.random.default_rng(len(sizes) + len(klens))
    keys = [rng.integers(0, 256, klens[i % len(klens)], np.uint8).tobytes()
            for i in range(len(sizes))]
    values = [rng.integers(0, 256, n, np.uint8).tobytes() for n in sizes]
    batch = frame_puts(keys, [memoryview(v) for v in values], 1234567)
    batch.bind(0xDEADBEEF12345678)
    assert _joined(batch.iovecs) == _reference(keys, values, 1234567, 0xDEADBEEF12345678)
    assert batch.nbytes == len(_joined(batch.iovecs))
    recs = parse_run(memoryview(_joined(batch.iovecs)), 64, salt=0xDEADBEEF12345678)
    assert [r.key for r in recs] == keys
    assert [bytes(r.value) for r in recs] == values
    assert batch.csum.tolist() == [r.checksum for r in recs]
    assert (batch.rel + 64).tolist() == [r.record_offset for r in recs]


def test_frame_refuses_bad_keys_and_values() -> None:
    with pytest.raises(InvalidArgumentError, match="1 to 1024 bytes"):
        frame_puts([b""], [b"x"], 1)
    with pytest.raises(InvalidArgumentError, match="1 to 1024 bytes"):
        frame_puts([b"k" * 1025], [b"x"], 1)
    with pytest.raises(InvalidArgumentError, match="contiguous bytes-like"):
        frame_puts([b"k" * 16], [12], 1)  # type: ignore[list-item]


def test_key_words_match_the_per_key_path() -> None:
    keys = [os.urandom(16) for _ in range(50)] + [b"a", b"abc" * 10]
    k0, k1, klen = key_words(keys)
    kd = KeyDirectory()
    for i, k in enumerate(keys):
        kd.put(k, (1, 64 * (i + 1), 64 * (i + 1) + 64, 0, 64 * (i + 2), i, 0))
    rows = kd.find_rows(keys)
    assert (rows >= 0).all()
    assert klen.tolist() == [len(k) for k in keys]
    assert int(k0[0]) == int.from_bytes(keys[0][:8], "little")
    assert int(k1[0]) == int.from_bytes(keys[0][8:], "little")
    assert int(k0[50]) == int.from_bytes(b"a".ljust(8, b"\0"), "little") and int(k1[50]) == 0
    assert kd.find_rows([b"nope" * 4, b"missing"]).tolist() == [-1, -1]
    kd.delete(keys[3], 2)  # a tombstone reads as absent, on the scalar and vector paths
    small, big = kd.find_rows(keys[:8]), kd.find_rows(keys)
    assert small[3] == big[3] == -1 and (small == big[:8]).all()


@pytest.mark.parametrize("seed", [1, 2])
def test_append_blocks_index_equals_a_dict_model(tmp_path: Path, seed: int) -> None:
    rng = np.random.default_rng(seed)
    pool = [rng.integers(0, 256, 16, np.uint8).tobytes() for _ in range(300)]
    pool += [b"short", b"x" * 40]
    model: dict[bytes, bytes] = {}
    with SegmentLog(tmp_path / "kv", segment_bytes=256 * KiB) as log:
        for _ in range(40):
            n = int(rng.integers(1, 60))
            keys = [pool[int(i)] for i in rng.integers(0, len(pool), n)]  # duplicates too
            values = [rng.integers(0, 256, int(rng.choice([512, 4096, 40_000])),
                                   np.uint8).tobytes() for _ in keys]
            assert log.append_blocks(keys, values) == n
            model.update(zip(keys, values, strict=True))
            if rng.random() < 0.2:
                gone = pool[int(rng.integers(0, len(pool)))]
                assert log.delete(gone) == (gone in model)
                model.pop(gone, None)
        assert len(log) == len(model)
        probe = [*pool, b"absent-key-00000"]
        found = log.contains_many(probe)
        assert found.tolist() == [k in model for k in probe]
        for k, loc in zip(probe, log.locate_many(probe), strict=True):
            assert (loc is None) == (k not in model)
            if loc is not None:
                assert loc == log.locate(k)
                assert bytes(log.read(loc)) == model[k]
        by_fives = [loc for i in range(0, len(probe), 5)  # key by key (keytable.SCALAR_BATCH)
                    for loc in log.locate_many(probe[i:i + 5])]
        assert by_fives == log.locate_many(probe)  # batched: the same
        live = {s.segment_id: s.live_bytes for s in log.segments()}
    with SegmentLog(tmp_path / "kv", segment_bytes=256 * KiB) as log:  # hints + scan
        assert {k: bytes(v) for k in model if (v := log.get(k)) is not None} == model
        assert {s.segment_id: s.live_bytes for s in log.segments()} == live


def test_hint_from_columns_equals_the_per_key_encoding(tmp_path: Path) -> None:
    keys = [os.urandom(16) for _ in range(200)]
    with SegmentLog(tmp_path / "kv", segment_bytes=1 << 20) as log:
        log.append_blocks(keys, [os.urandom(1000) for _ in keys])
        log.append_blocks(keys[:50], [os.urandom(3000) for _ in keys[:50]])  # overwrites
        for k in keys[60:70]:
            log.delete(k)
        sid = log.segments()[-1].segment_id
        kd = log._keydir
        size = log.segments()[-1].file_bytes
        fast = kd.hint_bytes(sid, size)
        share = kd.share(sid)
    slow = encode_hint(sid, size, share)
    assert fast[:8] == slow[:8] and fast[8:10] == b"\x02\0" and slow[8:10] == b"\x01\0"
    assert len(fast) < len(slow)
    a, b = decode_share(fast, sid, size), decode_share(slow, sid, size)
    assert (a.keys, a.entries, a.live_bytes) == (b.keys, b.entries, b.live_bytes)
    assert sorted(a.tombstones) == sorted(b.tombstones) == sorted(keys[60:70])


def test_rotation_during_appends_leaves_hints_that_reopen_uses(tmp_path: Path) -> None:
    keys = [os.urandom(16) for _ in range(2000)]
    values = [os.urandom(4096) for _ in keys]
    with SegmentLog(tmp_path / "kv", segment_bytes=1 << 20) as log:
        for i in range(0, len(keys), 100):
            log.append_blocks(keys[i:i + 100], values[i:i + 100])
        sealed = [s.segment_id for s in log.segments() if s.state == "sealed"]
        assert len(sealed) >= 7
    hints = sorted(p.name for p in (tmp_path / "kv").glob("*.hint"))
    assert hints == [f"seg-{sid:08d}.hint" for sid in sealed]  # close waited for them
    with SegmentLog(tmp_path / "kv", segment_bytes=1 << 20) as log:
        assert all(bytes(log.get(k) or b"") == v for k, v in zip(keys, values, strict=True))


def test_adjacent_runs_for_one_device_merge_into_one_append() -> None:
    from isolane.kvpool.tiers.disk import _merge_runs

    assert _merge_runs([(0, 0, 4), (0, 4, 8), (1, 8, 12), (0, 12, 16), (0, 16, 18)]) == [
        (0, 0, 8), (1, 8, 12), (0, 12, 18)]
    assert _merge_runs([]) == []


def test_vectorised_apply_of_a_scan_equals_the_per_key_path() -> None:
    rng = np.random.default_rng(5)
    pool = [rng.integers(0, 256, 16, np.uint8).tobytes() for _ in range(40)] + [b"k1", b"k22"]
    fast, slow = KeyDirectory(), KeyDirectory()
    for sid in (1, 2, 3):
        items = []
        pos = 64
        for _ in range(200):
            k = pool[int(rng.integers(0, len(pool)))]
            if rng.random() < 0.2:
                items.append((k, 2, (sid, pos, pos + 64, 0, pos + 64, 0, 0)))
                pos += 64
            else:
                items.append((k, 1, (sid, pos, pos + 64, 128, pos + 192, int(pos), 7)))
                pos += 192
        fast.apply(sid, items)
        for key, flags, entry in items:  # the per-key reference
            if flags == 2:
                slow.delete(key, sid)
            else:
                slow.put(key, entry)
    assert len(fast) == len(slow)
    assert {k: fast.get(k) for k in pool} == {k: slow.get(k) for k in pool}
    for sid in (1, 2, 3):
        assert fast.live_bytes(sid) == slow.live_bytes(sid)
        assert fast.live_count(sid) == slow.live_count(sid)
        assert sorted(fast.tombstones_in(sid)) == sorted(slow.tombstones_in(sid))


@pytest.mark.parametrize("sizes", [[4096] * 300, [0, 1, 63, 64, 65, 4096, 5000, 100] * 20])
def test_framing_into_a_used_scratch_buffer_gives_the_same_bytes(sizes: list[int]) -> None:
    """A frame reused across batches (dirty with the last batch's bytes) holds exactly
    the bytes a fresh zeroed frame would: padding and header gaps are zeroed again."""
    keys = [os.urandom(16) if i % 3 else os.urandom(1 + i % 15) for i in range(len(sizes))]
    values = [memoryview(os.urandom(n)) for n in sizes]
    fresh = frame_puts(keys, values, 123)
    scratch = np.full(fresh.frame_bytes + 4096, 0xA5, np.uint8)
    reused = frame_puts(keys, values, 123, scratch)
    assert reused.frame_bytes == fresh.frame_bytes > 0
    for batch in (fresh, reused):
        batch.bind(0x1234)
    assert bytes(reused.iovecs[0]) == bytes(fresh.iovecs[0])
    assert np.shares_memory(reused.iovecs[0], scratch)


def test_appends_reuse_a_frame_buffer(tmp_path: Path) -> None:
    keys = [os.urandom(16) for _ in range(600)]
    values = [os.urandom(100 + i) for i in range(600)]
    with SegmentLog(tmp_path / "kv", segment_bytes=1 << 20) as log:
        for i in range(0, 600, 100):
            log.append_blocks(keys[i:i + 100], values[i:i + 100])
        kept = log.frame_buffers.kept()  # each batch larger than the last: framed anew
        assert 1 <= len(kept) <= log.frame_buffers.keep
        log.append_blocks(keys[:100], values[:100])  # smaller: framed into a kept buffer
        assert {id(b) for b in log.frame_buffers.kept()} == {id(b) for b in kept}
        assert all(bytes(log.get(k)) == v for k, v in zip(keys, values, strict=True))
    with SegmentLog(tmp_path / "kv", segment_bytes=1 << 20) as log:
        assert all(bytes(log.get(k)) == v for k, v in zip(keys, values, strict=True))


def test_the_frame_buffers_of_a_log_stay_bounded_whatever_the_threads(tmp_path: Path) -> None:
    import threading

    from isolane.kvpool.log.framing import FRAME_SCRATCH_MAX

    with SegmentLog(tmp_path / "kv", segment_bytes=8 << 20) as log:
        def put(t: int) -> None:
            for r in range(5):
                keys = [os.urandom(16) for _ in range(64)]
                log.append_blocks(keys, [bytes([t]) * (4096 + 64 * r)] * 64)

        threads = [threading.Thread(target=put, args=(t,)) for t in range(6)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        kept = log.frame_buffers.kept()
        assert 1 <= len(kept) <= log.frame_buffers.keep  # not one a thread
        assert all(len(b) <= FRAME_SCRATCH_MAX for b in kept)
        assert len(log) == 6 * 5 * 64
