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
unforgeable, 64-byte padding) is in ``records.py``. The log's parts live beside it: the
segment files and their vectored I/O (``segment_files.py``), the read path with its
segment pins (``segment_reads.py``), the write path: append, seal, retire, evict
(``segment_writes.py``), the reopen from hint files (``segment_reopen.py``), the
recovery scan and damage report (``segment_scan.py``), compaction
(``segment_compaction.py``). This module is the log's public face: opening, lookups,
checked reads, the public writes and the lifecycle.

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

import dataclasses
import errno
import fcntl
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import numpy as np
import numpy.typing as npt

from isolane.errors import (
    CapacityError,
    IntegrityError,
    InvalidArgumentError,
    KeyNotFoundError,
    StorageError,
)
from isolane.kvpool.log.frame_buffers import FrameBuffers
from isolane.kvpool.log.keydir import FLAG_PUT, FLAG_TOMBSTONE, LocatedColumns, Location
from isolane.kvpool.log.keytable import KeyDirectory
from isolane.kvpool.log.records import (
    RECORD_ALIGN,
    RECORD_HEADER,
    SEGMENT_HEADER,
    SEGMENT_HEADER_BYTES,
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
from isolane.kvpool.log.segment_compaction import CompactionResult, compact_segment
from isolane.kvpool.log.segment_files import (
    FULL_ERRNOS,
    O_DIRECT,
    SegmentFile,
    SegmentInfo,
    StaleLocationError,
    parse_segment_name,
)
from isolane.kvpool.log.segment_reads import DirectIO
from isolane.kvpool.log.segment_reopen import load_folder, write_close_mark
from isolane.kvpool.log.segment_scan import (
    MAX_DAMAGE_ENTRIES,
    Damage,
    read_damage,
    write_damage,
)
from isolane.kvpool.log.segment_writes import SegmentWrites
from isolane.storage.base import Buffer

__all__ = [
    "FLAG_PUT", "FLAG_TOMBSTONE", "RECORD_ALIGN", "RECORD_HEADER", "SEGMENT_HEADER",
    "CompactionResult", "Damage", "Location", "Record", "RecordIntegrityError", "SegmentInfo",
    "SegmentLog", "StaleLocationError", "encode_segment_header", "new_salt",
    "parse_run", "parse_segment_header", "parse_segment_name", "record_geometry",
    "verify_parts", "verify_record",
]

log = logging.getLogger(__name__)

MiB = 1 << 20


class SegmentLog(SegmentWrites):
    """Bitcask-style log of KV blocks in ``folder`` (format and guarantees above).

    ``segment_bytes`` is the size at which the live segment is sealed; ``max_bytes``
    (None: no budget) caps the log's files: after an append that crosses it, whole
    oldest sealed segments are evicted (at least ``2 * segment_bytes``). ``sync`` is
    ``"batch"`` or ``"seal"``. ``direct_io`` (``off``/``auto``/``on``/``cold``) says
    which reads use O_DIRECT (``segment_reads``: ``cold`` = ranges of 256 KiB or more
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
        (``segment_compaction.compact_segment``): copies in chunks of 8 MiB with appends
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
                    write_close_mark(self.folder, self._live.segment_id, self._live.size)
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
