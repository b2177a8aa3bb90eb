"""Hint files read ahead on a thread of their own while a reopen decodes the ones before."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from isolane.kvpool.log.hint_reads import HintReads


@pytest.mark.parametrize("threaded", [True, False])
def test_hints_arrive_in_order_with_the_error_of_an_unreadable_one(
        tmp_path: Path, threaded: bool) -> None:
    paths = []
    for i in range(12):
        path = tmp_path / f"h{i}"
        path.write_bytes(bytes([i]) * (1000 + i))
        paths.append((i, path))
    os.unlink(paths[3][1])
    os.symlink(tmp_path / "h4", paths[3][1])  # a link is never followed
    paths[5][1].unlink()  # gone
    with HintReads(paths, window=2, threaded=threaded) as reads:
        got = [reads.next(sid) for sid, _ in paths]
    for i, data in enumerate(got):
        if i in (3, 5):
            assert isinstance(data, OSError)
        else:
            assert data == bytes([i]) * (1000 + i)


def test_a_reopen_that_stops_early_stops_the_reader(tmp_path: Path) -> None:
    paths = [(i, tmp_path / f"h{i}") for i in range(50)]
    for _, path in paths:
        path.write_bytes(b"x" * 100)
    before = threading.active_count()
    with HintReads(paths, window=1) as reads:
        assert reads.next(0) == b"x" * 100
    assert threading.active_count() == before  # joined, not left blocked on the queue


def test_asking_out_of_order_is_refused(tmp_path: Path) -> None:
    paths = [(i, tmp_path / f"h{i}") for i in range(3)]
    for _, path in paths:
        path.write_bytes(b"y")
    with HintReads(paths) as reads, pytest.raises(ValueError, match="segment 2"):
        reads.next(2)
