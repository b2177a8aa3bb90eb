"""The host's last settled write limit, remembered past the plane's life (warm start).

The plane file goes once no process uses it (``isolane.lanes.plane_files``), and with
it the governor block a newly elected member continues from. So the first governor
of the next run (a restarted trainer, the next benchmark run) started unlimited, sent
a burst the reads paid for, cut down and then climbed back on seconds of good reads.
The elected member therefore also writes the last **settled** host write limit (one
at which every read for at least ``control.GROW_HOLD_S`` had a p99 within the SLO)
into a small file beside the plane, ``<plane>.memory``, and a governor that is elected
on a fresh plane (no block to continue from) starts from it. Only a limit judged
against the same or a tighter SLO is used (a looser one could be over this SLO), and
only for ``MEMORY_MAX_AGE_S``; the law is unchanged, so slow reads cut it at once.

Layout (little endian, 64 bytes)::

    magic "ISOLANEM" (8s), version u32, config digest (16s), limit f64 (bytes/s),
    ceiling f64 (bytes/s; NaN: none), SLO f64 (s), saved f64 (Unix s), crc32 u32

Untrusted on read, like the plane: a regular file of our uid, not writable by others,
exactly that size, the right magic, version, digest and CRC, finite positive values,
else it is ignored with one warning (and replaced at the next settled limit).
Written whole through ``storage.files.atomic_write`` (0600).
"""

from __future__ import annotations

import logging
import math
import os
import stat
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

from isolane.storage.files import atomic_write

log = logging.getLogger(__name__)

MAGIC = b"ISOLANEM"
VERSION = 1
BODY = struct.Struct("<8sI16sdddd")
CRC = struct.Struct("<I")
FILE_BYTES = BODY.size + CRC.size
MEMORY_MAX_AGE_S = 3600.0  # older: the device and its neighbours may have changed
_warned: set[str] = set()


@dataclass(frozen=True)
class Settled:
    """A host write limit that held the SLO (bytes/s), and what it was judged on."""

    limit: float
    ceiling: float | None
    slo_s: float
    saved_s: float  # wall clock (time.time): the monotonic clock is per boot


def memory_path(plane: Path) -> Path:
    return plane.with_name(plane.name + ".memory")


def pack(digest: bytes, settled: Settled) -> bytes:
    body = BODY.pack(MAGIC, VERSION, digest, settled.limit,
                     math.nan if settled.ceiling is None else settled.ceiling,
                     settled.slo_s, settled.saved_s)
    return body + CRC.pack(zlib.crc32(body))


def unpack(data: bytes, digest: bytes) -> Settled | str:
    """The remembered limit, or why ``data`` is not one to trust."""
    if len(data) != FILE_BYTES:
        return f"{len(data)} bytes, expected {FILE_BYTES}"
    body = data[:BODY.size]
    if CRC.unpack_from(data, BODY.size)[0] != zlib.crc32(body):
        return "checksum mismatch"
    magic, version, found, limit, ceiling, slo_s, saved_s = BODY.unpack(body)
    if magic != MAGIC:
        return "bad magic"
    if version != VERSION:
        return f"format version {version}, this isolane reads version {VERSION}"
    if found != digest:
        return "belongs to another host config"
    if not (math.isfinite(limit) and limit > 0 and math.isfinite(slo_s) and slo_s > 0
            and math.isfinite(saved_s)):
        return "values out of range"
    if not (math.isnan(ceiling) or (math.isfinite(ceiling) and ceiling > 0)):
        return "ceiling out of range"
    return Settled(limit, None if math.isnan(ceiling) else ceiling, slo_s, saved_s)


def recall(plane: Path, digest: bytes, *, slo_s: float, now_s: float) -> Settled | None:
    """The settled limit remembered beside ``plane`` that may start a governor with SLO
    ``slo_s`` at wall time ``now_s``; None when there is none to use (a damaged or
    foreign file says so once)."""
    path = memory_path(plane)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        _warn(path, f"cannot be opened ({exc.strerror})")
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            found: Settled | str = "not a regular file"
        elif info.st_uid != os.geteuid():
            found = f"owned by uid {info.st_uid}"
        elif info.st_mode & 0o022:
            found = f"writable by others (mode {info.st_mode & 0o777:o})"
        else:
            found = unpack(os.pread(fd, FILE_BYTES + 1, 0), digest)
    finally:
        os.close(fd)
    if isinstance(found, str):
        _warn(path, found)
        return None
    if found.slo_s > slo_s * (1 + 1e-9) or not 0 <= now_s - found.saved_s <= MEMORY_MAX_AGE_S:
        return None  # judged on a looser SLO, from the future, or too old
    return found


def remember(plane: Path, digest: bytes, settled: Settled) -> bool:
    """Write ``settled`` beside ``plane``; False (logged) when the folder refuses."""
    try:
        atomic_write(memory_path(plane), pack(digest, settled), mode=0o600)
    except OSError as exc:
        log.debug("host lane plane %s: settled limit not remembered: %s", plane, exc)
        return False
    return True


def _warn(path: Path, why: str) -> None:
    key = f"{path}:{why}"
    if key not in _warned:
        _warned.add(key)
        log.warning("host lane plane memory %s: %s; ignored (a governor starts from its "
                    "law, unlimited, and the next settled limit replaces it)", path, why)
