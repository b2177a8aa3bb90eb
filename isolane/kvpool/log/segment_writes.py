"""The write path of a ``SegmentLog``: append, publish, rotate and seal, retire and evict.

``SegmentWrites`` is the layer of ``SegmentLog`` (``segment_log.py``) that changes the
files; every method here runs under the log's write lock (one writer at a time;
``_append_batch``, the public appends' body, takes it itself):

* append: a batch is written contiguously into the live segment (``_write_frame`` for a
  framed batch of puts, ``_write`` for single records: tombstones, compaction copies),
  rotating first when it would overflow ``segment_bytes`` (``compaction.should_rotate``);
  a failed write is cut off again (``_rollback``); a full device evicts cold segments
  and retries once (``_with_room``).
* publish: only after the bytes are written, the segment's committed size and then the
  key directory are updated under the index lock (``_publish_frame``, ``_publish``), so
  no reader is ever handed a location of unwritten bytes.
* seal: the live segment is renamed ``.sealed``, fsynced and given its hint file, now
  or on the sealer thread (``_seal``, ``_finish_seal``, ``_wait_sealed``).
* retire: a sealed segment is renamed ``.dead``, its keys forgotten, and closed +
  unlinked at its last unpin (``_retire``); eviction retires the oldest ones per
  ``compaction.plan_eviction`` (``_evict``, ``_enforce_budget``) and tells ``on_evict``.

The state belongs to the ``SegmentLog`` (declared below, set by its ``__init__``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal, TypeVar

import numpy as np

from isolane.errors import CapacityError, InvalidArgumentError, StorageError
from isolane.kvpool.log.compaction import plan_eviction, should_rotate
from isolane.kvpool.log.frame_buffers import FrameBuffers
from isolane.kvpool.log.framing import FramedBatch, frame_puts
from isolane.kvpool.log.keydir import FLAG_TOMBSTONE, Entry
from isolane.kvpool.log.keytable import KeyDirectory
from isolane.kvpool.log.records import (
    SEGMENT_HEADER_BYTES,
    PendingRecord,
    encode_segment_header,
    new_salt,
)
from isolane.kvpool.log.segment_files import FULL_ERRNOS, SegmentFile, pwritev_all
from isolane.kvpool.log.segment_reads import SegmentReads
from isolane.kvpool.log.segment_reopen import hint_path, write_hint
from isolane.storage.base import Buffer
from isolane.storage.files import fsync_dir

__all__ = ["SegmentWrites"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")


class SegmentWrites(SegmentReads):
    """The writing layer of a log (see the module docstring); callers hold the write
    lock, and take the index lock only where this code says so."""

    segment_bytes: int
    max_bytes: int | None
    sync: Literal["batch", "seal"]
    on_evict: Callable[[list[bytes]], None] | None
    _write_lock: threading.Lock  # appends, rotation, retirement
    frame_buffers: FrameBuffers  # reusable frames, shared by the appending threads
    _keydir: KeyDirectory
    _live: SegmentFile | None
    _sealer: ThreadPoolExecutor | None  # fsyncs + hints of rotated segments
    _sealing: list[Future[None]]
    _total_bytes: int
    _next_id: int

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
