"""The files of a KV segment log: their names, one open segment file, and the
vectored reads and writes on them (no index, no locks: ``segment_log.py`` holds those).

File names carry the lifecycle (``seg-<id:08d>.live``/``.sealed``/``.hint``/``.dead``;
see ``segment_log.py``). ``SegmentFile`` is one segment's descriptor(s), committed size and
salt, with the reference count that defers closing (and unlinking) a retired segment
until its last reader is done.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from isolane.errors import InvalidArgumentError, KeyNotFoundError
from isolane.kvpool.log.records import SEGMENT_HEADER_BYTES, RecordIntegrityError
from isolane.storage.base import Buffer

__all__ = [
    "FULL_ERRNOS", "IOV_MAX", "O_DIRECT", "SegmentFile", "SegmentInfo", "StaleLocationError",
    "check_range", "fresh_buffer", "parse_segment_name", "pread_all", "preadv_all",
    "pwritev_all", "read_nofollow", "vectored_all",
]

MiB = 1 << 20
FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
O_DIRECT: int = getattr(os, "O_DIRECT", 0)
IOV_MAX = 512  # below every platform's IOV_MAX (1024 on Linux)
_NAME = re.compile(r"seg-(\d{8})\.(live|sealed|hint|dead)")


def parse_segment_name(name: str) -> tuple[int, str] | None:
    """``seg-<id:08d>.<kind>`` -> (id, kind); None for any other file name."""
    m = _NAME.fullmatch(name)
    return None if m is None else (int(m.group(1)), m.group(2))


class StaleLocationError(KeyNotFoundError):
    """The segment a location points into was compacted or evicted: call ``locate``
    again (``SegmentLog.read`` does so itself)."""

    def __init__(self, segment_id: int, folder: Path) -> None:
        self.segment_id = segment_id
        super().__init__(f"KV segment {segment_id} is no longer in {folder} (compacted or "
                         "evicted); look the key up again with locate()")


@dataclass(frozen=True)
class SegmentInfo:
    segment_id: int
    state: Literal["live", "sealed"]
    file_bytes: int
    live_bytes: int
    live_keys: int
    path: Path


class SegmentFile:
    """One segment file open in a log: its descriptors, committed size and salt, and
    the pins of the readers in it (see ``SegmentLog._acquire``)."""

    __slots__ = ("dead", "direct_fd", "fd", "path", "refs", "retired", "salt", "sealed",
                 "segment_id", "size")

    def __init__(self, segment_id: int, path: Path, size: int, *, sealed: bool,
                 fd: int = -1, salt: int = 0) -> None:
        self.segment_id, self.path, self.size, self.sealed = segment_id, path, size, sealed
        self.salt = salt  # known for segments created or scanned by this process
        self.fd, self.direct_fd = fd, -1
        self.refs = 0
        self.retired = False  # no new readers; close once refs drops to 0
        self.dead = False  # ... and unlink the file then

    def close(self) -> None:
        for fd in (self.fd, self.direct_fd):
            if fd >= 0:
                os.close(fd)
        self.fd = self.direct_fd = -1
        if self.dead:
            self.path.unlink(missing_ok=True)


def read_nofollow(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with open(fd, "rb") as f:
        return f.read()


def pwritev_all(fd: int, parts: Sequence[Buffer], offset: int) -> None:
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    if not vectored_all(os.pwritev, fd, views, offset):
        raise OSError(errno.EIO, "pwritev wrote nothing")


def vectored_all(op: Callable[[int, list[memoryview], int], int], fd: int,
                 views: list[memoryview], offset: int) -> bool:
    """Run ``op`` (``os.preadv``/``os.pwritev``) until every view is done, 512 at a
    time, resuming after short transfers; False when a call moved nothing (EOF)."""
    i = 0
    while i < len(views):
        n = op(fd, views[i:i + IOV_MAX], offset)
        if n <= 0:
            return False
        offset += n
        while n > 0:
            if n >= len(views[i]):
                n -= len(views[i])
                i += 1
            else:
                views[i] = views[i][n:]
                n = 0
    return True


def check_range(seg: SegmentFile, start: int, end: int) -> None:
    if start < SEGMENT_HEADER_BYTES or end > seg.size:
        raise InvalidArgumentError(
            f"byte range [{start}, {end}) is outside the records of KV segment "
            f"{seg.segment_id} [{SEGMENT_HEADER_BYTES}, {seg.size})")


def fresh_buffer(nbytes: int) -> memoryview:
    # Large buffers come from mmap: zero pages on first touch, no memset pass over them.
    return memoryview(mmap.mmap(-1, nbytes) if nbytes >= MiB else bytearray(nbytes))


def preadv_all(seg: SegmentFile, views: list[memoryview], offset: int) -> None:
    if not vectored_all(os.preadv, seg.fd, views, offset):
        raise RecordIntegrityError(None, seg.segment_id, offset,
                                   "the segment file is shorter than its index")


def pread_all(seg: SegmentFile, fd: int, view: memoryview, offset: int, need: int) -> None:
    """Read ``need`` bytes at ``offset`` into ``view`` (resuming after short reads)."""
    done = 0
    while done < need:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise RecordIntegrityError(None, seg.segment_id, offset + done,
                                       "the segment file is shorter than its index")
        done += n
