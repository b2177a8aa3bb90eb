"""Page-aligned buffers for O_DIRECT I/O.

Anonymous ``mmap`` memory is page aligned. Fresh pages cost a fault per 4 KiB on first
touch (~0.5 GB/s here against ~13 GB/s for warm pages), so buffers are meant to be
allocated once and reused (see ``snapshot.staging.StagingPool``).

The mapping is private (``MAP_PRIVATE``), not Python's default ``MAP_SHARED``: shared
anonymous memory is shmem, which takes no transparent huge pages while
``shmem_enabled`` is 'never' (the default), so ``advise_hugepages`` did nothing for it.
Huge pages matter for O_DIRECT beyond the faults: the block layer builds a request from
physically contiguous segments (``max_segments``, 254 on the virtio disk measured), so a
read into 4 KiB pages reaches the device in pieces of ~0.5-1 MiB, into 2 MiB pages in
pieces of ``max_sectors_kb`` (4 MiB there): 32 MiB O_DIRECT reads ran at 1.3 GB/s into
the former, 2.1 GB/s into the latter (session 9, one stream, same file).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap

import numpy as np

ALIGN = 4096


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def buffer_address(buf: memoryview) -> int:
    """Address of the first byte of ``buf`` (works for read-only buffers too)."""
    if buf.nbytes == 0:
        return 0
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


def copy_bytes(dst: int, src: int, nbytes: int) -> None:
    """``memmove`` of ``nbytes`` between two addresses, without the GIL.

    What staging copies use instead of ``Tensor.copy_``: a single-threaded memcpy
    (non-temporal stores for big blocks) that several Python threads can run at once,
    where ``copy_`` from several threads would start an OpenMP team each and
    oversubscribe the cores."""
    if nbytes > 0:
        ctypes.memmove(dst, src, nbytes)


def zero_bytes(dst: int, nbytes: int) -> None:
    if nbytes > 0:
        ctypes.memset(dst, 0, nbytes)


def is_aligned(buf: memoryview, align: int = ALIGN) -> bool:
    return buffer_address(buf) % align == 0


class AlignedBuffer:
    """A page-aligned, writable buffer of ``capacity`` bytes backed by anonymous mmap."""

    def __init__(self, capacity: int) -> None:
        self.capacity = align_up(max(capacity, ALIGN))
        # Lengths in whole 2 MiB also start on a 2 MiB boundary (Linux >= 6.7 aligns
        # such anonymous mappings), so every one of their pages can be a huge page.
        self._map = mmap.mmap(-1, self.capacity,
                              flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.view = memoryview(self._map)
        self.address = buffer_address(self.view)

    def close(self) -> None:
        """Unmap now, or leave it to the garbage collector while views are exported
        (e.g. held by a traceback): closing must never raise on a cleanup path."""
        try:
            self.view.release()
            self._map.close()
        except BufferError:
            pass


def advise_hugepages(buf: AlignedBuffer) -> None:
    """Ask for transparent huge pages: first touch then costs one fault per 2 MiB, and
    O_DIRECT requests from the buffer reach the device whole (module docstring). With
    THP defrag 'madvise' a fault may compact memory first: meant for the few buffers a
    process keeps and reuses, not for memory handed to callers."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        # THP disabled on this kernel: plain pages still work, only slower to fault.
        with contextlib.suppress(OSError):
            buf._map.madvise(advice)
