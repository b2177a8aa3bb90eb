from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from isolane.kvpool.log.coalesce import coalesce_ranges, split_ranges
from isolane.kvpool.log.keydir import Location


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


def test_split_ranges_cuts_between_records_only() -> None:
    ranges = coalesce_ranges([_loc(1, i * 1000, 1000, i) for i in range(10)])
    pieces = split_ranges(ranges, 2500)
    assert [(p.start, p.end) for p in pieces] == [(0, 2000), (2000, 4000), (4000, 6000),
                                                  (6000, 8000), (8000, 10_000)]
    assert [pos for p in pieces for pos, _ in p.members] == list(range(10))
    huge = split_ranges(coalesce_ranges([_loc(1, 0, 5000), _loc(1, 5000, 5000)]), 1000)
    assert [(p.start, p.end) for p in huge] == [(0, 5000), (5000, 10_000)]  # never cut


@given(st.lists(st.integers(min_value=64, max_value=5000), min_size=1, max_size=40),
       st.integers(min_value=1, max_value=20_000))
def test_split_ranges_keeps_every_member_once(lengths: list[int], piece: int) -> None:
    offsets = [sum(lengths[:i]) for i in range(len(lengths))]
    ranges = coalesce_ranges([_loc(0, o, n, i) for i, (o, n) in
                              enumerate(zip(offsets, lengths, strict=True))])
    pieces = split_ranges(ranges, piece)
    assert sorted(pos for p in pieces for pos, _ in p.members) == list(range(len(lengths)))
    for p in pieces:
        assert len(p.members) == 1 or p.nbytes <= piece
        assert p.start == p.members[0][1].record_offset
