"""Several files mapped back to back into one contiguous, private memory region.

A big tensor is stored as several chunk files; restoring it by ``read`` costs a page
fault, a page zeroing and a copy per page of fresh memory. Mapping the files instead
puts the page cache pages themselves behind the tensor (copy-on-write, ``MAP_PRIVATE``:
writes never reach the files, and only the pages written are copied), as
``torch.load(mmap=True)`` and safetensors do. The parts are populated for reading
(``MADV_POPULATE_READ``), never for writing, which would copy every page at once.

The region is reserved with one anonymous mapping and each file is mapped over its
part with ``MAP_FIXED``, so every part must start on a page boundary. The region is
unmapped when the last object exporting its buffer (e.g. a tensor) is gone.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from typing import Any

PAGE = mmap.PAGESIZE
_PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE
_MAP_FIXED = 0x10
_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.restype = ctypes.c_int
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MADV_POPULATE_READ = 22  # Linux 5.14+
_MADV_POPULATE_WRITE = 23


def populate_write(address: int, length: int) -> bool:
    """Fault in ``length`` bytes of writable anonymous memory at ``address`` (rounded
    out to pages) in one call, as a write would, without writing: ``MADV_POPULATE_WRITE``.
    False when the kernel lacks it (the pages then fault on first touch instead)."""
    start = address - address % PAGE
    done: int = _libc.madvise(start, _round_up(address + length - start), _MADV_POPULATE_WRITE)
    return done == 0


def populate_file_cache(fd: int, length: int) -> bool:
    """Read the first ``length`` bytes of the file ``fd`` into the page cache and wait
    for them, without copying them anywhere: a shared read-only mapping populated by
    ``MADV_POPULATE_READ`` (Linux 5.14+), then unmapped. False when the kernel or the
    file refuses it (read it instead)."""
    if length <= 0:
        return True
    size = _round_up(length)
    address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if address in (None, _FAILED):
        return False
    try:
        return bool(_libc.madvise(address, size, _MADV_POPULATE_READ) == 0)
    finally:
        _libc.munmap(address, size)


def _round_up(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


class MappedRegion:
    """``nbytes`` of private memory at ``address``; parts are filled with ``map_file``."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.size = _round_up(max(nbytes, 1))
        address = _libc.mmap(None, self.size, _PROT_RW,
                             mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        if address in (None, _FAILED):
            err = ctypes.get_errno()
            raise OSError(err, f"cannot reserve {self.size} bytes: {os.strerror(err)}")
        self.address: int = address
        self._lock = threading.Lock()
        self._closed = False

    def populate(self, offset: int, length: int) -> bool:
        """Fault in part of an anonymous region ahead of its use (see ``populate_write``)."""
        if length <= 0 or offset >= self.nbytes:
            return True
        return populate_write(self.address + offset, min(length, self.nbytes - offset))

    def map_file(self, path: str | os.PathLike[str], offset: int, length: int) -> None:
        """Map the first ``length`` bytes of ``path`` at ``offset`` (page aligned)."""
        if offset % PAGE or offset + length > self.nbytes:
            raise ValueError(f"part [{offset}, {offset + length}) does not fit the region "
                             "on a page boundary")
        if length == 0:
            return
        fd = os.open(path, os.O_RDONLY)
        try:
            if os.fstat(fd).st_size < length:
                raise EOFError(f"{path} holds {os.fstat(fd).st_size} bytes, expected "
                               f"at least {length}")
            # Not MAP_POPULATE: on a writable private mapping it faults every page in
            # for writing, i.e. copies each one into anonymous memory (copy-on-write
            # broken up front). MADV_POPULATE_READ maps the page cache pages themselves;
            # a later write copies only the page it touches.
            got = _libc.mmap(self.address + offset, _round_up(length), _PROT_RW,
                             mmap.MAP_PRIVATE | _MAP_FIXED, fd, 0)
            if got in (None, _FAILED):
                err = ctypes.get_errno()
                raise OSError(err, f"cannot map {path}: {os.strerror(err)}")
        finally:
            os.close(fd)
        # False on kernels before 5.14: the pages then fault in on first read instead.
        _libc.madvise(self.address + offset, _round_up(length), _MADV_POPULATE_READ)

    def buffer(self) -> Any:
        """A writable buffer over the region that keeps it mapped while referenced."""
        array = (ctypes.c_char * self.nbytes).from_address(self.address)
        array._region = self  # type: ignore[attr-defined]
        return array

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                _libc.munmap(self.address, self.size)

    def __del__(self) -> None:
        self.close()
