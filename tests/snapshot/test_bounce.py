"""Bounce buffers for O_DIRECT restores: private, huge-page backed memory (large device
requests), and every big chunk of a load(into=...) read through one."""

from __future__ import annotations

from pathlib import Path

import pytest

from isolane.storage.aligned import AlignedBuffer, advise_hugepages

MiB = 1 << 20


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "never"
    return text.split("[", 1)[1].split("]", 1)[0]


def _smaps_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps entry of the mapping holding ``address``: its permissions
    ('perms') and its fields."""
    entry: dict[str, str] = {}
    found = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and ":" not in head[0]:
            if found:
                break
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            found = lo <= address < hi
            if found:
                entry["perms"] = head[1]
        elif found:
            key, _, value = line.partition(":")
            entry[key] = value.strip()
    assert found, hex(address)
    return entry


def test_aligned_buffers_are_private_anonymous_memory() -> None:
    """Python's mmap.mmap(-1, n) is MAP_SHARED: shmem, which takes no transparent huge
    pages while shmem_enabled is 'never' (MADV_HUGEPAGE is then a silent no-op), and
    which a forked child would share."""
    buf = AlignedBuffer(4 * MiB)
    try:
        assert _smaps_of(buf.address)["perms"].endswith("p")
    finally:
        buf.close()


@pytest.mark.skipif(_thp_mode() == "never", reason="transparent huge pages disabled")
def test_advised_buffers_can_take_huge_pages() -> None:
    buf = AlignedBuffer(8 * MiB)
    try:
        advise_hugepages(buf)
        assert _smaps_of(buf.address)["THPeligible"] == "1"
    finally:
        buf.close()

