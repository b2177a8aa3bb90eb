"""``save_async`` stages like a sync save when staging memory is not warm or not large
enough: it never faults in more fresh memory on the caller's time than a sync save's
window, its writes start as soon as staging has to wait, and memory stays within the
staging budget. Once the pool holds a state's buffers warm, the same state is staged
whole and the call returns before any chunk is written."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import isolane.snapshot.staging as staging
import isolane.snapshot.writer as writer
from isolane import SnapshotStore
from isolane.config import config_from_dict
from isolane.lanes.assignment import JobKind
from isolane.snapshot.stager import STAGE_THREADS
from isolane.snapshot.staging import WARM
from isolane.storage.local import LocalBlobStore
from tests.snapshot.conftest import assert_same

MiB = 1 << 20
CHUNK = 2 * MiB
STATE_CHUNKS = 20  # 40 MiB of 2 MiB chunks


def _config(where: Path, budget: str) -> Any:
    return config_from_dict({
        "device_groups": {"ckpt": {"role": "write", "devices": [str(where)]}},
        "snapshot": {"chunk_bytes": "2MiB", "pack_threshold": "64KiB",
                     "staging_budget": budget}})


def _state(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {f"w{i}": torch.randn(CHUNK // 4) for i in range(STATE_CHUNKS)}


class _Watch:
    """What happened before ``save_async`` let its caller go on (the save's ``staged``
    event, which the caller waits for): staging memory mapped inline (not by a
    background prefill) and chunk writes started. Judged by the event, not by the
    caller's return, because the lane may write between the two."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.fresh_before_return = 0
        self.writes_before_return = 0
        self._job: writer.SaveJob | None = None
        self._lock = threading.Lock()
        fresh, write, job_class = staging._fresh, LocalBlobStore.write, writer.SaveJob
        watch = self

        class WatchedJob(job_class):  # type: ignore[misc, valid-type]
            def __init__(self) -> None:
                super().__init__()
                watch._job = self

        def counted_fresh(capacity: int, *, populate: bool) -> Any:
            with self._lock:
                if not populate and self._staging():
                    self.fresh_before_return += capacity
            return fresh(capacity, populate=populate)

        def counted_write(store: LocalBlobStore, key: str, *args: Any, **kwargs: Any) -> Any:
            with self._lock:
                leaf = key.rsplit("/", 1)[-1]
                if (leaf == "c" or leaf.startswith("c.")) and self._staging():
                    self.writes_before_return += 1
            return write(store, key, *args, **kwargs)

        monkeypatch.setattr(staging, "_fresh", counted_fresh)
        monkeypatch.setattr(LocalBlobStore, "write", counted_write)
        monkeypatch.setattr(writer, "SaveJob", WatchedJob)

    def _staging(self) -> bool:
        """A watched save is still staging: its caller waits."""
        return self._job is not None and not self._job.staged.is_set()

    def save_async(self, store: SnapshotStore, state: dict[str, torch.Tensor],
                   name: str) -> Any:
        self._job = None
        self.fresh_before_return = self.writes_before_return = 0
        return store.save_async(state, name)


@pytest.fixture(autouse=True)
def cold_process() -> Iterator[None]:
    WARM.clear()  # no warm buffers left by other tests' stores
    yield
    WARM.clear()


def _window(store: SnapshotStore) -> int:
    return store.scheduler.lane(JobKind.CHECKPOINT_WRITE).threads + 2 * STAGE_THREADS


def _settle(store: SnapshotStore) -> None:
    for thread in threading.enumerate():
        if thread.name == "isolane-staging-prefill":
            thread.join(timeout=60)


@pytest.mark.parametrize("budget", ["32MiB", "40MiB", "64MiB"])  # under / at / above
def test_a_cold_async_save_streams_like_a_sync_save(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, budget: str) -> None:
    watch = _Watch(monkeypatch)
    store = SnapshotStore(_config(tmp_path / "d0", budget))
    try:
        state = _state(1)
        expected = {k: v.clone() for k, v in state.items()}
        handle = watch.save_async(store, state, "a")
        for tensor in state.values():
            tensor.fill_(-1.0)  # the caller may change its tensors at once
        # Fresh pages cost a fault each: the caller pays for no more than a sync save's
        # window of them, and writes free buffers for the rest instead of more memory.
        assert watch.fresh_before_return <= _window(store) * CHUNK
        assert watch.writes_before_return > 0
        handle.result(timeout=60)
        assert store.staging.peak_allocated_bytes <= int(budget.removesuffix("MiB")) * MiB
        assert_same(expected, store.load("a"))
    finally:
        store.close()


@pytest.mark.parametrize(("budget", "streams"), [("40MiB", False), ("64MiB", False),
                                                 ("24MiB", True)],
                         ids=["within-40MiB", "within-64MiB", "over-24MiB"])
def test_once_warm_a_save_maps_no_fresh_memory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, budget: str, streams: bool) -> None:
    """Within the budget the state is staged whole before any write; over it, the save
    streams through the warm buffers."""
    watch = _Watch(monkeypatch)
    store = SnapshotStore(_config(tmp_path / "d0", budget))
    try:
        store.save_async(_state(1), "a").result(timeout=60)
        _settle(store)  # the pool grows to the state in the background
        state = _state(2)
        expected = {k: v.clone() for k, v in state.items()}
        handle = watch.save_async(store, state, "b")
        for tensor in state.values():
            tensor.fill_(-1.0)
        assert watch.fresh_before_return == 0
        assert (watch.writes_before_return > 0) is streams
        handle.result(timeout=60)
        assert store.staging.peak_allocated_bytes <= int(budget.removesuffix("MiB")) * MiB
        assert_same(expected, store.load("b"))
    finally:
        store.close()


def test_a_write_failing_while_the_save_streams_surfaces_on_result(
        tmp_path: Path, tmpfs: Any) -> None:
    where = tmpfs("12m")
    store = SnapshotStore(_config(where, "8MiB"))
    try:
        handle = store.save_async(_state(1), "too-big")  # 40 MiB on 12 MiB, 8 MiB staging
        with pytest.raises(OSError, match="full"):
            handle.result(timeout=60)
        assert store.staging.in_use_bytes == 0  # every buffer came back
        assert store.list() == []
    finally:
        store.close()
