"""LocalBlobStore: the conformance suite (O_DIRECT auto and off) plus O_DIRECT details.

The mount tests need root (``mount -t tmpfs``/``ramfs``) and skip with the reason
otherwise. Since Linux 6.6 tmpfs accepts O_DIRECT, so the buffered fall-back is
exercised on ramfs, which refuses it on every kernel; tmpfs (it has a size limit)
covers the full-device case.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import gc
import mmap
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from isolane.errors import CapacityError, StorageError
from isolane.storage.aligned import ALIGN, AlignedBuffer, buffer_address
from isolane.storage.local import LocalBlobStore
from tests.storage.conformance import BlobStoreConformance, MiB, pattern
from tests.support.page_cache import evict


class TestLocalStoreAuto(BlobStoreConformance):
    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[LocalBlobStore]:
        store = LocalBlobStore(tmp_path / "store", direct_io="auto")
        yield store
        store.close()


class TestLocalStoreBuffered(BlobStoreConformance):
    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[LocalBlobStore]:
        store = LocalBlobStore(tmp_path / "store", direct_io="off")
        yield store
        store.close()


# -- O_DIRECT ----------------------------------------------------------------------------
def accepts_o_direct(folder: Path) -> bool:
    probe = folder / ".o_direct_probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise
    try:
        with contextlib.closing(mmap.mmap(-1, ALIGN)) as page:
            os.write(fd, page)
        return True
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise
    finally:
        os.close(fd)
        probe.unlink()


Filled = Callable[[int, int, int], tuple[memoryview, bytes]]


@pytest.fixture
def filled() -> Iterator[Filled]:
    """``filled(capacity, length, seed)`` -> (aligned view, the ``length`` bytes in it).

    Buffers are closed at teardown, after the test's exceptions (whose tracebacks hold
    slices of the buffer) are gone.
    """
    buffers: list[AlignedBuffer] = []

    def make(capacity: int, length: int, seed: int) -> tuple[memoryview, bytes]:
        buf = AlignedBuffer(capacity)
        buffers.append(buf)
        data = pattern(length, seed=seed)
        buf.view[:length] = data
        return buf.view, data

    yield make
    gc.collect()
    for buf in buffers:
        buf.close()


@pytest.mark.parametrize("length", [1, 4095, 4097, 10_000, 3 * ALIGN, 1 * MiB + 123])
def test_direct_write_of_unaligned_length_is_exact(
    tmp_path: Path, filled: Filled, length: int
) -> None:
    store = LocalBlobStore(tmp_path / "store", direct_io="auto")
    view, data = filled(length + ALIGN, length, length)
    store.write("blob", view, length=length)
    assert store.size("blob") == length
    assert os.stat(store.path("blob")).st_size == length
    assert store.read("blob") == data
    if accepts_o_direct(store.root):
        assert store.direct_io == "auto"  # the write went through O_DIRECT, no fall-back


def test_unaligned_buffer_takes_the_buffered_path(tmp_path: Path) -> None:
    """``on`` refuses filesystems, not buffers: a plain bytearray is written buffered."""
    store = LocalBlobStore(tmp_path / "store", direct_io="on")
    data = pattern(5000, seed=1)
    store.write("blob", memoryview(bytearray(data)))
    assert store.read("blob") == data


def _resident_pages(path: Path) -> int:
    """Pages of the file in the page cache (mincore of a read-only mapping)."""
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    vec = (ctypes.c_ubyte * pages)()
    with open(path, "rb") as f, contextlib.closing(
            mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)) as mapped:
        view = memoryview(mapped)
        try:
            if libc.mincore(buffer_address(view), size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
        finally:
            view.release()
    return sum(v & 1 for v in vec)


@pytest.mark.parametrize("length", [4096, 3 * MiB + 1234])
def test_read_into_any_buffer_and_offset_gets_the_exact_bytes(
    tmp_path: Path, filled: Filled, length: int
) -> None:
    """Aligned buffers take O_DIRECT for the bulk and a buffered read for the tail;
    misaligned buffers or offsets read buffered; all give the same bytes."""
    store = LocalBlobStore(tmp_path / "store", direct_io="auto")
    data = pattern(length, seed=7)
    store.write("blob", data)
    out, _ = filled(length + 2 * ALIGN, 0, 0)
    for shift, offset in [(0, 0), (512, 0), (64, 0), (0, 512), (0, 100), (4096, 1536)]:
        want = length - offset
        view = out[shift:shift + want]
        store.read_into("blob", view, offset)
        assert bytes(view) == data[offset:], (shift, offset)
    with pytest.raises(EOFError, match="the file ends after"):
        store.read_into("blob", out[:length + 512])
    with pytest.raises(FileNotFoundError):
        store.read_into("missing", out[:4096])


def test_aligned_read_into_bypasses_the_page_cache(tmp_path: Path, filled: Filled) -> None:
    store = LocalBlobStore(tmp_path / "store", direct_io="auto")
    if not accepts_o_direct(store.root):
        pytest.skip(f"{store.root} refuses O_DIRECT")
    length = 4 * MiB + 100
    store.write("blob", pattern(length, seed=3))
    path = store.path("blob")
    evict(path)
    assert _resident_pages(path) == 0
    out, _ = filled(length + ALIGN, 0, 0)
    store.read_into("blob", out[:length])
    assert bytes(out[:length]) == pattern(length, seed=3)
    # only the last partial block came through the page cache (and its readahead)
    assert _resident_pages(path) < 64
    assert store.direct_read_align == 512


def test_read_into_on_a_filesystem_without_o_direct(ramfs: Path, filled: Filled) -> None:
    store = LocalBlobStore(ramfs / "store", direct_io="auto")
    data = pattern(2 * MiB + 7, seed=5)
    store.write("blob", data)
    out, _ = filled(len(data) + ALIGN, 0, 0)
    store.read_into("blob", out[:len(data)])
    assert bytes(out[:len(data)]) == data
    assert store.direct_read_align is None  # refused once, buffered from then on


# -- mounted filesystems -----------------------------------------------------------------
@contextlib.contextmanager
def mounted(fstype: str, folder: Path, size: str = "8m") -> Iterator[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        ["mount", "-t", fstype, "-o", f"size={size}", fstype, str(folder)],
        capture_output=True, text=True, check=False)
    if result.returncode != 0:
        pytest.skip(f"cannot mount {fstype} at {folder} (needs root / CAP_SYS_ADMIN): "
                    f"{result.stderr.strip() or result.returncode}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


@pytest.fixture
def ramfs(tmp_path: Path) -> Iterator[Path]:
    with mounted("ramfs", tmp_path / "ramfs") as folder:
        yield folder


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    with mounted("tmpfs", tmp_path / "tmpfs", size="8m") as folder:
        yield folder


def test_auto_falls_back_to_buffered_without_o_direct(ramfs: Path, filled: Filled) -> None:
    assert not accepts_o_direct(ramfs)
    store = LocalBlobStore(ramfs / "store", direct_io="auto")
    view, data = filled(3 * ALIGN, 10_000, 2)
    store.write("a", view, length=10_000)
    store.write("b", view, length=10_000)  # already buffered: no retry of O_DIRECT
    assert store.direct_io == "off"
    assert store.read("a") == data
    assert store.read("b") == data


def test_direct_io_on_refuses_a_filesystem_without_o_direct(
    ramfs: Path, filled: Filled
) -> None:
    store = LocalBlobStore(ramfs / "store", direct_io="on")
    view, _ = filled(2 * ALIGN, 2 * ALIGN, 3)
    with pytest.raises(StorageError, match="O_DIRECT"):
        store.write("a", view)


def test_tmpfs_auto_writes_exact_bytes(tmpfs: Path, filled: Filled) -> None:
    """tmpfs takes O_DIRECT from Linux 6.6 on and refuses it before; both must work."""
    store = LocalBlobStore(tmpfs / "store", direct_io="auto")
    view, data = filled(3 * ALIGN, 9999, 4)
    store.write("a", view, length=9999)
    assert store.read("a") == data
    assert store.direct_io == ("auto" if accepts_o_direct(tmpfs) else "off")


@pytest.mark.parametrize("direct_io", ["auto", "off"])
def test_full_device_raises_capacity_error(
    tmpfs: Path, filled: Filled, direct_io: str
) -> None:
    store = LocalBlobStore(tmpfs / "store", direct_io=direct_io)
    view, _ = filled(3 * MiB, 3 * MiB, 5)
    with pytest.raises(CapacityError) as info:
        for i in range(4):  # 12 MiB into 8 MiB
            store.write(f"chunk{i}", view)
    assert info.value.errno == errno.ENOSPC
    assert str(tmpfs / "store") in str(info.value)


def _dirty_pages(path: Path) -> int:
    """Pages of ``path`` written but not yet on the device (``cachestat(2)``)."""
    class Range(ctypes.Structure):
        _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]

    class Stat(ctypes.Structure):
        _fields_ = [(n, ctypes.c_uint64) for n in ("nr_cache", "nr_dirty", "nr_writeback",
                                                     "nr_evicted", "nr_recently_evicted")]

    libc = ctypes.CDLL(None, use_errno=True)
    span, stat = Range(0, 0), Stat()  # len 0: to the end of the file
    fd = os.open(path, os.O_RDONLY)
    try:
        assert libc.syscall(451, fd, ctypes.byref(span), ctypes.byref(stat), 0) == 0, \
            os.strerror(ctypes.get_errno())
    finally:
        os.close(fd)
    return int(stat.nr_dirty + stat.nr_writeback)


def test_sync_all_makes_what_another_writer_left_unsynced_durable(tmp_path: Path) -> None:
    """One ``syncfs`` covers files this store did not write itself (another process's,
    here another store object on the same folder), without naming them."""
    writer = LocalBlobStore(tmp_path / "store", direct_io="off")
    writer.write("gen/rank-1/c.0", pattern(1 * MiB, seed=9), durable=False)
    path = tmp_path / "store" / "gen" / "rank-1" / "c.0"
    assert _dirty_pages(path) > 0
    committer = LocalBlobStore(tmp_path / "store")
    committer.sync_all()
    assert _dirty_pages(path) == 0
    assert committer.read("gen/rank-1/c.0") == pattern(1 * MiB, seed=9)
