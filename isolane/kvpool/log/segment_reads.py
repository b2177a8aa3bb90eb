"""The read path of a ``SegmentLog``: segment pins and the reads under them.

``SegmentReads`` is the layer of ``SegmentLog`` (``segment_log.py``) that reads bytes:
``read_run`` (one pread, O_DIRECT or through the page cache), ``read_scatter`` (one
preadv into the caller's buffers) and ``read_direct`` (O_DIRECT into a page-aligned
buffer of the caller's, when the log reads that range with O_DIRECT).

Which reads use O_DIRECT is ``direct_io``: ``off`` never, ``auto`` (and ``on``, which
refuses a filesystem without it) always, ``cold`` for a range of at least
``COLD_DIRECT_MIN_BYTES`` whose pages are not all in the page cache
(``storage.page_cache``: one ``cachestat`` call): a cold multi-block read then goes to
the device with the requests the caller keeps in flight instead of through the
kernel's read-ahead (about twice as fast here), while cached bytes are still read at
memory speed. Without ``cachestat`` a ``cold`` log reads through the page cache.

A read *pins* its segment (``_acquire``: a reference count taken under the index lock,
the descriptor opened on first use), reads without any lock, and unpins (``_release``);
a segment retired meanwhile (compaction, eviction) is closed, and unlinked if dead, when
its last reader unpins. A segment that is gone raises ``StaleLocationError``. These
reads return raw bytes: the record checks are the callers' (``SegmentLog.read``,
``reader.py``, compaction), so that every record handed out is checked exactly once.

The state it works on belongs to the ``SegmentLog`` (declared below, set by its
``__init__``); the write path (``segment_writes.SegmentWrites``) builds on this layer.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from isolane.errors import InvalidArgumentError, StorageError
from isolane.kvpool.log.segment_files import (
    O_DIRECT,
    SegmentFile,
    StaleLocationError,
    check_range,
    fresh_buffer,
    pread_all,
    preadv_all,
)
from isolane.storage.aligned import ALIGN, align_up, is_aligned
from isolane.storage.base import Buffer
from isolane.storage.page_cache import fully_cached

__all__ = ["COLD_DIRECT_MIN_BYTES", "DirectIO", "SegmentReads", "direct_span"]

DirectIO = Literal["off", "auto", "on", "cold"]
COLD_DIRECT_MIN_BYTES = 256 << 10
"""``cold`` logs read smaller ranges through the page cache (a one-block get)."""


def direct_span(start: int, end: int) -> int:
    """Bytes an O_DIRECT read of ``[start, end)`` needs: the range widened to pages."""
    return align_up(end) - start // ALIGN * ALIGN

log = logging.getLogger(__name__)


class SegmentReads:
    """Pinned reads of the open segment files of a log (see the module docstring).
    Thread-safe: any number of readers, alongside the one writer."""

    folder: Path
    direct_io: DirectIO
    _index_lock: threading.Lock  # the segment table, sizes and pins (and the key directory)
    _segments: dict[int, SegmentFile]
    _closed: bool

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
