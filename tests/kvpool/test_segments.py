"""SegmentLog on real files: round trips, runs, rotation, reopen, crashes, damage,
compaction, eviction, a full device and concurrent readers/writers."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import logging
import os
import random
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from isolane.errors import (
    CapacityError,
    IntegrityError,
    InvalidArgumentError,
    KeyNotFoundError,
    StorageError,
)
from isolane.kvpool.log.compaction import (
    plan_eviction,
    should_compact,
    should_keep_tombstone,
    should_rotate,
)
from isolane.kvpool.log.hint_columns import decode_share
from isolane.kvpool.log.keydir import encode_hint
from isolane.kvpool.log.segment_log import (
    RECORD_ALIGN,
    RecordIntegrityError,
    SegmentLog,
    StaleLocationError,
    parse_run,
    parse_segment_header,
    verify_record,
)
from tests.support.damage import flip_byte

KiB = 1024
REPO = Path(__file__).resolve().parents[2]


def key(i: int, ns: int = 0) -> bytes:
    return ns.to_bytes(8, "big") + i.to_bytes(8, "big")


def value(k: bytes, n: int, version: int = 0) -> bytes:
    """Self-checking bytes: a function of key, version and length only."""
    block = hashlib.blake2b(k + version.to_bytes(8, "little"), digest_size=64).digest()
    return (block * (n // 64 + 1))[:n]


def versioned_value(k: bytes, n: int, version: int) -> bytes:
    """``value`` that starts with its version, so a reader can check any version."""
    return version.to_bytes(8, "little") + value(k, n - 8, version)


def is_versioned_value(k: bytes, v: memoryview | bytes) -> bool:
    return len(v) >= 8 and v == versioned_value(k, len(v), int.from_bytes(v[:8], "little"))


def got(log: SegmentLog, k: bytes) -> bytes | None:
    v = log.get(k)
    return None if v is None else bytes(v)


def files(folder: Path, suffix: str) -> list[Path]:
    return sorted(folder.glob(f"seg-*{suffix}"))


def segment_salt(folder: Path, segment_id: int) -> int:
    path = next(folder.glob(f"seg-{segment_id:08d}.*"))
    header = parse_segment_header(path.read_bytes()[:64], segment_id)
    assert header is not None
    return header[1]


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return tmp_path / "kv"


# -- pure predicates ------------------------------------------------------------------------
def test_should_rotate() -> None:
    assert not should_rotate(64, 100, 1000, 64)  # empty segment takes any batch
    assert not should_rotate(64, 5000, 1000, 64)  # even an oversized one
    assert not should_rotate(500, 500, 1000, 64)
    assert should_rotate(501, 500, 1000, 64)


def test_should_compact_and_tombstones() -> None:
    assert not should_compact(0, 0, 0.5)
    assert should_compact(0, 100, 0.5)
    assert should_compact(49, 100, 0.5)
    assert not should_compact(50, 100, 0.5)
    assert should_keep_tombstone(5, 3)
    assert not should_keep_tombstone(5, 5)


@given(st.lists(st.integers(1, 1000), max_size=20), st.integers(0, 30000),
       st.integers(0, 5000))
def test_plan_eviction_drops_oldest_first_until_within_budget(
        sizes: list[int], target: int, at_least: int) -> None:
    sealed = list(enumerate(sizes, start=1))
    total = sum(sizes) + 64  # + the live segment
    plan = plan_eviction(sealed, total, target, at_least=at_least)
    assert plan == [sid for sid, _ in sealed[:len(plan)]]  # a prefix: oldest first
    freed = sum(sizes[:len(plan)])
    if len(plan) < len(sealed):  # stopped early: the goal is met
        assert total - freed <= target and freed >= at_least
    if plan:  # and not one segment too many
        before = freed - sizes[len(plan) - 1]
        assert total - before > target or before < at_least


# -- basics ---------------------------------------------------------------------------------
def test_round_trip(folder: Path) -> None:
    sizes = [4 * KiB, 64 * KiB, 5000, 1, 0, 1 * 1024 * KiB + 3]
    with SegmentLog(folder, segment_bytes=4 * 1024 * KiB) as log:
        for i, n in enumerate(sizes):
            loc = log.put(key(i), value(key(i), n))
            assert loc.value_offset % RECORD_ALIGN == 0 and loc.value_length == n
        arr = np.arange(1000, dtype=np.float32)
        log.put(key(99), arr.data)
        for i, n in enumerate(sizes):
            assert got(log, key(i)) == value(key(i), n)
        assert np.array_equal(np.frombuffer(got(log, key(99)) or b"", np.float32), arr)
        assert log.locate(key(1000)) is None and got(log, key(1000)) is None
        assert len(log) == len(sizes) + 1 and key(0) in log
        log.put(key(0), b"new")  # overwrite
        assert got(log, key(0)) == b"new" and len(log) == len(sizes) + 1
        with pytest.raises(InvalidArgumentError):
            log.put(b"", b"x")
        with pytest.raises(InvalidArgumentError):
            log.put(b"k" * 2000, b"x")
        with pytest.raises(InvalidArgumentError):
            log.put(key(1), np.zeros((4, 4))[:, 1].data)  # not contiguous


def test_batch_is_one_contiguous_run(folder: Path) -> None:
    with SegmentLog(folder) as log:
        log.put(key(100), b"before")
        items = [(key(i), value(key(i), 4 * KiB * (i + 1) + i)) for i in range(8)]
        locs = log.append_many(items)
        log.put(key(101), b"after")
        assert len({loc.segment_id for loc in locs}) == 1
        for a, b in itertools.pairwise(locs):
            assert a.record_end == b.record_offset
        start, end = locs[0].record_offset, locs[-1].record_end
        run = log.read_run(locs[0].segment_id, start, end)  # ONE pread
        salt = segment_salt(folder, locs[0].segment_id)
        records = parse_run(run, start, salt=salt, segment_id=locs[0].segment_id)
        with pytest.raises(RecordIntegrityError, match="salted"):  # another segment's salt
            parse_run(run, start, salt=salt ^ 1, segment_id=locs[0].segment_id)
        assert [(r.key, bytes(r.value)) for r in records] == items
        for loc, (_k, v) in zip(locs, items, strict=True):
            got = verify_record(run, start, loc)
            assert got == v and got.obj is run.obj  # a view into the run, no copy
        with pytest.raises(InvalidArgumentError):  # beyond what was written
            log.read_run(locs[0].segment_id, start, log.total_bytes + 4096)


def test_direct_reads_match_buffered(folder: Path) -> None:
    with SegmentLog(folder, direct_io="auto") as log:
        locs = log.append_many([(key(i), value(key(i), 5000 + i)) for i in range(5)])
        start, end = locs[1].record_offset, locs[3].record_end
        direct = log.read_run(1, start, end, direct=True)
        assert direct == log.read_run(1, start, end, direct=False)
        for loc in locs[1:4]:
            v = verify_record(direct, start, loc)
            assert v == value(loc.key, loc.value_length)
            assert np.frombuffer(v, np.uint8).ctypes.data % RECORD_ALIGN == 0
        assert log.read(locs[4], direct=True) == value(key(4), 5004)


def test_rotation_seals_with_hints_and_never_splits_a_batch(folder: Path) -> None:
    with SegmentLog(folder, segment_bytes=64 * KiB) as log:
        for i in range(20):
            log.put(key(i), value(key(i), 16 * KiB))
        big = log.append_many([(key(100 + i), value(key(100 + i), 30 * KiB)) for i in range(4)])
        assert len({loc.segment_id for loc in big}) == 1  # 120 KiB batch: own segment
        infos = log.segments()
        assert [i.state for i in infos] == ["sealed"] * (len(infos) - 1) + ["live"]
        assert len(files(folder, ".live")) == 1
        sealed = files(folder, ".sealed")
        assert len(sealed) == len(infos) - 1 >= 5
        log.flush()  # the sealer thread fsyncs rotated segments, then writes their hints
        assert [p.with_suffix(".hint") for p in sealed] == files(folder, ".hint")
        assert all(i.file_bytes <= 64 * KiB for i in infos if i.segment_id != big[0].segment_id)
        assert log.total_bytes == sum(p.stat().st_size for p in folder.glob("seg-*"
                                                                              ".[ls]*[ed]"))
        assert log.rotate() == infos[-1].segment_id
        assert log.rotate() is None  # nothing to seal


# -- reopen ---------------------------------------------------------------------------------
def _fill(log: SegmentLog, n: int, size: int = 8 * KiB) -> dict[bytes, bytes]:
    data = {key(i): value(key(i), size + i) for i in range(n)}
    items = list(data.items())
    for i in range(0, n, 5):
        log.append_many(items[i:i + 5])
    return data


def test_reopen_keeps_every_key_via_hints_and_via_scan(folder: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    with SegmentLog(folder, segment_bytes=64 * KiB) as log:
        data = _fill(log, 60)
        log.delete(key(3))
        del data[key(3)]
        log.put(key(4), b"v2")
        data[key(4)] = b"v2"
    hints = files(folder, ".hint")
    assert len(hints) >= 5
    for round_ in range(2):  # hints (+ scan of the live), then every segment scanned
        with SegmentLog(folder, segment_bytes=64 * KiB) as log:
            assert len(log) == len(data)
            assert {k: got(log, k) for k in data} == data
        if round_ == 0:
            for hint in hints:
                hint.unlink()
    assert files(folder, ".hint") == hints  # the scan wrote the hints again
    assert "error" not in caplog.text.lower()


def test_reopen_of_100k_keys_reads_only_hints(folder: Path) -> None:
    with SegmentLog(folder, segment_bytes=2048 * KiB) as log:
        for b in range(200):
            log.append_many([(key(i), b"v" * 64) for i in range(b * 500, b * 500 + 500)])
        log.rotate()
    t0 = time.perf_counter()
    with SegmentLog(folder, segment_bytes=2048 * KiB) as log:
        seconds = time.perf_counter() - t0
        assert len(log) == 100_000 and got(log, key(99_999)) == b"v" * 64
    assert seconds < 2.0  # ~0.1 s here; a scan of the data would be several times that


def test_sync_per_batch(folder: Path) -> None:
    with SegmentLog(folder, sync="batch") as log:
        log.append_many([(key(i), value(key(i), 5000)) for i in range(4)])
        assert log.delete(key(0))
    with SegmentLog(folder, sync="batch") as log:
        assert sorted(log) == [key(i) for i in range(1, 4)]
    with pytest.raises(InvalidArgumentError, match="sync"):
        SegmentLog(folder, sync="never")  # type: ignore[arg-type]


def test_reopen_reads_hints_not_data(folder: Path) -> None:
    with SegmentLog(folder, segment_bytes=64 * KiB) as log:
        data = _fill(log, 30)
        loc = log.locate(key(0))
        assert loc is not None
    flip_byte(files(folder, ".sealed")[0], loc.value_offset + 10)
    with SegmentLog(folder, segment_bytes=64 * KiB) as log:
        assert log.locate(key(0)) == loc  # a scan would have stopped at the damage
        with pytest.raises(RecordIntegrityError):
            got(log, key(0))
        assert got(log, key(1)) == data[key(1)]


def test_torn_tail_is_truncated_and_logged(folder: Path, caplog: pytest.LogCaptureFixture) -> None:
    with SegmentLog(folder) as log:
        locs = log.append_many([(key(i), value(key(i), 10 * KiB)) for i in range(6)])
    live = files(folder, ".live")[0]
    os.truncate(live, locs[-1].record_offset + 5000)  # the crash cut the last record
    with caplog.at_level(logging.WARNING), SegmentLog(folder) as log:
        assert "torn tail" in caplog.text
        assert live.stat().st_size == locs[-1].record_offset
        assert log.locate(key(5)) is None
        assert all(got(log, key(i)) == value(key(i), 10 * KiB) for i in range(5))
        log.put(key(5), b"again")
    caplog.clear()
    with caplog.at_level(logging.WARNING), SegmentLog(folder) as log:
        assert got(log, key(5)) == b"again" and len(log) == 6
    assert "torn" not in caplog.text


@pytest.mark.parametrize("where", ["value", "header"])
def test_damage_mid_segment_keeps_the_records_after_it(
        folder: Path, where: str, caplog: pytest.LogCaptureFixture) -> None:
    with SegmentLog(folder) as log:
        locs = log.append_many([(key(i), value(key(i), 10 * KiB)) for i in range(6)])
    live = files(folder, ".live")[0]
    damaged = locs[2]
    # a flipped value byte, or a header whose key length no longer parses
    flip_byte(live, damaged.value_offset + 100 if where == "value" else damaged.record_offset + 11)
    with caplog.at_level(logging.WARNING), SegmentLog(folder) as log:
        assert "skipping damaged bytes" in caplog.text
        assert log.locate(key(2)) is None  # dropped: a miss, never returned
        assert all(got(log, key(i)) == value(key(i), 10 * KiB) for i in (0, 1, 3, 4, 5))
        assert live.stat().st_size == locs[-1].record_end  # nothing truncated
        log.put(key(6), b"after")
    with SegmentLog(folder) as log:
        assert got(log, key(6)) == b"after" and len(log) == 6


def _forged_record(k: bytes, v: bytes) -> bytes:
    """A record for ``k`` laid out exactly as docs/FORMATS.md draws it, checksummed as
    anyone who reads the format would: an attacker's value may carry it."""
    tail = struct.pack("<BBHIQ", 1, 0, len(k), len(v), time.time_ns())
    delta = -(-(24 + len(k)) // 64) * 64
    body = tail + k.ljust(delta - 24, b"\0") + v
    record = struct.pack("<Q", xxhash.xxh3_64_intdigest(body)) + body
    return record.ljust(-(-len(record) // 64) * 64, b"\0")


@pytest.mark.parametrize("damage", ["header", "torn-tail"])
def test_resync_never_serves_a_record_forged_inside_a_value(folder: Path, damage: str) -> None:
    victim = key(7)
    with SegmentLog(folder) as log:
        log.put(victim, b"the real value")
        # an attacker's block whose value embeds a record claiming the victim's key
        payload = _forged_record(victim, b"forged!") + bytes(64)
        attack = log.put(key(8), payload)
        if damage == "torn-tail":  # a record after it, then cut: the scan must resync
            after = log.put(key(9), value(key(9), 10 * KiB))
    live = files(folder, ".live")[0]
    if damage == "header":
        flip_byte(live, attack.record_offset + 11)  # the attacker's own header breaks
    else:
        flip_byte(live, attack.record_offset + 11)
        os.truncate(live, after.record_offset + 100)
    with SegmentLog(folder) as log:
        assert got(log, victim) == b"the real value"
        assert log.locate(key(8)) is None
        assert len(log) == 1


def _version1_segment(path: Path, segment_id: int, records: list[bytes]) -> None:
    """A segment file as version 1 wrote it: no salt, records checksummed plainly."""
    head = struct.pack("<8sHHIQ", b"ISOKVSEG", 1, 64, segment_id, time.time_ns())
    head += struct.pack("<Q", xxhash.xxh3_64_intdigest(head))
    path.write_bytes(head.ljust(64, b"\0") + b"".join(records))


def test_version1_segments_are_read_but_never_resynced(folder: Path) -> None:
    folder.mkdir()
    _version1_segment(folder / "seg-00000001.live", 1,
                      [_forged_record(key(i), value(key(i), 1000)) for i in range(3)])
    with SegmentLog(folder) as log:
        assert all(got(log, key(i)) == value(key(i), 1000) for i in range(3))
        log.put(key(3), b"new")  # goes to a version 2 segment: the old one was sealed
        assert [s.state for s in log.segments()] == ["sealed", "live"]
        assert parse_segment_header((folder / "seg-00000001.sealed").read_bytes(), 1) == (1, 0)
    with SegmentLog(folder) as log:  # via the hint written at seal
        assert len(log) == 4
    # damage in a version 1 segment: no salt to prove a resync, so the scan stops there
    _version1_segment(folder / "seg-00000001.sealed", 1,
                      [_forged_record(key(i), value(key(i), 1000)) for i in range(3)])
    (folder / "seg-00000001.hint").unlink()
    flip_byte(folder / "seg-00000001.sealed", 64 + 1088 + 11)  # record 1's key_len
    with SegmentLog(folder) as log:
        assert got(log, key(0)) == value(key(0), 1000)
        assert log.locate(key(1)) is None and log.locate(key(2)) is None
        assert [d.offset for d in log.damage_report()] == [64 + 1088]


_CHILD = """
import sys
from isolane.kvpool.log.segment_log import SegmentLog
log = SegmentLog(sys.argv[1], segment_bytes=256 * 1024)
i = 0
while True:
    log.append_many([(i.to_bytes(8, "big") + j.to_bytes(8, "big"),
                      bytes([i % 251]) * (20000 + j)) for j in range(4)])
    print(i, flush=True)
    i += 1
"""


def test_sigkill_while_appending_loses_nothing_acknowledged(folder: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(folder)], env=env,
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    acked = -1
    try:
        for line in child.stdout:
            acked = int(line)
            if acked >= 60:
                break
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert acked >= 60, "the child died before appending"
    with SegmentLog(folder, segment_bytes=256 * 1024) as log:
        for i in range(acked + 1):
            for j in range(4):
                assert got(log, i.to_bytes(8, "big") + j.to_bytes(8, "big")) == (
                    bytes([i % 251]) * (20000 + j))
        for k in log:  # whatever else survived is whole
            i, j = int.from_bytes(k[:8], "big"), int.from_bytes(k[8:], "big")
            assert got(log, k) == bytes([i % 251]) * (20000 + j)


# -- damage ----------------------------------------------------------------------------------
def test_flipped_byte_raises_integrity_error_naming_key_and_segment(folder: Path) -> None:
    with SegmentLog(folder, segment_bytes=64 * KiB) as log:
        data = _fill(log, 20)
        for k in (key(2), key(19)):  # one in a sealed segment, one in the live one
            loc = log.locate(k)
            assert loc is not None
            path = next(folder.glob(f"seg-{loc.segment_id:08d}.*[ed]"))
            flip_byte(path, loc.value_offset + loc.value_length - 1)
            with pytest.raises(IntegrityError) as err:
                got(log, k)
            assert isinstance(err.value, RecordIntegrityError)
            assert err.value.key == k and err.value.segment_id == loc.segment_id
            assert k.hex() in str(err.value) and f"segment {loc.segment_id}" in str(err.value)
            assert log.delete(k)  # what the pool does: drop the key
        assert got(log, key(3)) == data[key(3)]


def test_corrupted_hint_falls_back_to_scan(folder: Path,
                                           caplog: pytest.LogCaptureFixture) -> None:
    with SegmentLog(folder, segment_bytes=64 * KiB) as log:
        data = _fill(log, 30)
    hint = files(folder, ".hint")[1]
    flip_byte(hint, 100)
    with caplog.at_level(logging.WARNING), SegmentLog(folder, segment_bytes=64 * KiB) as log:
        assert "ignoring the hint file" in caplog.text and "checksum mismatch" in caplog.text
        assert {k: got(log, k) for k in data} == data
    sealed = hint.with_suffix(".sealed")
    decode_share(hint.read_bytes(), int(hint.stem[4:]), sealed.stat().st_size)  # rewritten


def test_a_hint_whose_entries_lie_falls_back_to_scan(folder: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """A hint with a valid checksum whose entries do not match the record layout (a
    record end moved) is not loaded: the segment is scanned and its hint rewritten."""
    with SegmentLog(folder, segment_bytes=64 * KiB) as log:
        data = _fill(log, 30)
    hint = files(folder, ".hint")[0]
    sid, size = int(hint.stem[4:]), hint.with_suffix(".sealed").stat().st_size
    share = decode_share(hint.read_bytes(), sid, size)
    entries = list(share.entries)
    e = entries[0]
    entries[0] = (e[0], e[1], e[2], e[3], e[4] + 64, e[5], e[6])
    hint.write_bytes(encode_hint(sid, size, dataclasses.replace(share, entries=entries)))
    with caplog.at_level(logging.WARNING), SegmentLog(folder, segment_bytes=64 * KiB) as log:
        assert "disagree with the record layout" in caplog.text
        assert {k: got(log, k) for k in data} == data
        assert log.segments()[0].live_bytes == share.live_bytes
    assert decode_share(hint.read_bytes(), sid, size).entries == share.entries


def test_tombstones_survive_reopen_scan_and_compaction(folder: Path) -> None:
    with SegmentLog(folder, segment_bytes=64 * KiB) as log:
        log.append_many([(key(i), value(key(i), 4 * KiB)) for i in range(3)])
        first = log.rotate()
        assert log.delete(key(0)) and not log.delete(key(0))
        log.put(key(1), b"v2")
        second = log.rotate()
        assert first is not None and second is not None
    with SegmentLog(folder, segment_bytes=64 * KiB) as log:
        assert log.locate(key(0)) is None and got(log, key(1)) == b"v2"
        log.compact(second)  # segment 1 still holds key 0's put: the tombstone moves
        assert not (folder / f"seg-{second:08d}.sealed").exists()
    for hint in files(folder, ".hint"):
        hint.unlink()
    with SegmentLog(folder, segment_bytes=64 * KiB) as log:
        assert log.locate(key(0)) is None and got(log, key(1)) == b"v2"
        assert got(log, key(2)) == value(key(2), 4 * KiB) and len(log) == 2


# -- compaction and eviction ------------------------------------------------------------------
def test_compaction_keeps_live_values_and_frees_space(folder: Path) -> None:
    with SegmentLog(folder, segment_bytes=128 * KiB) as log:
        old = {key(i): value(key(i), 8 * KiB) for i in range(12)}
        log.append_many(list(old.items()))
        first = log.rotate()
        assert first is not None
        for i in range(0, 12, 2):  # overwrite half
            old[key(i)] = log.put(key(i), b"new").key and b"new"
        info = log.segments()[0]
        assert info.live_keys == 6 and should_compact(info.live_bytes, info.file_bytes, 0.6)
        stale = log.locate(key(1))
        assert stale is not None and stale.segment_id == first
        before = log.total_bytes
        pinned = log._acquire(first)  # a reader in the middle of a pread
        result = log.compact(first)
        assert result.copied_records == 6 and result.freed_bytes == info.file_bytes
        assert log.total_bytes < before
        dead = folder / f"seg-{first:08d}.dead"
        assert dead.exists() and not (folder / f"seg-{first:08d}.sealed").exists()
        assert os.pread(pinned.fd, 8, 0) == b"ISOKVSEG"  # the pinned reader finishes
        log._release(pinned)
        assert not dead.exists()  # deferred unlink at the last unpin
        with pytest.raises(StaleLocationError):
            log.read_run(first, stale.record_offset, stale.record_end)
        assert log.read(stale) == old[key(1)]  # read() looks the key up again
        assert {k: got(log, k) for k in old} == old
    with SegmentLog(folder, segment_bytes=128 * KiB) as log:
        assert {k: got(log, k) for k in old} == old


def test_compaction_deletes_a_damaged_record_for_good(folder: Path) -> None:
    with SegmentLog(folder, segment_bytes=128 * KiB) as log:
        log.put(key(0), b"old value")
        first = log.rotate()
        log.append_many([(key(i), value(key(i), 8 * KiB)) for i in range(4)])
        second = log.rotate()
        loc = log.locate(key(0))
        assert first is not None and second is not None and loc is not None
        flip_byte(folder / f"seg-{second:08d}.sealed", loc.value_offset + 1)
        result = log.compact(second)
        assert result.dropped_records == 1 and result.copied_records == 3
        assert log.locate(key(0)) is None
    with SegmentLog(folder, segment_bytes=128 * KiB) as log:  # no resurrection from `first`
        assert log.locate(key(0)) is None and sorted(log) == [key(1), key(2), key(3)]


def test_eviction_of_cold_segments_under_a_byte_budget(folder: Path) -> None:
    evicted: list[bytes] = []
    budget = 256 * KiB
    with SegmentLog(folder, segment_bytes=64 * KiB, max_bytes=budget,
                    on_evict=evicted.extend) as log:
        for i in range(100):
            log.append_many([(key(i, j), value(key(i, j), 6 * KiB)) for j in range(2)])
            assert log.total_bytes <= budget
        assert evicted and sorted(evicted) == sorted(set(evicted))
        for k in evicted:
            assert log.locate(k) is None
        kept = list(log)
        assert len(kept) + len(evicted) == 200
        assert all(got(log, k) == value(k, 6 * KiB) for k in kept)
        assert min(int.from_bytes(k[8:], "big") for k in kept) > 0  # the oldest went first
        returned = log.evict_cold_segments(100 * KiB)
        assert returned and all(log.locate(k) is None for k in returned)
        assert log.total_bytes <= 100 * KiB
    with pytest.raises(InvalidArgumentError):
        SegmentLog(folder, segment_bytes=64 * KiB, max_bytes=100 * KiB)


@pytest.fixture
def small_tmpfs(tmpfs: Callable[[str], Path]) -> Path:
    return tmpfs("8m")


def test_device_full_evicts_and_retries_then_capacity_error(small_tmpfs: Path) -> None:
    evicted: list[bytes] = []
    with SegmentLog(small_tmpfs, segment_bytes=1024 * KiB, on_evict=evicted.extend) as log:
        for i in range(60):  # 24 MiB through an 8 MiB device
            log.append_many([(key(i, j), value(key(i, j), 200 * KiB)) for j in range(2)])
        assert evicted and all(log.locate(k) is None for k in evicted)
        assert all(got(log, k) == value(k, 200 * KiB) for k in log)
        with pytest.raises(CapacityError) as err:
            log.put(key(1000), bytes(9 * 1024 * KiB))
        assert "full" in str(err.value)
        log.put(key(1001), b"still works")
        kept = set(log)
    with SegmentLog(small_tmpfs, segment_bytes=1024 * KiB) as log:
        assert set(log) == kept and got(log, key(1001)) == b"still works"


def test_device_full_waits_for_the_sealer_before_giving_up(small_tmpfs: Path) -> None:
    """A segment rotated during appends stays pinned (its file open) until the sealer
    thread has fsynced it; evicted meanwhile, its bytes are only freed then. A full
    device must wait for the sealer instead of failing (seen as a flake under load)."""
    gate = threading.Event()
    with SegmentLog(small_tmpfs, segment_bytes=1024 * KiB) as log:
        for i in range(4):  # a rotation during appends starts the sealer thread
            log.append_many([(key(i, j), value(key(i, j), 200 * KiB)) for j in range(2)])
        sealer = log._sealer
        assert sealer is not None
        sealer.submit(gate.wait)  # from now on the sealer is far behind
        opened = threading.Timer(1.0, gate.set)
        opened.start()
        try:
            for i in range(4, 40):  # 14 MiB more through the 8 MiB device
                log.append_many([(key(i, j), value(key(i, j), 200 * KiB)) for j in range(2)])
        finally:
            gate.set()
            opened.cancel()
        assert got(log, key(39, 1)) == value(key(39, 1), 200 * KiB)


# -- concurrency ------------------------------------------------------------------------------
def test_concurrent_readers_and_writers_never_see_a_torn_record(folder: Path) -> None:
    log = SegmentLog(folder, segment_bytes=256 * KiB, max_bytes=2048 * KiB)
    written: list[bytes] = []
    errors: list[BaseException] = []
    stop = threading.Event()
    counts = {"hits": 0, "misses": 0, "runs": 0, "compactions": 0}

    def guard(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except BaseException as exc:  # reported by the assertion below
                errors.append(exc)
                stop.set()
        return run

    def writer(ns: int) -> None:
        rng = random.Random(ns)
        i = 0
        while not stop.is_set():
            batch = []
            for _ in range(rng.randint(1, 4)):
                k = key(rng.randrange(i + 1), ns)  # overwrite old keys too
                batch.append((k, versioned_value(k, rng.choice((4, 8, 16)) * KiB, i)))
                i += 1
            log.append_many(batch)
            written.extend(k for k, _ in batch)

    def check(k: bytes, v: memoryview) -> None:
        assert is_versioned_value(k, v), f"torn or wrong value for {k.hex()}"

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            if not written:
                continue
            k = written[rng.randrange(len(written))]
            loc = log.locate(k)
            try:
                if loc is None:
                    counts["misses"] += 1
                elif rng.random() < 0.5:
                    check(k, log.read(loc))
                    counts["hits"] += 1
                else:
                    run = log.read_run(loc.segment_id, loc.record_offset, loc.record_end)
                    check(k, verify_record(run, loc.record_offset, loc))
                    counts["runs"] += 1
            except KeyNotFoundError:  # evicted or compacted away meanwhile
                counts["misses"] += 1

    def maintainer() -> None:
        while not stop.is_set():
            for info in log.segments():
                if info.state == "sealed" and should_compact(info.live_bytes,
                                                             info.file_bytes, 0.7):
                    try:
                        log.compact(info.segment_id)
                        counts["compactions"] += 1
                    except StaleLocationError:
                        pass  # evicted before we got to it
            time.sleep(0.01)

    threads = [threading.Thread(target=guard(functools.partial(writer, n))) for n in (1, 2)]
    threads += [threading.Thread(target=guard(functools.partial(reader, n))) for n in range(5)]
    threads.append(threading.Thread(target=guard(maintainer)))
    for t in threads:
        t.start()
    time.sleep(2.5)
    stop.set()
    for t in threads:
        t.join(timeout=30)
    log.close()
    assert not errors, errors
    assert counts["hits"] > 50 and counts["runs"] > 50 and counts["compactions"] > 0, counts
    with SegmentLog(folder, segment_bytes=256 * KiB, max_bytes=2048 * KiB) as again:
        for k in again:
            v = got(again, k)
            assert v is not None and is_versioned_value(k, v)


def test_folder_is_locked_and_closed_log_refuses(folder: Path) -> None:
    log = SegmentLog(folder)
    with pytest.raises(StorageError, match="open in another SegmentLog"):
        SegmentLog(folder)
    loc = log.put(key(1), b"x")
    log.close()
    log.close()  # idempotent
    with pytest.raises(StorageError, match="closed"):
        log.put(key(2), b"y")
    with pytest.raises(StorageError, match="closed"):
        log.read(loc)
    with SegmentLog(folder) as again:
        assert got(again, key(1)) == b"x"


def test_links_in_a_segment_folder_are_never_followed(folder: Path, tmp_path: Path) -> None:
    with SegmentLog(folder) as log:
        loc = log.put(key(1), value(key(1), 5000))
    live = files(folder, ".live")[0]
    outside = tmp_path / "outside"
    outside.mkdir()
    # a copy of a real segment with a torn tail: a scan through a link would cut it
    precious = live.read_bytes() + b"\1" * 100
    for name in ("seg-00000005.live", "seg-00000004.sealed", "seg-00000004.hint",
                 "seg-00000003.dead", "x.tmp"):
        (outside / name).write_bytes(precious)
        (folder / name).symlink_to(outside / name)
    with SegmentLog(folder) as log:
        assert got(log, key(1)) == value(key(1), 5000)
        assert [s.segment_id for s in log.segments()] == [loc.segment_id]
        log.put(key(2), b"more")
    for name in ("seg-00000005.live", "seg-00000004.sealed", "seg-00000004.hint",
                 "seg-00000003.dead", "x.tmp"):
        assert (outside / name).read_bytes() == precious, name
        assert (folder / name).is_symlink(), name  # reported and left: not ours to judge
