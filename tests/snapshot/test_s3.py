"""Snapshots on a real SeaweedFS S3 server: direct saves, mirrors, outages."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from isolane import SnapshotStore
from isolane.config import config_from_dict
from isolane.errors import IntegrityError
from isolane.storage.fsspec_store import FsspecBlobStore
from tests.snapshot.conftest import assert_same
from tests.support.seaweedfs import SeaweedServer

pytestmark = pytest.mark.s3


def _state(seed: int, n: int = 6) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {"model": {f"w{i}": torch.randn(256, 1024, generator=gen) for i in range(n)},
            "bias": torch.randn(100, generator=gen), "step": seed}


def _mirror_config(local: Path, url: str, options: dict[str, Any], **snapshot: Any) -> Any:
    return config_from_dict({
        "device_groups": {
            "ckpt": {"role": "write", "devices": [str(local)]},
            "cold": {"role": "capacity", "devices": [url], "storage_options": options},
        },
        "snapshot": {"chunk_bytes": "1MiB", "mirror": True, **snapshot}})


def test_save_directly_to_s3(s3_url: tuple[str, dict[str, Any]]) -> None:
    url, options = s3_url
    store = SnapshotStore(url, storage_options=options)
    base = _state(1)
    first = store.save(base, "s0")
    assert first.url.startswith(url)
    assert_same(base, store.load("s0"))
    assert_same({"model": {"w2": base["model"]["w2"]}}, store.load("s0", keys=["model.w2"]))
    base["bias"].add_(1)
    second = store.save(base, "s1")  # unchanged chunks: server-side copies
    assert second.linked_bytes >= 6 * 256 * 1024 * 4
    store.verify("s1")
    assert [i.name for i in store.list()] == ["s0", "s1"]
    store.delete("s0")
    assert_same(base, SnapshotStore(url, storage_options=options).load("s1"))
    store.gc(keep_last=1)
    assert [i.name for i in store.list()] == ["s1"]


def test_damaged_object_on_s3_fails_verify(s3_url: tuple[str, dict[str, Any]]) -> None:
    url, options = s3_url
    store = SnapshotStore(url, storage_options=options)
    store.save(_state(2), "s")
    chunk = next(c for c in store.manifest("s").chunks if c.key.startswith("model/w3/"))
    key = f"snapshots/s/{store.manifest('s').generation}/{chunk.key}"
    data = bytearray(store.stores[0].read(key))
    data[100] ^= 1
    store.stores[0].write(key, bytes(data))
    with pytest.raises(IntegrityError, match=r"model\.w3"):
        store.verify("s")
    with pytest.raises(IntegrityError):
        store.load("s")


def test_mirror_and_restore_from_mirror(tmp_path: Path,
                                        s3_url: tuple[str, dict[str, Any]]) -> None:
    url, options = s3_url
    store = SnapshotStore(_mirror_config(tmp_path / "local", url, options))
    state = _state(3)
    info = store.save(state, "m0")
    assert store.wait_for_mirrors(timeout=60) == {"m0": None}
    assert store.info("m0").mirrored is True
    state["bias"].add_(1)
    store.save(state, "m1")  # incremental locally and on the mirror
    assert store.wait_for_mirrors(timeout=60) == {"m0": None, "m1": None}
    shutil.rmtree(tmp_path / "local" / "snapshots")  # the local disk is gone
    fresh = SnapshotStore(_mirror_config(tmp_path / "local", url, options))
    listed = {i.name: i.location for i in fresh.list()}
    assert listed == {"m0": "mirror", "m1": "mirror"}
    assert_same(state, fresh.load("m1"))
    fresh.verify("m1")
    assert fresh.info("m0").generation == info.generation


def test_a_fresh_store_restores_from_the_mirror_without_an_s3fs_client(
        tmp_path: Path, s3_url: tuple[str, dict[str, Any]]) -> None:
    """With endpoint and key/secret in the options, finding the snapshot (listing,
    manifest) and reading it are presigned GETs: the aiobotocore client s3fs creates on
    its first call (~0.05 s of CPU) is never made by a restore."""
    url, options = s3_url
    store = SnapshotStore(_mirror_config(tmp_path / "local", url, options))
    state = _state(7, n=2)
    store.save(state, "r")
    assert store.wait_for_mirrors(timeout=60) == {"r": None}
    store.close()
    shutil.rmtree(tmp_path / "local" / "snapshots")
    fresh = SnapshotStore(_mirror_config(tmp_path / "local", url, options))
    assert_same(state, fresh.load("r"))
    assert fresh.mirror_store is not None
    assert fresh.mirror_store._fs._s3 is None  # type: ignore[attr-defined]
    fresh.close()


@pytest.mark.parametrize("damage", ["deleted", "flipped", "truncated"])
def test_restore_from_mirror_by_ranges_names_a_damaged_object(
        tmp_path: Path, s3_url: tuple[str, dict[str, Any]], monkeypatch: Any,
        damage: str) -> None:
    url, options = s3_url
    monkeypatch.setattr(FsspecBlobStore, "read_part_bytes", 192 << 10)  # 6 ranges a chunk
    store = SnapshotStore(_mirror_config(tmp_path / "local", url, options))
    state = _state(4)
    store.save(state, "r")
    assert store.wait_for_mirrors(timeout=60) == {"r": None}
    shutil.rmtree(tmp_path / "local" / "snapshots")  # restores now read the mirror
    fresh = SnapshotStore(_mirror_config(tmp_path / "local", url, options))
    assert fresh.info("r").location == "mirror"
    assert_same(state, fresh.load("r"))  # every chunk in concurrent ranged GETs
    manifest = fresh.manifest("r")
    chunk = next(c for c in manifest.chunks if c.key.startswith("model/w3/"))
    key = f"snapshots/r/{manifest.generation}/{chunk.key}"
    mirror = fresh.mirror_store
    assert mirror is not None
    if damage == "deleted":
        mirror.delete(key)
    else:
        data = bytearray(mirror.read(key))
        data[len(data) // 2] ^= 1
        mirror.write(key, bytes(data if damage == "flipped" else data[:len(data) // 3]))
    with pytest.raises(IntegrityError, match=r"tensor 'model\.w3'"):
        SnapshotStore(_mirror_config(tmp_path / "local", url, options)).load("r")
    partial = SnapshotStore(_mirror_config(tmp_path / "local", url, options)).load(
        "r", keys=["model.w1"])  # what is intact still restores
    assert torch.equal(partial["model"]["w1"], state["model"]["w1"])


def test_s3_outage_mid_mirror_keeps_local_snapshot_and_retries(
        tmp_path: Path, fresh_s3_server: SeaweedServer) -> None:
    server = fresh_s3_server
    bucket = server.create_bucket()
    url, options = f"s3://{bucket}/cold", server.storage_options
    store = SnapshotStore(_mirror_config(tmp_path / "local", url, options,
                                         mirror_attempts=2, mirror_backoff_s=0.2))
    state = _state(4, n=48)  # 48 MiB: the mirror is still uploading when the server dies
    store.save(state, "big")
    server.kill()
    errors = store.wait_for_mirrors(timeout=120)
    assert errors["big"] is not None and "StorageError" in errors["big"]
    assert store.info("big").mirrored is None  # unknown while the server is down
    assert_same(state, store.load("big"))  # the local snapshot is untouched
    store.verify("big")
    server.start()
    assert store.sync_mirrors() == ["big"]
    assert store.wait_for_mirrors(timeout=120)["big"] is None
    assert store.info("big").mirrored is True
    shutil.rmtree(tmp_path / "local" / "snapshots")
    assert_same(state, store.load("big"))


def test_unreachable_capacity_does_not_block_local_saves(tmp_path: Path) -> None:
    options = {"key": "x", "secret": "y",
               "client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}}
    store = SnapshotStore(_mirror_config(tmp_path / "local", "s3://nowhere/cold", options,
                                         mirror_attempts=1, mirror_backoff_s=0.0))
    started = time.monotonic()
    store.save({"w": torch.ones(10)}, "a")
    assert time.monotonic() - started < 10
    assert "StorageError" in (store.wait_for_mirrors(timeout=60)["a"] or "")
    assert [i.name for i in store.list()] == ["a"]
    assert torch.equal(store.load("a")["w"], torch.ones(10))
