"""Bounce buffers for O_DIRECT restores: private, huge-page backed memory (large device
requests), and every big chunk of a load(into=...) read through one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import isolane.snapshot.reader as reader
from isolane import SnapshotStore
from isolane.config import config_from_dict
from isolane.errors import IntegrityError
from isolane.snapshot.dtypes import dtype_name
from isolane.snapshot.reader import fresh_memory
from isolane.snapshot.staging import WARM, StagingPool
from isolane.storage.aligned import AlignedBuffer, advise_hugepages
from tests.snapshot.conftest import assert_same
from tests.support.damage import flip_byte

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


def _config(tmp_path: Path, **snapshot: Any) -> Any:
    direct_io = snapshot.pop("direct_io", "auto")
    return config_from_dict({
        "device_groups": {"ckpt": {"role": "write", "devices": [str(tmp_path / "d0")],
                                   "direct_io": direct_io}},
        "snapshot": {"chunk_bytes": "2MiB", "pack_threshold": "64KiB", **snapshot}})


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(13)
    return {"w": torch.randn(1536, 1024),  # 6 MiB: 3 chunks
            "b": torch.randn(700, 1024).to(torch.bfloat16),  # 1.4 MiB: 1 chunk
            "small": torch.randn(100)}  # packed


def _page_aligned_like(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Zeroed targets whose memory starts on a page: what O_DIRECT could fill in place."""
    out = {}
    for key, t in state.items():
        out[key], _region = fresh_memory(dtype_name(t.dtype), tuple(t.shape))
        out[key].zero_()
    return out


def _big_chunks(store: SnapshotStore, name: str) -> list[Any]:
    return [c for c in store.manifest(name).chunks
            if c.tensor is not None and c.nbytes >= reader.BOUNCE_MIN_BYTES]


def test_into_page_aligned_targets_reads_every_big_chunk_through_a_bounce_buffer(
        tmp_path: Path) -> None:
    config = _config(tmp_path)
    state = _state()
    SnapshotStore(config).save(state, "s")
    store = SnapshotStore(config)
    target = _page_aligned_like(state)
    assert all(t.data_ptr() % 4096 == 0 for k, t in target.items() if k != "small")
    out = store.load("s", into=target)
    assert_same(state, out)
    assert all(out[k] is target[k] for k in target)
    assert store.staging.acquired == len(_big_chunks(store, "s")) == 4


def test_bounced_damage_names_the_tensor_and_never_reaches_the_target(tmp_path: Path) -> None:
    config = _config(tmp_path)
    state = _state()
    SnapshotStore(config).save(state, "s")
    store = SnapshotStore(config)
    manifest = store.manifest("s")
    chunk = next(c for c in manifest.chunks if c.key.startswith("b/"))
    flip_byte(tmp_path / "d0" / "snapshots" / "s" / manifest.generation / chunk.key, 4097)
    target = _page_aligned_like(state)
    with pytest.raises(IntegrityError, match=r"tensor 'b' \(chunk b/.*content hash mismatch"):
        store.load("s", into=target)
    assert int(target["b"].view(torch.uint8).count_nonzero()) == 0


def test_buffered_stores_and_small_chunks_read_in_place(tmp_path: Path) -> None:
    """No bounce without O_DIRECT (nothing to gain: the page cache copies anyway), nor
    for chunks under BOUNCE_MIN_BYTES (tensors of their own under 1 MiB)."""
    torch.manual_seed(5)
    small = {"x": torch.randn(128, 1024), "y": torch.randn(200, 1024).to(torch.float16)}
    for name, config, state in (("off", _config(tmp_path / "off", direct_io="off"), _state()),
                                ("small", _config(tmp_path / "small"), small)):
        SnapshotStore(config).save(state, name)
        store = SnapshotStore(config)
        if name == "small":  # not packed: chunks of their own, each under 1 MiB
            assert all(c.tensor is not None for c in store.manifest(name).chunks)
            assert not _big_chunks(store, name)
        out = store.load(name, into=_page_aligned_like(state))
        assert_same(state, out)
        assert store.staging.acquired == 0, name


def test_plain_loads_read_straight_into_their_fresh_memory(tmp_path: Path) -> None:
    config = _config(tmp_path)
    state = _state()
    SnapshotStore(config).save(state, "s")
    store = SnapshotStore(config)
    assert_same(state, store.load("s"))
    assert store.staging.acquired == 0  # fresh regions are aligned: O_DIRECT in place


@pytest.mark.skipif(_thp_mode() == "never", reason="transparent huge pages disabled")
def test_staging_buffers_can_take_huge_pages() -> None:
    WARM.clear()
    pool = StagingPool(4 * MiB, 16 * MiB)
    buf = pool.acquire()
    try:
        assert _smaps_of(buf.address)["THPeligible"] == "1"
    finally:
        pool.release(buf)
        pool.close()
        WARM.clear()
