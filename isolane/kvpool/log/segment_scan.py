"""The reopen scan of a KV segment file, and the damage report it keeps.

``scan_segment`` reads a segment file record by record (when it has no valid hint, and
always for the live segment): it checks every record's salted checksum, resyncs past
damage in the middle at the next record that proves itself, and truncates a torn tail.
Every byte range it drops is a ``Damage``, kept in ``damage.log`` (JSON lines) until
``isolane kv verify`` has reported it (``record_damage``/``read_damage``/``write_damage``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import mmap
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from isolane import bounded_json
from isolane.kvpool.log.keydir import LogItem
from isolane.kvpool.log.records import (
    RECORD_ALIGN,
    RECORD_HEADER,
    SEGMENT_HEADER_BYTES,
    check_record,
    next_valid_record,
    parse_segment_header,
)
from isolane.kvpool.log.segment_files import read_nofollow
from isolane.storage.files import atomic_write

__all__ = ["DAMAGE_FILE", "Damage", "ScanResult", "read_damage", "record_damage",
           "scan_segment", "write_damage"]

log = logging.getLogger(__name__)

DAMAGE_FILE = "damage.log"
"""JSON lines, one ``Damage`` each: what reopen scans dropped, until verify clears it."""
MAX_DAMAGE_ENTRIES = 1000


@dataclass(frozen=True)
class Damage:
    """Bytes ``[offset, offset + nbytes)`` of segment ``segment_id`` that a reopen scan
    dropped (the records there read as misses), and why."""

    segment_id: int
    offset: int
    nbytes: int
    reason: str
    reported: bool = False  # shown by a verify already (the bytes stay skipped)


@dataclass(frozen=True)
class ScanResult:
    """What ``scan_segment`` found: the records in log order, where the valid ones end
    (0: no valid header, the file is to be discarded), the salt and format version."""

    items: list[LogItem]
    end: int
    salt: int
    version: int


def scan_segment(sid: int, path: Path, damage: list[Damage]) -> ScanResult:
    """Records of a segment file in log order, where the valid ones end (0: no valid
    header), its salt and its format version; a file longer than that end is
    truncated there (a torn tail). Every byte range dropped is appended to ``damage``.

    After damage in the middle the scan resyncs at the next record whose *salted*
    checksum checks out, so the records after the damage are kept; a record forged
    inside a value cannot check out (``records.py``). Version 1 segments have no
    salt: their scan stops at the first bad record instead."""
    items: list[LogItem] = []
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    with open(fd, "rb+") as f:
        size = os.fstat(f.fileno()).st_size
        header = parse_segment_header(f.read(SEGMENT_HEADER_BYTES), sid)
        if header is None:
            if size > SEGMENT_HEADER_BYTES:  # else: a crash before any record
                damage.append(Damage(sid, 0, size, "no valid segment header: "
                                     "the file was discarded"))
            log.warning("KV segment file %s has no valid header; discarding it", path)
            return ScanResult(items, 0, 0, 0)
        version, salt = header
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m, memoryview(m) as buf:
            pos, reason = SEGMENT_HEADER_BYTES, ""
            while pos < size:
                parsed = check_record(buf, pos, salt)
                if isinstance(parsed, str):
                    # Damage in the middle must not cost the records after it:
                    # resume at the next record that proves itself, if there is one.
                    after = (next_valid_record(buf, pos + RECORD_ALIGN, salt)
                             if version >= 2 else None)
                    if after is None:
                        reason = parsed
                        break
                    log.warning("KV segment %s: skipping damaged bytes [%d, %d) (%s); "
                                "the records after them are kept", path, pos, after,
                                parsed)
                    damage.append(Damage(sid, pos, after - pos, parsed))
                    pos = after
                    continue
                csum, flags, klen, vlen, delta, rbytes, ts = parsed
                key = bytes(buf[pos + RECORD_HEADER.size:pos + RECORD_HEADER.size + klen])
                items.append((key, flags, (sid, pos, pos + delta, vlen, pos + rbytes,
                                           csum, ts)))
                pos += rbytes
        if pos < size:
            log.warning("KV segment %s: dropping %d bytes after offset %d (%s): a torn "
                        "tail from a crash, or damage", path, size - pos, pos, reason)
            damage.append(Damage(sid, pos, size - pos,
                                 f"torn tail from a crash, or damage: {reason}"))
            os.ftruncate(f.fileno(), pos)
            os.fsync(f.fileno())
    return ScanResult(items, pos, salt, version)


def record_damage(folder: Path, found: Iterable[Damage], segment_ids: Iterable[int]) -> None:
    """Keep ``damage.log`` in step with this open: add the byte ranges ``found`` that
    it does not list yet, forget those of segments that are gone (not in
    ``segment_ids``). A damaged range in a segment stays in the file and is skipped at
    every open; it is listed once, and reported once (``clear_damage`` marks it)."""
    path = folder / DAMAGE_FILE
    present = set(segment_ids)
    known = {(d.segment_id, d.offset, d.nbytes): d for d in read_damage(folder)}
    for d in found:
        known.setdefault((d.segment_id, d.offset, d.nbytes), d)
    entries = [d for d in known.values() if d.segment_id in present
               or not d.reported][-MAX_DAMAGE_ENTRIES:]
    write_damage(folder, entries)
    if not entries:
        path.unlink(missing_ok=True)


def read_damage(folder: Path) -> list[Damage]:
    path = folder / DAMAGE_FILE
    try:
        text = read_nofollow(path).decode(errors="replace")
    except FileNotFoundError:
        return []
    except OSError as exc:
        return [Damage(0, 0, 0, f"the damage report {path} is unreadable "
                       f"({exc.strerror}); delete it")]
    out = []
    for line in text.splitlines():
        try:
            out.append(Damage(**bounded_json.loads(line)))
        except (ValueError, TypeError):
            out.append(Damage(0, 0, 0, f"unreadable line in {path}: {line[:80]!r}"))
    return out


def write_damage(folder: Path, entries: list[Damage]) -> None:
    path = folder / DAMAGE_FILE
    try:
        atomic_write(path, "".join(json.dumps(dataclasses.asdict(d)) + "\n"
                                   for d in entries))
    except OSError as exc:
        log.warning("could not record KV damage in %s: %s", path, exc.strerror)
