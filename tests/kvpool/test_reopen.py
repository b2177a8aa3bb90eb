"""A reopen loads sealed segments from their hint files and scans only the live segment:
the first get is answered without reading any sealed segment's data; a segment whose
hint is damaged is scanned instead (and only that one)."""

from __future__ import annotations

import logging
import os
import random
from pathlib import Path

import numpy as np
import pytest

from isolane.kvpool.log.hint_columns import decode_hint_columns, decode_share, encode_hint_columns
from isolane.kvpool.log.keydir import encode_hint
from isolane.kvpool.log.segment_log import RecordIntegrityError, SegmentLog
from isolane.kvpool.log.segment_scan import read_damage
from tests.kvpool.test_segments import KiB, _fill, files, got
from tests.support.damage import flip_byte


def _segment_id(path: Path) -> int:
    return int(path.name[4:12])


def test_reopen_scans_the_live_segment_only_and_a_segment_whose_hint_is_damaged(
        tmp_path: Path) -> None:
    folder = tmp_path / "kv"
    with SegmentLog(folder, segment_bytes=64 * KiB) as log:
        data = _fill(log, 40)
        locs = {k: log.locate(k) for k in data}
    sealed, live = files(folder, ".sealed"), files(folder, ".live")
    assert len(sealed) >= 3 and len(live) == 1
    live_id = _segment_id(live[0])
    # Damage the first record's value in every segment: a scan drops (and reports) it,
    # a load from the hint does not read it.
    first = {}
    for path in [*sealed, *live]:
        sid = _segment_id(path)
        k, loc = min(((k, v) for k, v in locs.items() if v is not None and v.segment_id == sid),
                     key=lambda kv: kv[1].record_offset)
        flip_byte(path, loc.value_offset + 10)
        first[sid] = k
    damaged_hint = sealed[1]
    flip_byte(damaged_hint.with_suffix(".hint"), 100)
    scanned = {live_id, _segment_id(damaged_hint)}

    with SegmentLog(folder, segment_bytes=64 * KiB) as log:
        reported = {d.segment_id for d in read_damage(folder)}
        assert reported == scanned  # no other segment's data was read at open
        for sid, k in first.items():
            if sid in scanned:
                assert log.locate(k) is None  # the scan dropped the damaged record
            else:
                assert log.locate(k) == locs[k]  # indexed from the hint, data unread
                with pytest.raises(RecordIntegrityError):
                    log.get(k)  # the damage is found when the record is read
        for k, v in data.items():
            if k not in first.values():
                assert got(log, k) == v


def _churn(log: SegmentLog, rounds: int) -> dict[bytes, bytes | None]:
    """Puts over a small key set across many segments (each key rewritten in later
    segments), deletes and re-puts, keys of 16 bytes and shorter: the model to expect."""
    model: dict[bytes, bytes | None] = {}
    keys = [os.urandom(16) for _ in range(60)] + [b"k%d" % i for i in range(20)]
    rng = random.Random(5)
    for r in range(rounds):
        batch = rng.sample(keys, 25)
        items = [(k, os.urandom(rng.choice([0, 10, 3000]))) for k in batch]
        log.append_many(items)
        model.update(items)
        for k in rng.sample(keys, 4):
            log.delete(k)
            model[k] = None
        if r % 4 == 3:
            log.rotate()
    return model


def _check(log: SegmentLog, model: dict[bytes, bytes | None]) -> None:
    assert {k: got(log, k) for k in model} == model
    assert len(log) == sum(v is not None for v in model.values())


@pytest.mark.parametrize("threaded", [False, True])
def test_reopen_from_hints_keeps_the_newest_record_of_every_key(
        tmp_path: Path, threaded: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every sealed segment's hint is entered at once (one table build): a key written
    in several segments keeps its newest value, a deleted key stays deleted, the live
    counts match, and the same holds from the version 1 hints older releases wrote
    (``threaded``: the hints read on the reader thread, as a big pool's are)."""
    if threaded:
        from isolane.kvpool.log import segment_log
        monkeypatch.setattr(segment_log, "THREAD_BYTES", 0)
    folder = tmp_path / "kv"
    with SegmentLog(folder, segment_bytes=64 * KiB) as log:
        model = _churn(log, 40)
        live = {s.segment_id: s.live_bytes for s in log.segments()}
    hints = files(folder, ".hint")
    assert len(hints) >= 8 and all(h.read_bytes()[8:10] == b"\x02\0" for h in hints)
    with SegmentLog(folder, segment_bytes=64 * KiB) as log:
        _check(log, model)
        assert {s.segment_id: s.live_bytes for s in log.segments() if s.segment_id in live} == live
    for hint in hints:  # the version 1 hints of older releases still load
        sid, size = _segment_id(hint), hint.with_suffix(".sealed").stat().st_size
        hint.write_bytes(encode_hint(sid, size, decode_share(hint.read_bytes(), sid, size)))
    with SegmentLog(folder, segment_bytes=64 * KiB) as log:
        _check(log, model)
        assert {s.segment_id: s.live_bytes for s in log.segments() if s.segment_id in live} == live
        assert read_damage(folder) == []


def test_a_version_2_hint_that_lies_is_refused_and_rewritten(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A version 2 hint with a valid checksum whose record runs past the segment, or
    whose short key is not zero padded, is not loaded: the segment is scanned."""
    folder = tmp_path / "kv"
    with SegmentLog(folder, segment_bytes=64 * KiB) as log:
        model = _churn(log, 12)
    hint = files(folder, ".hint")[0]
    sid, size = _segment_id(hint), hint.with_suffix(".sealed").stat().st_size
    good = decode_hint_columns(hint.read_bytes(), sid, size)
    for lie, reason in (("roff", "disagree with the record layout"),
                        ("k1", "not zero padded")):
        cols = decode_hint_columns(hint.read_bytes(), sid, size)
        column = np.array(getattr(cols, lie))
        if lie == "roff":
            column[0] = size  # the record starts at the end of the file
        else:
            short = int(np.flatnonzero(cols.klen < 16)[0])
            column[short] |= np.uint64(1) << np.uint64(63)
        setattr(cols, lie, column)
        hint.write_bytes(encode_hint_columns(cols, size))
        with caplog.at_level(logging.WARNING), SegmentLog(folder,
                                                         segment_bytes=64 * KiB) as log:
            assert reason in caplog.text
            _check(log, model)
        caplog.clear()
        again = decode_hint_columns(hint.read_bytes(), sid, size)  # rewritten, good
        assert again.k0.tolist() == good.k0.tolist() or set(again.k0.tolist()) == set(
            good.k0.tolist())


@pytest.mark.parametrize(("lie", "reason"), [
    ("past the end", "disagree with the record layout"),
    ("inside the header", "disagree with the record layout"),
    ("live bytes", "disagree with the record layout"),
    ("one longer value", "disagree with the record layout"),
    ("none", "")])
def test_a_version_2_hint_of_same_size_records_is_checked_like_any_other(
        tmp_path: Path, lie: str, reason: str) -> None:
    """Hints of blocks (every key 16 bytes, every value the same length: the layout a
    reopen of a KV pool sees) go through the same checks: a record past the segment's
    end or inside its header, live bytes that do not add up, or one value longer than
    the rest where the records leave no room, are refused."""
    from isolane.errors import IntegrityError
    from isolane.kvpool.log.hint_columns import HintColumns
    from isolane.kvpool.log.records import record_geometry

    n, sid = 50, 3
    rb = record_geometry(16, 4096)[1]
    size = 64 + rb * n
    rng = np.random.default_rng(1)
    k = rng.integers(0, 2**63, (n, 2), dtype=np.int64).astype(np.uint64)
    roff = (64 + rb * np.arange(n)).astype(np.uint64)
    vlen = np.full(n, 4096, np.uint32)
    live = rb * n
    if lie == "past the end":
        roff[-1] += np.uint64(64)
    elif lie == "inside the header":
        roff[0] = np.uint64(0)
    elif lie == "live bytes":
        live -= 64
    elif lie == "one longer value":
        vlen[-1] += 64
        live += 64
    cols = HintColumns(sid, n, k[:, 0].copy(), k[:, 1].copy(), np.full(n, 16, np.uint16),
                       roff, vlen, k[:, 0] ^ k[:, 1], np.arange(n, dtype=np.uint64), live,
                       None)
    data = encode_hint_columns(cols, size)
    if not reason:
        again = decode_hint_columns(data, sid, size)
        assert again.roff.tolist() == roff.tolist() and again.live_bytes == live
        return
    with pytest.raises(IntegrityError, match=reason):
        decode_hint_columns(data, sid, size)
