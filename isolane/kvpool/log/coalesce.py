"""Range coalescing for batched KV reads (pure, no I/O).

A batch of block locations is grouped by segment, sorted by offset and merged into as
few byte ranges as possible: records that touch or sit less than ``max_gap_bytes``
apart share one read, up to ``max_range_bytes`` a range. A prompt's blocks are appended
together, so restoring a prefix is usually one range.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from isolane.kvpool.log.keydir import Location


@dataclass(frozen=True)
class ReadRange:
    """Bytes ``[start, end)`` of one segment, holding the records of ``members``
    (``(position in the batch, location)`` pairs, in offset order)."""

    segment_id: int
    start: int
    end: int
    members: tuple[tuple[int, Location], ...]

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def coalesce_ranges(
    locations: Sequence[Location | None], *, max_gap_bytes: int = 64 << 10,
    max_range_bytes: int = 64 << 20,
) -> list[ReadRange]:
    """Merge the records of ``locations`` (None entries are skipped) into read ranges."""
    by_segment: dict[int, list[tuple[int, Location]]] = defaultdict(list)
    for position, location in enumerate(locations):
        if location is not None:
            by_segment[location.segment_id].append((position, location))
    ranges: list[ReadRange] = []
    for segment_id in sorted(by_segment):
        members = sorted(by_segment[segment_id], key=lambda m: m[1].record_offset)
        run: list[tuple[int, Location]] = []
        start = end = 0
        for member in members:
            loc = member[1]
            if run and (loc.record_offset - end <= max_gap_bytes
                        and max(end, loc.record_end) - start <= max_range_bytes):
                run.append(member)
                end = max(end, loc.record_end)
                continue
            if run:
                ranges.append(ReadRange(segment_id, start, end, tuple(run)))
            run, start, end = [member], loc.record_offset, loc.record_end
        if run:
            ranges.append(ReadRange(segment_id, start, end, tuple(run)))
    return ranges


def split_ranges(ranges: Sequence[ReadRange], piece_bytes: int) -> list[ReadRange]:
    """Cut each range between records into pieces of about ``piece_bytes`` (a record is
    never cut; a record larger than that is a piece of its own), so one restore keeps
    several reads in flight instead of one long pread."""
    pieces: list[ReadRange] = []
    for read_range in ranges:
        run: list[tuple[int, Location]] = []
        for member in read_range.members:
            if run and member[1].record_end - run[0][1].record_offset > piece_bytes:
                pieces.append(_piece(read_range.segment_id, run))
                run = []
            run.append(member)
        if run:
            pieces.append(_piece(read_range.segment_id, run))
    return pieces


def _piece(segment_id: int, run: list[tuple[int, Location]]) -> ReadRange:
    return ReadRange(segment_id, run[0][1].record_offset,
                     max(loc.record_end for _, loc in run), tuple(run))
