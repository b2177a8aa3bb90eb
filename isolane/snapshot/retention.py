"""Retention and sweeping decisions (pure): what GC may remove, decided before any I/O."""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass

from isolane.lanes.procinfo import is_alive


@dataclass(frozen=True)
class Generation:
    """One ``snapshots/<name>/<generation>`` folder as GC sees it."""

    name: str
    generation: str
    committed_at: float | None  # None: no readable manifest
    writer: dict[str, object] | None  # the _writing.json marker, when present
    damaged: bool = False  # a manifest exists but cannot be read: never swept


def generation_time(generation: str) -> float:
    """Generations are named ``<time_ns:020d>-<random>``; their age needs no I/O."""
    try:
        return int(generation.split("-", 1)[0]) / 1e9
    except ValueError:
        return 0.0


def writer_alive(marker: dict[str, object], *, grace_s: float, now: float) -> bool:
    """A marker from this host names a process we can probe (``lanes.procinfo.is_alive``:
    a zombie, killed but not yet reaped, is gone; a reused pid has another start time;
    a marker without ``pid_start``, from before it was recorded, is probed by its pid
    alone); elsewhere trust it for grace_s."""
    started = marker.get("started")
    pid = marker.get("pid")
    if marker.get("host") == socket.gethostname() and isinstance(pid, int):
        pid_start = marker.get("pid_start")
        return is_alive(pid, pid_start if isinstance(pid_start, int) else 0)
    return isinstance(started, int | float) and now - started < grace_s


def should_sweep(gen: Generation, live: str | None, *, grace_s: float,
                 now: float | None = None) -> bool:
    """Only what provably never committed, or was superseded, is swept:

    - a damaged manifest: never (it may be the only copy of a committed snapshot);
    - a committed generation: when ``live`` (the name's latest commit, None when the
      name is damaged or has none) is another one, i.e. an overwrite replaced it;
    - no manifest, with a marker: when the marker's writer is gone;
    - no manifest, no marker: once older than ``grace_s`` (mirror uploads carry none;
      a local save's folder appears with its marker, ``snapshot.marker``, but one of
      an older isolane did not)."""
    now = time.time() if now is None else now
    if gen.damaged:
        return False
    if gen.committed_at is not None:
        return live is not None and gen.generation != live
    if gen.writer is not None:
        return not writer_alive(gen.writer, grace_s=grace_s, now=now)
    return now - generation_time(gen.generation) > grace_s


def plan_retention(committed: Sequence[tuple[str, float]], keep_last: int | None) -> list[str]:
    """Names to delete so that only the ``keep_last`` most recently committed remain."""
    if keep_last is None:
        return []
    newest_first = sorted(committed, key=lambda item: item[1], reverse=True)
    return [name for name, _ in newest_first[keep_last:]]
