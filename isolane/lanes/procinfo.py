"""Is the process that owns a plane slot still the one that wrote it?

A pid alone is not an identity: pids are reused. Linux gives each process a start
time (``/proc/<pid>/stat`` field 22, clock ticks since boot) that does not change
and is not shared by a later process with the same pid, so (pid, start) names one
process. A zombie (killed, not yet reaped) counts as gone: it runs nothing.
Elsewhere ``os.kill(pid, 0)`` answers for the pid alone (start 0).
"""

from __future__ import annotations

import os


def _stat_fields(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode("ascii", "replace")
    except OSError:
        return None
    # comm (field 2) may hold spaces and parentheses: split after the last ')'.
    return text[text.rfind(")") + 2:].split()


def start_ticks(pid: int) -> int:
    """The start time of ``pid`` (0 where unknown)."""
    fields = _stat_fields(pid)
    if fields is None or len(fields) < 20:
        return 0
    try:
        return int(fields[19])
    except ValueError:
        return 0


def is_alive(pid: int, start: int) -> bool:
    """Whether ``pid`` runs and is the process that started at ``start`` (0: any)."""
    if pid <= 0:
        return False
    fields = _stat_fields(pid)
    if fields is None:
        if os.path.isdir("/proc/self"):
            return False  # a Linux /proc without this pid: gone
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    if len(fields) < 20 or fields[0] in ("Z", "X", "x"):
        return False
    return not start or fields[19] == str(start)
