"""A sync save stages (copies and hashes) its chunks on threads of its own, ahead of the
write lane, whose threads then only link or write (``isolane.snapshot.stager``);
bounded by a window of staging buffers, bit-exact, and clean when staging or a write
fails."""

from __future__ import annotations

import errno
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import isolane.snapshot.chunks as chunks
from isolane import SnapshotStore
from isolane.config import config_from_dict
from isolane.lanes.assignment import JobKind
from isolane.lanes.scheduler import LaneHandle
from isolane.snapshot.stager import STAGE_THREADS
from isolane.storage.local import LocalBlobStore
from tests.snapshot.conftest import assert_same

MiB = 1 << 20


def _config(tmp_path: Path) -> Any:
    return config_from_dict({
        "device_groups": {"ckpt": {"role": "write", "devices": [str(tmp_path / "d0")]}},
        "snapshot": {"chunk_bytes": "2MiB", "pack_threshold": "64KiB"}})


def _state(seed: int = 1, big: int = 12) -> dict[str, Any]:
    torch.manual_seed(seed)
    return {"w": torch.randn(big * MiB // 4),  # `big` MiB: big / 2 chunks
            "h": torch.randn(1500, 1024).to(torch.bfloat16),  # ~2.9 MiB, padded tail chunk
            "i": torch.arange(3 * MiB // 8, dtype=torch.int64),
            "small": {"a": torch.randn(100), "b": torch.ones(7, dtype=torch.int8)},  # packed
            "step": 3}


class _Counting:
    """Staging buffers out of ``store``'s pool (acquired, not yet released), tracked."""

    def __init__(self, store: SnapshotStore) -> None:
        pool = store.staging
        self.out = self.peak = self.acquired = self.released = 0
        self._lock = threading.Lock()
        acquire, acquire_warm, release = pool.acquire, pool.acquire_warm, pool.release

        def counted(buf: Any) -> Any:
            if buf is not None:
                with self._lock:
                    self.out += 1
                    self.acquired += 1
                    self.peak = max(self.peak, self.out)
            return buf

        def counted_acquire(nbytes: int | None = None, **kwargs: Any) -> Any:
            return counted(acquire(nbytes, **kwargs))

        def counted_acquire_warm(nbytes: int) -> Any:
            return counted(acquire_warm(nbytes))

        def counted_release(buf: Any) -> None:
            with self._lock:
                self.out -= 1
                self.released += 1
            release(buf)

        pool.acquire = counted_acquire  # type: ignore[method-assign]
        pool.acquire_warm = counted_acquire_warm  # type: ignore[method-assign]
        pool.release = counted_release  # type: ignore[method-assign]


@pytest.fixture
def threads_of_work(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, set[str]]]:
    """The names of the threads that copied chunk bytes and that hashed them."""
    seen: dict[str, set[str]] = {"copy": set(), "hash": set()}
    copy_bytes, chunk_hash = chunks.copy_bytes, chunks.chunk_hash

    def copying(*args: Any) -> Any:
        seen["copy"].add(threading.current_thread().name)
        return copy_bytes(*args)

    def hashing(*args: Any) -> Any:
        seen["hash"].add(threading.current_thread().name)
        return chunk_hash(*args)

    monkeypatch.setattr(chunks, "copy_bytes", copying)
    monkeypatch.setattr(chunks, "chunk_hash", hashing)
    yield seen


def test_lane_threads_only_write_copies_and_hashes_run_on_stagers(
        tmp_path: Path, threads_of_work: dict[str, set[str]]) -> None:
    store = SnapshotStore(_config(tmp_path))
    state = _state()
    store.save(state, "s")
    for what in ("copy", "hash"):
        assert threads_of_work[what], what
        assert all(n.startswith("isolane-stage") for n in threads_of_work[what]), \
            (what, threads_of_work[what])
    assert_same(state, SnapshotStore(_config(tmp_path)).load("s"))


def test_staging_runs_ahead_of_slow_writes_within_its_window(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Writes slowed down: the stagers fill buffers ahead of them (more out than the
    lane's threads), never more than the window, and every buffer comes back."""
    write = LocalBlobStore.write

    def slow_write(self: LocalBlobStore, key: str, *args: Any, **kwargs: Any) -> Any:
        if "/w/" in key:
            time.sleep(0.03)
        return write(self, key, *args, **kwargs)

    monkeypatch.setattr(LocalBlobStore, "write", slow_write)
    store = SnapshotStore(_config(tmp_path))
    counting = _Counting(store)
    state = _state(big=64)  # 32 chunks of w
    store.save(state, "s")
    threads = store.scheduler.lane(JobKind.CHECKPOINT_WRITE).threads
    assert threads < counting.peak <= threads + 2 * STAGE_THREADS
    assert counting.out == 0 and counting.acquired == counting.released
    assert_same(state, SnapshotStore(_config(tmp_path)).load("s"))


def test_incremental_save_links_unchanged_chunks_without_copying_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = SnapshotStore(_config(tmp_path))
    first = _state()
    store.save(first, "s")
    second = _state()
    second["w"][-1] += 1.0  # the last chunk of w changes
    copied: list[int] = []
    copy_bytes = chunks.copy_bytes

    def counting(dst: int, src: int, n: int) -> None:
        copied.append(n)
        copy_bytes(dst, src, n)

    monkeypatch.setattr(chunks, "copy_bytes", counting)
    info = store.save(second, "s2")
    manifest = store.manifest("s2")
    written = [c for c in manifest.chunks if not c.linked]
    assert [c.key.split("/")[0] for c in written if c.tensor is not None] == ["w"]
    # Only the changed chunk and the small tensors (a pack is copied to be hashed, then
    # linked) went through staging.
    small = sum(t.numel() * t.element_size() for t in second["small"].values())
    assert sum(copied) == sum(c.nbytes for c in written if c.tensor is not None) + small
    assert info.linked_bytes > 0
    assert_same(second, SnapshotStore(_config(tmp_path)).load("s2"))


def test_a_failed_copy_fails_the_save_commits_nothing_and_returns_every_buffer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = SnapshotStore(_config(tmp_path))
    prev = _state(1)
    store.save(prev, "prev")
    copy_bytes = chunks.copy_bytes
    calls = {"n": 0}

    def failing(dst: int, src: int, n: int) -> None:
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("copy broke")
        copy_bytes(dst, src, n)

    monkeypatch.setattr(chunks, "copy_bytes", failing)
    counting = _Counting(store)
    with pytest.raises(RuntimeError, match="copy broke"):
        store.save(_state(2, big=64), "next", parent=False)
    assert counting.out == 0 and counting.acquired == counting.released
    assert counting.acquired < 20  # staging stopped soon after the failure (36 chunks)
    assert [i.name for i in store.list()] == ["prev"]
    assert [p.name for p in (tmp_path / "d0" / "snapshots").iterdir()] == ["prev"]
    monkeypatch.setattr(chunks, "copy_bytes", copy_bytes)
    assert_same(prev, store.load("prev"))
    store.save(_state(3), "after")  # the store still saves


def test_a_failed_write_fails_the_save_and_stops_the_stagers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = SnapshotStore(_config(tmp_path))
    prev = _state(1)
    store.save(prev, "prev")
    write = LocalBlobStore.write
    writes = {"n": 0}

    def full(self: LocalBlobStore, key: str, *args: Any, **kwargs: Any) -> Any:
        if "/next/" in key and "/w/" in key:
            writes["n"] += 1
            if writes["n"] >= 3:
                raise OSError(errno.ENOSPC, "No space left on device")
        return write(self, key, *args, **kwargs)

    monkeypatch.setattr(LocalBlobStore, "write", full)
    counting = _Counting(store)
    with pytest.raises(Exception, match=r"space|full"):
        store.save(_state(2, big=64), "next", parent=False)
    assert counting.out == 0 and counting.acquired == counting.released
    assert counting.acquired < 20
    assert [i.name for i in store.list()] == ["prev"]
    monkeypatch.setattr(LocalBlobStore, "write", write)
    assert_same(prev, store.load("prev"))


def test_a_lane_refusing_a_job_fails_the_save_and_never_hangs_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stager whose hand-off to the write lane raises (the lane shut down under the
    save) gives its buffer and its window slot back: the save fails, it does not wait
    for a slot that never comes."""
    store = SnapshotStore(_config(tmp_path))
    prev = _state(1)
    store.save(prev, "prev")
    submit_sized = LaneHandle.submit_sized
    calls = {"n": 0}

    def refusing(self: LaneHandle, *args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] >= 3:
            raise RuntimeError("lane closed")
        return submit_sized(self, *args, **kwargs)

    monkeypatch.setattr(LaneHandle, "submit_sized", refusing)
    counting = _Counting(store)
    outcome: dict[str, BaseException | None] = {}

    def save() -> None:
        try:
            store.save(_state(2, big=64), "next", parent=False)
            outcome["error"] = None
        except BaseException as exc:
            outcome["error"] = exc

    saver = threading.Thread(target=save, daemon=True)
    saver.start()
    saver.join(timeout=60)
    assert not saver.is_alive(), "the save hung after the lane refused a job"
    assert isinstance(outcome["error"], RuntimeError) and "lane closed" in str(outcome["error"])
    assert counting.out == 0 and counting.acquired == counting.released
    assert [i.name for i in store.list()] == ["prev"]
    monkeypatch.setattr(LaneHandle, "submit_sized", submit_sized)
    assert_same(prev, store.load("prev"))
