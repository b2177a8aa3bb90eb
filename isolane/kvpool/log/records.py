"""The byte format of KV segment files, pure (no I/O): headers, records, checksums.

``segment_log.py`` (the ``SegmentLog``) writes and reads these bytes; everything here is a
function of its arguments, so the format is testable without files. Integers are little
endian; ``docs/FORMATS.md`` ("KV segment files") has the same tables.

Segment header (64 bytes, little endian, version 2)::

    +--------+------+--------------+---------------------------------------------+
    | offset | size | field        | meaning                                     |
    +--------+------+--------------+---------------------------------------------+
    | 0      | 8    | magic        | b"ISOKVSEG"                                 |
    | 8      | 2    | version      | 2                                           |
    | 10     | 2    | header_bytes | 64: where the first record starts           |
    | 12     | 4    | segment_id   | matches the file name                       |
    | 16     | 8    | created_ns   | unix time in ns                             |
    | 24     | 8    | salt         | random, nonzero, fixed when the file starts |
    | 32     | 8    | checksum     | xxh3-64 of bytes [0, 32)                    |
    | 40     | 24   | reserved     | zeros                                       |
    +--------+------+--------------+---------------------------------------------+

(Version 1, still read: no salt, its checksum at 24 covers bytes [0, 24); see below.)

Record (``RECORD_HEADER``, then key, value; every record starts on a 64-byte boundary)::

    +--------+------+--------------+---------------------------------------------+
    | offset | size | field        | meaning                                     |
    +--------+------+--------------+---------------------------------------------+
    | 0      | 8    | checksum     | xxh3-64 of bytes [8, value end) XOR salt    |
    | 8      | 1    | flags        | 1 put, 2 tombstone                          |
    | 9      | 1    | reserved     | 0                                           |
    | 10     | 2    | key_len      | 1 .. 1024 (KV block keys: 16)               |
    | 12     | 4    | value_len    | bytes of value (0 for a tombstone)          |
    | 16     | 8    | timestamp_ns | unix time in ns of the append               |
    | 24     | k    | key          | then zeros up to a multiple of 64           |
    | 64 (*) | v    | value        | then zeros up to a multiple of 64           |
    +--------+------+--------------+---------------------------------------------+
    (*) value_offset = record_offset + align64(24 + key_len): 64 for 16-byte keys

The checksum covers the header fields after it, the key, its padding and the value
(the trailing padding is not covered). The record's *content checksum* ``H`` is that
xxh3-64; the record stores ``H XOR salt``, while the key directory, hint files and the
capacity tier's index keep ``H`` (reads check the bytes against ``H``; they need no salt).

Why the salt: values are arbitrary bytes (an attacker may choose them), so a value can
hold a well-formed record of another key. The reopen scan resyncs past damage or a torn
tail at the next record that checks out; without a secret in the check, that could be
such a forged record, then served under a key its writer never owned. With the salt
(``os.urandom``; no API returns raw segment bytes, and a sealed segment's copy on the
capacity tier takes no new records) a forged record checks out with probability 2**-64.
It guards against crafted values, not against someone who can write the files.
Compaction rebinds a copied record to the salt of the segment it lands in.
Version 1 segments (salt 0) are still read, but their scan never resyncs: it stops at
the first bad record; a version 1 live segment is sealed on open (new appends go to a
version 2 segment). xxh3-64 rather than crc32c: it is already a
dependency (xxhash), runs at ~10 GB/s a core with the GIL released, and 64 bits make
an undetected corruption of a 32 MiB value negligible.

Padding: 64 bytes, not 4096. A prompt's blocks are appended as one batch and restored
with ONE range read over ``[first.record_offset, last.record_end)``; what that needs is
contiguity, not page-aligned records. Page padding would cost up to 4095 bytes a record:
a 4 KiB block plus its 64-byte header would take 8 KiB (+100 %), a 64 KiB block +6 %,
and the run read would carry those holes. O_DIRECT does not need it either: it needs the
file offset, length and buffer aligned, so ``read_run(direct=True)`` widens the range
outward to page boundaries (at most 8 KiB more per run) and returns a view into a
page-aligned buffer. The 64-byte grid gives every value a cache-line-aligned address in
that buffer (numpy/torch views of any dtype) and fits header + 16-byte key exactly.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

from isolane.errors import IntegrityError, InvalidArgumentError
from isolane.kvpool.log.keydir import FLAG_PUT, FLAG_TOMBSTONE, Entry, Location
from isolane.storage.aligned import align_up
from isolane.storage.base import Buffer

__all__ = [
    "CHECKSUM", "MAX_KEY_BYTES", "MAX_VALUE_BYTES", "RECORD_ALIGN", "RECORD_HEADER",
    "RECORD_TAIL", "SEGMENT_HEADER", "SEGMENT_HEADER_BYTES", "SEGMENT_HEADER_V1",
    "SEGMENT_MAGIC", "SEGMENT_VERSION", "ZEROS", "PendingRecord", "Record",
    "RecordIntegrityError", "check_key", "check_record", "check_value",
    "encode_segment_header", "new_salt", "next_valid_record", "parse_run",
    "parse_segment_header", "record_geometry", "verify_parts", "verify_record",
]

SEGMENT_MAGIC = b"ISOKVSEG"
SEGMENT_VERSION = 2
SEGMENT_HEADER = struct.Struct("<8sHHIQQQ")
"""magic, version, header_bytes, segment_id, created_ns, salt, checksum; zeros to 64."""
SEGMENT_HEADER_V1 = struct.Struct("<8sHHIQQ")  # magic ... created_ns, checksum
SEGMENT_HEADER_BYTES = 64
RECORD_HEADER = struct.Struct("<QBBHIQ")
"""checksum, flags, reserved, key_len, value_len, timestamp_ns (24 bytes)."""
RECORD_ALIGN = 64
MAX_KEY_BYTES = 1024
MAX_VALUE_BYTES = 2**32 - 1

RECORD_TAIL = struct.Struct("<BBHIQ")  # the header after the checksum
CHECKSUM = struct.Struct("<Q")
_unpack_header = RECORD_HEADER.unpack_from
ZEROS = bytes(RECORD_ALIGN)


def record_geometry(key_len: int, value_len: int) -> tuple[int, int]:
    """(value offset from the record start, record bytes including padding)."""
    value_delta = align_up(RECORD_HEADER.size + key_len, RECORD_ALIGN)
    return value_delta, align_up(value_delta + value_len, RECORD_ALIGN)


def record_geometry_np(klen: npt.NDArray[Any], vlen: npt.NDArray[Any]
                       ) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
    """``record_geometry`` of many records at once (key and value lengths as arrays)."""
    a = np.uint64(RECORD_ALIGN - 1)
    delta = (klen.astype(np.uint64) + np.uint64(RECORD_HEADER.size) + a) & ~a
    return delta, (delta + vlen.astype(np.uint64) + a) & ~a


class RecordIntegrityError(IntegrityError):
    """A record failed its checksum or framing check; ``key`` (None when the header is
    unreadable), ``segment_id`` and ``offset`` say which. The pool treats it as a miss
    and drops the key (``SegmentLog.delete``)."""

    def __init__(self, key: bytes | None, segment_id: int | None, offset: int,
                 detail: str) -> None:
        self.key = key
        self.segment_id = segment_id
        self.offset = offset
        name = f"KV block {key.hex()}" if key is not None else "KV record"
        where = f"segment {segment_id}" if segment_id is not None else "a run"
        super().__init__(f"{name} in {where} at offset {offset}", detail,
                         hint="the block is dropped and reads as a miss (it is recomputed)")


@dataclass(frozen=True, slots=True)
class Record:
    """One record parsed out of a run; ``value`` is a zero-copy view into the run."""

    key: bytes
    flags: int
    timestamp_ns: int
    checksum: int
    record_offset: int
    value_offset: int
    record_end: int
    value: memoryview

    @property
    def is_tombstone(self) -> bool:
        return self.flags == FLAG_TOMBSTONE


def check_record(buf: memoryview, pos: int, salt: int
                 ) -> tuple[int, int, int, int, int, int, int] | str:
    """(content checksum, flags, key_len, value_len, value_delta, record_bytes,
    timestamp_ns) of the record at ``pos``, its salted checksum verified; or why it is
    not a valid complete record of the segment whose salt is ``salt``."""
    if pos + RECORD_HEADER.size > len(buf):
        return "the header is cut off"
    stored, flags, _, klen, vlen, ts = _unpack_header(buf, pos)
    if flags not in (FLAG_PUT, FLAG_TOMBSTONE) or not 0 < klen <= MAX_KEY_BYTES or (
            flags == FLAG_TOMBSTONE and vlen):
        return f"invalid header (flags {flags}, key_len {klen}, value_len {vlen})"
    delta = (RECORD_HEADER.size + klen + RECORD_ALIGN - 1) & -RECORD_ALIGN  # record_geometry
    rbytes = (delta + vlen + RECORD_ALIGN - 1) & -RECORD_ALIGN
    if pos + rbytes > len(buf):
        return f"the record ({rbytes} bytes) is cut off after {len(buf) - pos}"
    computed = xxhash.xxh3_64_intdigest(buf[pos + 8:pos + delta + vlen])
    if computed ^ salt != stored:
        return (f"checksum mismatch: stored {stored:016x}, computed {computed ^ salt:016x} "
                "(salted)")
    return computed, flags, klen, vlen, delta, rbytes, ts


def next_valid_record(buf: memoryview, pos: int, salt: int) -> int | None:
    """The first offset from ``pos`` on (at record alignment) that holds a complete
    record whose checksum checks out with the segment's ``salt``, or None. Cheap field
    checks first, so random value bytes are almost never hashed."""
    pos = align_up(pos, RECORD_ALIGN)
    while pos + RECORD_HEADER.size <= len(buf):
        _, flags, reserved, klen, _, _ = RECORD_HEADER.unpack_from(buf, pos)
        if (flags in (FLAG_PUT, FLAG_TOMBSTONE) and reserved == 0 and 0 < klen <= MAX_KEY_BYTES
                and not isinstance(check_record(buf, pos, salt), str)):
            return pos
        pos += RECORD_ALIGN
    return None


def parse_segment_header(head: Buffer, segment_id: int) -> tuple[int, int] | None:
    """``(version, salt)`` of a segment file whose first 64 bytes are ``head``, or None
    when they are not a valid header of segment ``segment_id`` (version 1: salt 0)."""
    head = memoryview(head).cast("B")
    if len(head) < SEGMENT_HEADER_BYTES:
        return None
    magic, version, hbytes, seg_id = SEGMENT_HEADER.unpack_from(head)[:4]
    if (magic, hbytes, seg_id) != (SEGMENT_MAGIC, SEGMENT_HEADER_BYTES, segment_id):
        return None
    if version == 1:
        csum = SEGMENT_HEADER_V1.unpack_from(head)[5]
        return (1, 0) if csum == xxhash.xxh3_64_intdigest(head[:24]) else None
    if version == SEGMENT_VERSION:
        salt, csum = SEGMENT_HEADER.unpack_from(head)[5:]
        ok = salt != 0 and csum == xxhash.xxh3_64_intdigest(head[:32])
        return (version, salt) if ok else None
    return None


def encode_segment_header(segment_id: int, salt: int, created_ns: int) -> bytes:
    """The 64-byte header of a new (version 2) segment file."""
    head = SEGMENT_HEADER.pack(SEGMENT_MAGIC, SEGMENT_VERSION, SEGMENT_HEADER_BYTES,
                               segment_id, created_ns, salt, 0)
    head = head[:32] + CHECKSUM.pack(xxhash.xxh3_64_intdigest(head[:32]))
    return head.ljust(SEGMENT_HEADER_BYTES, b"\0")


def new_salt() -> int:
    """A random nonzero 64-bit salt for a new segment."""
    while True:
        salt = int.from_bytes(os.urandom(8), "little")
        if salt:
            return salt


def parse_run(run: memoryview, start: int, *, salt: int,
              segment_id: int | None = None) -> list[Record]:
    """Every record of ``run`` (bytes ``[start, start + len(run))`` of a segment whose
    salt is ``salt``, from one record start to another), each verified; values are
    views into ``run``; ``Record.checksum`` is the content checksum. Raises
    ``RecordIntegrityError`` at the first record that does not check out."""
    run = memoryview(run).cast("B")
    records: list[Record] = []
    pos = 0
    while pos < len(run):
        parsed = check_record(run, pos, salt)
        if isinstance(parsed, str):
            raise RecordIntegrityError(None, segment_id, start + pos, parsed)
        csum, flags, klen, vlen, delta, rbytes, ts = parsed
        key = bytes(run[pos + RECORD_HEADER.size:pos + RECORD_HEADER.size + klen])
        records.append(Record(key, flags, ts, csum, start + pos, start + pos + delta,
                              start + pos + rbytes, run[pos + delta:pos + delta + vlen]))
        pos += rbytes
    return records


def verify_record(run: memoryview, start: int, location: Location) -> memoryview:
    """The value of ``location`` out of ``run`` (bytes ``[start, start + len(run))`` of
    its segment), checked against the location and the record's checksum; a zero-copy
    view. Raises ``RecordIntegrityError`` naming the key and segment."""
    loc = location
    rel, end = loc.record_offset - start, loc.value_end - start
    if rel < 0 or end > len(run):
        raise InvalidArgumentError(
            f"run [{start}, {start + len(run)}) does not cover the record of KV block "
            f"{loc.key.hex()} at [{loc.record_offset}, {loc.value_end})")
    value = run[end - loc.value_length:end]
    verify_parts(run[rel:end - loc.value_length], [value], loc)
    return value


def verify_parts(head: Buffer, value: Sequence[Buffer], location: Location) -> None:
    """Check a record read in parts: ``head`` holds its bytes up to the value (header,
    key, padding), ``value`` the value's bytes in order (e.g. scattered into a caller's
    tensor). Raises ``RecordIntegrityError`` naming the key and segment."""
    loc = location
    head = memoryview(head).cast("B")
    if len(head) != loc.value_offset - loc.record_offset:
        raise InvalidArgumentError(f"head of KV block {loc.key.hex()} holds {len(head)} "
                                   f"bytes, the record {loc.value_offset - loc.record_offset}")
    _stored, flags, _, klen, vlen, _ts = RECORD_HEADER.unpack_from(head, 0)
    delta = record_geometry(klen, vlen)[0]
    if (flags, klen, vlen, delta) != (FLAG_PUT, len(loc.key), loc.value_length, len(head)):
        raise _mismatch(loc, "the record header does not match the key directory")
    # Against the key directory's content checksum: the stored field is salted (it
    # proves a record to the reopen scan) and is not needed here.
    hasher = xxhash.xxh3_64(head[8:])
    for part in value:
        hasher.update(part)
    computed = hasher.intdigest()
    if computed != loc.checksum:
        raise _mismatch(loc, f"checksum mismatch: indexed {loc.checksum:016x}, "
                             f"computed {computed:016x}")
    if head[RECORD_HEADER.size:RECORD_HEADER.size + klen] != loc.key:
        raise _mismatch(loc, "the record holds another key")


def _mismatch(loc: Location, detail: str) -> RecordIntegrityError:
    # A module function, not a closure: verify_parts runs on every block read.
    return RecordIntegrityError(loc.key, loc.segment_id, loc.record_offset, detail)


class PendingRecord:
    """A record ready to be written: its bytes as buffers (``head``, then ``parts``),
    plus what the index needs. ``head`` starts with the 8-byte checksum field, filled in
    by ``bind`` with the salt of the segment the record goes to (``checksum`` is the
    content checksum, salt-free)."""

    __slots__ = ("checksum", "flags", "head", "key", "old", "parts", "record_bytes",
                 "timestamp_ns", "value_delta", "value_length")

    def __init__(self, key: bytes, flags: int, timestamp_ns: int, checksum: int,
                 value_length: int, head: bytearray, parts: list[memoryview | bytes],
                 old: Entry | None = None) -> None:
        self.key, self.flags, self.timestamp_ns = key, flags, timestamp_ns
        self.checksum, self.value_length, self.head, self.parts, self.old = (
            checksum, value_length, head, parts, old)
        self.value_delta, self.record_bytes = record_geometry(len(key), value_length)

    @classmethod
    def encode(cls, key: bytes, flags: int, value: memoryview, timestamp_ns: int) -> PendingRecord:
        delta, rbytes = record_geometry(len(key), len(value))
        tail = RECORD_TAIL.pack(flags, 0, len(key), len(value), timestamp_ns)
        keypad = key + ZEROS[:delta - RECORD_HEADER.size - len(key)]
        h = xxhash.xxh3_64(tail)
        h.update(keypad)
        h.update(value)
        csum = h.intdigest()
        parts: list[memoryview | bytes] = []
        if len(value):
            parts.append(value)
        if rbytes - delta - len(value):
            parts.append(ZEROS[:rbytes - delta - len(value)])
        return cls(key, flags, timestamp_ns, csum, len(value), bytearray(8) + tail + keypad,
                   parts)

    @classmethod
    def copy(cls, key: bytes, entry: Entry, record: memoryview) -> PendingRecord:
        """A verbatim copy of the record of ``entry`` (its bytes: ``record``), to be
        rebound to the salt of the segment it is copied to."""
        return cls(key, FLAG_PUT, entry[6], entry[5], entry[3], bytearray(8), [record[8:]],
                   entry)

    def bind(self, salt: int) -> None:
        CHECKSUM.pack_into(self.head, 0, self.checksum ^ salt)


def check_key(key: object) -> bytes:
    if isinstance(key, (bytearray, memoryview)):
        key = bytes(key)
    if not isinstance(key, bytes) or not 0 < len(key) <= MAX_KEY_BYTES:
        raise InvalidArgumentError(
            f"a KV key must be 1 to {MAX_KEY_BYTES} bytes (block keys are 16), got {key!r:.60}")
    return key


def check_value(value: object, key: bytes) -> memoryview:
    try:
        view = memoryview(value).cast("B")  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(
            f"the value of KV block {key.hex()} must be a contiguous bytes-like object "
            f"(bytes, bytearray, memoryview, numpy array): {exc}") from None
    if len(view) > MAX_VALUE_BYTES:
        raise InvalidArgumentError(f"the value of KV block {key.hex()} is {len(view)} bytes; "
                                   f"at most {MAX_VALUE_BYTES} are allowed")
    return view
