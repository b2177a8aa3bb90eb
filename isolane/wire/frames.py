"""KV bodies on the wire: key lists and framed block batches (pure, no I/O).

Metadata may be JSON; block values never are. Every integer is little endian; the
checksum is xxh3-64 (seed 0) of the value bytes. Layouts (``docs/FORMATS.md``, "Storage
node wire format", version 1)::

    key list (lookup, batch get, batch delete): count x 16-byte keys, back to back

    batch (request of a batch put, response of a batch get):
    +----------+---------+-------+-------+
    | magic    | version | flags | count |      16 bytes
    | ISOKVBAT | u16 = 1 | u16=0 | u32   |
    +----------+---------+-------+-------+
    then `count` frames, in request order:
    +-----+--------+----------+-----------+-----------+----------+
    | key | status | reserved | value_len | value     | checksum |
    | 16  | u8     | 3 x 0    | u32       | value_len | u64      |
    +-----+--------+----------+-----------+-----------+----------+
    status 1: value follows; status 0: a miss (value_len 0, checksum of no bytes)

A receiver knows from ``count`` how many frames to expect, so a body cut short (a
node killed mid-response) is told apart from a complete one: the frames before the
cut are whole and checked, the rest read as misses.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from isolane.errors import PayloadTooLargeError, WireFormatError
from isolane.kvpool.keys import KEY_BYTES

BATCH_MAGIC = b"ISOKVBAT"
VERSION = 1
BATCH_HEADER = struct.Struct("<8sHHI")
FRAME_HEADER = struct.Struct("<16sB3xI")
CHECKSUM = struct.Struct("<Q")
STATUS_MISS = 0
STATUS_VALUE = 1
Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True)
class FrameHeader:
    key: bytes
    status: int
    length: int


def checksum(value: Buffer) -> int:
    return xxhash.xxh3_64_intdigest(value)


def encode_keys(keys: Sequence[bytes]) -> bytes:
    for key in keys:
        if len(key) != KEY_BYTES:
            raise WireFormatError(f"a block key is {KEY_BYTES} bytes, got {len(key)}")
    return b"".join(keys)


def decode_keys(data: Buffer) -> list[bytes]:
    """A key-list body as a list of keys."""
    if len(data) % KEY_BYTES:
        raise WireFormatError(f"malformed key list: {len(data)} bytes is not a multiple of "
                              f"{KEY_BYTES} (a key list is 16-byte keys back to back)")
    view = memoryview(data)
    return [bytes(view[i:i + KEY_BYTES]) for i in range(0, len(view), KEY_BYTES)]


def encode_batch_header(count: int) -> bytes:
    return BATCH_HEADER.pack(BATCH_MAGIC, VERSION, 0, count)


def decode_batch_header(data: Buffer, max_count: int, field: str | None = None) -> int:
    """The frame count of a batch; WireFormatError for a foreign or newer body
    (``field``: the config field that raises ``max_count``, for the 413)."""
    if len(data) != BATCH_HEADER.size:
        raise WireFormatError(f"a batch starts with a {BATCH_HEADER.size}-byte header, "
                              f"the body has only {len(data)} bytes")
    magic, version, flags, count = BATCH_HEADER.unpack(data)
    if magic != BATCH_MAGIC:
        raise WireFormatError(f"not a KV batch: magic {bytes(magic)!r}, expected "
                              f"{BATCH_MAGIC!r} (docs/FORMATS.md)")
    if version != VERSION or flags:
        raise WireFormatError(f"KV batch version {version} (flags {flags}) is not supported; "
                              f"this node speaks version {VERSION}")
    if count > max_count:
        raise PayloadTooLargeError("a batch", count, max_count, unit="blocks", field=field)
    return int(count)


def encode_frame(key: bytes, value: Buffer | None) -> tuple[bytes, Buffer, bytes]:
    """Header, value and checksum of one frame (sent as three writes: no copy)."""
    if len(key) != KEY_BYTES:
        raise WireFormatError(f"a block key is {KEY_BYTES} bytes, got {len(key)}")
    if value is None:
        return FRAME_HEADER.pack(key, STATUS_MISS, 0), b"", CHECKSUM.pack(checksum(b""))
    return (FRAME_HEADER.pack(key, STATUS_VALUE, len(value)), value,
            CHECKSUM.pack(checksum(value)))


def decode_frame_header(data: Buffer, max_value_bytes: int, field: str | None = None
                        ) -> FrameHeader:
    """``field``: the config field that raises ``max_value_bytes`` (for the 413)."""
    if len(data) != FRAME_HEADER.size:
        raise WireFormatError(f"a frame starts with a {FRAME_HEADER.size}-byte header, got "
                              f"{len(data)} bytes")
    key, status, length = FRAME_HEADER.unpack(data)
    if status not in (STATUS_MISS, STATUS_VALUE) or (status == STATUS_MISS and length):
        raise WireFormatError(f"malformed frame for key {bytes(key).hex()}: status {status}, "
                              f"value_len {length}")
    if length > max_value_bytes:
        raise PayloadTooLargeError(f"the value of block {bytes(key).hex()}", length,
                                   max_value_bytes, field=field)
    return FrameHeader(bytes(key), int(status), int(length))


def check_value(header: FrameHeader, value: Buffer, trailer: Buffer) -> None:
    """Raise WireFormatError unless ``trailer`` is the checksum of ``value``."""
    (expected,) = CHECKSUM.unpack(trailer)
    if checksum(value) != expected:
        raise WireFormatError(f"checksum mismatch in the frame of key {header.key.hex()}: "
                              "the value was damaged in transit")
