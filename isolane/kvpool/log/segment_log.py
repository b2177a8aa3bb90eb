"""Append-only segment files for KV blocks: the disk tier of the KV pool, Bitcask style.

A ``SegmentLog`` owns one folder of segment files. Values are appended as records to
the *live* segment; when it reaches ``segment_bytes`` it is *sealed* (renamed) with a
hint file beside it, and a new live segment starts. An in-memory ``KeyDirectory``
(``isolane.kvpool.log.keydir``) maps each key to its newest record. Nothing is ever
rewritten in place: compaction copies live records forward and retires the old file.

Files (the lifecycle is in the name; ids grow and are never reused while open)::

    seg-00000007.live      the one segment being appended to (highest id)
    seg-00000006.sealed    read-only from now on; renamed from .live when full
    seg-00000006.hint      its key directory share (format in keydir.py)
    seg-00000003.dead      compacted or evicted; unlinked once no reader holds it
    lock                   flock()ed by the process that has the folder open

The byte format (segment header, records, the salt that makes the reopen scan's resync
unforgeable, 64-byte padding) is in ``records.py``; the segment files and their vectored
I/O in ``segment_files.py``; the recovery scan and damage report in ``segment_scan.py``;
the pure decisions (rotate, evict, compact, keep a tombstone) in ``compaction.py``. This
module is the log itself, one class with its state in one place, in this order: the
reopen from hint files, compaction of a segment, then ``SegmentLog``: opening, lookups,
checked reads, the read path with its segment pins, the public writes, the write path
(append, publish, seal, retire, evict) and the lifecycle.

Reopen (``load_folder``): list the folder (removing temp files of a crash and ``.dead``
segments, never following a link), size the key directory once from the hint files,
load the hint of every sealed segment straight into it (read ahead on a thread:
``hint_reads.HintReads``; ``hint_columns.decode_hint_columns``, ``bulk_load.BulkLoad``:
the table is built once for all of them; a damaged or lying hint falls back to
``segment_scan.scan_segment``, which then rewrites it), and scan the live segment.

Reads: ``read_run`` (one pread, O_DIRECT or through the page cache), ``read_scatter``
(one preadv into the caller's buffers) and ``read_direct`` (O_DIRECT into a page-aligned
buffer of the caller's, when the log reads that range with O_DIRECT). Which reads use
O_DIRECT is ``direct_io``: ``off`` never, ``auto`` (and ``on``, which refuses a
filesystem without it) always, ``cold`` for a range of at least ``COLD_DIRECT_MIN_BYTES``
whose pages are not all in the page cache (``storage.page_cache``: one ``cachestat``
call): a cold multi-block read then goes to the device with the requests the caller
keeps in flight instead of through the kernel's read-ahead (about twice as fast here),
while cached bytes are still read at memory speed. Without ``cachestat`` a ``cold`` log
reads through the page cache. These reads return raw bytes: the record checks are the
callers' (``read``, ``reader.py``, compaction), so that every record handed out is
checked exactly once.

Writes, all under the write lock (one writer at a time): a batch is written
contiguously into the live segment (``_write_frame`` for a framed batch of puts,
``_write`` for single records: tombstones, compaction copies), rotating first when it
would overflow ``segment_bytes`` (``compaction.should_rotate``); a failed write is cut
off again (``_rollback``); a full device evicts cold segments and retries once
(``_with_room``). Only after the bytes are written are the segment's committed size and
then the key directory updated under the index lock (``_publish_frame``, ``_publish``).
Sealing renames the live segment ``.sealed``, fsyncs it and writes its hint, now or on
the sealer thread (``_seal``, ``_finish_seal``, ``_wait_sealed``). Retiring renames a
sealed segment ``.dead``, forgets its keys, and closes + unlinks it at its last unpin
(``_retire``); eviction retires the oldest per ``compaction.plan_eviction`` and tells
``on_evict``.

Durability (``sync``): ``"batch"`` fdatasyncs after every ``append_many``/``delete``,
so an acknowledged batch survives power loss; ``"seal"`` (default: this is a cache)
fsyncs a segment when it is sealed (a rotation during appends leaves the fsync and the
hint to a sealer thread, so appends do not wait for the device; ``rotate`` and ``close``
wait) and on ``close``. A killed process loses nothing that ``append_many`` returned (it
is in the page cache); a power loss under ``"seal"`` can lose the unsynced part of the
live segment and of a segment sealed just before (at most ``2 * segment_bytes``). In every case
the reopen scan checks each record of the live segment, skips damaged bytes (resyncing
at the next record its salted checksum proves) and truncates a torn tail (logged, never
fatal; each drop goes to ``damage.log`` for ``isolane kv verify``), and every read checks
the checksum: a corrupt record is never returned (``RecordIntegrityError``).

Concurrency: any number of readers, one writer at a time. ``locate`` takes the index
lock briefly; ``read_run`` pins the segment (a reference count), preads without any
lock, and unpins. Appends, deletes, rotation, compaction copies and eviction hold the
write lock; the index and the live segment's committed size are updated only after the
bytes are written, so no reader can be handed a location or range of unwritten bytes.
Compaction and eviction *retire* a segment: rename to ``.dead``, forget its keys, and
close + unlink the file when the last reader that pinned it unpins it (deferred unlink;
a reader mid-pread finishes normally). A location into a retired segment makes
``read_run`` raise ``StaleLocationError``; ``read`` then looks the key up again itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import numpy as np
import numpy.typing as npt

from isolane.errors import (
    CapacityError,
    IntegrityError,
    InvalidArgumentError,
    KeyNotFoundError,
    StorageError,
)
from isolane.kvpool.log.bulk_load import BulkLoad
from isolane.kvpool.log.compaction import plan_eviction, should_keep_tombstone, should_rotate
from isolane.kvpool.log.frame_buffers import FrameBuffers
from isolane.kvpool.log.framing import FramedBatch, frame_puts
from isolane.kvpool.log.hint_columns import HINT_V2_PUT_BYTES, decode_hint_columns
from isolane.kvpool.log.hint_reads import THREAD_BYTES, HintReads
from isolane.kvpool.log.keydir import (
    FLAG_PUT,
    FLAG_TOMBSTONE,
    HINT_HEADER,
    HINT_MAGIC,
    Entry,
    LocatedColumns,
    Location,
    LogItem,
)
from isolane.kvpool.log.keytable import KeyDirectory
from isolane.kvpool.log.records import (
    RECORD_ALIGN,
    RECORD_HEADER,
    SEGMENT_HEADER,
    SEGMENT_HEADER_BYTES,
    PendingRecord,
    Record,
    RecordIntegrityError,
    check_key,
    encode_segment_header,
    new_salt,
    parse_run,
    parse_segment_header,
    record_geometry,
    record_geometry_np,
    verify_parts,
    verify_record,
)
from isolane.kvpool.log.segment_files import (
    FULL_ERRNOS,
    O_DIRECT,
    SegmentFile,
    SegmentInfo,
    StaleLocationError,
    check_range,
    fresh_buffer,
    parse_segment_name,
    pread_all,
    preadv_all,
    pwritev_all,
)
from isolane.kvpool.log.segment_scan import (
    DAMAGE_FILE,
    MAX_DAMAGE_ENTRIES,
    Damage,
    read_damage,
    record_damage,
    scan_segment,
    write_damage,
)
from isolane.storage.aligned import ALIGN, align_up, is_aligned
from isolane.storage.base import Buffer
from isolane.storage.files import atomic_write, fsync_dir
from isolane.storage.page_cache import fully_cached

__all__ = [
    "COLD_DIRECT_MIN_BYTES", "FLAG_PUT", "FLAG_TOMBSTONE", "RECORD_ALIGN", "RECORD_HEADER",
    "SEGMENT_HEADER", "CompactionResult", "Damage", "DirectIO", "Location", "Record",
    "RecordIntegrityError", "SegmentInfo", "SegmentLog", "StaleLocationError", "direct_span",
    "encode_segment_header", "new_salt", "parse_run", "parse_segment_header",
    "parse_segment_name", "record_geometry", "verify_parts", "verify_record",
]

log = logging.getLogger(__name__)

MiB = 1 << 20
_T = TypeVar("_T")

DirectIO = Literal["off", "auto", "on", "cold"]
COLD_DIRECT_MIN_BYTES = 256 << 10
"""``cold`` logs read smaller ranges through the page cache (a one-block get)."""


def direct_span(start: int, end: int) -> int:
    """Bytes an O_DIRECT read of ``[start, end)`` needs: the range widened to pages."""
    return align_up(end) - start // ALIGN * ALIGN


# -- reopen ---------------------------------------------------------------------------
def hint_path(folder: Path, segment_id: int) -> Path:
    return folder / f"seg-{segment_id:08d}.hint"


def write_hint(folder: Path, segment_id: int, hint: bytes) -> None:
    """Best effort: a missing hint only makes the next open scan the segment."""
    path = hint_path(folder, segment_id)
    try:
        atomic_write(path, hint)
    except OSError as exc:
        log.warning("could not write the hint file %s (%s); the next open will scan "
                    "segment %d instead", path, exc.strerror, segment_id)


def load_folder(seglog: SegmentLog) -> None:
    """Load every segment of ``seglog.folder`` into the log (its write lock held)."""
    found: dict[int, dict[str, Path]] = {}
    for name in sorted(os.listdir(seglog.folder)):
        path = seglog.folder / name
        parsed = parse_segment_name(name)
        temp = name.endswith(".tmp") or (name.startswith(".") and ".tmp-" in name)
        if not temp and parsed is None:
            continue
        if path.is_symlink():  # never read, truncate or delete through a link
            log.warning("ignoring %s: a symbolic link in a KV segment folder (isolane "
                        "never follows links in its store); remove it", path)
            continue
        if parsed is None:  # a temp file left by a crash (atomic_write's, or older .tmp)
            path.unlink(missing_ok=True)
            continue
        sid, kind = parsed
        seglog._next_id = max(seglog._next_id, sid + 1)
        if kind == "dead":
            path.unlink(missing_ok=True)
        else:
            found.setdefault(sid, {})[kind] = path
    data_ids = sorted(sid for sid, kinds in found.items() if kinds.keys() - {"hint"})
    newest_live = max((sid for sid in data_ids if "live" in found[sid]
                       and "sealed" not in found[sid]), default=None)
    hints = [(sid, found[sid]["hint"]) for sid in data_ids
             if "hint" in found[sid] and "sealed" in found[sid]]
    nbytes = _hint_bytes(hints)
    bulk = BulkLoad(seglog._keydir, nbytes // HINT_V2_PUT_BYTES)
    with HintReads(hints, threaded=nbytes >= THREAD_BYTES) as reads:
        for sid in data_ids:
            kinds = found[sid]
            if "sealed" in kinds:
                if "live" in kinds:
                    log.warning("ignoring %s: segment %d is also sealed", kinds["live"], sid)
                _load_sealed(seglog, sid, kinds["sealed"],
                             reads.next(sid) if "hint" in kinds else None, bulk)
                continue
            bulk.finish()  # the segments below need the directory of the older ones
            if sid == newest_live and sid == data_ids[-1]:
                # A version 1 live segment (no salt) is sealed: appends go to version 2.
                if _load_live(seglog, sid, kinds["live"]) == 1:
                    seglog._seal()
            else:  # a live segment older than another: a crash mid-rotation; seal it
                _load_live(seglog, sid, kinds["live"])
                seglog._seal()
    bulk.finish()
    for kinds in found.values():
        if kinds.keys() == {"hint"}:
            kinds["hint"].unlink(missing_ok=True)
    if seglog._damage or os.path.lexists(seglog.folder / DAMAGE_FILE):
        record_damage(seglog.folder, seglog._damage, seglog._segments)
    if seglog._live is None:
        seglog._new_live()


def _hint_bytes(hints: list[tuple[int, Path]]) -> int:
    """The bytes of the hints' entries (from their sizes; as version 2 puts, an
    estimate of the keys they list: the key directory's columns are sized once, unused
    capacity is zero pages never touched)."""
    nbytes = 0
    for _, hint in hints:
        with contextlib.suppress(OSError):
            nbytes += max(0, os.lstat(hint).st_size - HINT_HEADER.size)
    return nbytes


def _load_sealed(seglog: SegmentLog, sid: int, path: Path, hint: bytes | OSError | None,
                 bulk: BulkLoad) -> None:
    """``hint``: the bytes of the segment's hint file (``HintReads``), the error reading
    it raised, or None without one."""
    size = os.lstat(path).st_size
    if hint is not None:
        try:
            if isinstance(hint, OSError):
                raise hint
            cols = decode_hint_columns(hint, sid, size)
        except (OSError, IntegrityError) as exc:
            log.warning("ignoring the hint file %s (%s); scanning the segment",
                        hint_path(seglog.folder, sid), exc)
        else:
            seglog._segments[sid] = SegmentFile(sid, path, size, sealed=True)
            seglog._total_bytes += size
            bulk.add(sid, cols)
            return
    bulk.finish()  # the hint written below is the directory's share of the segment
    scan = scan_segment(sid, path, seglog._damage)
    items, end, salt = scan.items, scan.end, scan.salt
    promised = _hint_promise(hint, sid)
    if promised is not None and len(items) < promised[1]:
        # The hint was written when the segment was sealed: records it counted that the
        # file no longer holds were lost since (truncated or damaged), not never written.
        data_bytes, puts = promised
        seglog._damage.append(Damage(sid, end, max(0, data_bytes - end), (
            f"the segment holds {len(items)} of the {puts} records its hint promised "
            f"({size} of {data_bytes} bytes): truncated or damaged since it was sealed")))
    if end == 0:
        path.unlink()
        return
    seg = SegmentFile(sid, path, end, sealed=True, salt=salt)
    _add_segment(seglog, seg, items)
    write_hint(seglog.folder, sid, seglog._keydir.hint_bytes(sid, end))


def _hint_promise(hint: bytes | OSError | None, sid: int) -> tuple[int, int] | None:
    """``(data_bytes, put_count)`` a readable hint header of segment ``sid`` states."""
    if not isinstance(hint, bytes) or len(hint) < HINT_HEADER.size:
        return None
    magic, _version, _, segment_id, data_bytes, puts, *_ = HINT_HEADER.unpack_from(hint)
    if magic != HINT_MAGIC or segment_id != sid:
        return None
    return int(data_bytes), int(puts)


def _load_live(seglog: SegmentLog, sid: int, path: Path) -> int:
    """Scan the live segment ``sid``; returns its format version (0: discarded)."""
    scan = scan_segment(sid, path, seglog._damage)
    items, end, salt, version = scan.items, scan.end, scan.salt, scan.version
    if end == 0:  # crashed before its header was durable: nothing to keep
        path.unlink()
        return 0
    seg = SegmentFile(sid, path, end, sealed=False,
                      fd=os.open(path, os.O_RDWR | os.O_NOFOLLOW), salt=salt)
    _add_segment(seglog, seg, items)
    seglog._live = seg
    return version


def _add_segment(seglog: SegmentLog, seg: SegmentFile, items: list[LogItem]) -> None:
    seglog._segments[seg.segment_id] = seg
    seglog._total_bytes += seg.size
    seglog._keydir.apply(seg.segment_id, items)


# -- compaction -----------------------------------------------------------------------
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


class SegmentLog:
    """Bitcask-style log of KV blocks in ``folder`` (format and guarantees above).

    ``segment_bytes`` is the size at which the live segment is sealed; ``max_bytes``
    (None: no budget) caps the log's files: after an append that crosses it, whole
    oldest sealed segments are evicted (at least ``2 * segment_bytes``). ``sync`` is
    ``"batch"`` or ``"seal"``. ``direct_io`` (``off``/``auto``/``on``/``cold``) says
    which reads use O_DIRECT (module docstring: ``cold`` = ranges of 256 KiB or more
    that are not in the page cache). ``on_evict(keys)`` is told of keys the log drops on its
    own (byte budget, device full); it runs under the write lock, so it may call
    ``locate``/``read`` but not the writing methods.

    Opening takes an exclusive lock on the folder (one process at a time), loads the hint
    of every sealed segment (scanning those without a valid one) and scans the live
    segment, truncating a torn tail. All methods are thread-safe. ``close`` when done.
    """

    def __init__(
        self,
        folder: str | os.PathLike[str],
        *,
        segment_bytes: int = 256 * MiB,
        max_bytes: int | None = None,
        sync: Literal["batch", "seal"] = "seal",
        direct_io: DirectIO = "off",
        on_evict: Callable[[list[bytes]], None] | None = None,
    ) -> None:
        if isinstance(segment_bytes, bool) or not isinstance(segment_bytes, int) or (
                segment_bytes < 4096):
            raise InvalidArgumentError(f"segment_bytes must be an int >= 4096, got "
                                       f"{segment_bytes!r}")
        if max_bytes is not None and (not isinstance(max_bytes, int)
                                      or max_bytes < 2 * segment_bytes):
            raise InvalidArgumentError(
                f"max_bytes must be None or at least 2 * segment_bytes ({2 * segment_bytes}),"
                f" got {max_bytes!r}; lower segment_bytes for a small budget")
        if sync not in ("batch", "seal"):
            raise InvalidArgumentError(f"sync must be 'batch' or 'seal', got {sync!r}")
        if direct_io not in ("off", "auto", "on", "cold"):
            raise InvalidArgumentError(f"direct_io must be 'off', 'auto', 'on' or 'cold', "
                                       f"got {direct_io!r}")
        self.folder = Path(folder).resolve()
        self.segment_bytes = segment_bytes
        self.max_bytes = max_bytes
        self.sync = sync
        self.direct_io = direct_io if O_DIRECT else "off"
        self.on_evict = on_evict
        self._write_lock = threading.Lock()  # appends, rotation, retirement
        self.frame_buffers = FrameBuffers()  # reusable frames of the appending threads
        self._index_lock = threading.Lock()  # keydir, segment table, sizes, refs
        self._compact_lock = threading.Lock()  # one compaction at a time
        self._keydir = KeyDirectory()
        self._damage: list[Damage] = []  # found by this open's scans
        self._segments: dict[int, SegmentFile] = {}
        self._live: SegmentFile | None = None
        self._sealer: ThreadPoolExecutor | None = None  # fsyncs + hints of rotated segments
        self._sealing: list[Future[None]] = []
        self._total_bytes = 0
        self._next_id = 1
        self._closed = False
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._lock_fd = os.open(self.folder / "lock",
                                    os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as exc:
            raise StorageError(exc.errno, f"cannot open KV segment folder {self.folder}: "
                               f"{exc.strerror}; check the path and its permissions") from None
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise StorageError(errno.EBUSY, f"KV segment folder {self.folder} is open in "
                               "another SegmentLog (this or another process); close it "
                               "first or use another folder") from None
        try:
            with self._write_lock:
                load_folder(self)
                self._notify(self._enforce_budget())
        except OSError as exc:
            self.close()
            if isinstance(exc, StorageError | CapacityError):
                raise
            kind = CapacityError if exc.errno in FULL_ERRNOS else StorageError
            raise kind(exc.errno, f"cannot open the KV segments in {self.folder}: "
                       f"{exc.strerror} ({exc.filename})") from exc
        except BaseException:
            self.close()
            raise

    # -- lookups and reads -----------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._keydir)

    def __contains__(self, key: object) -> bool:
        return key in self._keydir

    def locate(self, key: bytes) -> Location | None:
        """Where ``key``'s newest value is, or None."""
        with self._index_lock:
            entry = self._keydir.get(key)
        return None if entry is None else Location.from_entry(key, entry)

    def live_locations(self, segment_id: int) -> list[Location]:
        """Where the keys whose newest value lies in ``segment_id`` are (a snapshot)."""
        with self._index_lock:
            return [Location.from_entry(k, e) for k, e in self._keydir.entries_in(segment_id)]

    def keys(self) -> list[bytes]:
        """A snapshot of the keys (``iter(log)`` iterates over one too)."""
        with self._index_lock:
            return self._keydir.keys()

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.keys())

    def read(self, location: Location, *, direct: bool | None = None) -> memoryview:
        """The checked value at ``location`` (one pread). If the location went stale
        (compaction, eviction) it reads the key's newest value instead, and raises
        ``KeyNotFoundError`` when there is none; ``RecordIntegrityError`` when damaged."""
        loc = location
        for _ in range(8):
            try:
                run = self.read_run(loc.segment_id, loc.record_offset, loc.value_end,
                                    direct=direct)
                return verify_record(run, loc.record_offset, loc)
            except StaleLocationError:
                fresh = self.locate(loc.key)
                if fresh is None:
                    raise KeyNotFoundError(f"KV block {loc.key.hex()} is no longer in "
                                           f"{self.folder} (evicted or deleted)") from None
                loc = fresh
        raise StaleLocationError(loc.segment_id, self.folder)

    def get(self, key: bytes) -> memoryview | None:
        """``key``'s value, or None: ``locate`` + ``read``."""
        loc = self.locate(key)
        if loc is None:
            return None
        try:
            return self.read(loc)
        except KeyNotFoundError:
            return None

    # -- writes ----------------------------------------------------------------------------
    def append_many(self, items: Sequence[tuple[bytes, Buffer]]) -> list[Location]:
        """Append ``(key, value)`` pairs as one contiguous run of records, in order (the
        last of duplicate keys wins); returns their locations (``append_blocks`` without
        building them is faster). Raises ``CapacityError`` when the device is full even
        after evicting cold segments."""
        keys = [k for k, _ in items]
        batch, sid, start = self._append_batch(keys, [v for _, v in items])
        if batch is None:
            return []
        roff = (batch.rel + start).tolist()
        delta, rbytes = record_geometry_np(batch.klen, batch.vlen)
        return [Location(k, sid, r, r + d, v, r + b, c, batch.timestamp_ns)
                for k, r, d, v, b, c in zip(batch.keys, roff, delta.tolist(),
                                            batch.vlen.tolist(), rbytes.tolist(),
                                            batch.csum.tolist(), strict=True)]

    def append_blocks(self, keys: Sequence[bytes], values: Sequence[Buffer]) -> int:
        """Append ``keys[i] -> values[i]`` as one contiguous run of records, in order
        (the last of duplicate keys wins); returns how many records were written.

        The batch is framed before the write lock is taken (``framing.frame_puts``:
        headers and offsets in numpy, one xxh3 call per record), written with one
        pwrite (values under 32 KiB, copied into one frame) or pwritev (larger values,
        not copied), and entered into the key directory in one vectorised step.
        Raises ``CapacityError`` when the device is full even after evicting."""
        return 0 if (batch := self._append_batch(keys, values)[0]) is None else len(batch)

    def locate_many(self, keys: Sequence[bytes]) -> list[Location | None]:
        """``locate`` of each key, with one vectorised probe of the key directory (key
        by key for a few keys: ``KeyDirectory.entries``)."""
        klist = [bytes(k) for k in keys] if any(type(k) is not bytes for k in keys) else list(keys)
        with self._index_lock:
            entries = self._keydir.entries(klist)
        return [None if e is None else Location(k, *e)
                for k, e in zip(klist, entries, strict=True)]

    def locate_columns(self, keys: list[bytes]) -> LocatedColumns:
        """``locate_many`` as numpy columns (``LocatedColumns``): one vectorised probe
        and no object per key (``keys``: ``bytes`` each)."""
        with self._index_lock:
            rows = self._keydir.find_rows(keys)
            cols = self._keydir.columns_of_rows(rows)
        return LocatedColumns(keys, rows >= 0, *cols)

    def contains_many(self, keys: Sequence[bytes]) -> npt.NDArray[np.bool_]:
        """Whether each key has a value here (one vectorised probe)."""
        klist = [bytes(k) for k in keys] if any(type(k) is not bytes for k in keys) else list(keys)
        with self._index_lock:
            return self._keydir.contains_many(klist)

    def put(self, key: bytes, value: Buffer) -> Location:
        return self.append_many([(key, value)])[0]

    def drop_damaged(self, key: bytes, exc: IntegrityError) -> None:
        """Delete ``key`` because a read found its record damaged (``exc``), and add the
        record to the damage report (``damage.log``), so that ``isolane kv verify`` names
        it later, whichever process read it. Idempotent: when ``exc`` names the damaged
        record (a ``RecordIntegrityError`` with its key, segment and offset) and ``key``
        no longer points there (dropped already, or written anew since), nothing is
        deleted. The batched reads (``reader.py``) call this themselves."""
        key = check_key(key)
        with self._write_lock:
            self._check_open()
            loc = self.locate(key)
            if loc is None:
                return  # gone meanwhile (another reader dropped it first)
            if (isinstance(exc, RecordIntegrityError) and exc.key == key
                    and exc.segment_id is not None
                    and (exc.segment_id, exc.offset) != (loc.segment_id, loc.record_offset)):
                return  # the damaged record is no longer the key's newest
            self._delete_present(key)
            drop = Damage(loc.segment_id, loc.record_offset,
                          loc.record_end - loc.record_offset, f"read failed: {exc.detail}")
            write_damage(self.folder, [*read_damage(self.folder), drop][-MAX_DAMAGE_ENTRIES:])

    def delete(self, key: bytes) -> bool:
        """Append a tombstone for ``key``; False (and nothing written) if it is absent."""
        key = check_key(key)
        with self._write_lock:
            self._check_open()
            with self._index_lock:
                if key not in self._keydir:
                    return False
            self._delete_present(key)
        return True

    def rotate(self) -> int | None:
        """Seal the live segment now if it holds records; returns its id."""
        with self._write_lock:
            self._check_open()
            live = self._live
            if live is None or live.size <= SEGMENT_HEADER_BYTES:
                return None
            self._seal()
            return live.segment_id

    def flush(self) -> None:
        """Wait until every segment sealed so far is fsynced and has its hint file (a
        rotation during appends leaves both to the sealer thread)."""
        with self._write_lock:
            self._wait_sealed()

    # -- segments, compaction, eviction ----------------------------------------------------
    @property
    def total_bytes(self) -> int:
        """Bytes of all segment files (hint files not counted)."""
        return self._total_bytes

    def segments(self) -> list[SegmentInfo]:
        """Every segment, oldest first."""
        with self._index_lock:
            return [SegmentInfo(s.segment_id, "sealed" if s.sealed else "live", s.size,
                                self._keydir.live_bytes(s.segment_id),
                                self._keydir.live_count(s.segment_id), s.path)
                    for s in sorted(self._segments.values(), key=lambda s: s.segment_id)]

    def compact(self, segment_id: int) -> CompactionResult:
        """Copy the live records of a sealed segment to the live segment, then retire it
        (``compact_segment``): copies in chunks of 8 MiB with appends
        going on between them, compare and set, fsynced before the old file is renamed
        ``.dead``; readers still holding it finish first."""
        return compact_segment(self, segment_id)

    def evict_cold_segments(self, max_bytes: int | None = None) -> list[bytes]:
        """Drop whole oldest sealed segments until the log is within ``max_bytes``
        (default: the log's budget; nothing without one). Returns the keys that lost
        their value, for the pool's tiers (``on_evict`` is not called for these)."""
        with self._write_lock:
            self._check_open()
            return self._enforce_budget(max_bytes)

    def evict_segment(self, segment_id: int) -> list[bytes]:
        """Drop one sealed segment (e.g. once it is safely demoted to the capacity tier);
        returns the keys that lost their value here. The live segment is refused."""
        with self._write_lock:
            self._check_open()
            with self._index_lock:
                seg = self._segments.get(segment_id)
            if seg is None:
                return []
            if not seg.sealed:
                raise InvalidArgumentError(f"segment {segment_id} of {self.folder} is the "
                                           "live segment; rotate() it first")
            return self._retire(seg)

    # -- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        """fsync the live segment and close every file. Idempotent; readers that are
        still in a pread finish, then their segment closes."""
        with self._write_lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._wait_sealed()
                if self._sealer is not None:
                    self._sealer.shutdown()
                if self._live is not None and self._live.fd >= 0:
                    os.fsync(self._live.fd)
            finally:
                with self._index_lock:
                    idle = [s for s in self._segments.values() if s.refs == 0]
                    for seg in self._segments.values():
                        seg.retired = True
                    self._segments.clear()
                for seg in idle:
                    seg.close()
                os.close(self._lock_fd)

    def __enter__(self) -> SegmentLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"SegmentLog({str(self.folder)!r}, keys={len(self)}, "
                f"segments={len(self._segments)}, bytes={self._total_bytes})")

    # -- internals: the damage report ------------------------------------------------------
    def damage_report(self) -> list[Damage]:
        """Byte ranges the reopen scans dropped (damage or torn tails) and no verify has
        reported yet, found by this process or an earlier one; oldest first."""
        with self._write_lock:
            return [d for d in read_damage(self.folder) if not d.reported]

    def clear_damage(self) -> None:
        """Mark the damage report as shown (after ``isolane kv verify`` printed it)."""
        with self._write_lock:
            entries = read_damage(self.folder)
            if any(not d.reported for d in entries):
                write_damage(self.folder, [dataclasses.replace(d, reported=True)
                                           for d in entries])

    # -- the read path: segment pins and the reads under them ---------------------------
    def read_run(self, segment_id: int, start: int, end: int, *, direct: bool | None = None,
                 out: memoryview | None = None) -> memoryview:
        """Bytes ``[start, end)`` of a segment in one pread (records are not checked:
        use ``verify_record``/``parse_run``). ``direct`` (default: as ``direct_io``
        says, see the module docstring) reads with O_DIRECT, widening the range to page
        boundaries; ``out`` is a buffer to read into (page-aligned and as long as the
        widened range for O_DIRECT). Raises ``StaleLocationError`` when the segment is
        gone."""
        if not 0 <= start <= end:
            raise InvalidArgumentError(f"invalid byte range [{start}, {end})")
        seg = self._acquire(segment_id)
        try:
            check_range(seg, start, end)
            if direct is None:
                direct = self._reads_direct(seg, start, end)
            if direct and self.direct_io != "off" and start < end:
                got = self._try_direct(seg, start, end, out)
                if got is not None:
                    return got
            n = end - start
            if out is not None and len(out) < n:
                raise InvalidArgumentError(f"out holds {len(out)} bytes, the range {n}")
            view = fresh_buffer(n) if out is None else out.cast("B")[:n]
            pread_all(seg, seg.fd, view, start, n)
            return view
        finally:
            self._release(seg)

    def read_scatter(self, segment_id: int, start: int, buffers: Sequence[Buffer]) -> None:
        """Read the bytes from ``start`` on into ``buffers`` in order (one ``preadv``
        per up to 512 buffers), e.g. straight into the caller's tensor. Buffered, not
        O_DIRECT: the destinations need not be aligned. Records are not checked.
        Raises ``StaleLocationError`` when the segment is gone."""
        views = [memoryview(b).cast("B") for b in buffers if len(b)]
        end = start + sum(map(len, views))
        seg = self._acquire(segment_id)
        try:
            check_range(seg, start, end)
            preadv_all(seg, views, start)
        finally:
            self._release(seg)

    def read_direct(self, segment_id: int, start: int, end: int,
                    out: memoryview) -> memoryview | None:
        """Bytes ``[start, end)`` read with O_DIRECT into ``out`` (page-aligned, at least
        ``direct_span(start, end)`` bytes) and returned as a view into it, when this log
        reads the range with O_DIRECT (``direct_io``, see the module docstring); None
        when it reads it through the page cache (nothing read: use ``read_scatter`` or
        ``read_run``). Records are not checked. Raises ``StaleLocationError`` when the
        segment is gone."""
        if not 0 <= start < end:
            raise InvalidArgumentError(f"invalid byte range [{start}, {end})")
        seg = self._acquire(segment_id)
        try:
            check_range(seg, start, end)
            if not self._reads_direct(seg, start, end):
                return None
            return self._try_direct(seg, start, end, out)
        finally:
            self._release(seg)

    def _reads_direct(self, seg: SegmentFile, start: int, end: int) -> bool:
        """Whether a read of ``[start, end)`` of ``seg`` (pinned) goes O_DIRECT."""
        mode = self.direct_io
        if mode != "cold":
            return mode != "off"
        return (end - start >= COLD_DIRECT_MIN_BYTES
                and fully_cached(seg.fd, start, end - start) is False)

    def _try_direct(self, seg: SegmentFile, start: int, end: int,
                    out: memoryview | None) -> memoryview | None:
        """``_read_direct`` of ``[start, end)``, or None when the segment has no O_DIRECT
        descriptor or the filesystem refuses O_DIRECT (EINVAL: this log then stops
        trying, ``_refuse_direct``); the caller reads buffered instead."""
        fd = self._direct_fd(seg)
        if fd < 0:
            return None
        try:
            return self._read_direct(seg, fd, start, end, out)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self._refuse_direct(exc)
            return None

    def _read_direct(self, seg: SegmentFile, fd: int, start: int, end: int,
                     out: memoryview | None) -> memoryview:
        lo, hi = start // ALIGN * ALIGN, align_up(end)
        if out is None:
            view = memoryview(mmap.mmap(-1, hi - lo))
        elif len(out) < hi - lo or not is_aligned(out):
            raise InvalidArgumentError(
                f"out must be page-aligned and hold {hi - lo} bytes for an O_DIRECT read")
        else:
            view = out.cast("B")[:hi - lo]
        pread_all(seg, fd, view, lo, end - lo)
        return view[start - lo:end - lo]


    def _check_open(self) -> None:
        if self._closed:
            raise StorageError(errno.EBADF, f"the KV segment log of {self.folder} is closed")

    def _acquire(self, segment_id: int) -> SegmentFile:
        with self._index_lock:
            seg = self._segments.get(segment_id)
            if seg is None or seg.retired:
                self._check_open()
                raise StaleLocationError(segment_id, self.folder)
            if seg.fd < 0:
                seg.fd = os.open(seg.path, os.O_RDONLY | os.O_NOFOLLOW)
            seg.refs += 1
            return seg

    def _release(self, seg: SegmentFile) -> None:
        with self._index_lock:
            seg.refs -= 1
            idle = seg.retired and seg.refs == 0
        if idle:
            seg.close()

    def _direct_fd(self, seg: SegmentFile) -> int:
        """The segment's O_DIRECT descriptor (opened on first use), or -1 when the
        filesystem refuses O_DIRECT and ``direct_io`` is ``auto``."""
        with self._index_lock:
            if seg.direct_fd < 0 and self.direct_io != "off":
                try:
                    seg.direct_fd = os.open(seg.path, os.O_RDONLY | os.O_NOFOLLOW | O_DIRECT)
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    self._refuse_direct(exc)
            return seg.direct_fd

    def _refuse_direct(self, exc: OSError) -> None:
        if self.direct_io == "on":
            raise StorageError(errno.EINVAL, f"{self.folder} does not support O_DIRECT reads "
                               f"({exc.strerror}); use direct_io='auto' or 'off'") from None
        log.info("%s does not support O_DIRECT reads; reading through the page cache",
                 self.folder)  # "cold" too: cached or not, every read goes buffered
        self.direct_io = "off"

    # -- the write path: append, publish, rotate and seal, retire and evict ---------------
    def _append_batch(self, keys: Sequence[bytes], values: Sequence[Buffer]
                      ) -> tuple[FramedBatch | None, int, int]:
        if len(keys) != len(values):
            raise InvalidArgumentError(f"append_blocks got {len(keys)} keys and "
                                       f"{len(values)} values")
        if not keys:
            return None, 0, 0
        return self._append_framed(self._frame(keys, values))

    def _frame(self, keys: Sequence[bytes], values: Sequence[Buffer]) -> FramedBatch:
        """Frame a batch (pure, no lock) into one of the log's frame buffers."""
        scratch = self.frame_buffers.take()
        try:
            batch = frame_puts(keys, values, time.time_ns(), scratch)
        except BaseException:
            self.frame_buffers.give(scratch)
            raise
        if batch.buffer is not scratch:  # framed elsewhere: scratch is free again
            self.frame_buffers.give(scratch)
        return batch

    def _append_framed(self, batch: FramedBatch) -> tuple[FramedBatch, int, int]:
        """Write a framed batch and publish it; its frame buffer is kept for later
        batches whatever the outcome."""
        try:
            with self._write_lock:
                self._check_open()
                seg, start = self._with_room(lambda: self._write_frame(batch), batch.nbytes)
                self._publish_frame(seg, start, batch)
                self._notify(self._enforce_budget())
        finally:
            self.frame_buffers.give(batch.buffer)
        return batch, seg.segment_id, start

    def _delete_present(self, key: bytes) -> None:
        """Append a tombstone for ``key`` (callers hold the write lock)."""
        pending = [PendingRecord.encode(key, FLAG_TOMBSTONE, memoryview(b""), time.time_ns())]
        seg, offsets = self._append(pending)
        self._publish(seg, offsets, pending)

    def _append(self, pending: list[PendingRecord]) -> tuple[SegmentFile, list[int]]:
        """Write ``pending`` contiguously into the live segment (rotating first if
        needed); on a full device evict cold segments and retry once."""
        return self._with_room(lambda: self._write(pending),
                               sum(p.record_bytes for p in pending))

    def _with_room(self, write: Callable[[], _T], nbytes: int) -> _T:
        """``write()`` (which appends ``nbytes`` of records to the live segment); on a
        full device wait for the sealer, evict cold segments and retry once."""
        try:
            return write()
        except OSError as exc:
            self._rollback()
            if exc.errno not in FULL_ERRNOS:
                raise StorageError(exc.errno, f"cannot append to KV segments in "
                                   f"{self.folder}: {exc.strerror}") from exc
        # Segments rotated during appends stay open until the sealer has fsynced them:
        # wait for it, so that those evicted before or now are unlinked before the retry.
        self._wait_sealed()
        need = nbytes + SEGMENT_HEADER_BYTES
        evicted = self._evict(self._total_bytes - need, at_least=need)
        self._wait_sealed()
        if evicted is None:
            raise CapacityError(errno.ENOSPC, f"device of {self.folder} is full and no "
                                "sealed KV segment is left to evict; free space or lower the "
                                "KV pool's disk budget (max_bytes)")
        self._notify(evicted)
        try:
            return write()
        except OSError as exc:
            self._rollback()
            if exc.errno in FULL_ERRNOS:
                raise CapacityError(exc.errno, f"device of {self.folder} is still full after "
                                    "evicting cold KV segments; free space or lower the KV "
                                    "pool's disk budget (max_bytes)") from exc
            raise StorageError(exc.errno, f"cannot append to KV segments in {self.folder}: "
                               f"{exc.strerror}") from exc

    def _write(self, pending: list[PendingRecord]) -> tuple[SegmentFile, list[int]]:
        batch = sum(p.record_bytes for p in pending)
        live = self._live or self._new_live()
        if should_rotate(live.size, batch, self.segment_bytes, SEGMENT_HEADER_BYTES):
            self._seal(wait=False)
            live = self._new_live()
        offsets: list[int] = []
        parts: list[memoryview | bytes | bytearray] = []
        off = live.size
        for p in pending:
            p.bind(live.salt)
            offsets.append(off)
            parts.append(p.head)
            parts += p.parts
            off += p.record_bytes
        pwritev_all(live.fd, parts, live.size)
        if self.sync == "batch":
            os.fdatasync(live.fd)
        return live, offsets

    def _write_frame(self, batch: FramedBatch) -> tuple[SegmentFile, int]:
        live = self._live or self._new_live()
        if should_rotate(live.size, batch.nbytes, self.segment_bytes, SEGMENT_HEADER_BYTES):
            self._seal(wait=False)
            live = self._new_live()
        batch.bind(live.salt)
        pwritev_all(live.fd, batch.iovecs, live.size)
        if self.sync == "batch":
            os.fdatasync(live.fd)
        return live, live.size

    def _publish_frame(self, seg: SegmentFile, start: int, batch: FramedBatch) -> None:
        """Make a written batch visible: committed size first, then the index."""
        sid = seg.segment_id
        sel: Any = slice(None) if batch.keep is None else batch.keep
        keys = batch.keys if batch.keep is None else [batch.keys[i] for i in batch.keep.tolist()]
        roff = (batch.rel[sel] + start).astype(np.uint64)
        with self._index_lock:
            end = start + batch.nbytes
            self._total_bytes += end - seg.size
            seg.size = end
            self._keydir.put_columns(sid, batch.k0[sel], batch.k1[sel], batch.klen[sel], roff,
                                     batch.vlen[sel], batch.csum[sel],
                                     np.full(len(keys), batch.timestamp_ns, np.uint64), keys)

    def _rollback(self) -> None:
        """Cut a partly written batch off the live segment (no reader knows of it)."""
        live = self._live
        if live is not None:
            try:
                os.ftruncate(live.fd, live.size)
            except OSError as exc:
                raise StorageError(exc.errno, f"cannot truncate {live.path} after a failed "
                                   f"write: {exc.strerror}") from exc

    def _publish(self, seg: SegmentFile, offsets: list[int],
                 pending: list[PendingRecord]) -> list[Entry]:
        """Make written records visible: committed size first, then the index."""
        entries: list[Entry] = []
        sid = seg.segment_id
        with self._index_lock:
            end = offsets[-1] + pending[-1].record_bytes
            self._total_bytes += end - seg.size
            seg.size = end
            for p, off in zip(pending, offsets, strict=True):
                entry = (sid, off, off + p.value_delta, p.value_length, off + p.record_bytes,
                         p.checksum, p.timestamp_ns)
                entries.append(entry)
                if p.flags == FLAG_TOMBSTONE:
                    self._keydir.delete(p.key, sid)
                elif p.old is not None:
                    self._keydir.replace(p.key, p.old, entry)
                else:
                    self._keydir.put(p.key, entry)
        return entries

    def _new_live(self) -> SegmentFile:
        sid = self._next_id
        path = self.folder / f"seg-{sid:08d}.live"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        salt = new_salt()
        try:
            pwritev_all(fd, [encode_segment_header(sid, salt, time.time_ns())], 0)
            if self.sync == "batch":  # under "seal" the seal's fsyncs make it durable
                os.fsync(fd)
                fsync_dir(self.folder)
        except OSError:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        self._next_id += 1
        seg = SegmentFile(sid, path, SEGMENT_HEADER_BYTES, sealed=False, fd=fd, salt=salt)
        with self._index_lock:
            self._segments[sid] = seg
            self._total_bytes += seg.size
        self._live = seg
        return seg

    def _seal(self, *, wait: bool = True) -> None:
        """Rename the live segment ``.sealed``; fsync it and the folder, then write its
        hint: now, or with ``wait=False`` (rotation during appends) on the sealer thread,
        so that the appends do not wait for the device. The hint is written only after
        the fsyncs, so a hint never describes bytes that a power loss could take (a
        sealed segment without a hint is scanned on open, its torn tail cut; a rename
        the power loss undid leaves an older ``.live``, which the open seals)."""
        live = self._live
        if live is None:
            return
        if wait:
            os.fsync(live.fd)
        sealed = live.path.with_suffix(".sealed")
        os.rename(live.path, sealed)
        if wait:
            fsync_dir(self.folder)
        with self._index_lock:
            live.path, live.sealed = sealed, True
            hint = self._keydir.hint_bytes(live.segment_id, live.size)
            if not wait:
                live.refs += 1  # pinned (its fd stays open) until the sealer is done
        self._live = None
        if wait:
            write_hint(self.folder, live.segment_id, hint)
            return
        if self._sealer is None:
            self._sealer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-seal")
        self._sealing = [f for f in self._sealing if not f.done()]
        self._sealing.append(self._sealer.submit(self._finish_seal, live, hint))

    def _finish_seal(self, seg: SegmentFile, hint: bytes) -> None:
        try:
            os.fsync(seg.fd)
            fsync_dir(self.folder)  # the rename, and the next live segment's name
            with self._index_lock:
                gone = seg.retired
            if not gone:
                write_hint(self.folder, seg.segment_id, hint)
        except OSError as exc:
            log.warning("could not fsync the sealed KV segment %s (%s); no hint is written, "
                        "the next open scans it", seg.path, exc.strerror)
        finally:
            self._release(seg)

    def _wait_sealed(self) -> None:
        """Wait for the sealer thread's fsyncs and hints (callers hold the write lock)."""
        for fut in self._sealing:
            fut.result()
        self._sealing = []

    def _retire(self, seg: SegmentFile) -> list[bytes]:
        """Retire a sealed segment (``.dead``, keys forgotten; unlinked at the last unpin);
        returns the keys that lost their value."""
        dead = seg.path.with_suffix(".dead")
        with contextlib.suppress(FileNotFoundError):
            os.rename(seg.path, dead)
        hint_path(self.folder, seg.segment_id).unlink(missing_ok=True)
        fsync_dir(self.folder)
        with self._index_lock:
            self._segments.pop(seg.segment_id, None)
            self._total_bytes -= seg.size
            seg.path, seg.retired, seg.dead = dead, True, True
            idle = seg.refs == 0
            keys = self._keydir.drop_segment(seg.segment_id)
        if idle:
            seg.close()
        return keys

    def _evict(self, target_bytes: int, *, at_least: int = 0) -> list[bytes] | None:
        """Retire oldest sealed segments per ``plan_eviction``; None if none was."""
        with self._index_lock:
            sealed = sorted((s.segment_id, s.size) for s in self._segments.values() if s.sealed)
        plan = plan_eviction(sealed, self._total_bytes, target_bytes, at_least=at_least)
        if not plan:
            return None
        keys: list[bytes] = []
        for sid in plan:
            seg = self._segments[sid]
            log.info("evicting KV segment %d (%d bytes) from %s", sid, seg.size, self.folder)
            keys += self._retire(seg)
        return keys

    def _enforce_budget(self, max_bytes: int | None = None) -> list[bytes]:
        budget = self.max_bytes if max_bytes is None else max_bytes
        if budget is None or self._total_bytes <= budget:
            return []
        return self._evict(budget) or []

    def _notify(self, keys: list[bytes] | None) -> None:
        if keys and self.on_evict is not None:
            try:
                self.on_evict(keys)
            except Exception:  # the append it follows succeeded: report, do not undo
                log.exception("on_evict callback of %s failed", self.folder)
