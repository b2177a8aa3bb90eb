"""Many segments' hint columns entered into an empty key directory at once (a reopen).

``KeyDirectory.load_columns`` enters one segment at a time: it probes the table for the
segment's keys (an older segment may hold them), then inserts the new ones, both in
random order over the whole table. A reopen loads every sealed segment into an empty
directory, so ``BulkLoad`` only appends each segment's rows to the columns (``add``:
slice copies, nothing probed) and builds the table once at the end (``finish``:
``key_slots.place_rows``, which also finds the keys several segments list and keeps the
newest row of each: the same winner rule as loading them in order). Segments with keys
over 16 bytes, and any segment after one, take ``load_columns``.

Between ``add`` and ``finish`` the directory's table does not list the staged rows: the
caller (``segment_log.load_folder``) makes no other call on the directory until
``finish`` returned. A part of ``KeyDirectory`` kept in its own module (it sets the
directory's columns and counters).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from isolane.kvpool.log.key_slots import place_rows, table_size
from isolane.kvpool.log.keydir import FLAG_PUT, FLAG_TOMBSTONE
from isolane.kvpool.log.records import record_geometry_np

if TYPE_CHECKING:
    from isolane.kvpool.log.hint_columns import HintColumns
    from isolane.kvpool.log.keytable import KeyDirectory

__all__ = ["BulkLoad"]


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        trim: Callable[[int], int] = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): no trim, no harm
        return None
    return trim


_TRIM = _malloc_trim()


class BulkLoad:
    """Stage segments (oldest first) with ``add``, then ``finish``. ``rows``: an estimate
    of the rows to come (the columns are sized once for it)."""

    def __init__(self, keydir: KeyDirectory, rows: int = 0) -> None:
        self._kd = keydir
        self._staging = keydir._n == 0
        self._segments: dict[int, tuple[int, int]] = {}  # sid -> (puts, live bytes)
        if self._staging and rows > keydir._cap:
            keydir._grow_rows(rows)

    def add(self, segment_id: int, cols: HintColumns) -> None:
        """Stage the share of ``segment_id`` (every staged segment is older)."""
        kd = self._kd
        if cols.long_keys or not self._staging:
            self.finish()
            kd.load_columns(segment_id, cols)
            return
        n, p = len(cols.k0), cols.puts
        if n == 0:
            return
        a = kd._n
        if a + n > kd._cap:
            kd._grow_rows(max(a + n, 2 * kd._cap))
        c = kd._cols
        c["k0"][a:a + n], c["k1"][a:a + n], c["klen"][a:a + n] = cols.k0, cols.k1, cols.klen
        c["sid"][a:a + n] = segment_id
        c["flag"][a:a + p], c["flag"][a + p:a + n] = FLAG_PUT, FLAG_TOMBSTONE
        for name, col in (("roff", cols.roff), ("vlen", cols.vlen), ("csum", cols.csum),
                          ("ts", cols.ts)):
            c[name][a:a + p] = col
            c[name][a + p:a + n] = 0
        kd._n = a + n
        puts, live = self._segments.get(segment_id, (0, 0))
        self._segments[segment_id] = (puts + p, live + cols.live_bytes)

    def finish(self) -> None:
        """Build the table of the staged rows; later ``add`` calls load segment by
        segment. Idempotent."""
        if not self._staging:
            return
        self._staging = False
        kd = self._kd
        n = kd._n
        if n == 0:
            return
        c = kd._cols
        table, gone = place_rows(kd._hash.many(c["k0"][:n], c["k1"][:n]), c["k0"][:n],
                                 c["k1"][:n], c["klen"][:n], max(table_size(n), len(kd._table)))
        for sid, (puts, live) in self._segments.items():
            kd._live_bytes[sid] = kd._live_bytes.get(sid, 0) + live
            kd._live_count[sid] = kd._live_count.get(sid, 0) + puts
            kd._puts += puts
        if len(gone):  # older rows of keys a newer segment lists: take back their counts
            was_put = gone[c["flag"][gone] == FLAG_PUT]
            rbytes = record_geometry_np(c["klen"][was_put], c["vlen"][was_put])[1]
            sids = c["sid"][was_put]
            uniq, inv = np.unique(sids, return_inverse=True)
            nbytes = np.bincount(inv, weights=rbytes.astype(np.float64), minlength=len(uniq))
            counts = np.bincount(inv, minlength=len(uniq))
            for sid, nb, cnt in zip(uniq.tolist(), nbytes.tolist(), counts.tolist(),
                                    strict=True):
                kd._live_bytes[sid] -= int(nb)
                kd._live_count[sid] -= cnt
            kd._puts -= len(was_put)
            keep = np.ones(n, bool)
            keep[gone] = False
            m = n - len(gone)
            for col in c.values():
                col[:m] = col[:n][keep]
                col[m:n] = 0
            n = m
        kd._n = kd._present = n
        kd._table, kd._mask = table, len(table) - 1
        if _TRIM is not None:
            # glibc keeps freed blocks under its (adaptive, up to 32 MiB) mmap threshold
            # in the heap: the build's temporaries stayed resident, ~54 B a key (114
            # instead of 60 B of RSS a key measured at 1M keys); hand them back.
            _TRIM(0)
