"""The compact key directory against a dict model, and its hint loading path."""

from __future__ import annotations

import random

import numpy as np
import pytest

from isolane.errors import IntegrityError
from isolane.kvpool.log.bulk_load import BulkLoad
from isolane.kvpool.log.hint_columns import decode_hint_columns
from isolane.kvpool.log.key_slots import place_rows, probe_many
from isolane.kvpool.log.keydir import Entry, SegmentShare, encode_hint
from isolane.kvpool.log.keytable import KeyDirectory
from isolane.kvpool.log.records import record_geometry, record_geometry_np


class Model:
    """The semantics the key directory must have, as plain dicts."""

    def __init__(self) -> None:
        self.entries: dict[bytes, Entry] = {}
        self.tombs: dict[bytes, int] = {}

    def put(self, key: bytes, entry: Entry) -> None:
        self.tombs.pop(key, None)
        self.entries[key] = entry

    def delete(self, key: bytes, sid: int) -> Entry | None:
        self.tombs[key] = sid
        return self.entries.pop(key, None)

    def drop(self, sid: int) -> list[bytes]:
        gone = sorted(k for k, e in self.entries.items() if e[0] == sid)
        for k in gone:
            del self.entries[k]
        for k in [k for k, s in self.tombs.items() if s == sid]:
            del self.tombs[k]
        return gone

    def in_segment(self, sid: int) -> list[tuple[bytes, Entry]]:
        return sorted(((k, e) for k, e in self.entries.items() if e[0] == sid),
                      key=lambda item: item[1][1])


def entry(sid: int, off: int, key: bytes, vlen: int, rng: random.Random) -> Entry:
    delta, rbytes = record_geometry(len(key), vlen)
    return (sid, off, off + delta, vlen, off + rbytes, rng.getrandbits(64),
            rng.getrandbits(63))


def check_same(kd: KeyDirectory, model: Model, sids: range) -> None:
    assert len(kd) == len(model.entries)
    assert sorted(kd.keys()) == sorted(model.entries)
    for key, e in model.entries.items():
        assert kd.get(key) == e
        assert key in kd
    for key in model.tombs:
        assert kd.get(key) is None
    for sid in sids:
        items = model.in_segment(sid)
        assert kd.entries_in(sid) == items
        assert kd.live_count(sid) == len(items)
        assert kd.live_bytes(sid) == sum(e[4] - e[1] for _, e in items)
        assert kd.tombstones_in(sid) == sorted(k for k, s in model.tombs.items() if s == sid)


def test_vectorised_geometry_matches_the_record_format() -> None:
    klens = [1, 15, 16, 17, 40, 41, 1024]
    vlens = [0, 1, 63, 64, 4096, 65537]
    pairs = [(k, v) for k in klens for v in vlens]
    delta, rbytes = record_geometry_np(np.array([k for k, _ in pairs], np.uint16),
                                       np.array([v for _, v in pairs], np.uint32))
    assert list(zip(delta.tolist(), rbytes.tolist(), strict=True)) == [
        record_geometry(k, v) for k, v in pairs]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_operations_match_a_dict(seed: int) -> None:
    rng = random.Random(seed)
    kd, model = KeyDirectory(), Model()
    # 16-byte block keys, short keys and long keys (kept beside the columns).
    pool = ([rng.randbytes(16) for _ in range(3000)] + [rng.randbytes(rng.randint(1, 15))
                                                          for _ in range(300)]
            + [rng.randbytes(rng.randint(17, 80)) for _ in range(300)])
    off = {sid: 64 for sid in range(1, 9)}
    for step in range(20000):
        sid = 1 + step // 2500
        key = rng.choice(pool)
        op = rng.random()
        if op < 0.7:
            e = entry(sid, off[sid], key, rng.choice((0, 10, 4096)), rng)
            off[sid] = e[4]
            kd.put(key, e)
            model.put(key, e)
        elif op < 0.9:
            assert kd.delete(key, sid) == model.delete(key, sid)
        elif op < 0.95:
            current = model.entries.get(key)
            new = entry(sid, off[sid], key, 7, rng)
            if current is not None:
                assert kd.replace(key, current, new)
                off[sid] = new[4]
                model.put(key, new)
            assert not kd.replace(key, (0, 0, 0, 0, 0, 0, 0), new)
        elif op < 0.952 and sid > 2:
            victim = rng.randint(1, sid - 1)
            assert kd.drop_segment(victim) == model.drop(victim)
    check_same(kd, model, range(1, 9))


def test_many_keys_grow_and_rebuild_the_table() -> None:
    rng = random.Random(7)
    kd, model = KeyDirectory(), Model()
    keys = [rng.randbytes(16) for _ in range(50000)]
    for i, key in enumerate(keys):
        e = entry(1 + i // 10000, 64 + 4160 * (i % 10000), key, 4096, rng)
        kd.put(key, e)
        model.put(key, e)
    for sid in (1, 2, 3):  # most rows absent: the next growth compacts them away
        assert kd.drop_segment(sid) == model.drop(sid)
    for key in keys[:5000]:
        e = entry(9, 64, key, 1, rng)
        kd.put(key, e)
        model.put(key, e)
    check_same(kd, model, range(1, 10))
    assert kd.nbytes() < 64 * 50000


def share_of(model: Model, sid: int) -> SegmentShare:
    items = model.in_segment(sid)
    tombs = sorted(k for k, s in model.tombs.items() if s == sid)
    return SegmentShare([k for k, _ in items], [e for _, e in items], tombs,
                        sum(e[4] - e[1] for _, e in items))


@pytest.mark.parametrize("long_keys", [False, True])
def test_load_columns_matches_applying_the_segments_in_order(long_keys: bool) -> None:
    """Hints of segments loaded oldest first give the directory the records would."""
    rng = random.Random(11)
    keys = [rng.randbytes(16) for _ in range(4000)]
    if long_keys:
        keys += [rng.randbytes(33) for _ in range(50)] + [b"k", b"key-2"]
    segments, whole = _segments_of(rng, keys, 5, 1500, sizes=[4096])
    kd = KeyDirectory()
    for sid, seg in enumerate(segments, 1):
        data = encode_hint(sid, 10**9, share_of(seg, sid))
        kd.load_columns(sid, decode_hint_columns(data, sid, 10**9))
    check_same(kd, whole, range(1, 6))


def test_a_hint_that_disagrees_with_the_record_layout_is_refused() -> None:
    rng = random.Random(3)
    key = rng.randbytes(16)
    good = entry(4, 64, key, 4096, rng)
    for bad in [(4, 64, 64 + 64, 4096, 64 + 4096, good[5], 1),  # wrong record end
                (5, 64, 128, 4096, 64 + 4160, good[5], 1),  # another segment
                (4, 0, 64, 4096, 4160, good[5], 1),  # inside the segment header
                (4, 64, 128, 4096, 64 + 4160 + 10**9, good[5], 1)]:  # past the file
        share = SegmentShare([key], [bad], [], bad[4] - bad[1])
        with pytest.raises(IntegrityError):
            decode_hint_columns(encode_hint(4, 10**6, share), 4, 10**6)
    share = SegmentShare([key], [good], [], good[4] - good[1])
    cols = decode_hint_columns(encode_hint(4, 10**6, share), 4, 10**6)
    kd = KeyDirectory()
    kd.load_columns(4, cols)
    assert kd.get(key) == good


def _segments_with_overlaps(seed: int, sids: int, per: int) -> tuple[list[Model], Model]:
    """Segments of random puts and deletes over a shared key set (keys recur across
    segments), and the model of applying them in order."""
    rng = random.Random(seed)
    keys = [rng.randbytes(16) for _ in range(3 * per)] + [b"k", b"key-2", b"x" * 15]
    return _segments_of(rng, keys, sids, per, sizes=[0, 100, 4096])


def _segments_of(rng: random.Random, keys: list[bytes], sids: int, per: int,
                 sizes: list[int]) -> tuple[list[Model], Model]:
    """Segments 1..``sids`` of ``per`` random puts (80 %, value sizes from ``sizes``)
    and deletes each over ``keys``, and the model of applying them in order."""
    segments: list[Model] = []
    whole = Model()
    for sid in range(1, sids + 1):
        seg, off = Model(), 64
        for key in rng.sample(keys, per):
            if rng.random() < 0.8:
                e = entry(sid, off, key, rng.choice(sizes), rng)
                off = e[4]
                seg.put(key, e)
                whole.put(key, e)
            else:
                seg.delete(key, sid)
                whole.delete(key, sid)
        segments.append(seg)
    return segments, whole


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_bulk_load_of_all_segments_matches_loading_them_in_order(seed: int) -> None:
    """A reopen stages every hint and builds the table once: the same directory as
    loading the segments one by one (newest record wins, tombstones, live counts),
    and it keeps working afterwards (puts, deletes, growth, dropping a segment)."""
    segments, whole = _segments_with_overlaps(seed, 6, 1500)
    kd = KeyDirectory()
    bulk = BulkLoad(kd, rows=100)  # an estimate too small: the columns grow
    for sid, seg in enumerate(segments, 1):
        bulk.add(sid, decode_hint_columns(encode_hint(sid, 10**9, share_of(seg, sid)), sid,
                                          10**9))
    bulk.finish()
    check_same(kd, whole, range(1, 7))
    rng = random.Random(seed)
    for i in range(6000):  # the table grows past its bulk size
        key = rng.randbytes(16) if i % 3 else rng.choice(sorted(whole.entries))
        if i % 7 == 0:
            assert kd.delete(key, 7) == whole.delete(key, 7)
        else:
            e = entry(7, 64 + i * 4160, key, 4096, rng)
            kd.put(key, e)
            whole.put(key, e)
    assert kd.drop_segment(2) == whole.drop(2)
    check_same(kd, whole, range(1, 8))


def test_a_bulk_load_hands_segments_with_long_keys_and_later_ones_to_load_columns() -> None:
    segments, whole = _segments_with_overlaps(5, 4, 800)
    rng = random.Random(9)
    long_seg, off = Model(), 64
    for key in [rng.randbytes(40) for _ in range(30)] + sorted(segments[0].entries)[:20]:
        e = entry(5, off, key, 100, rng)
        off = e[4]
        long_seg.put(key, e)
        whole.put(key, e)
    segments.insert(4, long_seg)
    more, _ = _segments_with_overlaps(6, 1, 800)
    for key, e in more[0].entries.items():
        whole.put(key, (6, *e[1:]))
    segments.append(Model())
    segments[-1].entries = {k: (6, *e[1:]) for k, e in more[0].entries.items()}
    kd = KeyDirectory()
    bulk = BulkLoad(kd)
    for sid, seg in enumerate(segments, 1):
        bulk.add(sid, decode_hint_columns(encode_hint(sid, 10**9, share_of(seg, sid)), sid,
                                          10**9))
    bulk.finish()
    check_same(kd, whole, range(1, 7))


def test_place_rows_wraps_rows_past_the_last_slot_and_drops_older_copies() -> None:
    """Every home slot near the end of the table: rows wrap to the start; copies of a
    key keep only the newest row."""
    rng = np.random.default_rng(4)
    n, size = 300, 512
    k0 = rng.integers(0, 2**63, n, dtype=np.int64).astype(np.uint64)
    k1 = rng.integers(0, 2**63, n, dtype=np.int64).astype(np.uint64)
    k0[200:250], k1[200:250] = k0[:50], k1[:50]  # 50 keys listed twice
    klen = np.full(n, 16, np.uint16)
    hashes = (size - 1 - rng.integers(0, 8, n)).astype(np.uint64)
    hashes[200:250] = hashes[:50]
    table, gone = place_rows(hashes, k0, k1, klen, size)
    assert gone.tolist() == list(range(50))
    keep = np.setdiff1d(np.arange(n), gone)
    rows, _ = probe_many(table, hashes[keep], k0[keep], k1[keep], klen[keep], k0[keep],
                         k1[keep], klen[keep])
    assert rows.tolist() == list(range(len(keep)))
    assert int((table >= 0).sum()) == len(keep)
    assert int(table[0]) >= 0  # some rows wrapped around


@pytest.mark.parametrize(("seed", "spread"), [(1, 0), (2, 64), (3, 4096), (4, 1 << 20)])
def test_place_rows_keeps_the_newest_row_of_every_key_where_a_probe_finds_it(
        seed: int, spread: int) -> None:
    """Rows with many copies of keys (up to five of one), home slots packed into
    ``spread`` slots before the table's end (0: anywhere; small: clusters many rounds
    deep that wrap around): the table holds each key's newest row, renumbered without
    the older copies, where a probe from its home slot finds it, and nothing else."""
    rng = np.random.default_rng(seed)
    distinct, size = 3000, 8192
    d0 = rng.integers(0, 2**63, distinct, dtype=np.int64).astype(np.uint64)
    d1 = rng.integers(0, 2**63, distinct, dtype=np.int64).astype(np.uint64)
    dl = rng.integers(1, 17, distinct).astype(np.uint16)
    d1[1::4] = d1[0::4]  # keys 4i, 4i + 1 differ in their first word only
    d0[3::4] = d0[2::4]  # keys 4i + 2, 4i + 3 in their second word only
    dl[2::4] = dl[3::4] = 16
    assert len(set(zip(d0.tolist(), d1.tolist(), dl.tolist(), strict=True))) == distinct
    dh = rng.integers(0, 2**63, distinct, dtype=np.int64).astype(np.uint64)
    if spread:
        dh = (size - 1 - dh % np.uint64(spread)).astype(np.uint64)
    which = rng.integers(0, distinct, 5000)  # the rows in log order: copies of keys
    k0, k1, klen, hashes = d0[which], d1[which], dl[which], dh[which]
    table, gone = place_rows(hashes, k0, k1, klen, size)
    newest = {int(w): i for i, w in enumerate(which.tolist())}
    kept = sorted(newest.values())
    assert gone.tolist() == sorted(set(range(len(which))) - set(kept))
    keep = np.array(kept)
    rows, _ = probe_many(table, hashes[keep], k0[keep], k1[keep], klen[keep], k0[keep],
                         k1[keep], klen[keep])
    assert rows.tolist() == list(range(len(kept)))
    assert sorted(table[table >= 0].tolist()) == list(range(len(kept)))


def test_the_slot_hash_of_a_batch_is_the_hash_of_each_key() -> None:
    """``SlotHash.many`` (a reopen's and a batch's home slots) equals ``home`` key by
    key, and ``mix_np`` with and without a scratch array equals ``mix``."""
    from isolane.kvpool.log.key_slots import SlotHash, mix, mix_np

    rng = np.random.default_rng(6)
    k0 = rng.integers(0, 2**63, 1000, dtype=np.int64).astype(np.uint64) * np.uint64(3)
    k1 = rng.integers(0, 2**63, 1000, dtype=np.int64).astype(np.uint64)
    h = SlotHash(0x9E3779B97F4A7C15, 12345)
    assert h.many(k0, k1).tolist() == [h.home(a, b) for a, b in zip(
        k0.tolist(), k1.tolist(), strict=True)]
    want = [mix(z) for z in k0.tolist()]
    assert mix_np(k0.copy()).tolist() == want
    assert mix_np(k0.copy(), np.empty_like(k0)).tolist() == want
