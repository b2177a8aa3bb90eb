"""A reopen loads sealed segments from their hint files and scans only the live segment:
the first get is answered without reading any sealed segment's data; a segment whose
hint is damaged is scanned instead (and only that one)."""

from __future__ import annotations

from pathlib import Path

import pytest

from isolane.kvpool.log.segment_log import RecordIntegrityError, SegmentLog
from isolane.kvpool.log.segment_scan import read_damage
from tests.kvpool.test_segments import KiB, _fill, files, got
from tests.support.damage import flip_byte


def _segment_id(path: Path) -> int:
    return int(path.name[4:12])


def test_reopen_scans_the_live_segment_only_and_a_segment_whose_hint_is_damaged(
        tmp_path: Path) -> None:
    folder = tmp_path / "kv"
    with SegmentLog(folder, segment_bytes=64 * KiB) as log:
        data = _fill(log, 40)
        locs = {k: log.locate(k) for k in data}
    sealed, live = files(folder, ".sealed"), files(folder, ".live")
    assert len(sealed) >= 3 and len(live) == 1
    live_id = _segment_id(live[0])
    # Damage the first record's value in every segment: a scan drops (and reports) it,
    # a load from the hint does not read it.
    first = {}
    for path in [*sealed, *live]:
        sid = _segment_id(path)
        k, loc = min(((k, v) for k, v in locs.items() if v is not None and v.segment_id == sid),
                     key=lambda kv: kv[1].record_offset)
        flip_byte(path, loc.value_offset + 10)
        first[sid] = k
    damaged_hint = sealed[1]
    flip_byte(damaged_hint.with_suffix(".hint"), 100)
    scanned = {live_id, _segment_id(damaged_hint)}

    with SegmentLog(folder, segment_bytes=64 * KiB) as log:
        reported = {d.segment_id for d in read_damage(folder)}
        assert reported == scanned  # no other segment's data was read at open
        for sid, k in first.items():
            if sid in scanned:
                assert log.locate(k) is None  # the scan dropped the damaged record
            else:
                assert log.locate(k) == locs[k]  # indexed from the hint, data unread
                with pytest.raises(RecordIntegrityError):
                    log.get(k)  # the damage is found when the record is read
        for k, v in data.items():
            if k not in first.values():
                assert got(log, k) == v
