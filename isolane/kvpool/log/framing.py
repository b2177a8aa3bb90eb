"""Framing a batch of put records at once: headers, offsets and index columns in numpy,
one xxh3 call per record over contiguous bytes, one ``pwritev`` per run (pure: no I/O).

``frame_puts`` turns ``(keys, values)`` into the exact bytes ``records.PendingRecord``
would produce record by record (the format is ``records.py``'s), plus the columns the
key directory takes in bulk (``KeyDirectory.put_columns``). Two layouts:

* values under ``INLINE_VALUE_BYTES``: the whole batch is framed into ONE contiguous
  buffer (headers written with vectorised stores at the records' offsets, each value
  copied in with one memcpy), each record's content checksum is one
  ``xxh3_64_intdigest`` over its bytes, and the batch goes down in one ``pwrite``;
* larger values: the headers (key and padding included) sit in one buffer, the values
  are not copied; the write is a ``pwritev`` of (header, value, padding) iovecs, and
  the checksum hashes the header and the value in two updates.

An inline batch can be framed into a caller's ``scratch`` buffer (``SegmentLog`` keeps
one per thread): fresh memory would be faulted in page by page on every batch (about 1
µs a 4 KiB block, a third of the framing); only the bytes no header field, key or value
covers are zeroed there.

Either way the stored checksum (content checksum XOR the segment's salt) is filled in by
``FramedBatch.bind`` once the segment is known, with one vectorised store.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

from isolane.kvpool.log.key_slots import key_words
from isolane.kvpool.log.keydir import FLAG_PUT
from isolane.kvpool.log.records import (
    RECORD_HEADER,
    check_key,
    check_value,
    record_geometry_np,
)
from isolane.storage.base import Buffer

__all__ = ["FRAME_SCRATCH_MAX", "INLINE_VALUE_BYTES", "FramedBatch", "check_puts", "frame_puts"]

INLINE_VALUE_BYTES = 32 * 1024
"""Values shorter than this are copied into one contiguous frame (one pwrite per batch);
longer ones are written from the caller's buffer (pwritev) without a copy."""
FRAME_SCRATCH_MAX = 64 << 20
"""Largest frame a reusable scratch buffer is kept for (a batch of 4096 4 KiB blocks
frames into 17 MB)."""
_ZEROS = np.zeros(64, np.uint8)
_HEAD = RECORD_HEADER.size


class FramedBatch:
    """A batch of put records ready to be appended: ``iovecs`` written back to back
   `` (after ``bind``) are the records; ``rel[i]`` is record i's offset in the batch.

    Columns for the key directory: ``k0``/``k1``/``klen`` (keys of <= 16 bytes as two
    little-endian u64 and a length; ``long_keys`` when some key is longer), ``vlen``,
    ``csum`` (content checksums), one ``timestamp_ns`` for all; ``keep`` lists the
    records that stay some key's newest (the last of duplicate keys wins)."""

    __slots__ = ("_frame", "_inline", "csum", "iovecs", "k0", "k1", "keep", "keys", "klen",
                 "long_keys", "nbytes", "rbytes", "rel", "timestamp_ns", "vlen")

    def __init__(self, keys: list[bytes], k0: npt.NDArray[np.uint64],
                 k1: npt.NDArray[np.uint64], klen: npt.NDArray[np.uint16],
                 vlen: npt.NDArray[np.uint32], rel: npt.NDArray[np.int64],
                 rbytes: npt.NDArray[np.uint64], csum: npt.NDArray[np.uint64],
                 timestamp_ns: int, frame: npt.NDArray[np.uint8],
                 iovecs: list[Any] | None, keep: npt.NDArray[np.intp] | None) -> None:
        self.keys, self.k0, self.k1, self.klen, self.vlen = keys, k0, k1, klen, vlen
        self.rel, self.rbytes, self.csum, self.timestamp_ns = rel, rbytes, csum, timestamp_ns
        self._frame, self.keep = frame, keep
        self._inline = iovecs is None  # the frame holds the whole records
        self.iovecs: list[Any] = [frame] if iovecs is None else iovecs
        self.long_keys = bool(len(klen)) and int(klen.max()) > 16
        self.nbytes = int(rbytes.sum())

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def buffer(self) -> npt.NDArray[np.uint8] | None:
        """The whole buffer the frame was written into (a caller's scratch, or fresh
        memory), to be reused for a later batch once this one is written; None when the
        values are written from the caller's buffers."""
        if not self._inline:
            return None
        base = self._frame.base
        return base if isinstance(base, np.ndarray) and base.dtype == np.uint8 else self._frame

    @property
    def frame_bytes(self) -> int:
        """Bytes of the one contiguous frame (0: the values are written from the
        caller's buffers)."""
        return len(self._frame) if self._inline else 0

    def bind(self, salt: int) -> None:
        """Store every record's checksum field for a segment whose salt is ``salt``."""
        words = self._frame.view("<u8")
        where = self._head_offsets() // 8
        words[where] = self.csum ^ np.uint64(salt)

    def _head_offsets(self) -> npt.NDArray[np.int64]:
        if self._inline:  #: the heads sit at the records' offsets
            return self.rel
        delta = record_geometry_np(self.klen, self.vlen)[0].astype(np.int64)
        return np.concatenate(([0], np.cumsum(delta)[:-1])).astype(np.int64)


def frame_puts(keys: Sequence[bytes], values: Sequence[Buffer], timestamp_ns: int,
               scratch: npt.NDArray[np.uint8] | None = None) -> FramedBatch:
    """Frame put records of ``keys[i]`` -> ``values[i]`` (checked like
    ``records.check_key``/``check_value``; bad input raises ``InvalidArgumentError``).
    An inline batch that fits in ``scratch`` is framed there: the batch is valid until
    ``scratch`` is used again."""
    n = len(keys)
    klist, views = check_puts(keys, values)
    vlen = np.fromiter((v.nbytes for v in views), np.int64, n)
    if n and int(vlen.max()) > 0xFFFFFFFF:
        check_value(views[int(vlen.argmax())], klist[int(vlen.argmax())])  # raises
    k0, k1, klen = key_words(klist)
    delta, rbytes = record_geometry_np(klen, vlen)
    keep = _last_of_each(klist)
    inline = n == 0 or int(vlen.max()) < INLINE_VALUE_BYTES
    if inline:
        return _frame_inline(klist, views, k0, k1, klen, vlen, delta, rbytes,
                             timestamp_ns, keep, scratch)
    return _frame_iovecs(klist, views, k0, k1, klen, vlen, delta, rbytes, timestamp_ns, keep)


def check_puts(keys: Sequence[bytes], values: Sequence[Buffer]
               ) -> tuple[list[bytes], list[memoryview]]:
    """The keys as ``bytes`` and the values as byte views, checked as
    ``records.check_key``/``check_value`` do (``InvalidArgumentError`` names the first
    bad one)."""
    if len(values) != len(keys):
        raise ValueError(f"{len(keys)} keys and {len(values)} values")
    klist = [k if type(k) is bytes and 0 < len(k) <= 1024 else check_key(k) for k in keys]
    views = [v if type(v) is memoryview and v.format == "B" and v.contiguous
             else check_value(v, klist[i]) for i, v in enumerate(values)]
    return klist, views


def _last_of_each(keys: list[bytes]) -> npt.NDArray[np.intp] | None:
    """Indexes of the last record of each key, in order; None when keys are distinct."""
    if len(set(keys)) == len(keys):
        return None
    last = {k: i for i, k in enumerate(keys)}
    return np.array(sorted(last.values()), np.intp)


def _write_heads(buf: npt.NDArray[np.uint8], at: npt.NDArray[np.int64], keys: list[bytes],
                 k0: npt.NDArray[np.uint64], k1: npt.NDArray[np.uint64],
                 klen: npt.NDArray[np.uint16], vlen: npt.NDArray[np.int64],
                 timestamp_ns: int) -> None:
    """Record headers (checksum field left 0) and keys at the 64-aligned offsets
    ``at`` of ``buf``, whose key padding is already zero."""
    buf[at + 8] = FLAG_PUT
    buf.view("<u2")[(at + 10) // 2] = klen
    buf.view("<u4")[(at + 12) // 4] = vlen.astype(np.uint32)
    buf.view("<u8")[(at + 16) // 8] = np.uint64(timestamp_ns)
    if len(klen) and int(klen.min()) == int(klen.max()) == 16:
        words = buf.view("<u8")
        words[(at + 24) // 8] = k0
        words[(at + 32) // 8] = k1
    else:
        for a, key in zip(at.tolist(), keys, strict=True):
            buf[a + _HEAD:a + _HEAD + len(key)] = np.frombuffer(key, np.uint8)


def _frame_inline(keys: list[bytes], views: list[memoryview], k0: Any, k1: Any, klen: Any,
                  vlen: npt.NDArray[np.int64], delta: Any, rbytes: Any, timestamp_ns: int,
                  keep: npt.NDArray[np.intp] | None,
                  scratch: npt.NDArray[np.uint8] | None) -> FramedBatch:
    n = len(keys)
    ends = np.cumsum(rbytes.astype(np.int64))
    total = int(ends[-1]) if n else 0
    rel = (ends - rbytes.astype(np.int64)).astype(np.int64)
    frame = _zeroed_frame(total, scratch, delta, vlen, rbytes)
    _write_heads(frame, rel, keys, k0, k1, klen, vlen, timestamp_ns)
    mv = memoryview(frame.data)
    vstart = (rel + delta.astype(np.int64)).tolist()
    for a, v in zip(vstart, views, strict=True):
        mv[a:a + v.nbytes] = v
    digest = xxhash.xxh3_64_intdigest
    vend = (rel + delta.astype(np.int64) + vlen).tolist()
    csum = np.fromiter((digest(mv[a + 8:b]) for a, b in zip(rel.tolist(), vend, strict=True)),
                       np.uint64, n)
    return FramedBatch(keys, k0, k1, klen, vlen.astype(np.uint32), rel, rbytes, csum,
                       timestamp_ns, frame, None, keep)


def _zeroed_frame(total: int, scratch: npt.NDArray[np.uint8] | None, delta: Any,
                  vlen: npt.NDArray[np.int64], rbytes: Any) -> npt.NDArray[np.uint8]:
    """``total`` bytes to frame into, zero wherever no header field, key or value will
    be written: new zeroed memory, or the start of ``scratch`` when it is large enough
    (records all of one size: only each record's header and key area and its tail
    padding are zeroed; else all of it)."""
    if scratch is None or len(scratch) < total or total == 0:
        return np.zeros(total, np.uint8)
    frame = scratch[:total]
    n = len(vlen)
    if (int(rbytes.min()) == int(rbytes.max()) and int(delta.min()) == int(delta.max())
            and int(vlen.min()) == int(vlen.max())):
        rec = frame.reshape(n, int(rbytes[0]))
        d, v = int(delta[0]), int(vlen[0])
        rec[:, :d] = 0
        rec[:, d + v:] = 0
    else:
        frame[:] = 0
    return frame


def _frame_iovecs(keys: list[bytes], views: list[memoryview], k0: Any, k1: Any, klen: Any,
                  vlen: npt.NDArray[np.int64], delta: Any, rbytes: Any, timestamp_ns: int,
                  keep: npt.NDArray[np.intp] | None) -> FramedBatch:
    n = len(keys)
    d64 = delta.astype(np.int64)
    hend = np.cumsum(d64)
    hat = (hend - d64).astype(np.int64)
    heads = np.zeros(int(hend[-1]), np.uint8)
    _write_heads(heads, hat, keys, k0, k1, klen, vlen, timestamp_ns)
    hv = memoryview(heads.data)
    iov: list[Any] = []
    csum = np.empty(n, np.uint64)
    pads = (rbytes.astype(np.int64) - d64 - vlen).tolist()
    zeros = memoryview(_ZEROS.data)
    for i, (a, b, pad) in enumerate(zip(hat.tolist(), hend.tolist(), pads, strict=True)):
        h = xxhash.xxh3_64(hv[a + 8:b])
        h.update(views[i])
        csum[i] = h.intdigest()
        iov.append(hv[a:b])
        if views[i].nbytes:
            iov.append(views[i])
        if pad:
            iov.append(zeros[:pad])
    ends = np.cumsum(rbytes.astype(np.int64))
    rel = (ends - rbytes.astype(np.int64)).astype(np.int64)
    return FramedBatch(keys, k0, k1, klen, vlen.astype(np.uint32), rel, rbytes, csum,
                       timestamp_ns, heads, iov, keep)
