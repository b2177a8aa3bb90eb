"""The chain list: which chains a node holds, as ``GET /v1/kv/{ns}/chains`` answers it.

A cluster client asks each node for it to move chains on join/leave (``client.mover``);
the node builds it from its chain index (``node.chains``). Pure (no I/O)::

    +----------+---------+-------+-------+
    | ISOCHAIN | u16 = 1 | u16=0 | count |  then count x (digest 16 | n u32 | n x key 16),
    +----------+---------+-------+-------+  then a u64 xxh3-64 of everything before it

(``docs/FORMATS.md``, "KV chain index").
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

from isolane.errors import WireFormatError
from isolane.kvpool.keys import KEY_BYTES

LIST_MAGIC = b"ISOCHAIN"
VERSION = 1
LIST_HEADER = struct.Struct("<8sHHI")
LIST_ENTRY = struct.Struct("<16sI")
CHECKSUM = struct.Struct("<Q")

Chain = tuple[bytes, list[bytes]]
"""A chain: its routing digest and the keys of its blocks a node holds."""


def encode_chain_list(chains: Sequence[Chain]) -> bytes:
    """The chain-list body of ``chains``."""
    parts = [LIST_HEADER.pack(LIST_MAGIC, VERSION, 0, len(chains))]
    for digest, keys in chains:
        parts.append(LIST_ENTRY.pack(digest, len(keys)))
        parts.extend(keys)
    body = b"".join(parts)
    return body + CHECKSUM.pack(xxhash.xxh3_64_intdigest(body))


def decode_chain_list(data: bytes) -> list[Chain]:
    """The chains of a chain-list body; WireFormatError if it does not check out."""
    if len(data) < LIST_HEADER.size + CHECKSUM.size:
        raise WireFormatError(f"a chain list is at least {LIST_HEADER.size + CHECKSUM.size} "
                              f"bytes, got {len(data)}")
    body, (expected,) = data[:-CHECKSUM.size], CHECKSUM.unpack(data[-CHECKSUM.size:])
    if xxhash.xxh3_64_intdigest(body) != expected:
        raise WireFormatError("the chain list was damaged in transit (checksum mismatch)")
    magic, version, flags, count = LIST_HEADER.unpack_from(body)
    if magic != LIST_MAGIC or version != VERSION or flags:
        raise WireFormatError(f"not a version {VERSION} chain list: magic {magic!r}, "
                              f"version {version}")
    out: list[Chain] = []
    at = LIST_HEADER.size
    for _ in range(count):
        if at + LIST_ENTRY.size > len(body):
            raise WireFormatError("the chain list ends inside an entry")
        digest, n = LIST_ENTRY.unpack_from(body, at)
        at += LIST_ENTRY.size
        end = at + n * KEY_BYTES
        if end > len(body):
            raise WireFormatError("the chain list ends inside a key list")
        out.append((bytes(digest), [body[i:i + KEY_BYTES] for i in range(at, end, KEY_BYTES)]))
        at = end
    if at != len(body):
        raise WireFormatError("the chain list goes on after its last entry")
    return out
