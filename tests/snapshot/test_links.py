"""Deletion and walking never follow a symbolic link out of the store (issue 11, item 4).

Links are planted at every level an attacker or a careless operator could reach: a
snapshot name, a generation, a folder and a chunk inside a committed generation (node
uploads stream into the store's writer: there is no spool folder to sweep). ``gc``,
``rm`` and the storage seam's ``delete_prefix`` must leave the canary tree outside the
store byte for byte as it was, and report the links they found.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from isolane import SnapshotStore
from isolane.storage.local import LocalBlobStore
from tests.snapshot.test_store import _small_config


def _canary(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    outside = tmp_path / "canary"
    files = {"precious.bin": b"keep me", "sub/deep.bin": b"deep", "0001-aaaaaa/isolane.json": b"{}"}
    for rel, data in files.items():
        (outside / rel).parent.mkdir(parents=True, exist_ok=True)
        (outside / rel).write_bytes(data)
    return outside, files


def _intact(outside: Path, files: dict[str, bytes]) -> None:
    found = {str(p.relative_to(outside)): p.read_bytes()
             for p in outside.rglob("*") if p.is_file()}
    assert found == files


def test_gc_and_rm_never_follow_links_planted_in_the_store(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    outside, files = _canary(tmp_path)
    store = SnapshotStore(_small_config(tmp_path))
    store.save({"w": torch.randn(300_000), "b": torch.ones(3)}, "good")
    snaps = tmp_path / "d0" / "snapshots"
    gen = Path(store.path("good"))
    (snaps / "evil-name").symlink_to(outside, target_is_directory=True)
    (snaps / "good" / "00000000000000000001-abcdef").symlink_to(outside)
    (gen / "planted-dir").symlink_to(outside, target_is_directory=True)
    (gen / "planted-file").symlink_to(outside / "precious.bin")
    with caplog.at_level(logging.WARNING):
        report = store.gc()
        assert report.deleted_snapshots == ()
        _intact(outside, files)
        assert "evil-name" in caplog.text
        store.delete("good")
        _intact(outside, files)
        with pytest.raises(FileNotFoundError):
            store.delete("evil-name")
        _intact(outside, files)
    assert "symbolic link" in caplog.text


def test_local_delete_prefix_through_a_linked_folder_touches_nothing_outside(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    outside, files = _canary(tmp_path)
    store = LocalBlobStore(tmp_path / "store")
    store.write("a/real/x", b"x")
    (tmp_path / "store" / "a" / "link").symlink_to(outside, target_is_directory=True)
    with caplog.at_level(logging.WARNING):
        store.delete_prefix("a/link/sub")
        store.delete("a/link/precious.bin")
        assert store.children("a/link") == []
        assert store.list("a/link") == []
        assert store.list("a") == ["a/real/x"]
        assert store.children("a") == ["real"]
        _intact(outside, files)
        store.delete_prefix("a")
    _intact(outside, files)
    assert not (tmp_path / "store" / "a").exists()
    assert "a/link" in caplog.text
