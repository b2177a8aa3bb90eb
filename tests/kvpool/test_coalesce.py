from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from isolane.kvpool.coalesce import coalesce_ranges
from isolane.kvpool.keydir import Location


def _loc(segment: int, offset: int, length: int, key: int = 0) -> Location:
    return Location(key=key.to_bytes(16, "little"), segment_id=segment, record_offset=offset,
                    value_offset=offset + 64, value_length=length - 64,
                    record_end=offset + length, checksum=0, timestamp_ns=0)


def test_adjacent_records_of_a_prompt_become_one_range() -> None:
    locs = [_loc(3, i * 1000, 1000, i) for i in range(16)]
    ranges = coalesce_ranges(list(reversed(locs)))
    assert len(ranges) == 1
    assert (ranges[0].start, ranges[0].end) == (0, 16_000)
    assert [pos for pos, _ in ranges[0].members] == list(range(15, -1, -1))


def test_gaps_segments_and_range_cap_split_ranges() -> None:
    locs = [_loc(1, 0, 100), _loc(1, 150, 100), _loc(1, 10_000, 100), _loc(2, 0, 100), None]
    ranges = coalesce_ranges(locs, max_gap_bytes=100)
    assert [(r.segment_id, r.start, r.end) for r in ranges] == [
        (1, 0, 250), (1, 10_000, 10_100), (2, 0, 100)]
    capped = coalesce_ranges([_loc(1, i * 100, 100) for i in range(10)], max_range_bytes=300)
    assert [r.nbytes for r in capped] == [300, 300, 300, 100]


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 50), st.integers(1, 5)),
                max_size=40),
       st.integers(0, 2000), st.integers(100, 5000))
def test_every_location_is_covered_exactly_once(
        specs: list[tuple[int, int, int]], gap: int, cap: int) -> None:
    locs = [_loc(seg, slot * 1000, size * 100, i) for i, (seg, slot, size) in enumerate(specs)]
    ranges = coalesce_ranges(locs, max_gap_bytes=gap, max_range_bytes=cap)
    seen = sorted(pos for r in ranges for pos, _ in r.members)
    assert seen == list(range(len(locs)))
    for r in ranges:
        for _pos, loc in r.members:
            assert r.segment_id == loc.segment_id
            assert r.start <= loc.record_offset and loc.record_end <= r.end
