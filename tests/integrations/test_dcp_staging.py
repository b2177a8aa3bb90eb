"""``dcp.async_save`` stages through the store's bounded staging pool."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from isolane import SnapshotStore
from isolane.config import config_from_dict
from isolane.integrations.dcp import IsolaneStorageReader, IsolaneStorageWriter

MiB = 1 << 20


def open_store(root: Path, budget: str) -> SnapshotStore:
    return SnapshotStore(config_from_dict({
        "device_groups": {"ckpt": {"role": "write", "devices": [str(root / "a")]}},
        "snapshot": {"chunk_bytes": "1MiB", "pack_threshold": "4KiB",
                     "staging_budget": budget}}))


def make_state(count: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    # 1.5 MiB each: one 2 MiB staging buffer per tensor
    return {f"w{i}": torch.randn(384 * 1024, generator=g) for i in range(count)}


def async_save_then_mutate(store: SnapshotStore, state: dict[str, torch.Tensor],
                           name: str) -> IsolaneStorageWriter:
    writer = IsolaneStorageWriter(store, name)
    fut = dcp.async_save(state, storage_writer=writer)
    for t in state.values():  # the next training step
        t.add_(1.0)
    fut.result()
    return writer


def test_a_state_larger_than_the_budget_saves_within_it(tmp_path: Path) -> None:
    store = open_store(tmp_path, "8MiB")
    state = make_state(8)  # 12 MiB of tensors, 16 MiB of staging buffers
    expected = {k: v.clone() for k, v in state.items()}
    writer = async_save_then_mutate(store, state, "big")
    assert 0 < writer.staged_bytes < sum(t.nbytes for t in expected.values())
    assert store.staging.peak_allocated_bytes <= 8 * MiB
    assert store.staging.in_use_bytes == 0  # every staged buffer went back
    into = {k: torch.zeros_like(v) for k, v in expected.items()}
    dcp.load(into, storage_reader=IsolaneStorageReader(store, "big"))
    for k, v in expected.items():
        assert torch.equal(into[k], v), k


def test_a_state_within_the_budget_is_staged_whole_and_returns_at_once(
        tmp_path: Path) -> None:
    store = open_store(tmp_path, "64MiB")
    state = make_state(4)
    expected = {k: v.clone() for k, v in state.items()}
    writer = IsolaneStorageWriter(store, "small")
    staged = writer.stage(state)
    assert not writer.should_synchronize_after_execute
    assert writer.staged_bytes == sum(t.nbytes for t in expected.values())
    assert store.staging.in_use_bytes == 4 * 2 * MiB
    writer.release_staging()
    assert store.staging.in_use_bytes == 0
    for k in state:
        assert torch.equal(staged[k], expected[k])
    writer = async_save_then_mutate(store, state, "small")
    assert store.staging.in_use_bytes == 0
    into = {k: torch.zeros_like(v) for k, v in expected.items()}
    dcp.load(into, storage_reader=IsolaneStorageReader(store, "small"))
    for k, v in expected.items():
        assert torch.equal(into[k], v), k


def test_a_save_that_fails_before_writing_lets_the_caller_go(tmp_path: Path) -> None:
    store = open_store(tmp_path, "8MiB")
    state = make_state(8)
    async_save_then_mutate(store, state, "taken")
    writer = IsolaneStorageWriter(store, "taken")  # exists: refused in planning
    fut = dcp.async_save(state, storage_writer=writer)  # must not hang
    with pytest.raises(CheckpointException, match="already exists"):
        fut.result(timeout=60)
    deadline = time.monotonic() + 10
    while store.staging.in_use_bytes and time.monotonic() < deadline:
        time.sleep(0.01)  # the buffers go back once the save's thread is gone
    assert store.staging.in_use_bytes == 0
