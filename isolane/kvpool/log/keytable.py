"""The compact key directory of the KV segment log: numpy columns, no object per key.

``KeyDirectory`` maps each key to its newest record (a put: segment, offset, value
length, checksum, timestamp; or a tombstone: the segment it was written to). It keeps
one *row* per key in column arrays and an open-addressing hash table of row numbers:

    column     dtype       bytes  meaning
    k0, k1     u64, u64    16     the key (keys of <= 16 bytes, zero padded); longer keys
                                  hold BLAKE2b-128 of the key, the key itself in ``_long``
    klen       u16         2      key length
    flag       u8          1      0 absent (deleted, or its segment is gone), 1 put,
                                  2 tombstone
    sid        u32         4      segment of the newest record
    roff       u64         8      record offset in that segment
    vlen       u32         4      value length
    csum       u64         8      content checksum (xxh3-64, unsalted)
    ts         u64         8      timestamp_ns of the record
    table      i32         4/load row number per slot (-1: empty), linear probing

The value offset and the record end are not stored: they follow from the key and value
lengths (``records.record_geometry``). That is 59 bytes a row, plus 5.7-11.4 bytes of
table a row (load factor 0.35-0.7): about 60-64 bytes of RSS per key (the columns grow
by doubling into lazily mapped zero pages, so unused capacity costs no RSS).

A removed key keeps its row (``flag`` 0) and its table slot until the next rebuild
(when absent rows outnumber the present ones, or the table grows): re-adding it reuses
the row. Bulk paths (``load_columns`` from a hint file, ``drop_segment``, ``share``) are
vectorised; single-key paths (``get``/``put``/``delete``) cost a few hundred ns of
Python. The key words, the seeded slot hash and the probing are ``key_slots.py``; a
hint file as columns ``hint_columns.py``.

Not thread-safe: ``SegmentLog`` serializes every call under its index lock. Apply
records in log order (segments by id, records by offset): the last record of a key wins.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import numpy.typing as npt

from isolane.kvpool.log.hint_columns import HintColumns, encode_hint_columns
from isolane.kvpool.log.key_slots import (
    SHORT_KEY_BYTES,
    U64,
    SlotHash,
    group_sum,
    insert_many,
    key_id,
    key_words,
    mix,
    probe_many,
    table_size,
)
from isolane.kvpool.log.keydir import (
    FLAG_PUT,
    FLAG_TOMBSTONE,
    Entry,
    LogItem,
    SegmentShare,
    encode_hint,
)
from isolane.kvpool.log.records import record_geometry, record_geometry_np

_SHORT = SHORT_KEY_BYTES
_MIN_CAP = 1024
SCALAR_BATCH = 24  # batches up to this are looked up key by key: numpy's per-call cost
_COLUMNS: tuple[tuple[str, Any], ...] = (
    ("k0", np.uint64), ("k1", np.uint64), ("klen", np.uint16), ("flag", np.uint8),
    ("sid", np.uint32), ("roff", np.uint64), ("vlen", np.uint32), ("csum", np.uint64),
    ("ts", np.uint64))


class KeyDirectory:
    """key -> newest record, with per-segment live counts, live bytes and tombstones
    (layout and costs: module docstring). Same semantics as a dict of ``Entry``."""

    def __init__(self) -> None:
        self._hash = SlotHash.random()
        self._n = 0  # rows in use (present or absent)
        self._present = 0  # rows with a flag
        self._puts = 0  # rows that are puts: len()
        self._cap = 0
        self._cols: dict[str, npt.NDArray[Any]] = {}
        self._long: dict[int, bytes] = {}  # row -> key, keys longer than 16 bytes
        self._live_bytes: dict[int, int] = {}
        self._live_count: dict[int, int] = {}
        self._table: npt.NDArray[np.int32] = np.full(0, -1, np.int32)
        self._mask = -1
        self._grow_rows(_MIN_CAP)
        self._reindex(_MIN_CAP * 2)

    # -- sizes -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._puts

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and self.get(key) is not None

    def nbytes(self) -> int:
        """Bytes of the columns in use and of the table (what the RSS grows by)."""
        return self._n * sum(int(np.dtype(d).itemsize) for _, d in _COLUMNS) + int(
            self._table.nbytes)

    def live_bytes(self, segment_id: int) -> int:
        """Bytes of the records of ``segment_id`` that are some key's newest."""
        return self._live_bytes.get(segment_id, 0)

    def live_count(self, segment_id: int) -> int:
        return self._live_count.get(segment_id, 0)

    # -- single keys -------------------------------------------------------------------------
    def _find(self, key: bytes) -> tuple[int, int, bytes]:
        """(row or -1, the slot it is in or the empty slot that ends the probe, kid)."""
        kid = key_id(key)
        a = int.from_bytes(kid[:8], "little")
        b = int.from_bytes(kid[8:], "little")
        h = self._hash  # SlotHash.home, inline: this is the hot path of a get
        slot = mix(mix(a ^ h.s0) ^ b ^ h.s1) & self._mask
        table, k0, k1, klen = self._table, self._k0, self._k1, self._klen
        n = len(key)
        while True:  # .item(): a Python int, half the cost of int(array[i]) here
            row = table.item(slot)
            if row < 0:
                return -1, slot, kid
            if (k0.item(row) == a and k1.item(row) == b and klen.item(row) == n
                    and (n <= _SHORT or self._long.get(row) == key)):
                return row, slot, kid
            slot = (slot + 1) & self._mask

    def get(self, key: bytes) -> Entry | None:
        row = self._find(key)[0]
        if row < 0 or self._flag.item(row) != FLAG_PUT:
            return None
        return self._entry(row)

    def _entry(self, row: int) -> Entry:
        c = self._cols
        sid, roff, vlen = c["sid"].item(row), c["roff"].item(row), c["vlen"].item(row)
        delta, rbytes = record_geometry(c["klen"].item(row), vlen)
        return (sid, roff, roff + delta, vlen, roff + rbytes, c["csum"].item(row),
                c["ts"].item(row))

    def _row_for(self, key: bytes) -> int:
        """The row of ``key``, added (absent) when it has none."""
        row, slot, kid = self._find(key)
        if row >= 0:
            return row
        if (self._n + 1) * 10 > len(self._table) * 7:
            self._make_room(1)
            row, slot, kid = self._find(key)
        if self._n == self._cap:
            self._grow_rows(self._cap * 2)
        row = self._n
        self._n += 1
        self._k0[row] = int.from_bytes(kid[:8], "little")
        self._k1[row] = int.from_bytes(kid[8:], "little")
        self._klen[row] = len(key)
        self._flag[row] = 0
        if len(key) > _SHORT:
            self._long[row] = key
        self._table[slot] = row
        return row

    def _make_room(self, rows: int) -> None:
        """Rebuild (dropping absent rows) or grow the table so that ``rows`` more fit."""
        if self._n - self._present > self._present // 4:
            self._rebuild()
        need = self._n + rows
        if need * 10 > len(self._table) * 7:
            self._reindex(table_size(need))

    def _unset(self, row: int) -> None:
        """Take back what row's current record counts for."""
        flag = int(self._flag[row])
        if flag == 0:
            return
        sid = int(self._sid[row])
        if flag == FLAG_PUT:
            rbytes = record_geometry(int(self._klen[row]), int(self._cols["vlen"][row]))[1]
            self._live_bytes[sid] -= rbytes
            self._live_count[sid] -= 1
            self._puts -= 1
        self._present -= 1
        self._flag[row] = 0

    def put(self, key: bytes, entry: Entry) -> None:
        """``key``'s newest record is now ``entry`` (a put)."""
        row = self._row_for(key)
        self._unset(row)
        c = self._cols
        sid = entry[0]
        c["sid"][row], c["roff"][row], c["vlen"][row] = sid, entry[1], entry[3]
        c["csum"][row], c["ts"][row] = entry[5], entry[6]
        self._flag[row] = FLAG_PUT
        self._present += 1
        self._puts += 1
        self._live_bytes[sid] = self._live_bytes.get(sid, 0) + entry[4] - entry[1]
        self._live_count[sid] = self._live_count.get(sid, 0) + 1

    def replace(self, key: bytes, expected: Entry, entry: Entry) -> bool:
        """Compare and set: point ``key`` at ``entry`` only if it still is at ``expected``."""
        if self.get(key) != expected:
            return False
        self.put(key, entry)
        return True

    def delete(self, key: bytes, tombstone_segment: int) -> Entry | None:
        """A tombstone for ``key`` was written in ``tombstone_segment``; returns the
        entry it removed (None when the key had none)."""
        row = self._row_for(key)
        old = self._entry(row) if self._flag[row] == FLAG_PUT else None
        self.set_tombstone_row(row, tombstone_segment)
        return old

    def set_tombstone(self, key: bytes, segment_id: int) -> None:
        self.set_tombstone_row(self._row_for(key), segment_id)

    def set_tombstone_row(self, row: int, segment_id: int) -> None:
        self._unset(row)
        c = self._cols
        c["sid"][row], c["roff"][row], c["vlen"][row] = segment_id, 0, 0
        c["csum"][row], c["ts"][row] = 0, 0
        self._flag[row] = FLAG_TOMBSTONE
        self._present += 1

    # -- batches of keys ---------------------------------------------------------------------
    def find_rows(self, keys: list[bytes]) -> npt.NDArray[np.int64]:
        """Row of each key whose newest record is a put, else -1: one vectorised probe
        of all of them (keys longer than 16 bytes are checked against ``_long``)."""
        if len(keys) <= SCALAR_BATCH:  # a few keys: numpy's per-call cost would dominate
            scalar = [self._find(k)[0] for k in keys]
            return np.array([r if r >= 0 and self._flag[r] == FLAG_PUT else -1 for r in scalar],
                            np.int64)
        k0, k1, klen = key_words(keys)
        rows = self._find_many(self._hash.many(k0, k1), k0, k1, klen)[0]
        found = rows >= 0
        rows[found & (self._flag[np.where(found, rows, 0)] != FLAG_PUT)] = -1
        if self._long and int(klen.max()) > _SHORT:
            for i in np.flatnonzero((rows >= 0) & (klen > _SHORT)).tolist():
                if self._long.get(int(rows[i])) != keys[i]:
                    rows[i] = -1
        return rows

    def contains_many(self, keys: list[bytes]) -> npt.NDArray[np.bool_]:
        return self.find_rows(keys) >= 0

    def entries(self, keys: list[bytes]) -> list[Entry | None]:
        """``get`` of each key (no arrays built for up to ``SCALAR_BATCH`` keys)."""
        small = len(keys) <= SCALAR_BATCH
        return [self.get(k) for k in keys] if small else self.entries_of_rows(self.find_rows(keys))

    def entries_of_rows(self, rows: npt.NDArray[np.int64]) -> list[Entry | None]:
        """``Entry`` of each row (None for -1), built from the columns at once."""
        if len(rows) <= SCALAR_BATCH:
            return [None if r < 0 else self._entry(r) for r in rows.tolist()]
        have = np.flatnonzero(rows >= 0)
        out: list[Entry | None] = [None] * len(rows)
        for i, e in zip(have.tolist(), self._entries_of(rows[have]), strict=True):
            out[i] = e
        return out

    def columns_of_rows(self, rows: npt.NDArray[np.int64]) -> tuple[U64, ...]:
        """(segment_id, record_offset, value_offset, value_length, record_end, checksum,
        timestamp_ns) of each row as columns, the ``Entry`` fields (garbage for -1)."""
        c = self._cols
        r = np.where(rows >= 0, rows, 0)
        roff, vlen = c["roff"][r], c["vlen"][r].astype(np.uint64)
        delta, rbytes = record_geometry_np(c["klen"][r], vlen)
        return (c["sid"][r].astype(np.uint64), roff, roff + delta, vlen, roff + rbytes,
                c["csum"][r], c["ts"][r])

    def put_columns(self, segment_id: int, k0: U64, k1: U64, klen: npt.NDArray[np.uint16],
                    roff: U64, vlen: npt.NDArray[np.uint32], csum: U64, ts: U64,
                    keys: list[bytes]) -> None:
        """Many puts into ``segment_id`` at once (distinct keys of <= 16 bytes take the
        vectorised path of ``load_columns``; others go key by key)."""
        n = len(keys)
        if n == 0:
            return
        if int(klen.max()) > _SHORT:
            delta, rbytes = record_geometry_np(klen, vlen)
            ends = roff + rbytes
            for i, key in enumerate(keys):
                self.put(key, (segment_id, int(roff[i]), int(roff[i] + delta[i]),
                               int(vlen[i]), int(ends[i]), int(csum[i]), int(ts[i])))
            return
        live = int(record_geometry_np(klen, vlen)[1].sum())
        self.load_columns(segment_id, HintColumns(segment_id, n, k0, k1, klen, roff, vlen,
                                                  csum, ts, live, None))

    # -- whole segments ----------------------------------------------------------------------
    def _rows_in(self, segment_id: int, flag: int) -> npt.NDArray[np.intp]:
        n = self._n
        return np.flatnonzero((self._sid[:n] == segment_id) & (self._flag[:n] == flag))

    def _keys_of(self, rows: npt.NDArray[np.intp]) -> list[bytes]:
        k = np.empty((len(rows), 2), np.uint64)
        k[:, 0], k[:, 1] = self._k0[rows], self._k1[rows]
        raw = k.astype("<u8").tobytes()
        lens = self._klen[rows].tolist()
        return [raw[16 * i:16 * i + n] if n <= _SHORT else self._long[int(rows[i])]
                for i, n in enumerate(lens)]

    def keys(self) -> list[bytes]:
        return self._keys_of(np.flatnonzero(self._flag[:self._n] == FLAG_PUT))

    def entries_in(self, segment_id: int) -> list[tuple[bytes, Entry]]:
        """The live keys of a segment with their entries, by record offset."""
        rows = self._rows_in(segment_id, FLAG_PUT)
        rows = rows[np.argsort(self._roff[rows], kind="stable")]
        return list(zip(self._keys_of(rows), self._entries_of(rows), strict=True))

    def _entries_of(self, rows: npt.NDArray[np.intp]) -> list[Entry]:
        return [tuple(e) for e in np.stack(self.columns_of_rows(rows), axis=1).tolist()]

    def tombstones_in(self, segment_id: int) -> list[bytes]:
        """Keys whose newest tombstone is in ``segment_id``."""
        return sorted(self._keys_of(self._rows_in(segment_id, FLAG_TOMBSTONE)))

    def share(self, segment_id: int) -> SegmentShare:
        """The segment's share, to be written as its hint."""
        items = self.entries_in(segment_id)
        return SegmentShare([k for k, _ in items], [e for _, e in items],
                            self.tombstones_in(segment_id), self.live_bytes(segment_id))

    def hint_bytes(self, segment_id: int, data_bytes: int) -> bytes:
        """The hint file of ``segment_id`` (version 2 of ``hint_columns``, built from the
        columns at once; tombstones in row order), or ``keydir.encode_hint`` (long keys)."""
        puts = self._rows_in(segment_id, FLAG_PUT)
        puts = puts[np.argsort(self._roff[puts], kind="stable")]
        rows = np.concatenate((puts, self._rows_in(segment_id, FLAG_TOMBSTONE)))
        klen = self._klen[rows]
        if len(rows) and int(klen.max()) > _SHORT:
            return encode_hint(segment_id, data_bytes, self.share(segment_id))
        c = self._cols
        return encode_hint_columns(HintColumns(
            segment_id, len(puts), self._k0[rows], self._k1[rows], klen, self._roff[puts],
            c["vlen"][puts], c["csum"][puts], c["ts"][puts], self.live_bytes(segment_id),
            None), data_bytes)

    def drop_segment(self, segment_id: int) -> list[bytes]:
        """Forget everything in a segment that is gone; returns the keys that lost their
        value (evicted), sorted."""
        n = self._n
        puts = self._rows_in(segment_id, FLAG_PUT)
        tombs = self._rows_in(segment_id, FLAG_TOMBSTONE)
        keys = sorted(self._keys_of(puts))
        self._flag[puts] = 0
        self._flag[tombs] = 0
        self._puts -= len(puts)
        self._present -= len(puts) + len(tombs)
        self._live_bytes.pop(segment_id, None)
        self._live_count.pop(segment_id, None)
        if n - self._present > max(self._present, _MIN_CAP):
            self._rebuild()
        return keys

    def apply(self, segment_id: int, items: Iterable[LogItem]) -> None:
        """Apply a segment's records, as a scan finds them, in log order: the last
        record of each key wins, entered in one vectorised step (``load_columns``) when
        every key is at most 16 bytes, else key by key."""
        items = list(items)
        if len(items) < SCALAR_BATCH or any(len(k) > _SHORT for k, _, _ in items):
            for key, flags, entry in items:
                if flags == FLAG_TOMBSTONE:
                    self.delete(key, segment_id)
                else:
                    self.put(key, entry)
            return
        last = {key: i for i, (key, _, _) in enumerate(items)}
        puts = [items[i] for i in last.values() if items[i][1] != FLAG_TOMBSTONE]
        tombs = [items[i][0] for i in last.values() if items[i][1] == FLAG_TOMBSTONE]
        k0, k1, klen = key_words([k for k, _, _ in puts] + tombs)
        ent = np.array([e for _, _, e in puts], np.uint64).reshape(len(puts), 7)
        live = int((ent[:, 4] - ent[:, 1]).sum())
        self.load_columns(segment_id, HintColumns(
            segment_id, len(puts), k0, k1, klen, ent[:, 1], ent[:, 3], ent[:, 5], ent[:, 6],
            live, None))

    def load(self, segment_id: int, share: SegmentShare) -> None:
        """Apply a segment's share after every older segment (slow path: per key)."""
        for key, entry in zip(share.keys, share.entries, strict=True):
            self.put(key, entry)
        for key in share.tombstones:
            self.set_tombstone(key, segment_id)

    def reserve(self, rows: int) -> None:
        """Make room for ``rows`` more keys at once (a reopen sizes the table first)."""
        if (self._n + rows) * 10 > len(self._table) * 7:
            self._make_room(rows)
        need = self._n + rows
        if need > self._cap:
            self._grow_rows(max(need, self._cap * 2))

    def load_columns(self, segment_id: int, cols: HintColumns) -> None:
        """Apply a segment's share decoded by ``hints.decode_hint_columns``: the same as
        ``load``, vectorised (a reopen spends its time here)."""
        if cols.long_keys:  # keys longer than 16 bytes: the per-key path
            self.load(segment_id, cols.to_share())
            return
        n = len(cols.k0)
        if n == 0:
            return
        self.reserve(n)
        hashes = self._hash.many(cols.k0, cols.k1)
        if self._n:
            rows, ends = self._find_many(hashes, cols.k0, cols.k1, cols.klen)
        else:  # nothing loaded yet: every key is new
            rows, ends = np.full(n, -1, np.int64), None
        old = rows[rows >= 0]
        if len(old):  # keys an older segment holds: take back what they count for
            flags = self._flag[old]
            was_put = old[flags == FLAG_PUT]
            if len(was_put):
                rb = record_geometry_np(self._klen[was_put], self._cols["vlen"][was_put])[1]
                sids = self._sid[was_put]
                for sid, nb, cnt in group_sum(sids, rb):
                    self._live_bytes[sid] -= nb
                    self._live_count[sid] -= cnt
                self._puts -= len(was_put)
            self._present -= int(np.count_nonzero(flags))
        new = np.flatnonzero(rows < 0)
        first = self._n
        c = self._cols
        if len(new) == n:  # all new: the rows are one range, written as slices
            rows = np.arange(first, first + n)
            c["k0"][first:first + n], c["k1"][first:first + n] = cols.k0, cols.k1
            c["klen"][first:first + n] = cols.klen
            self._n += n
            insert_many(self._table, hashes, rows, ends)
        elif len(new):
            rows[new] = np.arange(first, first + len(new))
            self._n += len(new)
            c["k0"][first:self._n], c["k1"][first:self._n] = cols.k0[new], cols.k1[new]
            c["klen"][first:self._n] = cols.klen[new]
            insert_many(self._table, hashes[new], rows[new],
                        None if ends is None else ends[new])
        p = cols.puts
        prow: Any = rows[:p]
        trow: Any = rows[p:]
        if len(new) == n:
            prow, trow = slice(first, first + p), slice(first + p, first + n)
        c["sid"][prow] = segment_id
        c["roff"][prow], c["vlen"][prow] = cols.roff, cols.vlen
        c["csum"][prow], c["ts"][prow] = cols.csum, cols.ts
        c["flag"][prow] = FLAG_PUT
        c["sid"][trow] = segment_id
        for name in ("roff", "vlen", "csum", "ts"):
            c[name][trow] = 0
        c["flag"][trow] = FLAG_TOMBSTONE
        self._puts += p
        self._present += n
        self._live_bytes[segment_id] = self._live_bytes.get(segment_id, 0) + cols.live_bytes
        self._live_count[segment_id] = self._live_count.get(segment_id, 0) + p

    # -- internals ---------------------------------------------------------------------------
    def _find_many(self, hashes: U64, k0: U64, k1: U64, klen: npt.NDArray[np.uint16],
                   ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        return probe_many(self._table, hashes, k0, k1, klen, self._k0, self._k1, self._klen)

    def _grow_rows(self, cap: int) -> None:
        n = self._n
        for name, dtype in _COLUMNS:
            col = np.zeros(cap, dtype)  # calloc: pages are mapped on first touch
            if n:
                col[:n] = self._cols[name][:n]
            self._cols[name] = col
        self._cap = cap
        self._bind()

    def _bind(self) -> None:
        c = self._cols
        self._k0, self._k1, self._klen = c["k0"], c["k1"], c["klen"]
        self._flag, self._sid, self._roff = c["flag"], c["sid"], c["roff"]

    def _reindex(self, size: int) -> None:
        self._table = np.full(size, -1, np.int32)
        self._mask = size - 1
        n = self._n
        if n:
            insert_many(self._table, self._hash.many(self._k0[:n], self._k1[:n]),
                        np.arange(n, dtype=np.int64))

    def _rebuild(self) -> None:
        """Drop absent rows, then rehash into a table sized for the rest."""
        n = self._n
        keep = np.flatnonzero(self._flag[:n] != 0)
        if len(keep) < n:
            for name, _ in _COLUMNS:
                col = self._cols[name]
                col[:len(keep)] = col[keep]
                col[len(keep):n] = 0
            if self._long:
                where = {int(old): new for new, old in enumerate(keep.tolist())}
                self._long = {where[r]: k for r, k in self._long.items() if r in where}
            self._n = len(keep)
        self._reindex(table_size(self._n))
