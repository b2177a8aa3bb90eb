"""Is a byte range of a file in the page cache? One ``cachestat(2)`` call (Linux 6.5+).

What a reader asks before choosing how to read a range: pages already cached read at
memory speed through the page cache (and can land straight in the caller's buffers),
while a cold range reads faster with O_DIRECT and several requests in flight than
through the kernel's read-ahead (measured on this project's NVMe-backed VM: ~2x at 4
and 16 MiB, docs/BENCHMARKS.md "KV prompt restores of 64 KiB blocks, issue 15").

``cachestat`` only counts pages: it starts no I/O and moves no data (unlike a
``preadv2(RWF_NOWAIT)`` probe, which starts read-ahead of the range on a miss). Where
the call does not exist (an older kernel, another OS, a seccomp filter) ``cached_pages``
answers None, and callers keep reading through the page cache.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import sys

__all__ = ["PAGE", "cached_pages", "fully_cached"]

PAGE = mmap.PAGESIZE
"""The pages ``cachestat`` counts: this machine's (4 KiB on x86-64, 16 or 64 KiB on some
arm64 and ppc64le kernels)."""
_CACHESTAT = 451  # the same number on every architecture (syscalls from 424 on)


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in (
        "nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


class _CacheStat:
    """The ``cachestat`` entry point, or None once it is known to be missing."""

    def __init__(self) -> None:
        self.call = None
        if sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                call = libc.syscall
            except (OSError, AttributeError):
                return
            call.restype = ctypes.c_long
            self.call = call


_state = _CacheStat()
_MISSING = (errno.ENOSYS, errno.EPERM, errno.EOPNOTSUPP)


def cached_pages(fd: int, offset: int, length: int) -> int | None:
    """How many pages of ``[offset, offset + length)`` of ``fd`` are in the page cache
    (the pages the range touches); None when ``cachestat`` is not available here.
    Thread-safe; an I/O error of the call (e.g. a closed ``fd``) raises ``OSError``."""
    call = _state.call
    if call is None or length <= 0:
        return None if call is None else 0
    span = _Range(offset, length)
    stat = _Stat()
    rc = call(ctypes.c_long(_CACHESTAT), ctypes.c_int(fd), ctypes.byref(span),
              ctypes.byref(stat), ctypes.c_uint(0))
    if rc != 0:
        err = ctypes.get_errno()
        if err in _MISSING:
            _state.call = None  # not on this kernel: never ask again
            return None
        raise OSError(err, f"cachestat of fd {fd} failed")
    return int(stat.nr_cache)


def fully_cached(fd: int, offset: int, length: int) -> bool | None:
    """Whether every page of the range is in the page cache; None when unknown."""
    pages = cached_pages(fd, offset, length)
    if pages is None:
        return None
    first, last = offset // PAGE, (offset + max(length, 1) - 1) // PAGE
    return pages >= last - first + 1
