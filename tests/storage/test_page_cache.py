"""``storage.page_cache``: the page-cache residency of a byte range (``cachestat``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from isolane.storage.page_cache import PAGE, cached_pages, fully_cached
from tests.support.page_cache import evict


def test_counts_the_cached_pages_of_a_range(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(64 * PAGE))
    fd = os.open(path, os.O_RDONLY)
    try:
        if cached_pages(fd, 0, PAGE) is None:
            pytest.fail("cachestat(2) is missing on this kernel (Linux 6.5+ has it): the "
                        "cold-read policy of the KV pool cannot be tested here")
        assert fully_cached(fd, 0, 64 * PAGE) is True  # just written: dirty, cached
        evict(path)
        assert cached_pages(fd, 0, 64 * PAGE) == 0
        assert fully_cached(fd, 0, 64 * PAGE) is False
        os.pread(fd, 2 * PAGE, 8 * PAGE + 100)  # touches pages 8..10
        assert cached_pages(fd, 8 * PAGE, 3 * PAGE) == 3
        assert fully_cached(fd, 8 * PAGE + 100, 2 * PAGE) is True  # the pages it touches
        assert fully_cached(fd, 7 * PAGE, 2 * PAGE) is False
        assert cached_pages(fd, 0, 0) == 0
    finally:
        os.close(fd)


def test_a_closed_descriptor_raises(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * PAGE)
    fd = os.open(path, os.O_RDONLY)
    os.close(fd)
    with pytest.raises(OSError):
        cached_pages(fd, 0, PAGE)


def test_pages_are_the_machines_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """``PAGE`` is ``mmap.PAGESIZE``, not 4096: on a kernel with 16 KiB or 64 KiB pages
    (arm64, ppc64le) ``cachestat`` counts those, and a range of 4 KiB "pages" would
    never look fully cached. A fresh copy of the module, loaded with another page size,
    counts the pages a range touches in that size."""
    import importlib.util
    import mmap

    import isolane.storage.page_cache as real

    monkeypatch.setattr(mmap, "PAGESIZE", 16384)
    spec = importlib.util.spec_from_file_location("_page_cache_16k", real.__file__)
    assert spec is not None and spec.loader is not None
    copy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copy)
    assert copy.PAGE == 16384
    counted: list[int] = []
    monkeypatch.setattr(copy, "cached_pages", lambda fd, off, n: counted.pop())
    counted.append(2)  # [0, 32 KiB) is 2 pages of 16 KiB
    assert copy.fully_cached(-1, 0, 32768) is True
    counted.append(2)  # [8 KiB, 40 KiB) touches 3 of them
    assert copy.fully_cached(-1, 8192, 32768) is False
