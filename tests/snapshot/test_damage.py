"""A damaged manifest is reported, never swept, and fails alone (issue 11, items 3, 5, 8).

- gc never deletes a generation whose manifest exists but cannot be read: it may be the
  only copy of a committed snapshot (item 3);
- ``list``/``ls`` show the healthy snapshots and mark the damaged one; new saves pick
  their parent among readable snapshots (item 5);
- gc spares a generation that has neither manifest nor marker while it is younger than
  the grace period: a save that has just made its folder (item 8).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import torch

from isolane import SnapshotStore
from isolane.errors import IntegrityError
from isolane.snapshot.manifest import MANIFEST
from isolane.snapshot.names import new_generation
from tests.cli.helpers import fails, run
from tests.snapshot.test_store import _small_config

DAMAGES = {
    "truncated": lambda raw: raw[: len(raw) // 2],
    "null": lambda raw: b"null",
    "garbage": lambda raw: b"\x00\xff" * 10,
    "empty": lambda raw: b"",
}


def _two_snapshots(tmp_path: Path, damage: str) -> tuple[SnapshotStore, Path]:
    store = SnapshotStore(_small_config(tmp_path, keep_last=5))
    store.save({"w": torch.randn(300_000), "step": 1}, "a")
    store.save({"w": torch.randn(300_000), "step": 2}, "b")
    manifest = Path(store.path("b")) / MANIFEST
    manifest.write_bytes(DAMAGES[damage](manifest.read_bytes()))
    return SnapshotStore(_small_config(tmp_path, keep_last=5)), manifest.parent


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_gc_never_sweeps_a_generation_whose_manifest_is_damaged(tmp_path: Path, damage: str
                                                                ) -> None:
    store, folder = _two_snapshots(tmp_path, damage)
    files = sorted(p.name for p in folder.rglob("*"))
    report = store.gc()
    report = store.gc(keep_last=1)
    assert sorted(p.name for p in folder.rglob("*")) == files
    assert report.swept_generations == ()
    assert [d.name for d in report.damaged] == ["b"]
    assert [i.name for i in store.list()] == ["a"]  # retention only counts readable ones


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_manifest_fails_alone(tmp_path: Path, damage: str) -> None:
    store, folder = _two_snapshots(tmp_path, damage)
    assert [i.name for i in store.list()] == ["a"]
    damaged = store.damaged()
    assert [(d.name, d.generation) for d in damaged] == [("b", folder.name)]
    assert str(folder / MANIFEST) in damaged[0].problem
    for call in (store.load, store.verify, store.info):
        with pytest.raises(IntegrityError, match=str(folder / MANIFEST)):
            call("b")
    info = store.save({"w": torch.randn(300_000), "step": 3}, "c")
    assert info.parent is not None and info.parent["name"] == "a"
    assert store.load("a")["step"] == 1
    with pytest.raises(FileExistsError):
        store.save({"w": torch.ones(1)}, "b")  # damaged is not absent


def test_ls_marks_a_damaged_snapshot_and_exits_2(tmp_path: Path) -> None:
    _store, folder = _two_snapshots(tmp_path, "truncated")
    result = fails(run("--store", str(tmp_path / "d0"), "ls"), 2, "damaged")
    assert "a" in result.output and "DAMAGED" in result.output and "b" in result.output
    result = run("--store", str(tmp_path / "d0"), "ls", "--json")
    assert result.exit_code == 2
    rows = json.loads(result.stdout)
    assert [(r["name"], r.get("damaged") is not None) for r in rows] == [("a", False),
                                                                           ("b", True)]
    fails(run("--store", str(tmp_path / "d0"), "verify", "b"), 2, "isolane.json")
    result = fails(run("--store", str(tmp_path / "d0"), "gc"), 2, "damaged")
    assert (folder / "w").is_dir()


def test_gc_spares_a_young_generation_without_marker_and_sweeps_an_old_one(
        tmp_path: Path) -> None:
    store = SnapshotStore(_small_config(tmp_path))
    store.save({"w": torch.ones(3)}, "x")
    names = tmp_path / "d0" / "snapshots" / "x"
    young = names / new_generation()
    old = names / f"{1_000_000_000 * 10**9:020d}-abcdef"
    for folder in (young, old):
        (folder / "w").mkdir(parents=True)
        (folder / "w" / "c.0").write_bytes(b"partial")
    report = store.gc()
    assert young.is_dir() and not old.exists()
    assert report.swept_generations == (f"local:x/{old.name}",)


def test_gc_removes_an_empty_name_folder_only_once_it_is_older_than_the_grace(
        tmp_path: Path) -> None:
    """Two failed racers of one name can each find the other's generation in the name
    folder when they discard, so neither removes it (the chaos soak's orphan): gc takes
    an empty name folder once nothing has changed in it for gc_grace_s."""
    store = SnapshotStore(_small_config(tmp_path))
    store.save({"w": torch.ones(3)}, "x")
    root = tmp_path / "d0" / "snapshots"
    stale, fresh = root / "stale", root / "fresh"
    stale.mkdir()
    fresh.mkdir()
    long_ago = 1_000_000_000
    os.utime(stale, (long_ago, long_ago))
    store.gc()
    assert not stale.exists() and fresh.is_dir()
    assert [i.name for i in store.list()] == ["x"]


def test_gc_running_beside_many_starting_saves_breaks_none(tmp_path: Path) -> None:
    store = SnapshotStore(_small_config(tmp_path))
    collector = SnapshotStore(_small_config(tmp_path))
    stop = threading.Event()
    errors: list[BaseException] = []

    def collect() -> None:
        while not stop.is_set():
            try:
                collector.gc()
            except BaseException as exc:
                errors.append(exc)

    thread = threading.Thread(target=collect)
    thread.start()
    try:
        for i in range(150):
            store.save({"w": torch.full((8,), float(i))}, f"s{i}")
    finally:
        stop.set()
        thread.join()
    assert errors == []
    assert len(store.list()) == 150
    assert all(store.load(f"s{i}")["w"][0] == i for i in range(0, 150, 10))
