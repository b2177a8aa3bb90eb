"""The staging pool's warm buffers: prefilled off the critical path, kept across pools."""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import isolane.snapshot.staging as staging
from isolane.config import config_from_dict
from isolane.lanes.assignment import JobKind
from isolane.snapshot import SnapshotStore
from isolane.snapshot.staging import WARM, StagingPool

MiB = 1 << 20
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def resident_pages(address: int, length: int) -> int:
    """Pages of ``[address, address + length)`` backed by memory (``mincore``)."""
    pages = -(-length // mmap.PAGESIZE)
    vec = ctypes.create_string_buffer(pages)
    assert _libc.mincore(address, length, vec) == 0, os.strerror(ctypes.get_errno())
    return sum(b & 1 for b in vec.raw)


@pytest.fixture(autouse=True)
def empty_warm_cache() -> Iterator[None]:
    WARM.clear()
    yield
    WARM.clear()


def test_prefill_faults_slot_buffers_in_that_acquire_then_hands_out() -> None:
    pool = StagingPool(4 * MiB, 64 * MiB)
    thread = pool.prefill(3)
    assert thread is not None
    thread.join(timeout=30)
    assert pool.allocated_bytes == 12 * MiB
    bufs = [pool.acquire() for _ in range(3)]
    assert pool.allocated_bytes == 12 * MiB  # the prefilled ones, nothing new mapped
    for buf in bufs:
        assert resident_pages(buf.address, buf.capacity) == buf.capacity // mmap.PAGESIZE
        pool.release(buf)
    assert pool.prefill(3) is None  # already there: nothing to do
    pool.close()


def test_prefill_stays_within_the_budget() -> None:
    pool = StagingPool(4 * MiB, 10 * MiB)
    thread = pool.prefill(8)
    assert thread is not None
    thread.join(timeout=30)
    assert pool.allocated_bytes == 8 * MiB  # two 4 MiB slots fit a 10 MiB budget
    pool.close()


def test_acquire_waits_for_a_buffer_being_prefilled(monkeypatch: pytest.MonkeyPatch) -> None:
    """A save starting right after the store opened takes the buffer the prefill thread
    is faulting in, instead of mapping (and faulting inline) one more."""
    go = threading.Event()
    populate = staging.populate_write

    def slow_populate(address: int, length: int) -> bool:
        go.wait(timeout=30)
        return populate(address, length)

    monkeypatch.setattr(staging, "populate_write", slow_populate)
    pool = StagingPool(4 * MiB, 64 * MiB)
    thread = pool.prefill(1)
    assert thread is not None
    got: list[staging.AlignedBuffer] = []
    taker = threading.Thread(target=lambda: got.append(pool.acquire()))
    taker.start()
    taker.join(timeout=0.3)
    assert taker.is_alive() and not got  # waiting for the prefilled one
    go.set()
    taker.join(timeout=30)
    thread.join(timeout=30)
    assert len(got) == 1 and pool.allocated_bytes == 4 * MiB
    pool.release(got[0])
    pool.close()


def test_a_failed_prefill_gives_its_budget_back(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_memory(capacity: int, *, populate: bool) -> staging.AlignedBuffer:
        raise OSError(12, "Cannot allocate memory")

    pool = StagingPool(4 * MiB, 64 * MiB)
    monkeypatch.setattr(staging, "_fresh", no_memory)
    thread = pool.prefill(2)
    assert thread is not None
    thread.join(timeout=30)
    assert pool.allocated_bytes == 0
    monkeypatch.undo()
    buf = pool.acquire()  # does not wait for a prefill that will never come
    assert pool.allocated_bytes == 4 * MiB
    pool.release(buf)
    pool.close()


def test_prefill_sizes_adds_what_no_allocated_buffer_serves_within_the_budget() -> None:
    pool = StagingPool(4 * MiB, 12 * MiB)
    pool.release(pool.acquire(4 * MiB))
    thread = pool.prefill_sizes([3 * MiB] + [2 * MiB] * 5)
    assert thread is not None  # the 4 MiB buffer serves 3 MiB; 2 MiB ones up to 12 MiB
    thread.join(timeout=30)
    assert pool.allocated_bytes == 12 * MiB
    bufs = [pool.acquire_warm(n) for n in [3 * MiB] + [2 * MiB] * 5]
    assert [b.capacity if b is not None else None for b in bufs] == \
        [4 * MiB, 2 * MiB, 2 * MiB, 2 * MiB, 2 * MiB, None]  # the budget held four
    for buf in bufs:
        if buf is not None:
            pool.release(buf)
    assert pool.prefill_sizes([4 * MiB, 2 * MiB]) is None  # all there already
    pool.close()


def test_a_closed_pool_hands_its_warm_buffers_to_the_next_one() -> None:
    first = StagingPool(4 * MiB, 64 * MiB)
    buf = first.acquire()
    address = buf.address
    first.release(buf)
    first.close()
    assert first.allocated_bytes == 0 and WARM.nbytes == 4 * MiB
    second = StagingPool(4 * MiB, 64 * MiB)
    again = second.acquire()
    assert again.address == address and WARM.nbytes == 0  # the same warm memory
    assert second.allocated_bytes == 4 * MiB
    other = second.acquire(6 * MiB)  # no 6 MiB buffer kept: a fresh one
    assert other.address != address
    second.release(again)
    second.release(other)
    second.close()


def test_the_warm_cache_keeps_at_most_its_limit() -> None:
    pool = StagingPool(64 * MiB, staging.KEEP_WARM_BYTES * 2)
    bufs = [pool.acquire() for _ in range(staging.KEEP_WARM_BYTES // (64 * MiB) + 2)]
    for buf in bufs:
        pool.release(buf)
    pool.close()
    assert WARM.nbytes == staging.KEEP_WARM_BYTES  # the rest was unmapped


def test_a_forked_child_does_not_inherit_the_warm_cache() -> None:
    pool = StagingPool(4 * MiB, 64 * MiB)
    pool.release(pool.acquire())
    pool.close()
    assert WARM.nbytes == 4 * MiB
    pid = os.fork()
    if pid == 0:
        os._exit(0 if WARM.nbytes == 0 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert WARM.nbytes == 4 * MiB


def _store_config(tmp_path: Path) -> Any:
    return config_from_dict({
        "device_groups": {"ckpt": {"role": "write", "devices": [str(tmp_path / "d0")]}},
        "snapshot": {"chunk_bytes": "4MiB", "pack_threshold": "64KiB"}})


def _prefill_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "isolane-staging-prefill"]


def test_a_store_that_only_reads_allocates_no_staging(tmp_path: Path) -> None:
    """Opening a store is what ``isolane ls/show/verify/rm``, a node's read paths and a
    restore-only process do: none of them saves, so none may fault in staging memory
    (it used to be write-lane threads x chunk size, 128 MiB by default, at every open)."""
    config = _store_config(tmp_path)
    state = {"w": torch.randn(2048, 1024), "b": torch.randn(16)}
    with SnapshotStore(config) as writer:
        writer.save(state, "s")
    WARM.clear()  # the saving store left its buffers to the next one: not this test's
    store = SnapshotStore(config)
    try:
        assert [i.name for i in store.list()] == ["s"]
        store.info("s")
        store.verify("s")
        assert torch.equal(store.load("s")["w"], state["w"])
        assert torch.equal(store.load("s", mmap=True)["w"], state["w"])
        store.delete("s")
        store.gc()
        assert store.staging.allocated_bytes == 0 and store.staging.acquired == 0
        assert not _prefill_threads()
    finally:
        store.close()
    assert WARM.nbytes == 0


def test_the_first_save_warms_one_buffer_per_write_lane_thread(tmp_path: Path) -> None:
    """Prefilling moved from the open to the first save: it still fills one slot-sized
    buffer per write-lane thread (later saves copy into warm memory)."""
    store = SnapshotStore(_store_config(tmp_path))
    try:
        assert store.staging.allocated_bytes == 0
        store.save({"w": torch.randn(256, 1024)}, "s")  # 1 MiB: one buffer would do
        for thread in _prefill_threads():
            thread.join(timeout=30)
        threads = store.scheduler.lane(JobKind.CHECKPOINT_WRITE).threads
        assert store.staging.allocated_bytes == threads * 4 * MiB
    finally:
        store.close()


def test_prefill_counts_the_buffers_still_being_prefilled(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every save asks for a prefill; asking again while one runs adds nothing."""
    go = threading.Event()
    populate = staging.populate_write
    monkeypatch.setattr(staging, "populate_write",
                        lambda address, length: go.wait(timeout=30) and populate(address, length))
    pool = StagingPool(4 * MiB, 64 * MiB)
    thread = pool.prefill(2)
    assert thread is not None
    assert pool.prefill(2) is None and pool.allocated_bytes == 8 * MiB
    go.set()
    thread.join(timeout=30)
    pool.close()

