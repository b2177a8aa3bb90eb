"""The host lane plane's file layout: header, governor block, member slots (pure).

One file per host config (see ``isolane.lanes.plane``), read and written with
pread/pwrite by every member process. Little-endian throughout; every part carries a
CRC-32 so that a torn or foreign byte is detected, never trusted::

    offset 0      header (HEADER, 64 bytes)       magic "ISOLANEP", version, geometry,
                                                  config digest, created, crc32
    offset 256    governor block (GOV_BYTES)      u32 length, u32 crc32, JSON (utf-8):
                                                  the elected member's host decisions
    offset 4096   SLOTS x SLOT_BYTES member slots

A slot (SLOT_BYTES, written only by its owner, whole, with its crc32 last)::

    SLOT_HEAD   state u32 (0 free, 1 member), pid u32, start_ticks u64 (the pid's
                start time in clock ticks since boot: a reused pid is told apart),
                generation u64, joined f64, heartbeat f64 (CLOCK_MONOTONIC s),
                roles u32 (1 reader, 2 writer, 4 node), flags u32 (1 governs),
                read/write/background threads u16 x 3, pad u16,
                write/background demand bytes u64 x 2, write/background bytes/s f64 x 2,
                write/background limit f64 x 2 (NaN: unlimited), kv_gets u64
    EPOCH_HEAD  x EPOCHS: epoch index i64 (CLOCK_MONOTONIC // EPOCH_S), count u32, pad u32
    bins        x EPOCHS: BINS u32 counts of KV get latencies (isolane.lanes.histogram)
    zero padding, then crc32 u32 (the slot's last 4 bytes) over everything before it

A member joins and leaves under an flock on ``<plane>.lock`` (short); on the hot
path it rewrites only its own slot, and readers copy a slot and check its CRC
(retrying a torn read) without any lock.
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from isolane import bounded_json
from isolane.errors import InvalidArgumentError
from isolane.lanes.histogram import BINS, Counts

MAGIC = b"ISOLANEP"
VERSION = 1
HEADER = struct.Struct("<8sIIIIIII16sd")  # + crc32
HEADER_CRC = struct.Struct("<I")
GOV_OFFSET = 256
GOV_HEAD = struct.Struct("<II")
GOV_BYTES = 4096 - GOV_OFFSET
SLOTS_OFFSET = 4096
SLOTS = 64
EPOCHS = 16
EPOCH_S = 0.1
SLOT_HEAD = struct.Struct("<IIQQddIIHHHHQQddddQ")
EPOCH_HEAD = struct.Struct("<qII")
BINS_BYTES = BINS * 4
_BODY = SLOT_HEAD.size + EPOCHS * (EPOCH_HEAD.size + BINS_BYTES)
SLOT_BYTES = (_BODY + 4 + 511) // 512 * 512
FILE_BYTES = SLOTS_OFFSET + SLOTS * SLOT_BYTES

ROLE_READER, ROLE_WRITER, ROLE_NODE = 1, 2, 4
FLAG_GOVERNS = 1
ROLE_NAMES = ((ROLE_READER, "reader"), (ROLE_WRITER, "writer"), (ROLE_NODE, "node"))


def slot_offset(index: int) -> int:
    return SLOTS_OFFSET + index * SLOT_BYTES


@dataclass(frozen=True)
class Header:
    digest: bytes  # 16 bytes naming the host config's devices
    created_s: float  # wall clock, for display only

    def pack(self) -> bytes:
        body = HEADER.pack(MAGIC, VERSION, HEADER.size + 4, SLOTS, SLOT_BYTES, EPOCHS,
                           BINS, round(EPOCH_S * 1e6), self.digest, self.created_s)
        return body + HEADER_CRC.pack(zlib.crc32(body))


def check_header(data: bytes, digest: bytes) -> str | None:
    """Why ``data`` is not this config's plane header (None: it is)."""
    if len(data) < HEADER.size + 4:
        return "truncated header"
    body = data[:HEADER.size]
    (magic, version, size, slots, slot_bytes, epochs, bins, epoch_us, found,
     _created) = HEADER.unpack(body)
    if magic != MAGIC:
        return "not an isolane lane plane (bad magic)"
    if HEADER_CRC.unpack_from(data, HEADER.size)[0] != zlib.crc32(body):
        return "header checksum mismatch"
    if version != VERSION:
        return f"format version {version}, this isolane reads version {VERSION}"
    if (size, slots, slot_bytes, epochs, bins, epoch_us) != (
            HEADER.size + 4, SLOTS, SLOT_BYTES, EPOCHS, BINS, round(EPOCH_S * 1e6)):
        return "another geometry (slots, epochs or buckets)"
    if found != digest:
        return "belongs to another host config"
    return None


def fresh_file(header: Header) -> bytes:
    """A whole empty plane: header, empty governor block, free slots."""
    data = bytearray(FILE_BYTES)
    packed = header.pack()
    data[:len(packed)] = packed
    data[GOV_OFFSET:GOV_OFFSET + GOV_HEAD.size] = GOV_HEAD.pack(0, zlib.crc32(b""))
    for i in range(SLOTS):
        off = slot_offset(i)
        data[off:off + SLOT_BYTES] = free_slot()
    return bytes(data)


def free_slot() -> bytes:
    return SlotRecord().pack()


@dataclass
class SlotRecord:
    """One member's published state (``state`` 0: the slot is free)."""

    state: int = 0
    pid: int = 0
    start_ticks: int = 0
    generation: int = 0
    joined_s: float = 0.0
    heartbeat_s: float = 0.0
    roles: int = 0
    flags: int = 0
    threads: tuple[int, int, int] = (0, 0, 0)  # read, write, background
    write_demand: int = 0
    background_demand: int = 0
    write_bps: float = 0.0
    background_bps: float = 0.0
    write_limit: float | None = None
    background_limit: float | None = None
    kv_gets: int = 0
    epochs: list[tuple[int, int]] = field(default_factory=list)  # (epoch, count)
    bins: list[Counts] = field(default_factory=list)

    def pack(self) -> bytes:
        out = bytearray(SLOT_BYTES)
        SLOT_HEAD.pack_into(
            out, 0, self.state, self.pid, self.start_ticks, self.generation, self.joined_s,
            self.heartbeat_s, self.roles, self.flags, *self.threads, 0, self.write_demand,
            self.background_demand, self.write_bps, self.background_bps,
            _nan(self.write_limit), _nan(self.background_limit), self.kv_gets)
        off = SLOT_HEAD.size
        epochs = self.epochs + [(-1, 0)] * (EPOCHS - len(self.epochs))
        for epoch, count in epochs[:EPOCHS]:
            EPOCH_HEAD.pack_into(out, off, epoch, count, 0)
            off += EPOCH_HEAD.size
        for counts in self.bins[:EPOCHS]:
            out[off:off + BINS_BYTES] = counts.astype("<u4").tobytes()
            off += BINS_BYTES
        struct.pack_into("<I", out, SLOT_BYTES - 4, zlib.crc32(out[:SLOT_BYTES - 4]))
        return bytes(out)

    @classmethod
    def unpack(cls, data: bytes, *, with_bins: bool = True) -> SlotRecord | None:
        """The record, or None when its checksum fails (torn or damaged)."""
        if len(data) != SLOT_BYTES:
            return None
        if struct.unpack_from("<I", data, SLOT_BYTES - 4)[0] != zlib.crc32(
                data[:SLOT_BYTES - 4]):
            return None
        (state, pid, start, generation, joined, heartbeat, roles, flags, rt, wt, bt, _pad,
         wd, bd, wbps, bbps, wl, bl, kv_gets) = SLOT_HEAD.unpack_from(data, 0)
        off = SLOT_HEAD.size
        epochs = []
        for _ in range(EPOCHS):
            epoch, count, _p = EPOCH_HEAD.unpack_from(data, off)
            epochs.append((epoch, count))
            off += EPOCH_HEAD.size
        bins = []
        if with_bins:
            for _ in range(EPOCHS):
                bins.append(np.frombuffer(data, dtype="<u4", count=BINS, offset=off)
                            .astype(np.uint32))
                off += BINS_BYTES
        return cls(state, pid, start, generation, joined, heartbeat, roles, flags,
                   (rt, wt, bt), wd, bd, wbps, bbps, _none(wl), _none(bl), kv_gets,
                   epochs, bins)

    def role_names(self) -> list[str]:
        return [name for bit, name in ROLE_NAMES if self.roles & bit]


def _nan(value: float | None) -> float:
    return math.nan if value is None else float(value)


def _none(value: float) -> float | None:
    return None if math.isnan(value) else value


def pack_governor(block: dict[str, Any]) -> bytes:
    """The governor block: length, crc32, compact JSON; refuses what does not fit."""
    body = json.dumps(block, separators=(",", ":"), allow_nan=False).encode()
    if GOV_HEAD.size + len(body) > GOV_BYTES:
        raise InvalidArgumentError(f"governor block of {len(body)} bytes does not fit "
                         f"{GOV_BYTES - GOV_HEAD.size}")
    return GOV_HEAD.pack(len(body), zlib.crc32(body)) + body


def unpack_governor(data: bytes) -> dict[str, Any] | None:
    """The block's JSON object; None when empty, torn or damaged."""
    if len(data) < GOV_HEAD.size:
        return None
    length, crc = GOV_HEAD.unpack_from(data, 0)
    if not 0 < length <= GOV_BYTES - GOV_HEAD.size:
        return None
    body = data[GOV_HEAD.size:GOV_HEAD.size + length]
    if zlib.crc32(body) != crc:
        return None
    try:
        value = bounded_json.loads(body)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
