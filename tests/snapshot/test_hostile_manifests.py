"""A hostile or damaged manifest is one DAMAGED row: nesting 100k deep, a tree of an
unknown kind (its checksum recomputed), a dtype that is not one. It never blocks list,
save or gc, and the CLI names it without a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from isolane import SnapshotStore
from isolane.errors import IntegrityError
from isolane.snapshot.manifest import MANIFEST, content_checksum
from tests.cli.helpers import fails, run
from tests.snapshot.test_store import _small_config

DEEP = 100_000


def _store_with(tmp_path: Path) -> tuple[SnapshotStore, Path]:
    store = SnapshotStore(_small_config(tmp_path, keep_last=5))
    store.save({"w": torch.randn(1000), "step": 1}, "a")
    store.save({"w": torch.randn(1000), "step": 2}, "b")
    return store, Path(store.path("b")) / MANIFEST


def _rewrite_tree(manifest: Path, tree: object) -> None:
    """The tree replaced and the checksum recomputed, as a careful attacker would."""
    body = json.loads(manifest.read_bytes())
    body.pop("checksum")
    body["tree"] = tree
    body["checksum"] = content_checksum(body)
    manifest.write_text(json.dumps(body))


def test_a_manifest_nested_100k_deep_is_one_damaged_row(tmp_path: Path) -> None:
    _store, manifest = _store_with(tmp_path)
    raw = manifest.read_bytes()
    manifest.write_bytes(raw.replace(b'"tree":', b'"deep":' + b"[" * DEEP + b"]" * DEEP
                                     + b',"tree":', 1))
    store = SnapshotStore(_small_config(tmp_path, keep_last=5))
    assert [i.name for i in store.list()] == ["a"]
    assert [d.name for d in store.damaged()] == ["b"]
    with pytest.raises(IntegrityError, match="deeper"):
        store.info("b")
    assert store.save({"w": torch.ones(4)}, "c").parent["name"] == "a"  # type: ignore[index]
    report = store.gc(keep_last=1)
    assert [d.name for d in report.damaged] == ["b"] and manifest.is_file()
    folder = str(tmp_path / "d0")
    for args in (("ls",), ("gc",), ("verify", "b"), ("show", "b")):
        result = run("--store", folder, *args)
        fails(result, 2)
        assert "Traceback" not in result.output + result.stderr, args


@pytest.mark.parametrize("tree", [
    {"t": "pickle", "v": "gASVAAAAAAAAAAA="},
    {"t": "dict", "items": [["x", {"t": "dtype", "v": "load"}]]},
    {"t": "dict", "items": [["x", {"t": "bytes", "v": "!!not base64!!"}]]},
    {"t": "dict", "items": "nope"},
    [1, 2],
])
def test_a_tree_of_unknown_shape_is_the_librarys_error(tmp_path: Path, tree: object) -> None:
    _store, manifest = _store_with(tmp_path)
    _rewrite_tree(manifest, tree)
    store = SnapshotStore(_small_config(tmp_path, keep_last=5))
    for call in (store.load, store.info, store.verify):
        with pytest.raises(IntegrityError, match="tree"):
            call("b")
    assert [d.name for d in store.damaged()] == ["b"]
    assert store.load("a")["step"] == 1
