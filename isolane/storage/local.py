"""Local-folder blob store: O_DIRECT writes from aligned buffers, fsync discipline.

``direct_io``: ``on`` refuses a filesystem without O_DIRECT, ``off`` never uses it,
``auto`` tries it and falls back to buffered write + fsync (tmpfs, some overlay
filesystems) for the rest of the store's life.

Reads into a caller's buffer (``read_into``) go around the page cache too when the
buffer starts on a ``DIRECT_READ_ALIGN`` boundary: the aligned bulk with O_DIRECT (no
page cache pages to allocate, fill and copy from, the device writes into the buffer),
the last partial block buffered. A filesystem that refuses O_DIRECT reads gets
buffered reads from then on, whatever ``direct_io`` says (reads never fail for it).
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import fcntl
import logging
import os
import shutil
import stat
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from isolane.errors import CapacityError, StorageError
from isolane.storage import pacing
from isolane.storage.aligned import ALIGN, align_up, buffer_address, is_aligned
from isolane.storage.base import BlobStore, Buffer, ByteRange, check_key
from isolane.storage.files import atomic_write, fsync_path, remove_tree, sync_filesystem

log = logging.getLogger(__name__)
_FULL = {errno.ENOSPC, errno.EDQUOT}
_O_DIRECT = getattr(os, "O_DIRECT", 0)
# Memory address, file offset and length alignment of an O_DIRECT read: the logical
# block size (statx dio_mem_align / dio_offset_align report 512 on ext4 and xfs on
# NVMe and virtio disks; an EINVAL falls back to buffered reads).
DIRECT_READ_ALIGN = 512
SYNC_THREADS = 8


class LocalBlobStore(BlobStore):
    """Blobs as files under ``root``.

    Symbolic links are never followed by the walking and deleting methods
    (``children``, ``list``, ``delete``, ``delete_prefix``): a link found inside the
    store is logged as a warning and skipped (or, when it is the very thing deleted,
    removed as a link with its target untouched), so that nothing outside the store
    can be listed as a snapshot or deleted through it.
    """

    is_local = True

    def __init__(self, root: str | os.PathLike[str], *, direct_io: str = "auto") -> None:
        self.root = Path(root).resolve()
        self.url = str(self.root)
        self.direct_io = direct_io if _O_DIRECT else "off"
        self._direct_reads = self.direct_io != "off"
        self._made_dirs: set[Path] = set()
        self._lock = threading.Lock()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"cannot create store folder {self.root}: {exc.strerror}; "
                               "check the path and its permissions") from None

    # -- paths ---------------------------------------------------------------------------
    def path(self, key: str) -> Path:
        return self.root / check_key(key)

    def local_path(self, key: str) -> str | None:
        return str(self.path(key))

    def _linked_part(self, key: str, *, include_last: bool) -> Path | None:
        """The first symbolic link among the key's folders (and the key itself when
        ``include_last``), or None. lstat of each part: nothing is followed."""
        parts = check_key(key).split("/") if key else []
        current = self.root
        for i, part in enumerate(parts):
            current = current / part
            if i == len(parts) - 1 and not include_last:
                break
            try:
                if stat.S_ISLNK(os.lstat(current).st_mode):
                    return current
            except FileNotFoundError:
                return None
        return None

    def _skip_link(self, link: Path, what: str) -> None:
        log.warning("symbolic link %s found inside the store %s: not followed while %s; "
                    "remove it or replace it with the real folder", link, self.root, what)

    def _parent_dir(self, path: Path) -> None:
        parent = path.parent
        if parent not in self._made_dirs:
            parent.mkdir(parents=True, exist_ok=True)
            with self._lock:
                self._made_dirs.add(parent)

    def _translate(self, exc: OSError, key: str) -> OSError:
        if exc.errno in _FULL:
            return CapacityError(
                exc.errno, f"device {self.root} is full while writing {key}; free space "
                "or run 'isolane gc' to drop old snapshots")
        return exc

    # -- reads ---------------------------------------------------------------------------
    def read(self, key: str, byte_range: ByteRange | None = None) -> bytes:
        path = self.path(key)
        with open(path, "rb", buffering=0) as f:
            if byte_range is None:
                return f.read()
            f.seek(byte_range.start)
            return f.read(byte_range.length)

    @property
    def direct_read_align(self) -> int | None:
        return DIRECT_READ_ALIGN if self._direct_reads else None

    def read_into(self, key: str, out: memoryview, offset: int = 0) -> None:
        path = self.path(key)
        total = len(out)
        done = 0
        if (self._direct_reads and total >= DIRECT_READ_ALIGN
                and offset % DIRECT_READ_ALIGN == 0
                and buffer_address(out) % DIRECT_READ_ALIGN == 0):
            done = self._read_direct(path, out[:total - total % DIRECT_READ_ALIGN], offset)
        if done < total:
            fd = os.open(path, os.O_RDONLY)
            try:
                _pread_full(fd, out[done:], offset + done, f"{self.root}/{key}", done)
            finally:
                os.close(fd)

    def _read_direct(self, path: Path, out: memoryview, offset: int) -> int:
        """O_DIRECT read of the aligned ``out``; bytes read (0 when refused, fewer
        at the end of the file: the buffered tail read then reports it)."""
        try:
            fd = os.open(path, os.O_RDONLY | _O_DIRECT)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self._direct_reads = False
            return 0
        try:
            done = 0
            while done < len(out):
                try:
                    n = os.preadv(fd, [out[done:]], offset + done)
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    self._direct_reads = False
                    return done
                if n == 0:
                    break
                done += n
                if done % DIRECT_READ_ALIGN:  # short read at the end of the file
                    return done - done % DIRECT_READ_ALIGN
            return done
        finally:
            os.close(fd)

    def size(self, key: str) -> int:
        path = self.path(key)
        st = path.stat()
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{self.root}/{key} is a folder, not a blob")
        return st.st_size

    def list(self, prefix: str = "") -> builtins.list[str]:
        base = self.path(prefix) if prefix else self.root
        link = self._linked_part(prefix, include_last=True)
        if link is not None:
            self._skip_link(link, "listing")
            return []
        if not base.is_dir():
            return [prefix] if base.is_file() else []
        keys: builtins.list[str] = []
        for dirpath, dirs, files in os.walk(base, followlinks=False):
            rel = os.path.relpath(dirpath, self.root)
            for name in (*dirs, *files):
                if os.path.islink(os.path.join(dirpath, name)):
                    self._skip_link(Path(dirpath) / name, "listing")
            keys.extend(name if rel == "." else f"{rel}/{name}" for name in files
                        if not os.path.islink(os.path.join(dirpath, name)))
        return sorted(keys)

    def children(self, prefix: str = "") -> builtins.list[str]:
        base = self.path(prefix) if prefix else self.root
        link = self._linked_part(prefix, include_last=True)
        if link is not None:
            self._skip_link(link, "listing")
            return []
        try:
            entries = list(os.scandir(base))
        except (FileNotFoundError, NotADirectoryError):
            return []
        names = []
        for entry in entries:
            if entry.is_symlink():
                self._skip_link(Path(entry.path), "listing")
            else:
                names.append(entry.name)
        return sorted(names)

    def free_bytes(self) -> int | None:
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize

    # -- writes --------------------------------------------------------------------------
    def write(
        self, key: str, data: Buffer, *, length: int | None = None, durable: bool = True
    ) -> None:
        view = memoryview(data).cast("B")
        length = len(view) if length is None else length
        path = self.path(key)
        try:
            self._parent_dir(path)
            padded = align_up(length, ALIGN)
            # A new inode every time: the old path may be a hard link that another
            # snapshot still owns (incremental saves link chunks), never truncate it.
            path.unlink(missing_ok=True)
            direct = (self.direct_io != "off" and length > 0 and len(view) >= padded
                      and is_aligned(view))
            if direct and self._write_direct(path, view[:padded], length, durable=durable):
                return
            self._write_buffered(path, view[:length], durable=durable)
        except OSError as exc:
            raise self._translate(exc, key) from exc

    def _write_direct(self, path: Path, view: memoryview, length: int, *,
                      durable: bool = True) -> bool:
        """O_DIRECT write of an aligned buffer; False when the filesystem refuses it.
        Not ``durable``: the bytes are on the device but the file's size and extents
        wait for a later fsync (``sync(files=...)``)."""
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_DIRECT, 0o644)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                return self._refuse_direct(path)
            raise
        try:
            done = 0
            step = pacing.slice_bytes() or len(view)
            while done < len(view):
                try:
                    piece = view[done:done + step]
                    pacing.pace(len(piece))
                    done += os.write(fd, piece)
                except OSError as exc:
                    if exc.errno == errno.EINVAL and done == 0:
                        return self._refuse_direct(path)
                    raise
            if length != len(view):
                os.ftruncate(fd, length)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        return True

    def _refuse_direct(self, path: Path) -> bool:
        if self.direct_io == "on":
            raise StorageError(f"{self.root} does not support O_DIRECT; set direct_io: auto "
                               "or off for this device group")
        self.direct_io = "off"
        return False

    def _write_buffered(self, path: Path, view: memoryview, *, durable: bool = True) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            done = 0
            while done < len(view):
                done += os.write(fd, view[done:])
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)

    def write_atomic(self, key: str, data: Buffer) -> None:
        path = self.path(key)
        try:
            self._parent_dir(path)
            atomic_write(path, data)
        except OSError as exc:
            raise self._translate(exc, key) from exc

    def copy(self, src: str, dst: str) -> None:
        src_path, dst_path = self.path(src), self.path(dst)
        try:
            self._parent_dir(dst_path)
            dst_path.unlink(missing_ok=True)
            try:
                os.link(src_path, dst_path)
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
                    raise
                shutil.copyfile(src_path, dst_path)
                with open(dst_path, "rb+") as f:
                    os.fsync(f.fileno())
        except OSError as exc:
            raise self._translate(exc, dst) from exc

    def delete(self, key: str) -> None:
        """Unlink one blob (a link is unlinked, never its target); a key reached
        through a linked folder is reported and left alone."""
        path = self.path(key)
        link = self._linked_part(key, include_last=False)
        if link is not None:
            self._skip_link(link, f"deleting {key}")
            return
        try:
            path.unlink(missing_ok=True)
        except IsADirectoryError:
            raise StorageError(f"{path} is a folder, not a blob; delete_prefix removes "
                               "folders") from None

    def delete_prefix(self, prefix: str) -> None:
        """Remove the folder (or blob) ``prefix`` strictly inside the root, never
        following a link (``isolane.storage.files.remove_tree``)."""
        path = self.path(prefix)
        link = self._linked_part(prefix, include_last=False)
        if link is not None:
            self._skip_link(link, f"deleting {prefix}")
            return
        remove_tree(path, within=self.root,
                    on_link=lambda found: self._skip_link(found, f"deleting {prefix}"))
        with self._lock:
            self._made_dirs = {d for d in self._made_dirs if not d.is_relative_to(path)}

    @contextlib.contextmanager
    def lock(self, key: str) -> Iterator[None]:
        """``flock`` on the file ``key`` (created 0600, never deleted: removing a lock
        file lets two holders in at once)."""
        path = self.path(key)
        link = self._linked_part(key, include_last=True)
        if link is not None:
            raise StorageError(f"lock file {path} is reached through the symbolic link "
                               f"{link}; remove the link")
        try:
            self._parent_dir(path)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise self._translate(exc, key) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def folders_to_sync(self, prefixes: Iterable[str]) -> builtins.list[Path]:
        """Each folder of ``prefixes`` and its ancestors up to the root, each once,
        deepest first (the order ``sync`` makes them durable in)."""
        todo: set[Path] = set()
        for prefix in prefixes:
            path = self.path(prefix)
            while True:
                todo.add(path)
                if path == self.root:
                    break
                path = path.parent
        return sorted(todo, key=lambda p: -len(p.parts))

    def sync(self, prefixes: Iterable[str], files: Iterable[str] = ()) -> None:
        """fsync ``files``, then each folder and its ancestors up to the root, each once.

        The fsyncs run ``SYNC_THREADS`` at a time: the filesystem's journal commits
        those that arrive together at once, where one after the other each waits for a
        commit (and a device cache flush) of its own."""
        paths = [self.path(key) for key in files]
        folders = [p for p in self.folders_to_sync(prefixes) if p.is_dir()]
        if len(paths) + len(folders) <= 1:
            for path in [*paths, *folders]:
                fsync_path(path)
            return
        with ThreadPoolExecutor(SYNC_THREADS, thread_name_prefix="isolane-fsync") as pool:
            list(pool.map(fsync_path, [*paths, *folders]))

    def sync_all(self) -> None:
        """One ``syncfs`` of the root's file system: every file and folder written on
        it, by any process of this host."""
        try:
            sync_filesystem(self.root)
        except OSError as exc:
            raise self._translate(exc, "the files it syncs") from exc


def _pread_full(fd: int, out: memoryview, offset: int, what: str, before: int) -> None:
    done, total = 0, len(out)
    while done < total:
        n = os.preadv(fd, [out[done:]], offset + done)
        if n == 0:
            raise EOFError(f"{what}: expected {before + total} bytes at offset "
                           f"{offset - before}, the file ends after {before + done}")
        done += n

