"""torch.distributed.checkpoint on isolane with S3 (a real SeaweedFS): straight to
``s3://``, and mirrored from a local disk, restored from the mirror once the local copy
is gone, retention applied to DCP checkpoints like any snapshot. One process (DCP
without a process group); the multi-rank paths are tests/integrations/test_dcp.py's."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from isolane import SnapshotStore
from isolane.config import config_from_dict
from isolane.integrations.dcp import IsolaneStorageReader, IsolaneStorageWriter

pytestmark = pytest.mark.s3


def _state(seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(512, 1024, generator=gen),
                      "b": torch.randn(64, generator=gen).to(torch.bfloat16)},
            "step": seed}


def _zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    return {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "step": 0}


def _mirror_config(local: Path, url: str, options: dict[str, Any], **snapshot: Any) -> Any:
    return config_from_dict({
        "device_groups": {
            "ckpt": {"role": "write", "devices": [str(local)]},
            "cold": {"role": "capacity", "devices": [url], "storage_options": options},
        },
        "snapshot": {"chunk_bytes": "1MiB", "mirror": True, **snapshot}})


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["step"] == b["step"] and all(torch.equal(a["model"][k], b["model"][k])
                                          for k in a["model"])


def test_dcp_straight_to_s3(s3_url: tuple[str, dict[str, Any]]) -> None:
    url, options = s3_url
    state = _state(1)
    with SnapshotStore(url, storage_options=options) as store:
        dcp.save(state, storage_writer=IsolaneStorageWriter(store, "s3-1"))
        store.verify("s3-1")
        back = _zeros_like(state)
        dcp.load(back, storage_reader=IsolaneStorageReader(store, "s3-1"))
    assert _same(state, back)


def test_dcp_mirrored_then_restored_from_the_mirror(
        tmp_path: Path, s3_url: tuple[str, dict[str, Any]]) -> None:
    url, options = s3_url
    state = _state(2)
    with SnapshotStore(_mirror_config(tmp_path / "local", url, options, keep_last=2)) as store:
        dcp.save(state, storage_writer=IsolaneStorageWriter(store, "m0"))
        state["model"]["b"].add_(1)  # the big tensor is unchanged: linked, then copied
        dcp.save(state, storage_writer=IsolaneStorageWriter(store, "m1"))
        assert store.info("m1").linked_bytes >= 512 * 1024 * 4
        assert store.wait_for_mirrors(timeout=60) == {"m0": None, "m1": None}
        dcp.save(state, storage_writer=IsolaneStorageWriter(store, "m2"))
        store.wait_for_mirrors(timeout=60)
        assert [i.name for i in store.list()] == ["m1", "m2"]  # keep_last=2
    shutil.rmtree(tmp_path / "local" / "snapshots")  # the local disk is gone
    with SnapshotStore(_mirror_config(tmp_path / "local", url, options)) as fresh:
        assert {i.name: i.location for i in fresh.list()} == {"m1": "mirror", "m2": "mirror"}
        back = _zeros_like(state)
        dcp.load(back, storage_reader=IsolaneStorageReader(fresh, "m2"))
        assert _same(state, back)
        assert _same(state, fresh.load("m2"))  # the native API reads it too
        fresh.verify("m2")


def test_a_store_opened_from_a_config_belongs_to_the_writer(
        s3_url: tuple[str, dict[str, Any]]) -> None:
    url, options = s3_url
    state = _state(4)
    target = config_from_dict({"device_groups": {"c": {
        "role": "write", "devices": [url], "storage_options": options}}})
    writer = IsolaneStorageWriter(target, "by-config")
    dcp.save(state, storage_writer=writer)
    writer.close()
    reader = IsolaneStorageReader(target, "by-config")
    back = _zeros_like(state)
    dcp.load(back, storage_reader=reader)
    reader.close()
    assert _same(state, back)
