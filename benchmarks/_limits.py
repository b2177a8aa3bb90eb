"""What the disk and the memory can do, measured with the simplest code that does it.

The checkpoint benchmark compares isolane's save with the fastest of several simple
writers of the same number of bytes, and its restores with plain reads of the very
chunk files it restores from, all in the same run, interleaved round by round:

- ``simple_writers``: ``pwrite`` loops of 8, 32 and 64 MiB O_DIRECT requests from one
  page-aligned buffer into one new file, from 1 and from 4 threads (thread k writes
  blocks k, k+4, ...), timed from ``open`` to the end of the final ``fsync``;
- ``read_files``: the files read back with 4 threads, O_DIRECT or buffered, into
  memory already touched (the cold sequential read limit) or into fresh memory (what a
  restore into new tensors also pays: a page fault per page);
- ``profile_*``: the pieces of a save and a restore alone (one O_DIRECT file per chunk
  and its fsync, staging copies, hashing, faulting fresh memory), so that the report
  can say where the seconds go.

Linux only (O_DIRECT, ``MADV_POPULATE_WRITE``). Buffers are filled with random bytes.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MiB = 1 << 20
# After a big scratch file is deleted, the disk (ext4 mounted with ``discard`` on these
# VMs) is still trimming its blocks for a while after ``sync`` returned: a 1.6 GB save
# right after such a delete took 1.17 s against 1.06 s once the disk had settled
# (median of 4, same run). Every timed write starts after ``settle()``.
SETTLE_S = 0.5
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MADV_POPULATE_WRITE = 23


@dataclass(frozen=True)
class SimpleWriter:
    key: str
    label: str
    block_bytes: int
    threads: int

    def write(self, path: Path, nbytes: int, source: memoryview) -> float:
        """Write ``nbytes`` (rounded up to whole blocks) into a new file; seconds until
        the final fsync returned."""
        blocks = -(-nbytes // self.block_bytes)
        start = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
        try:
            def run(first: int) -> None:
                for b in range(first, blocks, self.threads):
                    done = 0
                    while done < self.block_bytes:
                        done += os.pwrite(fd, source[done:self.block_bytes],
                                          b * self.block_bytes + done)

            with ThreadPoolExecutor(self.threads) as pool:
                list(pool.map(run, range(self.threads)))
            os.fsync(fd)
        finally:
            os.close(fd)
        return time.perf_counter() - start


def settle() -> None:
    """``sync``, then give the disk ``SETTLE_S`` to finish trimming deleted files."""
    os.sync()
    time.sleep(SETTLE_S)


def simple_writers() -> list[SimpleWriter]:
    return [SimpleWriter(f"pwrite-{mib}m-{threads}t",
                         f"pwrite loop, {mib} MiB O_DIRECT, {threads} thread(s)", mib * MiB,
                         threads)
            for threads in (1, 4) for mib in (8, 32, 64)]


def random_buffer(nbytes: int) -> mmap.mmap:
    """A page-aligned buffer of random bytes (touched; huge pages, as isolane's staging:
    the simple writers write from the best memory there is)."""
    buf = fresh_memory(nbytes, huge=True)
    rng = np.random.default_rng(13)
    np.frombuffer(buf, dtype=np.uint8)[:] = rng.integers(0, 256, nbytes, dtype=np.uint8)
    return buf


def fresh_memory(nbytes: int, *, huge: bool = False) -> mmap.mmap:
    """Private anonymous memory, not touched. ``huge``: advised MADV_HUGEPAGE, where an
    O_DIRECT request leaves whole (4 MiB here) instead of in ~1 MiB pieces of 4 KiB
    pages (isolane.storage.aligned). Python's default mmap.mmap(-1, n) is shared
    (shmem), which takes no huge pages."""
    buf = mmap.mmap(-1, max(nbytes, mmap.PAGESIZE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge:
        buf.madvise(mmap.MADV_HUGEPAGE)
    return buf


def warm_memory(nbytes: int, *, huge: bool = False) -> mmap.mmap:
    buf = fresh_memory(nbytes, huge=huge)
    populate(buf)
    return buf


def populate(buf: mmap.mmap) -> None:
    """Fault every page of ``buf`` in (``MADV_POPULATE_WRITE``; a write per page when
    the kernel lacks it)."""
    address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    if _libc.madvise(address, len(buf), _MADV_POPULATE_WRITE) != 0:
        np.frombuffer(buf, dtype=np.uint8)[::mmap.PAGESIZE] = 0


def _aligned(n: int, align: int = 4096) -> int:
    return -(-n // align) * align


def read_files(files: Sequence[Path], buf: mmap.mmap, *, direct: bool, threads: int = 4
               ) -> int:
    """Read every file whole into consecutive page-aligned slots of ``buf``; bytes read."""
    view = memoryview(buf)
    slots = _slots(files, buf)

    def one(slot: tuple[Path, int, int]) -> int:
        path, at, size = slot
        return _read_whole(path, view[at:at + _aligned(size)], size, direct=direct)

    with ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(one, slots))


def files_bytes(files: Sequence[Path]) -> int:
    """Room ``read_files`` needs for ``files``."""
    return sum(_aligned(p.stat().st_size) for p in files)


def chunk_files(folder: Path) -> list[Path]:
    """The chunk files of a snapshot folder (``c.*`` below it), largest first."""
    found = [Path(d, f) for d, _dirs, names in os.walk(folder) for f in names
             if f == "c" or f.startswith("c.")]
    return sorted(found, key=lambda p: -p.stat().st_size)


def write_files(folder: Path, sizes: Sequence[int], source: memoryview, *,
                fsync_each: bool, threads: int = 4) -> float:
    """One new O_DIRECT file per size (as a save's chunk files), ``threads`` at a time;
    each fsynced right after its write, or all of them after the last write. Seconds,
    folder fsync included."""
    folder.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    def one(item: tuple[int, int]) -> int:
        i, size = item
        fd = os.open(folder / f"c.{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT,
                     0o600)
        try:
            padded, done = _aligned(size), 0
            while done < padded:
                done += os.pwrite(fd, source[done:padded], done)
            if padded != size:
                os.ftruncate(fd, size)
            if fsync_each:
                os.fsync(fd)
                return -1
            return os.dup(fd)
        finally:
            os.close(fd)

    with ThreadPoolExecutor(threads) as pool:
        open_fds = [fd for fd in pool.map(one, enumerate(sizes)) if fd >= 0]
    for fd in open_fds:
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    dfd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return time.perf_counter() - start


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _slots(files: Sequence[Path], buf: mmap.mmap) -> list[tuple[Path, int, int]]:
    slots, offset = [], 0
    for path in files:
        size = path.stat().st_size
        slots.append((path, offset, size))
        offset += _aligned(size)
    if offset > len(buf):
        raise ValueError(f"buffer of {len(buf)} bytes cannot hold {offset}")
    return slots


def _read_whole(path: Path, view: memoryview, size: int, *, direct: bool) -> int:
    """Read the ``size`` bytes of ``path`` into ``view`` (O_DIRECT: whole 512-byte
    sectors, so ``view`` is aligned and rounded up); bytes read."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    try:
        want, done = _aligned(size, 512) if direct else size, 0
        while done < size:
            n = os.preadv(fd, [view[done:want]], done)
            if n == 0:
                break
            done += n
        return done
    finally:
        os.close(fd)


def read_files_prefaulted(files: Sequence[Path], buf: mmap.mmap, *, threads: int = 4,
                          faulters: int = 1) -> float:
    """What a restore into new memory does, in the simplest code: ``buf`` is fresh
    (never touched); ``faulters`` threads fault the slots in, in read order (thread k
    slots k, k + faulters, ...; ``MADV_POPULATE_WRITE``), while ``threads`` readers
    read each file O_DIRECT into its slot and hash it (xxh3-128). Seconds."""
    import threading

    import xxhash

    slots = _slots(files, buf)
    view = memoryview(buf)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))

    def fault(first: int) -> None:
        for _path, at, size in slots[first::faulters]:
            _libc.madvise(base + at, _aligned(size), _MADV_POPULATE_WRITE)

    def one(slot: tuple[Path, int, int]) -> None:
        path, at, size = slot
        part = view[at:at + _aligned(size)]
        _read_whole(path, part, size, direct=True)
        xxhash.xxh3_128(part[:size]).digest()

    start = time.perf_counter()
    workers = [threading.Thread(target=fault, args=(k,)) for k in range(faulters)]
    for w in workers:
        w.start()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, slots))
    for w in workers:
        w.join()
    seconds = time.perf_counter() - start
    view.release()
    return seconds


def read_files_staged(files: Sequence[Path], buf: mmap.mmap, *, threads: int = 4,
                      read_seconds: list[float] | None = None) -> float:
    """What ``load(into=...)`` does for targets O_DIRECT cannot fill, in the simplest
    code: each of ``threads`` readers owns one reused, touched staging buffer; it reads a
    file into it with O_DIRECT, hashes it (xxh3-128) and copies it (``memmove``) 64 bytes
    past the file's slot in ``buf`` (touched, like a torch tensor: misaligned for
    O_DIRECT). Seconds, the staging buffers' first touch excluded; ``read_seconds`` gets
    the seconds each read took (the reads' thread-seconds)."""
    import threading

    import xxhash

    slots = _slots(files, buf)
    largest = max((size for _p, _a, size in slots), default=0)
    view = memoryview(buf)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    local = threading.local()
    stagings = [warm_memory(_aligned(largest) + 4096, huge=True) for _ in range(threads)]
    free = list(stagings)
    lock = threading.Lock()

    def one(slot: tuple[Path, int, int]) -> None:
        if not hasattr(local, "staging"):
            with lock:
                local.staging = free.pop()
        path, at, size = slot
        stage = memoryview(local.staging)
        try:
            began = time.perf_counter()
            _read_whole(path, stage, size, direct=True)
            if read_seconds is not None:
                read_seconds.append(time.perf_counter() - began)
            xxhash.xxh3_128(stage[:size]).digest()
            dst = base + at + 64 if at + 64 + size <= len(buf) else base + at
            ctypes.memmove(dst, ctypes.addressof(ctypes.c_char.from_buffer(local.staging)),
                           size)
        finally:
            stage.release()

    try:
        start = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, slots))
        return time.perf_counter() - start
    finally:
        view.release()
        for s in stagings:
            s.close()


def minor_faults() -> int:
    """Minor page faults of this process so far (``getrusage``)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def populate_threads(buf: mmap.mmap, threads: int) -> None:
    """``populate`` with ``threads`` threads, each faulting one contiguous part."""
    import threading

    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    part = _aligned(-(-len(buf) // threads))

    def run(i: int) -> None:
        start = i * part
        if start < len(buf):
            _libc.madvise(base + start, min(part, len(buf) - start), _MADV_POPULATE_WRITE)

    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
