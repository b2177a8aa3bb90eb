"""Device-level priorities: each lane's worker threads get an I/O priority class.

The governor paces checkpoint bytes per second, but a write already queued at the
device still delays the KV reads queued behind it. Linux I/O schedulers that honour
priorities (mq-deadline, bfq) dispatch a higher class first, so the read lane's threads
ask for the real-time class (best-effort level 0 where that is not permitted) and the
write and background lanes for best-effort level 7: ``ionice`` per thread. With the
``none`` scheduler, or on other systems, this is a no-op.
"""

from __future__ import annotations

import ctypes
import logging
import platform
import sys

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


def set_thread_io_priority(lane: LaneName) -> tuple[int, int] | None:
    """Give the calling thread ``lane``'s I/O priority; returns the (class, level) set,
    or None where the system has no per-thread I/O priorities."""
    if not sys.platform.startswith("linux") or _SYSCALL is None:
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    for io_class, level in LANE_IO_PRIORITY[lane]:
        if libc.syscall(_SYSCALL, _IOPRIO_WHO_PROCESS, 0, (io_class << 13) | level) == 0:
            return io_class, level
    log.debug("no I/O priority for the %s lane: errno %d", lane, ctypes.get_errno())
    return None


def thread_io_priority() -> tuple[int, int] | None:
    """The calling thread's (class, level), or None where unsupported."""
    if not sys.platform.startswith("linux") or _SYSCALL is None:
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    value = libc.syscall(_SYSCALL + 1, _IOPRIO_WHO_PROCESS, 0)  # ioprio_get
    return None if value < 0 else (value >> 13, value & 0x1FFF)
