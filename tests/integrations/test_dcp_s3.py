"""torch.distributed.checkpoint on isolane with S3 (a real SeaweedFS): straight to
``s3://``, and mirrored from a local disk, restored from the mirror once the local copy
is gone, retention applied to DCP checkpoints like any snapshot. One process (DCP
without a process group); the multi-rank paths are tests/integrations/test_dcp.py's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from isolane import SnapshotStore
from isolane.config import config_from_dict
from isolane.integrations.dcp import IsolaneStorageReader, IsolaneStorageWriter
from tests.integrations.test_dcp import lines, run_world

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


@pytest.mark.parametrize("devices", [(1, 2), (2, 1)],
                         ids=["coordinator-fewer", "coordinator-more"])
def test_ranks_on_two_hosts_write_their_own_disks_and_meet_on_the_mirror(
        tmp_path: Path, s3_url: tuple[str, dict[str, Any]], devices: tuple[int, int]) -> None:
    """Two hosts whose write groups may have different device counts: each part's
    chunks count devices in the group of the host that wrote them."""
    url, options = s3_url
    options = {k: v for k, v in options.items() if k != "session"}  # for other processes
    for rank in (0, 1):
        config = {"device_groups": {
            "ckpt": {"role": "write", "devices": [str(tmp_path / f"host-{rank}" / f"d{d}")
                                                  for d in range(devices[rank])]},
            "cold": {"role": "capacity", "devices": [url], "storage_options": options}},
            # small tensors get chunks of their own, striped over every device
            "snapshot": {"chunk_bytes": "1MiB", "pack_threshold": "4KiB", "mirror": True}}
        (tmp_path / f"store-{rank}.json").write_text(json.dumps(config))
    codes = run_world(tmp_path, "hosts", 2)
    crashes = lines(tmp_path, "hosts", "CRASH")
    assert not crashes, crashes[0]
    assert codes == [0, 0]
    assert sorted(lines(tmp_path, "hosts", "MIRRORED")) == [
        "MIRRORED h1 [None]", "MIRRORED h1 [None]", "MIRRORED h2 [None, None]",
        "MIRRORED h2 [None, None]"]
    # host 0 reads its own part from its disk and host 1's from the mirror; host 1,
    # which holds no manifest, reads everything from the mirror
    assert sorted(lines(tmp_path, "hosts", "HOSTLOAD")) == [
        "HOSTLOAD h1 local diff=''", "HOSTLOAD h1 mirror diff=''",
        "HOSTLOAD h2 local diff=''", "HOSTLOAD h2 mirror diff=''"]
    assert lines(tmp_path, "hosts", "LINKED") == ["LINKED True"]
    host0 = config_from_dict(json.loads((tmp_path / "store-0.json").read_text()))
    with SnapshotStore(host0) as store:
        store.verify("h2")  # its own chunks here, host 1's on the mirror
        manifest = store.manifest("h2")
        assert manifest.dcp["remote_ranks"] == [1]  # type: ignore[index]
        for rank in (0, 1):  # each part striped over every device of its own host
            used = {c.device for c in manifest.chunks
                    if c.key.startswith(manifest.ranks[rank].prefix + "/")}
            assert used == set(range(devices[rank])), (rank, used)
        assert len(manifest.ranks[1].devices or manifest.devices) == devices[1]
