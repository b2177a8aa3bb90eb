"""The partial manifests of a multi-rank save: each rank writes its ``_part.json`` after
its data and leaves syncing both to the coordinator on its host, whose commit syncs
the write group once before the manifest.

The ranks' steps are driven from one process here (the save transaction's own calls,
as ``LocalPartSaves`` and the native multi-rank save take them)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from isolane import SnapshotStore
from isolane.snapshot.distributed import commit_parts, stores_to_sync
from isolane.snapshot.manifest import PART_MANIFEST, WRITING_MARKER, Manifest
from isolane.snapshot.sharding import part_prefix
from isolane.snapshot.transaction import SaveTransaction
from isolane.snapshot.tree import flatten_state
from isolane.snapshot.writer import SaveRequest
from isolane.storage import blob_store_from_url
from tests.snapshot.conftest import assert_same

WORLD = 2


def _state(rank: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(rank)
    return {f"w{rank}": torch.randn(64, 32, generator=gen),
            f"b{rank}": torch.randn(16, generator=gen)}


def _write_parts(store: SnapshotStore, name: str) -> tuple[SaveTransaction, list[str]]:
    saves = store.saves
    saves.claim()
    try:
        tx = saves.begin(name, overwrite=False, parent=None, mark=True)
        parts = []
        for rank in range(WORLD):
            tree, leaves = flatten_state(_state(rank))
            part = part_prefix(rank)
            request = tx.request(tree, leaves, {}, {}, stage_all=False, part=part)
            tx.write(request).future.result()
            parts.append(tx.part_json(part))
        return tx, parts
    finally:
        saves.release()


def _part_file(root: Path, tx: SaveTransaction, rank: int) -> Path:
    return root / tx.prefix / part_prefix(rank) / PART_MANIFEST


def test_each_rank_reports_the_part_manifest_it_wrote_and_the_commit_loads(
        tmp_path: Path) -> None:
    with SnapshotStore(str(tmp_path)) as store:
        tx, parts = _write_parts(store, "ckpt")
        for rank, text in enumerate(parts):
            on_disk = _part_file(tmp_path, tx, rank).read_bytes()
            assert on_disk.decode() == text  # serialised once: what was written is sent
            assert Manifest.from_json(on_disk, "part").tensors[0].key == f"w{rank}"
        store.saves.claim()
        try:
            info = commit_parts(tx, parts, [{} for _ in parts], {}, mirror=False,
                                started=time.perf_counter())
        finally:
            store.saves.release()
        assert info.name == "ckpt"
        store.verify("ckpt")
        for rank in range(WORLD):
            assert_same(store.load("ckpt", shard=(rank, WORLD)), _state(rank))


def test_a_commit_whose_part_manifest_is_gone_commits_nothing(tmp_path: Path) -> None:
    """The commit syncs every part manifest on its store before the manifest, so a
    committed generation never lacks one (a part that could not be synced is an error,
    and the generation is removed)."""
    with SnapshotStore(str(tmp_path)) as store:
        tx, parts = _write_parts(store, "ckpt")
        _part_file(tmp_path, tx, 1).unlink()
        store.saves.claim()
        try:
            with pytest.raises(FileNotFoundError, match=PART_MANIFEST):
                commit_parts(tx, parts, [{} for _ in parts], {}, mirror=False,
                             started=time.perf_counter())
        finally:
            store.saves.release()
        assert store.list() == []
        assert not (tmp_path / tx.prefix).exists()


def _part_request(store: SnapshotStore, tx: SaveTransaction) -> SaveRequest:
    tree, leaves = flatten_state(_state(1))
    return tx.request(tree, leaves, {}, {}, stage_all=False, part=part_prefix(1))


def test_a_part_beside_its_coordinators_marker_leaves_marker_and_sync_to_it(
        tmp_path: Path) -> None:
    """On the coordinator's host and write group the generation's marker guards the
    part from gc and the commit's one sync makes it durable: the rank writes no marker
    and waits for no journal commit of its own."""
    with SnapshotStore(str(tmp_path / "here")) as store:
        store.saves.claim()
        try:
            tx = store.saves.begin("ckpt", overwrite=False, parent=None, mark=True)
            request = _part_request(store, tx)
            assert (request.mark, request.sync) == (False, False)
            tx.write(request).future.result()
            assert not (tmp_path / "here" / tx.prefix / part_prefix(1) / WRITING_MARKER
                        ).exists()
            # the coordinator on another host (one shared file system): its sync
            # would not reach this host's writes
            marker = tmp_path / "here" / tx.prefix / WRITING_MARKER
            body = json.loads(marker.read_text())
            marker.write_text(json.dumps({**body, "host": "elsewhere"}))
            request = _part_request(store, tx)
            assert (request.mark, request.sync) == (False, True)
        finally:
            store.saves.release()
    with SnapshotStore(str(tmp_path / "other-host")) as other:  # no marker there
        joined = other.saves.join("ckpt", tx.generation, None, overwrite=False)
        request = _part_request(other, joined)
        assert (request.mark, request.sync) == (True, True)


def test_one_sync_covers_the_devices_that_share_a_file_system(tmp_path: Path) -> None:
    """The commit syncs each file system of the write group once: devices in folders
    of one disk share a sync; stores without local files each keep theirs."""
    a, b = blob_store_from_url(str(tmp_path / "a")), blob_store_from_url(str(tmp_path / "b"))
    memory = blob_store_from_url("memory://isolane-sync-test")
    assert stores_to_sync([a, b, memory]) == [a, memory]
    shm = Path("/dev/shm")
    if shm.is_dir() and os.stat(shm).st_dev != os.stat(tmp_path).st_dev:
        other = blob_store_from_url(str(shm / f"isolane-sync-test-{os.getpid()}"))
        assert stores_to_sync([a, other, b]) == [a, other]
