"""atomic_write and remove_tree on a real folder."""

from __future__ import annotations

import os
from array import array
from pathlib import Path

import pytest

from isolane.errors import StorageError
from isolane.storage.files import atomic_write, is_strictly_inside, remove_tree


def test_atomic_write_replaces_whole_file_with_mode(tmp_path: Path) -> None:
    path = tmp_path / "meta.json"
    path.write_text("old")
    atomic_write(path, '{"new": 1}', mode=0o600)
    assert path.read_text() == '{"new": 1}'
    assert (path.stat().st_mode & 0o777) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["meta.json"]


def test_atomic_write_takes_bytes_like_data_and_parts(tmp_path: Path) -> None:
    path = tmp_path / "blob"
    words = array("I", [1, 2, 3])  # a multi-byte format: written as its bytes
    atomic_write(path, memoryview(words))
    assert path.read_bytes() == words.tobytes()
    atomic_write(path, [b"head:", bytearray(b"mid:"), memoryview(b"tail")[1:]])
    assert path.read_bytes() == b"head:mid:ail"
    atomic_write(path, ())
    assert path.read_bytes() == b""
    assert [p.name for p in tmp_path.iterdir()] == ["blob"]


def test_atomic_write_failure_keeps_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "blob"
    atomic_write(path, b"old")
    with pytest.raises(TypeError):
        atomic_write(path, [b"new", 42])  # type: ignore[list-item]
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["blob"]


def test_atomic_write_missing_folder_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        atomic_write(tmp_path / "gone" / "x", b"data")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["..", ".", ""])
def test_remove_tree_refuses_the_root_and_its_parent(tmp_path: Path, name: str) -> None:
    root = tmp_path / "root"
    (root / "keep").mkdir(parents=True)
    with pytest.raises(StorageError, match="refusing to delete"):
        remove_tree(root / name if name else root, within=root)
    assert (root / "keep").is_dir()


def test_remove_tree_refuses_a_path_through_a_linked_parent(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    (outside / "victim").mkdir(parents=True)
    root.mkdir()
    (root / "link").symlink_to(outside)
    assert not is_strictly_inside(root / "link" / "victim", root)
    with pytest.raises(StorageError):
        remove_tree(root / "link" / "victim", within=root)
    assert (outside / "victim").is_dir()


def test_remove_tree_unlinks_links_without_following_them(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("keep me")
    (root / "gen" / "sub").mkdir(parents=True)
    (root / "gen" / "sub" / "chunk").write_bytes(b"x")
    (root / "gen" / "to-dir").symlink_to(outside, target_is_directory=True)
    (root / "gen" / "sub" / "to-file").symlink_to(outside / "precious")
    (root / "top-link").symlink_to(outside)
    seen: list[Path] = []
    assert remove_tree(root / "gen", within=root, on_link=seen.append)
    assert remove_tree(root / "top-link", within=root, on_link=seen.append)
    assert sorted(p.name for p in seen) == ["to-dir", "to-file", "top-link"]
    assert not (root / "gen").exists() and not os.path.lexists(root / "top-link")
    assert (outside / "precious").read_text() == "keep me"


def test_remove_tree_missing_path_is_false(tmp_path: Path) -> None:
    assert remove_tree(tmp_path / "nothing", within=tmp_path) is False


def test_atomic_write_through_a_writer_function(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    path.write_bytes(b"old")
    atomic_write(path, lambda tmp: tmp.write_bytes(b"new contents"))
    assert path.read_bytes() == b"new contents"
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt"]


def test_atomic_write_writer_failure_keeps_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    path.write_bytes(b"old")

    def fail(tmp: Path) -> None:
        tmp.write_bytes(b"half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        atomic_write(path, fail)
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt"]


def test_atomic_write_without_overwrite_never_replaces(tmp_path: Path) -> None:
    path = tmp_path / "out.safetensors"
    atomic_write(path, b"first", overwrite=False)
    assert path.read_bytes() == b"first"
    with pytest.raises(FileExistsError):
        atomic_write(path, lambda tmp: tmp.write_bytes(b"second"), overwrite=False)
    assert path.read_bytes() == b"first"
    target = tmp_path / "target"
    target.write_bytes(b"keep")
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(FileExistsError):
        atomic_write(link, b"x", overwrite=False)
    assert target.read_bytes() == b"keep" and link.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "out.safetensors", "target"]
