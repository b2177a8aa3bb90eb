"""The host lane plane's files in their folder: the lock that follows its name, and the
removal of planes nobody uses any more.

A plane ``P`` comes with ``P.lock`` (an flock taken for join, leave, rebuild and
removal) and, while it is being built, ``P.tmp-<pid>``. Once no live process is a
member, all of them go (they are memory in /dev/shm): the last member out removes
them (``isolane.lanes.plane``), and a plane whose last member was SIGKILLed is removed
by the next process that opens any plane in the same folder (``sweep``).

Removing a lock file races a process waiting on it: the waiter gets the flock on the
unlinked inode while a newcomer creates a fresh file under the name and locks that,
and both would believe they hold the lock. ``plane_lock`` therefore re-checks, with the
flock held, that the file at the name is still the inode it locked, and starts over
when it is not. A plane file is removed only under its lock and only while it is the
inode whose slots were read, and a joiner re-checks under the lock that the file it
mapped is still the one at the name; so no process joins a removed file.

Nothing here follows a link: names are opened with O_NOFOLLOW, only regular files of
this uid named like a plane are considered, and removal goes through
``isolane.storage.files.remove_tree`` (never outside the plane folder).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path

from isolane.lanes.plane_format import (
    FILE_BYTES,
    HEADER,
    SLOT_HEAD,
    SLOTS,
    check_header,
    slot_offset,
)
from isolane.lanes.procinfo import is_alive
from isolane.storage.files import remove_tree

log = logging.getLogger(__name__)

LOCK_TRIES = 1000  # fresh lock files in a row before giving up (each a removal racing us)
_swept: set[str] = set()  # folders this process has swept


class PlaneLockError(OSError):
    """The lock file kept being replaced while we waited (never seen in practice)."""


@contextlib.contextmanager
def plane_lock(lock_path: Path, *, blocking: bool = True) -> Iterator[bool]:
    """Hold the flock of ``lock_path``: the file that is at that name while we hold it.
    Yields False (without the lock) when ``blocking`` is False and another holds it."""
    for _ in range(LOCK_TRIES):
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            mine = os.fstat(fd)
            try:
                now = os.stat(lock_path, follow_symlinks=False)
            except FileNotFoundError:
                continue  # removed by the last member out while we waited: start over
            if (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
                yield True
                return
        finally:
            os.close(fd)  # releases the flock
    raise PlaneLockError(f"lock file {lock_path} was replaced {LOCK_TRIES} times while "
                         "waiting for it; check what else writes that folder")


def remove_plane_files(path: Path) -> None:
    """Remove the plane ``path``, its temp files and its lock. Call with the plane's lock
    held, after checking that the file at ``path`` is the one nobody uses."""
    folder = path.parent
    for name in os.listdir(folder):
        if name.startswith(path.name + ".tmp-"):
            remove_tree(folder / name, within=folder)  # a build that died halfway
    remove_tree(path, within=folder)
    remove_tree(path.with_name(path.name + ".lock"), within=folder)  # last: we hold it


def nobody_in(fd: int) -> bool:
    """Whether no live process is a member of the plane open at ``fd``."""
    for index in range(SLOTS):
        head = os.pread(fd, SLOT_HEAD.size, slot_offset(index))
        if len(head) < SLOT_HEAD.size:
            return False
        state, pid, start = SLOT_HEAD.unpack_from(head)[:3]
        if state and is_alive(int(pid), int(start)):
            return False
    return True


def sweep(folder: Path) -> int:
    """Remove the planes of this uid in ``folder`` that no live process is a member of
    (the last one was killed), and lock files without a plane; once per process and
    folder, never waiting on a lock. Returns how many planes it removed."""
    key = os.path.realpath(folder)
    if key in _swept:
        return 0
    _swept.add(key)
    pattern = re.compile(rf"isolane-lanes-{os.geteuid()}-([0-9a-f]{{20}})\.plane(\.lock)?")
    try:
        names = os.listdir(folder)
    except OSError:
        return 0
    planes = set()
    for name in names:
        match = pattern.fullmatch(name)
        if match:
            planes.add(name.removesuffix(".lock"))
    removed = 0
    for name in sorted(planes):
        try:
            removed += _sweep_one(folder / name, name.split("-")[-1].removesuffix(".plane"))
        except OSError as exc:  # a link, someone else's file, a vanished name: leave it
            log.debug("not sweeping host lane plane %s: %s", folder / name, exc)
    return removed


def _sweep_one(path: Path, digest_hex: str) -> int:
    lock = path.with_name(path.name + ".lock")
    for name in (path, lock):
        if os.path.lexists(name) and not stat.S_ISREG(os.lstat(name).st_mode):
            return 0  # a link or anything else: not ours to judge
    with plane_lock(lock, blocking=False) as held:
        if not held:
            return 0  # someone is joining or leaving right now: it is in use
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            remove_tree(lock, within=path.parent)  # a lock left without its plane
            return 0
        try:
            info = os.fstat(fd)
            if (not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid()
                    or info.st_size != FILE_BYTES):
                return 0
            head = os.pread(fd, HEADER.size + 4, 0)
            if len(head) < HEADER.size + 4:
                return 0
            digest = HEADER.unpack_from(head)[8]
            if digest.hex()[:20] != digest_hex or check_header(head, digest) is not None:
                return 0  # not a plane this isolane reads: whoever opens it rebuilds it
            if not nobody_in(fd):
                return 0
            if os.stat(path, follow_symlinks=False).st_ino != info.st_ino:
                return 0
            remove_plane_files(path)
            log.info("removed host lane plane %s: its last member was gone", path)
            return 1
        finally:
            os.close(fd)
