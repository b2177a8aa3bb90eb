"""What the key directory of the KV segment log holds (``Entry``, ``Location``), and
its persisted form (hint files). The directory itself is ``keytable.KeyDirectory``.

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
from dataclasses import dataclass
from itertools import accumulate, pairwise
from typing import TypeAlias

import numpy as np
import numpy.typing as npt
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


@dataclass(frozen=True, slots=True)
class LocatedColumns:
    """Where each of a batch of keys' newest values is, as numpy columns by position in
    the batch (``SegmentLog.locate_columns``: one probe, no object per key): the fields
    of ``Location``, each valid where ``found``. ``locations`` builds the ``Location``
    objects of some positions only when a reader needs them."""

    keys: list[bytes]
    found: npt.NDArray[np.bool_]
    segment_id: npt.NDArray[np.uint64]
    record_offset: npt.NDArray[np.uint64]
    value_offset: npt.NDArray[np.uint64]
    value_length: npt.NDArray[np.uint64]
    record_end: npt.NDArray[np.uint64]
    checksum: npt.NDArray[np.uint64]
    timestamp_ns: npt.NDArray[np.uint64]

    def locations(self, positions: npt.NDArray[np.intp]) -> list[Location]:
        """``Location`` of each of ``positions`` (all found), in that order."""
        keys = self.keys
        cols = zip(*(c[positions].tolist() for c in (
            self.segment_id, self.record_offset, self.value_offset, self.value_length,
            self.record_end, self.checksum, self.timestamp_ns)), strict=True)
        return [Location(keys[p], *e) for p, e in zip(positions.tolist(), cols, strict=True)]


def encode_hint(segment_id: int, data_bytes: int, share: SegmentShare) -> bytes:
    """The hint file of a segment of ``data_bytes`` bytes."""
    keys = share.keys + share.tombstones
    body = bytearray()
    pack = HINT_ENTRY.pack
    for entry in share.entries:
        body += pack(*entry)
    lengths = array("H", [len(k) for k in keys])
    if sys.byteorder == "big":
        lengths.byteswap()
    return hint_from_parts(segment_id, data_bytes, len(share.keys), len(share.tombstones),
                           share.live_bytes, [body, lengths.tobytes(), b"".join(keys)])


def hint_from_parts(segment_id: int, data_bytes: int, puts: int, tombstones: int,
                    live_bytes: int, body: list[bytes | bytearray],
                    version: int = HINT_VERSION) -> bytes:
    """A hint file from its header fields and its body (version 1: entries, key
    lengths, keys; version 2: ``hint_columns``'s columns)."""
    head = HINT_HEADER.pack(HINT_MAGIC, version, 0, segment_id, data_bytes,
                            puts, tombstones, live_bytes, 0)
    h = xxhash.xxh3_64(head[:48])
    for part in body:
        h.update(part)
    return b"".join([head[:48], h.intdigest().to_bytes(8, "little"), *body])


def check_hint(data: bytes, segment_id: int,
               data_bytes: int) -> tuple[int, int, int, array[int], int]:
    """(put count, tombstone count, live bytes, key lengths, where the keys start) of
    a hint file; ``IntegrityError`` when it does not describe segment ``segment_id`` of
    ``data_bytes`` bytes or is damaged."""
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
    key_bytes = int(np.frombuffer(data, "<u2", len(lengths), pos).sum(dtype=np.int64))
    pos += 2 * n
    if len(lengths) != n or pos + key_bytes != len(data):
        raise IntegrityError(what, f"its sizes do not add up to its {len(data)} bytes")
    return puts, tombs, live, lengths, pos


def decode_hint(data: bytes, segment_id: int, data_bytes: int) -> SegmentShare:
    """The share stored in a hint file; ``IntegrityError`` when it does not describe
    segment ``segment_id`` of ``data_bytes`` bytes or is damaged."""
    puts, tombs, live, lengths, pos = check_hint(data, segment_id, data_bytes)
    n = puts + tombs
    view = memoryview(data)
    entries = list(HINT_ENTRY.iter_unpack(view[HINT_HEADER.size:HINT_HEADER.size
                                               + puts * HINT_ENTRY.size]))
    if n and min(lengths) == max(lengths):
        width = lengths[0]
        keys = [data[i:i + width] for i in range(pos, len(data), width)]
    else:
        ends = list(accumulate(lengths, initial=pos))
        keys = [data[a:b] for a, b in pairwise(ends)]
    return SegmentShare(keys[:puts], entries, keys[puts:], live)
