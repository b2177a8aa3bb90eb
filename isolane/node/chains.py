"""Which chains a node holds, per KV namespace: what a cluster moves on join/leave.

A block key does not reveal its chain (keys are chained hashes), so a node records the
routing digest that each put carries (``?chain=``) with the keys it brought. The index is
an append-only log beside the namespace's segments (``chains.log``), read back on open;
only keys new to their chain are appended, a torn or damaged tail is cut off (logged),
and the file is rewritten (``atomic_write``) once it holds more than twice the
live keys. Records are not fsynced one by one: this is a hint for moves, and a chain the
index forgot only stays behind on its old node, where it reads as a miss after a move.
Keys deleted or evicted from the pool stay in the index until the next listing, which
keeps only keys still stored (``chains(present)``).

File (version 1; ``docs/FORMATS.md``, "KV chain index")::

    +----------+---------+-------+----------+
    | ISOCHIDX | u16 = 1 | u16=0 | u32 = 0  |                   16-byte file header
    +----------+---------+-------+----------+
    then records:
    +--------+-------+----------+--------------+----------+
    | digest | count | reserved | keys         | checksum |
    | 16     | u32   | u32 = 0  | count x 16   | u64      |     xxh3-64 of digest..keys
    +--------+-------+----------+--------------+----------+

The answer of ``GET /v1/kv/{ns}/chains`` (the chain list) is a wire format:
``isolane.wire.chain_list``.

Thread-safe (one lock); ``close`` flushes and fsyncs.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import BinaryIO

import xxhash

from isolane.kvpool.keys import KEY_BYTES
from isolane.storage.files import atomic_write
from isolane.wire.chain_list import Chain

log = logging.getLogger(__name__)

FILE_MAGIC = b"ISOCHIDX"
VERSION = 1
FILE_HEADER = struct.Struct("<8sHHI")
RECORD_HEADER = struct.Struct("<16sII")
CHECKSUM = struct.Struct("<Q")
MAX_RECORD_KEYS = 1 << 20  # a record claiming more is damage, not data
REWRITE_SLACK_KEYS = 4096  # below this many dead keys the file is never rewritten


def encode_record(digest: bytes, keys: Sequence[bytes]) -> bytes:
    body = RECORD_HEADER.pack(digest, len(keys), 0) + b"".join(keys)
    return body + CHECKSUM.pack(xxhash.xxh3_64_intdigest(body))


def decode_records(data: bytes) -> tuple[list[Chain], int]:
    """The records of a chain-index file and the length of its good part (where a torn
    or damaged tail starts). A file that is not an index at all reads as empty."""
    if len(data) < FILE_HEADER.size:
        return [], 0
    magic, version, _flags, _reserved = FILE_HEADER.unpack_from(data)
    if magic != FILE_MAGIC or version != VERSION:
        return [], 0
    out: list[Chain] = []
    at = FILE_HEADER.size
    while at + RECORD_HEADER.size <= len(data):
        digest, count, _r = RECORD_HEADER.unpack_from(data, at)
        end = at + RECORD_HEADER.size + count * KEY_BYTES
        if count > MAX_RECORD_KEYS or end + CHECKSUM.size > len(data):
            break
        (expected,) = CHECKSUM.unpack_from(data, end)
        if xxhash.xxh3_64_intdigest(data[at:end]) != expected:
            break
        keys_at = at + RECORD_HEADER.size
        out.append((bytes(digest),
                    [data[i:i + KEY_BYTES] for i in range(keys_at, end, KEY_BYTES)]))
        at = end + CHECKSUM.size
    return out, at


# -- the index of one namespace on one node ----------------------------------------------
class ChainIndex:
    """Routing digest -> the chain's keys (in the order they were put), on ``path``."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._chains: dict[bytes, dict[bytes, None]] = {}
        self._file_keys = 0
        self._load()
        self._file = self._open_append()

    def _open_append(self) -> BinaryIO:
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        return open(fd, "ab")

    def _load(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.is_symlink():  # never read or cut through a link: replace it
            log.warning("KV chain index %s is a symbolic link; replacing the link by a new "
                        "index (its target is not touched)", self.path)
            data = b"not an index"
        else:
            try:
                fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
            except FileNotFoundError:
                data = b""
            else:
                with open(fd, "rb") as f:
                    data = f.read()
        records, good = decode_records(data)
        for digest, keys in records:
            self._chains.setdefault(digest, {}).update(dict.fromkeys(keys))
            self._file_keys += len(keys)
        if good == 0:
            if data:
                log.warning("KV chain index %s is not an index, starting it anew", self.path)
            self._write_all()
        elif good < len(data):
            log.warning("KV chain index %s: %d bytes of torn or damaged tail cut off",
                        self.path, len(data) - good)
            fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW)
            try:
                os.ftruncate(fd, good)
                os.fsync(fd)
            finally:
                os.close(fd)

    def add(self, digest: bytes, keys: Sequence[bytes]) -> int:
        """Record that ``keys`` belong to the chain ``digest``; returns how many were new."""
        with self._lock:
            known = self._chains.setdefault(bytes(digest), {})
            new = [bytes(k) for k in dict.fromkeys(keys) if k not in known]
            if not new:
                return 0
            known.update(dict.fromkeys(new))
            self._file.write(encode_record(digest, new))
            self._file.flush()
            self._file_keys += len(new)
            return len(new)

    def chains(self, present: Callable[[bytes], bool]) -> list[Chain]:
        """Every chain with the keys that ``present`` says are still stored (in put
        order); forgotten keys and empty chains are dropped, and the file rewritten
        once mostly dead."""
        with self._lock:
            out: list[Chain] = []
            for digest in list(self._chains):
                keys = [k for k in self._chains[digest] if present(k)]
                if keys:
                    self._chains[digest] = dict.fromkeys(keys)
                    out.append((digest, keys))
                else:
                    del self._chains[digest]
            live = sum(len(k) for _, k in out)
            if self._file_keys > 2 * live + REWRITE_SLACK_KEYS:
                self._file.close()
                self._write_all()
                self._file = self._open_append()
            return out

    def __len__(self) -> int:
        with self._lock:
            return len(self._chains)

    def _write_all(self) -> None:
        """Replace the file with one record per chain (``atomic_write``)."""
        atomic_write(self.path, b"".join(
            [FILE_HEADER.pack(FILE_MAGIC, VERSION, 0, 0),
             *(encode_record(digest, list(keys)) for digest, keys in self._chains.items())]))
        self._file_keys = sum(len(k) for k in self._chains.values())

    def close(self) -> None:
        with self._lock:
            if self._file.closed:
                return
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
