"""isolane's own file operations, recorded once and replayed by the simplest code.

The checkpoint targets compare isolane with a limit measured on one file written or
read in one go, while isolane writes and reads its own chunk files (one per chunk, a
folder per tensor). To tell what of the gap is isolane's code and what is those files,
the benchmark records what a save and an ``into=`` load ask of the local store and
replays exactly that with plain loops, interleaved with isolane in the same rounds:

- ``record_save``: while active, the save's O_DIRECT chunk writes (path under the
  snapshot folder, bytes written, file length, in the order they started), its small
  buffered files (marker, zarr metadata), the files and folders its step 4 fsyncs, and
  its manifest; ``replay_save`` creates the same files under another root with the same
  request sizes from 4 threads in the same order (from one warm aligned buffer: no
  copy, no hash), fsyncs the same files and folders from 8 threads, writes the manifest
  atomically;
- ``record_reads``: the load's reads (path, request size, offset, in start order;
  ``read_into`` chunks and whole-file ``read`` packs); ``replay_reads`` reads the same
  files in the same order with the same request sizes from 4 threads: the bulk with
  O_DIRECT into a reused warm buffer per thread, the tail buffered, xxh3-128, then
  ``memmove`` into touched, misaligned target memory (what ``into=`` does for torch's
  64-byte aligned tensors);
- ``DiskStats``: ``/proc/diskstats`` of the device under a folder, before and after a
  timed piece: requests, their average size, how busy the device was and how many
  requests it held on average (the device's own view, same for every piece).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _limits as LIM

SECTOR = 512
ALIGN = 4096


# -- what the device saw -------------------------------------------------------------------
def _device_name(folder: Path) -> str | None:
    st = os.stat(folder)
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    try:
        with open(f"/sys/dev/block/{major}:{minor}/uevent") as f:
            for line in f:
                if line.startswith("DEVNAME="):
                    return line.split("=", 1)[1].strip()
    except OSError:
        return None
    return None


@dataclass
class DiskCounters:
    ios: int = 0
    sectors: int = 0
    busy_ms: int = 0
    queue_ms: int = 0  # weighted: ms x requests in flight


@dataclass
class DiskStats:
    """Counters of one device (``/proc/diskstats``); reads or writes."""

    device: str | None
    writes: bool

    @classmethod
    def of(cls, folder: Path, *, writes: bool) -> DiskStats:
        return cls(_device_name(folder), writes)

    def read(self) -> DiskCounters | None:
        if self.device is None:
            return None
        with open("/proc/diskstats") as f:
            for line in f:
                p = line.split()
                if p[2] == self.device:
                    ios, sectors = (int(p[7]), int(p[9])) if self.writes else (int(p[3]),
                                                                              int(p[5]))
                    return DiskCounters(ios, sectors, int(p[12]), int(p[13]))
        return None

    @contextlib.contextmanager
    def span(self, out: dict[str, float]) -> Iterator[None]:
        """Fill ``out`` with what the device did inside the block: ``requests``,
        ``request_kib`` (average), ``busy`` (share of the wall clock with a request in
        flight) and ``depth`` (requests in flight on average)."""
        before, start = self.read(), time.perf_counter()
        try:
            yield
        finally:
            after, wall = self.read(), time.perf_counter() - start
            if before is not None and after is not None and wall > 0:
                ios = after.ios - before.ios
                out["requests"] = ios
                out["request_kib"] = (after.sectors - before.sectors) * SECTOR / 1024 / max(
                    ios, 1)
                out["busy"] = (after.busy_ms - before.busy_ms) / 1000 / wall
                out["depth"] = (after.queue_ms - before.queue_ms) / 1000 / wall


# -- recording -----------------------------------------------------------------------------
@dataclass
class SaveOps:
    """A save's file operations, paths relative to the store's root, in start order."""

    small: list[tuple[str, int]] = field(default_factory=list)  # buffered: path, bytes
    chunks: list[tuple[str, int, int]] = field(default_factory=list)  # path, written, length
    synced: list[str] = field(default_factory=list)  # what step 4 fsyncs, files first
    atomic: list[tuple[str, int, bool]] = field(default_factory=list)  # path, bytes, last?

    @property
    def nbytes(self) -> int:
        return sum(length for _p, _w, length in self.chunks)


@contextlib.contextmanager
def record_save(store: Any, name: str, ops: SaveOps) -> Iterator[None]:
    """Record the local store's writes under ``snapshots/<name>/`` inside the block into
    ``ops`` (and every file and folder its ``sync`` fsyncs, ancestors included)."""
    from isolane.storage.local import LocalBlobStore

    lock = threading.Lock()
    root = Path(store.stores[0].url)
    mine = root / "snapshots" / name
    direct, buffered = LocalBlobStore._write_direct, LocalBlobStore._write_buffered
    sync, atomic = LocalBlobStore.sync, LocalBlobStore.write_atomic

    def rel(path: Path) -> str | None:
        path = Path(path)
        return str(path.relative_to(root)) if path.is_relative_to(mine) else None

    def rec_direct(self: Any, path: Path, view: memoryview, length: int, **kw: Any) -> bool:
        if (r := rel(path)) is not None:
            with lock:
                ops.chunks.append((r, len(view), length))
        return direct(self, path, view, length, **kw)

    def rec_buffered(self: Any, path: Path, view: memoryview, **kw: Any) -> None:
        if (r := rel(path)) is not None:
            with lock:
                ops.small.append((r, len(view)))
        buffered(self, path, view, **kw)

    def rec_sync(self: Any, prefixes: Any, files: Any = ()) -> None:
        prefixes, files = list(prefixes), list(files)
        paths = [self.path(k) for k in files]
        folders = self.folders_to_sync(prefixes)
        if any(rel(p) is not None for p in [*paths, *folders]):
            ops.synced.extend(str(Path(p).relative_to(root)) for p in [*paths, *folders])
        sync(self, prefixes, files)

    def rec_atomic(self: Any, key: str, data: Any) -> None:
        if (r := rel(self.path(key))) is not None:
            with lock:
                ops.atomic.append((r, memoryview(data).nbytes, bool(ops.chunks)))
        atomic(self, key, data)

    patches = [("_write_direct", rec_direct), ("_write_buffered", rec_buffered),
               ("sync", rec_sync), ("write_atomic", rec_atomic)]
    originals = [(attr, getattr(LocalBlobStore, attr)) for attr, _fn in patches]
    for attr, fn in patches:
        setattr(LocalBlobStore, attr, fn)
    try:
        yield
    finally:
        for attr, fn in originals:
            setattr(LocalBlobStore, attr, fn)


@dataclass
class ReadOps:
    """A load's reads in start order, paths relative to the snapshot's generation
    folder (the same in every round's snapshot): (path, bytes, file offset, whole-file
    buffered read?)."""

    reads: list[tuple[str, int, int, bool]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(n for _p, n, _o, _w in self.reads)


@contextlib.contextmanager
def record_reads(store: Any, ops: ReadOps) -> Iterator[None]:
    """Record the local store's reads inside the block into ``ops``."""
    from isolane.storage.local import LocalBlobStore

    lock = threading.Lock()
    read_into, read = LocalBlobStore.read_into, LocalBlobStore.read

    def rec_into(self: Any, key: str, out: memoryview, offset: int = 0) -> None:
        with lock:
            ops.reads.append((_in_generation(key), len(out), offset, False))
        read_into(self, key, out, offset)

    def rec_read(self: Any, key: str, byte_range: Any = None) -> bytes:
        data = read(self, key, byte_range)
        if byte_range is None:
            with lock:
                ops.reads.append((_in_generation(key), len(data), 0, True))
        return data

    LocalBlobStore.read_into, LocalBlobStore.read = rec_into, rec_read  # type: ignore[method-assign]
    try:
        yield
    finally:
        LocalBlobStore.read_into, LocalBlobStore.read = read_into, read  # type: ignore[method-assign]


def _in_generation(key: str) -> str:
    """``snapshots/<name>/<generation>/<rest>`` -> ``<rest>``."""
    return "/".join(key.split("/")[3:])


# -- replaying -----------------------------------------------------------------------------
def replay_save(ops: SaveOps, root: Path, source: memoryview, *, threads: int = 4,
                sync_threads: int = 8) -> float:
    """Create the save's files under ``root`` (a fresh store root) as the save did:
    the atomic marker, the small buffered files, the chunk files (O_DIRECT, same sizes,
    same order, ``threads`` at a time, fsync deferred), step 4's fsyncs
    (``sync_threads`` at a time), the atomic manifest. Seconds. ``source``: a warm,
    page-aligned buffer at least as big as the largest write."""
    from isolane.storage.files import atomic_write, fsync_path

    dirs = {(root / p).parent for p, *_rest in [*ops.small, *ops.chunks, *ops.atomic]}
    start = time.perf_counter()
    for d in sorted(dirs, key=lambda d: len(d.parts)):
        d.mkdir(parents=True, exist_ok=True)
    for rel, nbytes, last in ops.atomic:
        if not last:
            atomic_write(root / rel, bytes(source[:nbytes]))
    for rel, nbytes in ops.small:
        fd = os.open(root / rel, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, bytes(source[:nbytes]))
        finally:
            os.close(fd)

    def one(item: tuple[str, int, int]) -> None:
        rel, written, length = item
        fd = os.open(root / rel, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT,
                     0o644)
        try:
            done = 0
            while done < written:
                done += os.write(fd, source[done:written])
            if length != written:
                os.ftruncate(fd, length)
        finally:
            os.close(fd)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, ops.chunks))
    with ThreadPoolExecutor(sync_threads) as pool:
        list(pool.map(fsync_path, [root / rel for rel in ops.synced]))
    for rel, nbytes, last in ops.atomic:
        if last:
            atomic_write(root / rel, bytes(source[:nbytes]))
    return time.perf_counter() - start


def staging_buffers(ops: ReadOps, threads: int = 4) -> list[Any]:
    """One warm buffer per reader thread for ``replay_reads`` (the caller closes them);
    huge pages, as isolane's staging pool."""
    largest = max((n for _p, n, _o, whole in ops.reads if not whole), default=0)
    return [LIM.warm_memory(_up(largest, ALIGN) + ALIGN, huge=True) for _ in range(threads)]


def replay_reads(ops: ReadOps, folder: Path, target: Any, stagings: list[Any]) -> float:
    """Read what the load read, from ``folder`` (the snapshot's generation folder), into
    the touched buffer ``target`` (``reads_room`` bytes at least), one thread per buffer
    of ``stagings`` (``staging_buffers``); seconds."""
    import xxhash

    threads = len(stagings)
    free = list(stagings)
    local = threading.local()
    lock = threading.Lock()
    base = ctypes.addressof(ctypes.c_char.from_buffer(target))
    slots, at = [], 0
    for item in ops.reads:
        slots.append((item, at))
        at += _up(item[1], ALIGN) + ALIGN

    def one(slot: tuple[tuple[str, int, int, bool], int]) -> None:
        (rel, nbytes, offset, whole), at = slot
        path = folder / rel
        if whole:
            with open(path, "rb", buffering=0) as f:
                data = f.read()
            xxhash.xxh3_128(data).digest()
            ctypes.memmove(base + at + 64, data, len(data))
            return
        if not hasattr(local, "staging"):
            with lock:
                local.staging = free.pop()
        stage = memoryview(local.staging)

        def read_up_to(end: int, done: int, flags: int) -> int:
            """Read ``stage[done:end]`` from ``path`` opened with ``flags``; returns where
            it stopped (``end``, or earlier at the end of the file)."""
            fd = os.open(path, os.O_RDONLY | flags)
            try:
                while done < end:
                    n = os.preadv(fd, [stage[done:end]], offset + done)
                    if n == 0:
                        break
                    done += n
            finally:
                os.close(fd)
            return done

        try:
            bulk = nbytes - nbytes % SECTOR
            done = read_up_to(bulk, 0, os.O_DIRECT) if bulk else 0
            if done < nbytes:  # the unaligned tail (or a short file) through the page cache
                done = read_up_to(nbytes, done, 0)
            xxhash.xxh3_128(stage[:nbytes]).digest()
            ctypes.memmove(base + at + 64,
                           ctypes.addressof(ctypes.c_char.from_buffer(local.staging)), nbytes)
        finally:
            stage.release()

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, slots))
    return time.perf_counter() - start


def reads_room(ops: ReadOps) -> int:
    """Target bytes ``replay_reads`` needs."""
    return sum(_up(n, ALIGN) + ALIGN for _p, n, _o, _w in ops.reads)


def _up(n: int, align: int) -> int:
    return -(-n // align) * align
