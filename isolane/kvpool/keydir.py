"""The in-memory key directory of the KV segment log, and its persisted form (hint files).

``KeyDirectory`` maps each key to its newest record (segment, offsets, length,
checksum) and keeps, per segment, the keys it holds live, their bytes, and the
tombstones that still matter. It does no I/O and no locking: ``SegmentLog`` owns one
and guards it with its index lock.

A hint file ``seg-<id:08d>.hint`` is the key directory's share of one sealed segment,
written when the segment is sealed (temp file, fsync, rename), so that a reopen reads
the hints and not the data. Its entries have exactly the layout of a key directory slot,
so a reopen turns them into slots with one ``struct.iter_unpack`` and no per-key Python
code. Format (little endian, version 1)::

    header (56 bytes)
    +--------+------+-----------------+-------------------------------------------+
    | offset | size | field           | meaning                                   |
    +--------+------+-----------------+-------------------------------------------+
    | 0      | 8    | magic           | b"ISOKVHNT"                               |
    | 8      | 2    | version         | 1                                         |
    | 10     | 2    | reserved        | 0                                         |
    | 12     | 4    | segment_id      | the segment this hint describes           |
    | 16     | 8    | data_bytes      | size of the segment file it describes     |
    | 24     | 8    | put_count       | P: keys whose newest record is a put here |
    | 32     | 8    | tombstone_count | T: keys whose newest record is a          |
    |        |      |                 | tombstone here                            |
    | 40     | 8    | live_bytes      | sum of record_end - record_offset (puts)  |
    | 48     | 8    | checksum        | xxh3-64 of bytes [0, 48) and all that     |
    |        |      |                 | follows                                   |
    +--------+------+-----------------+-------------------------------------------+
    then P put entries of 7 x u64 (56 bytes each), the Entry tuple's order:
        segment_id, record_offset, value_offset, value_length, record_end,
        checksum (the record's content checksum: xxh3-64, unsalted), timestamp_ns
    then P + T key lengths (u16 each), puts first
    then the P + T keys back to back, puts first, in the same order

A hint whose magic, version, segment id, ``data_bytes`` (against the file's size),
lengths or checksum do not match is ignored and the segment is scanned instead.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import accumulate, pairwise
from typing import TypeAlias

import xxhash

from isolane.errors import IntegrityError

FLAG_PUT = 1
"""Record flag: the record stores a value for its key."""
FLAG_TOMBSTONE = 2
"""Record flag: the key was deleted (no value)."""

HINT_MAGIC = b"ISOKVHNT"
HINT_VERSION = 1
HINT_HEADER = struct.Struct("<8sHHIQQQQQ")
"""magic, version, reserved, segment_id, data_bytes, put_count, tombstone_count,
live_bytes, checksum (56 bytes)."""
HINT_ENTRY = struct.Struct("<7Q")
"""One put: an ``Entry`` tuple, field for field (56 bytes)."""

Entry: TypeAlias = tuple[int, int, int, int, int, int, int]
"""(segment_id, record_offset, value_offset, value_length, record_end, checksum,
timestamp_ns): a key directory slot, kept as a plain tuple because a reopen builds one
per key (a frozen dataclass costs ~5x more to construct)."""

LogItem: TypeAlias = tuple[bytes, int, Entry]
"""(key, flags, entry): one record as a scan of a segment finds it."""


@dataclass(frozen=True)
class SegmentShare:
    """What a segment contributes to the key directory (what its hint file stores):
    ``keys[i]``'s newest record is the put ``entries[i]``; each of ``tombstones`` was
    last deleted here. Every key appears once."""

    keys: list[bytes]
    entries: list[Entry]
    tombstones: list[bytes]
    live_bytes: int


@dataclass(frozen=True, slots=True)
class Location:
    """Where a key's newest value lives.

    The record occupies bytes ``[record_offset, record_end)`` of segment ``segment_id``
    (``record_end`` includes the padding, so it is where the next record starts); the
    value is ``[value_offset, value_offset + value_length)``. ``checksum`` is the
    record's xxh3-64, checked on every read. A location is valid until the segment is
    compacted or evicted; reading it afterwards raises ``StaleLocationError`` (look the
    key up again with ``SegmentLog.locate``). Locations do not survive a reopen.
    """

    key: bytes
    segment_id: int
    record_offset: int
    value_offset: int
    value_length: int
    record_end: int
    checksum: int
    timestamp_ns: int

    @property
    def value_end(self) -> int:
        return self.value_offset + self.value_length

    @classmethod
    def from_entry(cls, key: bytes, entry: Entry) -> Location:
        return cls(key, *entry)


class KeyDirectory:
    """key -> newest record, with per-segment live keys, live bytes and tombstones.

    Not thread-safe: the owner serializes every call. Apply records in log order
    (segments by id, records by offset): the last record of a key wins.
    """

    def __init__(self) -> None:
        self._entries: dict[bytes, Entry] = {}
        self._segment_keys: dict[int, set[bytes]] = {}
        self._live_bytes: dict[int, int] = {}
        self._tombstones: dict[bytes, int] = {}  # key -> segment of its newest tombstone
        self._segment_tombstones: dict[int, set[bytes]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def get(self, key: bytes) -> Entry | None:
        return self._entries.get(key)

    def keys(self) -> list[bytes]:
        return list(self._entries)

    def live_bytes(self, segment_id: int) -> int:
        """Bytes of the records of ``segment_id`` that are some key's newest."""
        return self._live_bytes.get(segment_id, 0)

    def live_count(self, segment_id: int) -> int:
        return len(self._segment_keys.get(segment_id, ()))

    def put(self, key: bytes, entry: Entry) -> None:
        """``key``'s newest record is now ``entry`` (a put)."""
        self._unlink(key)
        tomb = self._tombstones.pop(key, None)
        if tomb is not None:
            self._segment_tombstones[tomb].discard(key)
        self._entries[key] = entry
        segment_id = entry[0]
        self._segment_keys.setdefault(segment_id, set()).add(key)
        self._live_bytes[segment_id] = (
            self._live_bytes.get(segment_id, 0) + entry[4] - entry[1])

    def replace(self, key: bytes, expected: Entry, entry: Entry) -> bool:
        """Compare and set: point ``key`` at ``entry`` only if it still is at ``expected``."""
        if self._entries.get(key) != expected:
            return False
        self.put(key, entry)
        return True

    def delete(self, key: bytes, tombstone_segment: int) -> Entry | None:
        """A tombstone for ``key`` was written in ``tombstone_segment``; returns the
        entry it removed (None when the key had none)."""
        old = self._unlink(key)
        self.set_tombstone(key, tombstone_segment)
        return old

    def set_tombstone(self, key: bytes, segment_id: int) -> None:
        prev = self._tombstones.get(key)
        if prev is not None:
            self._segment_tombstones[prev].discard(key)
        self._tombstones[key] = segment_id
        self._segment_tombstones.setdefault(segment_id, set()).add(key)

    def entries_in(self, segment_id: int) -> list[tuple[bytes, Entry]]:
        """The live keys of a segment with their entries, by record offset."""
        entries = self._entries
        items = [(key, entries[key]) for key in self._segment_keys.get(segment_id, ())]
        items.sort(key=lambda item: item[1][1])
        return items

    def tombstones_in(self, segment_id: int) -> list[bytes]:
        """Keys whose newest tombstone is in ``segment_id``."""
        return sorted(self._segment_tombstones.get(segment_id, ()))

    def share(self, segment_id: int) -> SegmentShare:
        """The segment's share, to be written as its hint."""
        items = self.entries_in(segment_id)
        return SegmentShare([k for k, _ in items], [e for _, e in items],
                            self.tombstones_in(segment_id), self.live_bytes(segment_id))

    def drop_segment(self, segment_id: int) -> list[bytes]:
        """Forget everything in a segment that is gone; returns the keys that lost their
        value (evicted), sorted."""
        keys = sorted(self._segment_keys.pop(segment_id, ()))
        for key in keys:
            del self._entries[key]
        self._live_bytes.pop(segment_id, None)
        for key in self._segment_tombstones.pop(segment_id, ()):
            del self._tombstones[key]
        return keys

    def apply(self, segment_id: int, items: Iterable[LogItem]) -> None:
        """Apply a segment's records, as a scan finds them, in log order."""
        for key, flags, entry in items:
            if flags == FLAG_TOMBSTONE:
                self.delete(key, segment_id)
            else:
                self.put(key, entry)

    def load(self, segment_id: int, share: SegmentShare) -> None:
        """Apply a segment's share (from its hint) after every older segment: the same
        result as ``apply`` on its records, in bulk (a reopen spends its time here)."""
        new = set(share.keys)
        for key in self._entries.keys() & new:
            self._unlink(key)
        for key in self._tombstones.keys() & new:
            self._segment_tombstones[self._tombstones.pop(key)].discard(key)
        self._entries.update(zip(share.keys, share.entries, strict=True))
        self._segment_keys.setdefault(segment_id, set()).update(new)
        self._live_bytes[segment_id] = self._live_bytes.get(segment_id, 0) + share.live_bytes
        for key in share.tombstones:
            self.delete(key, segment_id)

    def _unlink(self, key: bytes) -> Entry | None:
        old = self._entries.pop(key, None)
        if old is not None:
            segment_id = old[0]
            self._segment_keys[segment_id].discard(key)
            self._live_bytes[segment_id] -= old[4] - old[1]
        return old


def encode_hint(segment_id: int, data_bytes: int, share: SegmentShare) -> bytes:
    """The hint file of a segment of ``data_bytes`` bytes."""
    keys = share.keys + share.tombstones
    body = bytearray()
    pack = HINT_ENTRY.pack
    for entry in share.entries:
        body += pack(*entry)
    body += array("H", [len(k) for k in keys]).tobytes()
    body += b"".join(keys)
    head = HINT_HEADER.pack(HINT_MAGIC, HINT_VERSION, 0, segment_id, data_bytes,
                            len(share.keys), len(share.tombstones), share.live_bytes, 0)
    h = xxhash.xxh3_64(head[:48])
    h.update(body)
    return head[:48] + h.intdigest().to_bytes(8, "little") + bytes(body)


def decode_hint(data: bytes, segment_id: int, data_bytes: int) -> SegmentShare:
    """The share stored in a hint file; ``IntegrityError`` when it does not describe
    segment ``segment_id`` of ``data_bytes`` bytes or is damaged."""
    what = f"hint file of KV segment {segment_id}"
    if len(data) < HINT_HEADER.size:
        raise IntegrityError(what, f"{len(data)} bytes is shorter than its header")
    magic, version, _, seg, size, puts, tombs, live, checksum = HINT_HEADER.unpack_from(data)
    if magic != HINT_MAGIC or version != HINT_VERSION:
        raise IntegrityError(what, f"magic {magic!r} version {version} is not "
                             f"{HINT_MAGIC!r} version {HINT_VERSION}")
    view = memoryview(data)
    h = xxhash.xxh3_64(view[:48])
    h.update(view[HINT_HEADER.size:])
    if h.intdigest() != checksum:
        raise IntegrityError(what, "checksum mismatch")
    if seg != segment_id or size != data_bytes:
        raise IntegrityError(what, f"describes segment {seg} of {size} bytes, the file "
                             f"is segment {segment_id} of {data_bytes} bytes")
    n = puts + tombs
    pos = HINT_HEADER.size + puts * HINT_ENTRY.size
    lengths = array("H")
    lengths.frombytes(data[pos:pos + 2 * n])
    if sys.byteorder == "big":
        lengths.byteswap()
    pos += 2 * n
    if len(lengths) != n or pos + sum(lengths) != len(data):
        raise IntegrityError(what, f"its sizes do not add up to its {len(data)} bytes")
    entries = list(HINT_ENTRY.iter_unpack(view[HINT_HEADER.size:HINT_HEADER.size
                                               + puts * HINT_ENTRY.size]))
    if n and min(lengths) == max(lengths):
        width = lengths[0]
        keys = [data[i:i + width] for i in range(pos, len(data), width)]
    else:
        ends = list(accumulate(lengths, initial=pos))
        keys = [data[a:b] for a, b in pairwise(ends)]
    return SegmentShare(keys[:puts], entries, keys[puts:], live)
