"""A failed save's clean-up removes its name folder only when it is empty, in one step:
a save of the same name in another process may be creating its generation there."""

from __future__ import annotations

from pathlib import Path

from isolane.snapshot.catalog import remove_if_empty
from isolane.storage.local import LocalBlobStore


def test_an_empty_name_folder_goes_and_a_folder_in_use_stays(tmp_path: Path) -> None:
    store = LocalBlobStore(tmp_path / "dev")
    (tmp_path / "dev" / "snapshots" / "empty").mkdir(parents=True)
    starting = tmp_path / "dev" / "snapshots" / "busy" / "0001-abc"
    starting.mkdir(parents=True)  # another process's save, its marker not written yet
    remove_if_empty(store, "snapshots/empty")
    remove_if_empty(store, "snapshots/busy")
    remove_if_empty(store, "snapshots/missing")
    assert not (tmp_path / "dev" / "snapshots" / "empty").exists()
    assert starting.is_dir()


def test_a_linked_parent_is_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    (outside / "victim").mkdir(parents=True)
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "snapshots").symlink_to(outside, target_is_directory=True)
    remove_if_empty(LocalBlobStore(tmp_path / "dev"), "snapshots/victim")
    assert (outside / "victim").is_dir()
