"""Device-level priorities: each lane's worker threads get an I/O priority class.

The governor paces checkpoint bytes per second, but a write already queued at the
device still delays the KV reads queued behind it. Linux I/O schedulers that honour
priorities (mq-deadline, bfq) dispatch a higher class first, so the read lane's threads
ask for the real-time class (best-effort level 0 where that is not permitted) and the
write and background lanes for best-effort level 7: ``ionice`` per thread. With the
``none`` scheduler, or on other systems, this is a no-op.

``lane_io_priority`` gives the calling thread a lane's priority for the length of a
``with`` block and puts its own back after (``enter_io_priority`` and
``leave_io_priority`` the same as two calls): an inline read (``Lane.call``) runs on the
caller's thread at the read lane's priority. The class each lane got is remembered, so
that costs three system calls, not a retry of refused classes each time.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import platform
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from isolane.lanes.assignment import LaneName

log = logging.getLogger(__name__)

IOPRIO_CLASS_RT, IOPRIO_CLASS_BE = 1, 2
_IOPRIO_WHO_PROCESS = 1  # with who=0: the calling thread
_SYSCALL = {"x86_64": 251, "aarch64": 30}.get(platform.machine())

LANE_IO_PRIORITY: dict[LaneName, list[tuple[int, int]]] = {
    # (class, level) to try in order
    "read": [(IOPRIO_CLASS_RT, 4), (IOPRIO_CLASS_BE, 0)],
    "write": [(IOPRIO_CLASS_BE, 7)],
    "background": [(IOPRIO_CLASS_BE, 7)],
}


_granted: dict[LaneName, int] = {}  # the ioprio value each lane's first thread got


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux") or _SYSCALL is None:
        return None
    return ctypes.CDLL(None, use_errno=True)


def _set_raw(libc: ctypes.CDLL, value: int) -> bool:
    return bool(libc.syscall(_SYSCALL, _IOPRIO_WHO_PROCESS, 0, value) == 0)


def _get_raw(libc: ctypes.CDLL) -> int:
    # _libc() is None where _SYSCALL is, so a libc here means a syscall number.
    return int(libc.syscall((_SYSCALL or 0) + 1, _IOPRIO_WHO_PROCESS, 0))  # ioprio_get


def set_thread_io_priority(lane: LaneName) -> tuple[int, int] | None:
    """Give the calling thread ``lane``'s I/O priority; returns the (class, level) set,
    or None where the system has no per-thread I/O priorities."""
    libc = _libc()
    if libc is None:
        return None
    granted = _granted.get(lane)
    if granted is not None and _set_raw(libc, granted):
        return granted >> 13, granted & 0x1FFF
    for io_class, level in LANE_IO_PRIORITY[lane]:
        if _set_raw(libc, (io_class << 13) | level):
            _granted[lane] = (io_class << 13) | level
            return io_class, level
    log.debug("no I/O priority for the %s lane: errno %d", lane, ctypes.get_errno())
    return None


def thread_io_priority() -> tuple[int, int] | None:
    """The calling thread's (class, level), or None where unsupported."""
    libc = _libc()
    if libc is None:
        return None
    value = _get_raw(libc)
    return None if value < 0 else (value >> 13, value & 0x1FFF)


def enter_io_priority(lane: LaneName) -> int | None:
    """Give the calling thread ``lane``'s I/O priority for a while: the thread's own
    priority to put back with ``leave_io_priority``, or None when nothing was changed
    (unsupported, or it already has that priority). Plain calls, not a ``with`` block:
    an inline read pays for this on every call (``Lane.call_inline``)."""
    libc = _libc()
    if libc is None:
        return None
    own = _get_raw(libc)
    granted = _granted.get(lane)
    if own < 0 or own == granted:
        return None
    if granted is None or not _set_raw(libc, granted):  # the class to grant not known yet
        set_thread_io_priority(lane)
    return own


def leave_io_priority(own: int | None) -> None:
    """Put back the calling thread's own priority (``enter_io_priority``'s result)."""
    libc = _libc()
    if own is not None and libc is not None:
        _set_raw(libc, own)


@contextmanager
def lane_io_priority(lane: LaneName) -> Iterator[None]:
    """The calling thread at ``lane``'s I/O priority inside the block, at its own after
    (a no-op where unsupported, or when it already has that priority)."""
    own = enter_io_priority(lane)
    try:
        yield
    finally:
        leave_io_priority(own)
