"""Reopening a KV segment folder: hint files first, a scan only where there is none.

A part of ``SegmentLog`` (``segment_log.py``) kept in its own module. ``load_folder`` lists
the folder (removing temp files of a crash and ``.dead`` segments, never following a
link), sizes the key directory once from the hint files, loads the hint of every sealed
segment straight into it (read ahead on a thread: ``hint_reads.HintReads``;
``hint_columns.decode_hint_columns``,
``bulk_load.BulkLoad``: the table is built once for all of them; a damaged or lying
hint falls back to ``segment_scan.scan_segment``, which then rewrites it), and scans the
live segment.
``write_hint`` writes a sealed segment's hint (format in ``keydir.py`` and
docs/FORMATS.md).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from isolane import bounded_json
from isolane.errors import IntegrityError
from isolane.kvpool.log.bulk_load import BulkLoad
from isolane.kvpool.log.hint_columns import HINT_V2_PUT_BYTES, decode_hint_columns
from isolane.kvpool.log.hint_reads import THREAD_BYTES, HintReads
from isolane.kvpool.log.keydir import HINT_HEADER, HINT_MAGIC, LogItem
from isolane.kvpool.log.segment_files import SegmentFile, parse_segment_name
from isolane.kvpool.log.segment_scan import (
    DAMAGE_FILE,
    Damage,
    record_damage,
    scan_segment,
)
from isolane.storage.files import atomic_write

if TYPE_CHECKING:
    from isolane.kvpool.log.segment_log import SegmentLog

__all__ = ["hint_path", "load_folder", "write_close_mark", "write_hint"]
CLOSE_MARK = "closed.json"
"""Written at a clean close: the live segment's id and size then. A reopen compares the
live segment with it (and removes it), so bytes lost since are reported, not hidden."""

log = logging.getLogger(__name__)


def hint_path(folder: Path, segment_id: int) -> Path:
    return folder / f"seg-{segment_id:08d}.hint"


def write_hint(folder: Path, segment_id: int, hint: bytes) -> None:
    """Best effort: a missing hint only makes the next open scan the segment."""
    path = hint_path(folder, segment_id)
    try:
        atomic_write(path, hint)
    except OSError as exc:
        log.warning("could not write the hint file %s (%s); the next open will scan "
                    "segment %d instead", path, exc.strerror, segment_id)


def write_close_mark(folder: Path, segment_id: int, size: int) -> None:
    """Best effort, like a hint: without it a reopen only cannot tell what was lost."""
    try:
        atomic_write(folder / CLOSE_MARK, json.dumps({"segment_id": segment_id,
                                                      "bytes": size}).encode())
    except OSError as exc:
        log.warning("could not write %s (%s)", folder / CLOSE_MARK, exc.strerror)


def _take_close_mark(folder: Path) -> tuple[int, int] | None:
    """The live segment's (id, bytes) at the last clean close, removed as it is read."""
    path = folder / CLOSE_MARK
    try:
        raw = path.read_bytes()[:4096] if not path.is_symlink() else b""
        path.unlink()
    except OSError:
        return None
    try:
        mark = bounded_json.loads(raw)
        sid, size = mark["segment_id"], mark["bytes"]
    except (ValueError, KeyError, TypeError):
        return None
    return (sid, size) if type(sid) is int and type(size) is int else None


def _check_close_mark(seglog: SegmentLog, mark: tuple[int, int] | None) -> None:
    if mark is None:
        return
    sid, promised = mark
    seg = seglog._segments.get(sid)
    held = 0 if seg is None else seg.size
    if held < promised:
        seglog._damage.append(Damage(sid, held, promised - held, (
            f"the live segment holds {held} of the {promised} bytes it had at the last "
            "clean close: truncated or damaged since")))


def load_folder(seglog: SegmentLog) -> None:
    """Load every segment of ``seglog.folder`` into the log (its write lock held)."""
    mark = _take_close_mark(seglog.folder)
    found: dict[int, dict[str, Path]] = {}
    for name in sorted(os.listdir(seglog.folder)):
        path = seglog.folder / name
        parsed = parse_segment_name(name)
        temp = name.endswith(".tmp") or (name.startswith(".") and ".tmp-" in name)
        if not temp and parsed is None:
            continue
        if path.is_symlink():  # never read, truncate or delete through a link
            log.warning("ignoring %s: a symbolic link in a KV segment folder (isolane "
                        "never follows links in its store); remove it", path)
            continue
        if parsed is None:  # a temp file left by a crash (atomic_write's, or older .tmp)
            path.unlink(missing_ok=True)
            continue
        sid, kind = parsed
        seglog._next_id = max(seglog._next_id, sid + 1)
        if kind == "dead":
            path.unlink(missing_ok=True)
        else:
            found.setdefault(sid, {})[kind] = path
    data_ids = sorted(sid for sid, kinds in found.items() if kinds.keys() - {"hint"})
    newest_live = max((sid for sid in data_ids if "live" in found[sid]
                       and "sealed" not in found[sid]), default=None)
    hints = [(sid, found[sid]["hint"]) for sid in data_ids
             if "hint" in found[sid] and "sealed" in found[sid]]
    nbytes = _hint_bytes(hints)
    bulk = BulkLoad(seglog._keydir, nbytes // HINT_V2_PUT_BYTES)
    with HintReads(hints, threaded=nbytes >= THREAD_BYTES) as reads:
        for sid in data_ids:
            kinds = found[sid]
            if "sealed" in kinds:
                if "live" in kinds:
                    log.warning("ignoring %s: segment %d is also sealed", kinds["live"], sid)
                _load_sealed(seglog, sid, kinds["sealed"],
                             reads.next(sid) if "hint" in kinds else None, bulk)
                continue
            bulk.finish()  # the segments below need the directory of the older ones
            if sid == newest_live and sid == data_ids[-1]:
                # A version 1 live segment (no salt) is sealed: appends go to version 2.
                if _load_live(seglog, sid, kinds["live"]) == 1:
                    seglog._seal()
            else:  # a live segment older than another: a crash mid-rotation; seal it
                _load_live(seglog, sid, kinds["live"])
                seglog._seal()
    bulk.finish()
    _check_close_mark(seglog, mark)
    for kinds in found.values():
        if kinds.keys() == {"hint"}:
            kinds["hint"].unlink(missing_ok=True)
    if seglog._damage or os.path.lexists(seglog.folder / DAMAGE_FILE):
        record_damage(seglog.folder, seglog._damage, seglog._segments)
    if seglog._live is None:
        seglog._new_live()


def _hint_bytes(hints: list[tuple[int, Path]]) -> int:
    """The bytes of the hints' entries (from their sizes; as version 2 puts, an
    estimate of the keys they list: the key directory's columns are sized once, unused
    capacity is zero pages never touched)."""
    nbytes = 0
    for _, hint in hints:
        with contextlib.suppress(OSError):
            nbytes += max(0, os.lstat(hint).st_size - HINT_HEADER.size)
    return nbytes


def _load_sealed(seglog: SegmentLog, sid: int, path: Path, hint: bytes | OSError | None,
                 bulk: BulkLoad) -> None:
    """``hint``: the bytes of the segment's hint file (``HintReads``), the error reading
    it raised, or None without one."""
    size = os.lstat(path).st_size
    if hint is not None:
        try:
            if isinstance(hint, OSError):
                raise hint
            cols = decode_hint_columns(hint, sid, size)
        except (OSError, IntegrityError) as exc:
            log.warning("ignoring the hint file %s (%s); scanning the segment",
                        hint_path(seglog.folder, sid), exc)
        else:
            seglog._segments[sid] = SegmentFile(sid, path, size, sealed=True)
            seglog._total_bytes += size
            bulk.add(sid, cols)
            return
    bulk.finish()  # the hint written below is the directory's share of the segment
    scan = scan_segment(sid, path, seglog._damage)
    items, end, salt = scan.items, scan.end, scan.salt
    promised = _hint_promise(hint, sid)
    if promised is not None and len(items) < promised[1]:
        # The hint was written when the segment was sealed: records it counted that the
        # file no longer holds were lost since (truncated or damaged), not never written.
        data_bytes, puts = promised
        seglog._damage.append(Damage(sid, end, max(0, data_bytes - end), (
            f"the segment holds {len(items)} of the {puts} records its hint promised "
            f"({size} of {data_bytes} bytes): truncated or damaged since it was sealed")))
    if end == 0:
        path.unlink()
        return
    seg = SegmentFile(sid, path, end, sealed=True, salt=salt)
    _add_segment(seglog, seg, items)
    write_hint(seglog.folder, sid, seglog._keydir.hint_bytes(sid, end))


def _hint_promise(hint: bytes | OSError | None, sid: int) -> tuple[int, int] | None:
    """``(data_bytes, put_count)`` a readable hint header of segment ``sid`` states."""
    if not isinstance(hint, bytes) or len(hint) < HINT_HEADER.size:
        return None
    magic, _version, _, segment_id, data_bytes, puts, *_ = HINT_HEADER.unpack_from(hint)
    if magic != HINT_MAGIC or segment_id != sid:
        return None
    return int(data_bytes), int(puts)


def _load_live(seglog: SegmentLog, sid: int, path: Path) -> int:
    """Scan the live segment ``sid``; returns its format version (0: discarded)."""
    scan = scan_segment(sid, path, seglog._damage)
    items, end, salt, version = scan.items, scan.end, scan.salt, scan.version
    if end == 0:  # crashed before its header was durable: nothing to keep
        path.unlink()
        return 0
    seg = SegmentFile(sid, path, end, sealed=False,
                      fd=os.open(path, os.O_RDWR | os.O_NOFOLLOW), salt=salt)
    _add_segment(seglog, seg, items)
    seglog._live = seg
    return version


def _add_segment(seglog: SegmentLog, seg: SegmentFile, items: list[LogItem]) -> None:
    seglog._segments[seg.segment_id] = seg
    seglog._total_bytes += seg.size
    seglog._keydir.apply(seg.segment_id, items)
