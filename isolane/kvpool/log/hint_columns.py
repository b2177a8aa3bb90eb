"""A hint file as columns of the key directory, both ways, without an object per key.

``decode_hint_columns`` checks a hint file (format in ``keydir.py``) and turns it into
``HintColumns`` that ``KeyDirectory.load_columns`` enters in one vectorised step (a
reopen spends its time there); ``encode_hint_columns`` is the way back, used when a
segment is sealed. Keys longer than 16 bytes take the per-key path of ``keydir``
(``decode_hint``/``encode_hint``): ``HintColumns.share`` carries them. Pure.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from isolane.errors import IntegrityError
from isolane.kvpool.log.key_slots import SHORT_KEY_BYTES, U64
from isolane.kvpool.log.keydir import (
    HINT_ENTRY,
    HINT_HEADER,
    SegmentShare,
    check_hint,
    decode_hint,
    hint_from_parts,
)
from isolane.kvpool.log.records import RECORD_ALIGN, record_geometry_np

__all__ = ["HintColumns", "decode_hint_columns", "encode_hint_columns"]


class HintColumns:
    """A segment's share as columns (``decode_hint_columns``, ``KeyDirectory.hint_bytes``):
    ``puts`` put rows first, then tombstones (the key columns hold both; ``roff``,
    ``vlen``, ``csum`` and ``ts`` the puts only); keys as two u64 (little endian) and a
    length (``key_slots.key_words``)."""

    __slots__ = ("csum", "k0", "k1", "klen", "live_bytes", "long_keys", "puts", "roff",
                 "segment_id", "share", "ts", "vlen")

    def __init__(self, segment_id: int, puts: int, k0: U64, k1: U64,
                 klen: npt.NDArray[np.uint16], roff: U64, vlen: npt.NDArray[Any],
                 csum: U64, ts: U64, live_bytes: int, share: SegmentShare | None) -> None:
        self.segment_id, self.puts = segment_id, puts
        self.k0, self.k1, self.klen = k0, k1, klen
        self.roff, self.vlen, self.csum, self.ts = roff, vlen, csum, ts
        self.live_bytes = live_bytes
        self.share = share  # set when some key is longer than 16 bytes
        self.long_keys = share is not None

    def to_share(self) -> SegmentShare:
        if self.share is None:
            raise ValueError("columns of 16-byte keys carry no share")
        return self.share


def decode_hint_columns(data: bytes, segment_id: int, data_bytes: int) -> HintColumns:
    """A hint file (``keydir`` module docstring) as columns, without a Python object per
    key when every key is at most 16 bytes. ``IntegrityError`` when the hint does not
    describe segment ``segment_id`` of ``data_bytes`` bytes, is damaged, or its entries
    disagree with the record geometry (the caller then scans the segment)."""
    puts, tombs, live, _lengths, pos = check_hint(data, segment_id, data_bytes)
    what = f"hint file of KV segment {segment_id}"
    n = puts + tombs
    ent = np.frombuffer(data, "<u8", puts * 7, HINT_HEADER.size).reshape(puts, 7)
    klen = np.frombuffer(data, "<u2", n, HINT_HEADER.size + puts * HINT_ENTRY.size)
    share = None
    if n and int(klen.max()) > SHORT_KEY_BYTES:
        share = decode_hint(data, segment_id, data_bytes)
        k0 = k1 = np.zeros(0, np.uint64)
    elif n and int(klen.min()) == SHORT_KEY_BYTES:  # block keys: views into the file, no copy
        words = np.frombuffer(data, "<u8", 2 * n, pos).reshape(n, 2)
        k0, k1 = words[:, 0], words[:, 1]
    else:
        raw = np.zeros((n, SHORT_KEY_BYTES), np.uint8)
        offs = pos + np.concatenate(([0], np.cumsum(klen, dtype=np.int64)[:-1]))
        for i, (o, k) in enumerate(zip(offs.tolist(), klen.tolist(), strict=True)):
            raw[i, :k] = np.frombuffer(data, np.uint8, k, o)
        words = raw.view("<u8")
        k0, k1 = words[:, 0], words[:, 1]
    roff, vlen = ent[:, 1], ent[:, 3]
    delta, rbytes = record_geometry_np(klen[:puts], vlen)
    if puts and (bool(np.any(ent[:, 0] != segment_id))
                 or bool(np.any(ent[:, 2] != roff + delta))
                 or bool(np.any(ent[:, 4] != roff + rbytes))
                 or int(roff.min()) < RECORD_ALIGN or int(ent[:, 4].max()) > data_bytes
                 or bool(np.any(vlen > 0xFFFFFFFF))
                 or int(rbytes.sum()) != live):
        raise IntegrityError(what, "its entries disagree with the record layout or the "
                             "segment's size")
    if n and int(klen.min()) == 0:
        raise IntegrityError(what, "it lists an empty key")
    return HintColumns(segment_id, puts, k0, k1, klen, roff, vlen,
                       ent[:, 5], ent[:, 6], live, share)


def encode_hint_columns(cols: HintColumns, data_bytes: int) -> bytes:
    """The hint file of ``cols.segment_id`` (a segment of ``data_bytes`` bytes), for
    keys of at most 16 bytes: the same bytes as ``keydir.encode_hint`` of its share."""
    puts = cols.puts
    n = len(cols.klen)
    ent = np.empty((puts, 7), "<u8")
    delta, rbytes = record_geometry_np(cols.klen[:puts], cols.vlen)
    ent[:, 0], ent[:, 1], ent[:, 2] = cols.segment_id, cols.roff, cols.roff + delta
    ent[:, 3], ent[:, 4] = cols.vlen, cols.roff + rbytes
    ent[:, 5], ent[:, 6] = cols.csum, cols.ts
    raw = np.empty((n, 2), "<u8")
    raw[:, 0], raw[:, 1] = cols.k0, cols.k1
    keys = raw.view(np.uint8).reshape(n, SHORT_KEY_BYTES)
    if n and int(cols.klen.min()) < SHORT_KEY_BYTES:
        keys = keys[np.arange(SHORT_KEY_BYTES)[None, :] < cols.klen[:, None]]
    return hint_from_parts(cols.segment_id, data_bytes, puts, n - puts, cols.live_bytes,
                           [ent.tobytes(), cols.klen.astype("<u2").tobytes(), keys.tobytes()])
