"""Two file primitives every module that writes metadata or deletes folders goes through.

* ``atomic_write``: a small file replaced all at once and durably (temp file beside it,
  fsync, rename, fsync of the folder). A crash leaves the old file or the new one.
* ``remove_tree``: a recursive delete that refuses any path not strictly inside the
  folder it is meant for, never follows a symbolic link (a link is removed as a link,
  its target untouched, and reported), and treats a missing path as already removed.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import os
import shutil
import stat
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from isolane.errors import StorageError
from isolane.storage.base import Buffer

log = logging.getLogger(__name__)


def fsync_path(path: str | os.PathLike[str], flags: int = 0) -> None:
    """Make a file's bytes (or a folder's names) durable."""
    fd = os.open(path, os.O_RDONLY | flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_filesystem(path: str | os.PathLike[str]) -> None:
    """Make everything written on the file system that holds ``path`` durable, by any
    process of this host: its data, names and sizes (Linux ``syncfs``: one journal
    commit, where an fsync per file waits for its own; elsewhere ``sync``)."""
    syncfs = _libc_syncfs()
    if syncfs is None:
        os.sync()
        return
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if syncfs(fd) != 0:
            code = ctypes.get_errno()
            raise OSError(code, f"syncfs of {path}: {os.strerror(code)}")
    finally:
        os.close(fd)


@functools.cache
def _libc_syncfs() -> Callable[[int], int] | None:
    try:
        syncfs: Callable[[int], int] = ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):
        return None
    return syncfs


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make the names in a folder durable (after create, rename or unlink)."""
    fsync_path(path, os.O_DIRECTORY)


def atomic_write(path: str | os.PathLike[str],
                 data: str | Buffer | Sequence[Buffer] | Callable[[Path], None], *,
                 mode: int = 0o644, overwrite: bool = True) -> None:
    """Replace ``path`` with ``data`` atomically and durably. The parent folder must
    exist. Raises OSError (the temp file is removed) when the write fails.

    ``data`` is text (UTF-8), any bytes-like object (``BlobStore.write_atomic`` of the
    local store passes its buffer through), or a list or tuple of bytes-like parts
    written one after the other (no join).

    ``data`` may be a function that writes the file named by its argument (the temp
    file beside ``path``, created empty with ``mode``): for files too large to build in
    memory first (``torch.save``, safetensors). With ``overwrite=False`` an existing
    ``path`` is never replaced: FileExistsError (published with ``link``; on a
    filesystem without hard links, checked and then renamed)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:12]}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        try:
            if not callable(data):
                for part in _parts(data):
                    view = memoryview(part).cast("B")
                    while view:
                        view = view[os.write(fd, view):]
                os.fsync(fd)
        finally:
            os.close(fd)
        if callable(data):
            data(tmp)
            fsync_path(tmp)
        if overwrite:
            os.replace(tmp, path)
        else:
            _publish_new(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # gone after a rename; left beside a link
    fsync_dir(path.parent)


def _parts(data: str | Buffer | Sequence[Buffer]) -> Sequence[Buffer]:
    if isinstance(data, str):
        return [data.encode()]
    if isinstance(data, bytes | bytearray | memoryview):
        return [data]
    return data  # a list or tuple of parts


def _publish_new(tmp: Path, path: Path) -> None:
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise
    except OSError:  # no hard links on this filesystem: check, then rename
        if os.path.lexists(path):
            raise FileExistsError(errno.EEXIST, "File exists", str(path)) from None
        os.replace(tmp, path)


def is_strictly_inside(path: str | os.PathLike[str], root: str | os.PathLike[str]) -> bool:
    """True when ``path`` lies below ``root`` (not equal to it) once ``..`` and the links
    of its *parent* folders are resolved; ``path`` itself may be a link."""
    target = Path(path)
    parent = Path(os.path.realpath(target.parent))
    real_root = Path(os.path.realpath(root))
    if target.name in ("", ".", ".."):
        return False
    candidate = parent / target.name
    return candidate != real_root and candidate.is_relative_to(real_root)


def remove_tree(path: str | os.PathLike[str], *, within: str | os.PathLike[str],
                on_link: Callable[[Path], None] | None = None) -> bool:
    """Delete ``path`` (a folder with everything under it, or a single file) when it lies
    strictly inside ``within``; returns False when it did not exist.

    Links are never followed: a link at ``path`` or anywhere below it is unlinked and
    its target left as it is; each is passed to ``on_link`` (default: a warning), so
    that callers report what they found. Raises StorageError, deleting nothing, when
    ``path`` resolves outside ``within``.
    """
    target = Path(path)
    if not is_strictly_inside(target, within):
        raise StorageError(f"refusing to delete {target}: it does not lie inside {within}; "
                           "this is a bug or a crafted name, report it")
    report = on_link or _warn_link
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        return False
    if not stat.S_ISDIR(st.st_mode):
        if stat.S_ISLNK(st.st_mode):
            report(target)
        target.unlink(missing_ok=True)
        return True
    for folder, dirs, files in os.walk(target, followlinks=False):
        for name in (*dirs, *files):
            entry = Path(folder) / name
            if entry.is_symlink():
                report(entry)
    # shutil.rmtree uses the fd-based walk on Linux: it unlinks links found below the
    # root instead of descending into them, and is safe against a folder swapped for
    # a link while it runs.
    shutil.rmtree(target, onerror=_ignore_missing)
    return True


def _warn_link(path: Path) -> None:
    log.warning("symbolic link %s found inside the store: removed the link, its target "
                "was not touched", path)


def _ignore_missing(func: object, path: str, exc_info: tuple[type, BaseException, object]
                    ) -> None:
    if not isinstance(exc_info[1], FileNotFoundError):
        raise exc_info[1]
