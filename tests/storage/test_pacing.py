from __future__ import annotations

from pathlib import Path

import pytest

from isolane.storage import pacing
from isolane.storage.aligned import AlignedBuffer
from isolane.storage.local import LocalBlobStore


class RecordingPacer:
    """A pacer that records what it is asked for instead of sleeping."""

    def __init__(self, rate: float | None) -> None:
        self.rate = rate
        self.asked: list[int] = []

    def consume(self, nbytes: int) -> float:
        self.asked.append(nbytes)
        return 0.001


def test_paced_direct_writes_go_in_slices(tmp_path: Path) -> None:
    store = LocalBlobStore(str(tmp_path), direct_io="on")
    data = AlignedBuffer(16 << 20).view
    data[:] = bytes(range(256)) * (len(data) // 256)
    pacer = RecordingPacer(rate=4e6)
    with pacing.paced_by(pacer, len(data)) as waited:
        store.write("blob", data)
    assert pacer.asked == [pacing.MIN_SLICE_BYTES] * 16  # and nothing charged twice
    assert waited[0] == pytest.approx(0.016)
    assert (tmp_path / "blob").read_bytes() == bytes(data)


def test_unlimited_pacer_and_no_pacer_write_whole(tmp_path: Path) -> None:
    store = LocalBlobStore(str(tmp_path), direct_io="on")
    data = AlignedBuffer(8 << 20).view
    pacer = RecordingPacer(rate=None)
    with pacing.paced_by(pacer, len(data)):
        assert pacing.slice_bytes() is None
        store.write("a", data)
    assert pacer.asked == [8 << 20]  # one call: the bucket may still meter it
    assert pacing.slice_bytes() is None  # outside the block: unpaced
    store.write("b", data)
    assert (tmp_path / "b").stat().st_size == 8 << 20


def test_bytes_a_job_does_not_pace_are_charged_at_its_end() -> None:
    pacer = RecordingPacer(rate=1e6)
    with pacing.paced_by(pacer, 10 << 20):
        pacing.pace(3 << 20)
    assert pacer.asked == [3 << 20, 7 << 20]


def test_slices_shrink_with_the_rate_and_stay_aligned() -> None:
    assert pacing.slice_for(4e6) == pacing.MIN_SLICE_BYTES
    assert pacing.slice_for(600e6) == 2 << 20
    assert pacing.slice_for(2e9) == pacing.SLICE_BYTES
    sizes = [pacing.slice_for(r * 1e6) for r in range(1, 3000, 7)]
    assert all(s % 4096 == 0 for s in sizes) and sizes == sorted(sizes)
