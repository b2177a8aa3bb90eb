"""Compaction of one sealed KV segment: copy its live records forward, retire it.

A part of ``SegmentLog`` (``segment_log.py``) kept in its own module; the decisions
(which segments, whether a tombstone must move) are the pure predicates of
``compaction.py``. ``compact_segment`` takes the log's locks itseglog.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from isolane.errors import IntegrityError, InvalidArgumentError
from isolane.kvpool.log.compaction import should_keep_tombstone
from isolane.kvpool.log.keydir import FLAG_PUT, FLAG_TOMBSTONE, Entry, Location
from isolane.kvpool.log.records import PendingRecord, verify_record
from isolane.kvpool.log.segment_files import StaleLocationError

if TYPE_CHECKING:
    from isolane.kvpool.log.segment_log import SegmentLog

__all__ = ["COMPACT_CHUNK_BYTES", "CompactionResult", "compact_segment"]

log = logging.getLogger(__name__)

COMPACT_CHUNK_BYTES = 8 << 20


@dataclass(frozen=True)
class CompactionResult:
    segment_id: int
    copied_records: int
    copied_bytes: int
    dropped_records: int  # damaged records met while copying: keys deleted (tombstone)
    freed_bytes: int


def compact_segment(seglog: SegmentLog, segment_id: int) -> CompactionResult:
    """Copy the live records of a sealed segment to the live segment, then retire it.

    Copies run in chunks of 8 MiB: appends go on between chunks, a key overwritten
    meanwhile is not copied (compare and set). The copies are fsynced before the old
    file is renamed ``.dead``; readers still holding it finish first (see
    ``segment_log.py``). Tombstones move too while an older segment could hold their key.
    """
    with seglog._compact_lock:
        with seglog._index_lock:
            seg = seglog._segments.get(segment_id)
            if seg is None:
                raise StaleLocationError(segment_id, seglog.folder)
            if not seg.sealed:
                raise InvalidArgumentError(f"KV segment {segment_id} is live; rotate() "
                                           "before compacting it")
            entries = seglog._keydir.entries_in(segment_id)
        copied = copied_bytes = dropped = 0
        for chunk in _chunks(entries, COMPACT_CHUNK_BYTES):
            start, end = chunk[0][1][1], chunk[-1][1][4]
            try:
                run = seglog.read_run(segment_id, start, end, direct=False)
            except StaleLocationError:
                break  # evicted meanwhile: nothing left to copy
            pending = []
            for key, entry in chunk:
                try:
                    verify_record(run, start, Location.from_entry(key, entry))
                    pending.append(PendingRecord.copy(
                        key, entry, run[entry[1] - start:entry[4] - start]))
                except IntegrityError as exc:  # drop the key, durably: a tombstone
                    log.warning("compaction drops a damaged record: %s", exc)
                    tomb = PendingRecord.encode(key, FLAG_TOMBSTONE, memoryview(b""),
                                           time.time_ns())
                    tomb.old = entry
                    pending.append(tomb)
            with seglog._write_lock:
                seglog._check_open()
                with seglog._index_lock:
                    pending = [p for p in pending if seglog._keydir.get(p.key) == p.old]
                if pending:
                    seg_to, offsets = seglog._append(pending)
                    seglog._publish(seg_to, offsets, pending)
                    moved = [p for p in pending if p.flags == FLAG_PUT]
                    copied += len(moved)
                    copied_bytes += sum(p.record_bytes for p in moved)
                    dropped += len(pending) - len(moved)
        with seglog._write_lock:
            seglog._check_open()
            with seglog._index_lock:
                if seglog._segments.get(segment_id) is not seg:
                    return CompactionResult(segment_id, copied, copied_bytes, dropped, 0)
                oldest = min((i for i in seglog._segments if i != segment_id),
                             default=segment_id)
                tombs = (seglog._keydir.tombstones_in(segment_id)
                         if should_keep_tombstone(segment_id, oldest) else [])
            ts = time.time_ns()
            pending = [PendingRecord.encode(k, FLAG_TOMBSTONE, memoryview(b""), ts)
                       for k in tombs]
            if pending:
                seglog._publish(*seglog._append(pending), pending)
            if seglog._live is not None and copied + len(pending):
                os.fsync(seglog._live.fd)
            freed = seg.size
            seglog._notify(seglog._retire(seg))
    return CompactionResult(segment_id, copied, copied_bytes, dropped, freed)


def _chunks(entries: list[tuple[bytes, Entry]],
            max_bytes: int) -> list[list[tuple[bytes, Entry]]]:
    """Group records (by offset) into runs of at most ``max_bytes`` (or one record)."""
    chunks: list[list[tuple[bytes, Entry]]] = []
    for item in entries:
        if chunks and item[1][4] - chunks[-1][0][1][1] <= max_bytes:
            chunks[-1].append(item)
        else:
            chunks.append([item])
    return chunks

