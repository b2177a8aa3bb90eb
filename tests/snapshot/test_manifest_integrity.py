"""The manifest checks itself (issue 11, items 7 and 11, snapshot side).

A manifest carries an xxh3-128 checksum of its own content, checked on every open, and
its chunks must cover every tensor's bytes exactly: one changed digit of a shape made
``load`` return uninitialised memory and ``verify`` say OK. Malformed manifests
(``null``, unknown dtypes, negative shapes, device indices out of range) are
IntegrityErrors naming the file, never AttributeError/IndexError/RuntimeError, and the
CLI prints no traceback for them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from isolane import SnapshotStore
from isolane.config import config_from_dict
from isolane.errors import IntegrityError, InvalidArgumentError
from isolane.snapshot.manifest import MANIFEST, content_checksum
from tests.cli.helpers import fails, run
from tests.snapshot.conftest import assert_same
from tests.snapshot.test_store import _small_config

Body = dict[str, Any]


def _saved(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    state = {"big": torch.randn(1_000_000), "small": torch.arange(10), "step": 7}
    store = SnapshotStore(_small_config(tmp_path))
    store.save(state, "s")
    return Path(store.path("s")) / MANIFEST, state


def _edit(path: Path, change: Callable[[Body], None], *, keep_checksum: bool = True) -> None:
    body = json.loads(path.read_bytes())
    change(body)
    if not keep_checksum:
        body.pop("checksum", None)
    path.write_text(json.dumps(body, separators=(",", ":")))


def _big(body: Body) -> Body:
    return next(t for t in body["tensors"] if t["key"] == "big")


def _big_chunk(body: Body) -> Body:
    """A chunk of tensor ``big`` (the packs' chunks come first)."""
    return next(c for c in body["chunks"] if c["tensor"] == _big(body)["id"])


def test_a_changed_shape_digit_fails_load_verify_and_ls(tmp_path: Path) -> None:
    path, _state = _saved(tmp_path)
    raw = path.read_text()
    assert "[1000000]" in raw
    path.write_text(raw.replace("[1000000]", "[4000000]"))
    store = SnapshotStore(_small_config(tmp_path))
    for call in (store.load, store.verify):
        with pytest.raises(IntegrityError, match="checksum"):
            call("s")
    assert store.list() == [] and [d.name for d in store.damaged()] == ["s"]
    fails(run("--store", str(tmp_path / "d0"), "verify", "s"), 2, "checksum", MANIFEST)


def test_any_changed_byte_of_the_manifest_is_caught(tmp_path: Path) -> None:
    path, _state = _saved(tmp_path)
    _edit(path, lambda b: b["metadata"].update(evil=1))
    with pytest.raises(IntegrityError, match="checksum"):
        SnapshotStore(_small_config(tmp_path)).load("s")


def test_the_manifest_is_its_canonical_json_with_the_checksum_appended(tmp_path: Path
                                                                        ) -> None:
    """One encoding per write, and a reader hashes the bytes as they lie."""
    path, _state = _saved(tmp_path)
    raw = path.read_bytes()
    body = json.loads(raw)
    stored = body.pop("checksum")
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    assert raw == canonical[:-1] + b',"checksum":"' + stored.encode() + b'"}'
    assert stored == content_checksum(body)


def test_a_manifest_in_another_field_order_with_its_checksum_still_loads(tmp_path: Path
                                                                         ) -> None:
    """Files written by earlier versions (``format`` first, ``checksum`` last but not
    sorted) are checked by encoding their content canonically."""
    path, state = _saved(tmp_path)
    body = json.loads(path.read_bytes())
    first = {k: body.pop(k) for k in ("format", "version", "hash_algorithm")}
    checksum = body.pop("checksum")
    path.write_text(json.dumps({**first, **dict(reversed(body.items())),
                                "checksum": checksum}, separators=(",", ":")))
    store = SnapshotStore(_small_config(tmp_path))
    assert_same(store.load("s"), state)
    store.verify("s")
    path.write_text(path.read_text().replace('"step"', '"stop"', 1))
    with pytest.raises(IntegrityError, match="checksum"):
        SnapshotStore(_small_config(tmp_path)).load("s")


@pytest.mark.parametrize(("change", "match"), [
    (lambda b: _big(b).update(shape=[4000000]), "cover"),
    (lambda b: _big(b).update(shape=[250000]), "cover"),
    (lambda b: _big(b).update(dtype="float64"), "cover"),
    (lambda b: _big(b).update(dtype="float99"), "dtype"),
    (lambda b: _big(b).update(shape=[-1]), "shape"),
    (lambda b: _big(b).update(shape="x"), "shape"),
    (lambda b: b["chunks"][0].update(device=5), "device"),
    (lambda b: _big_chunk(b).update(offset=8), "cover"),
    (lambda b: b["chunks"][0].update(nbytes=b["chunks"][0]["stored"] + 1), "stored"),
    (lambda b: b["chunks"].remove(_big_chunk(b)), "cover"),
    (lambda b: next(t for t in b["tensors"] if t["key"] == "small")["pack"].update(
        nbytes=8), "pack"),
    (lambda b: b.update(tensors=None), "unreadable"),
])
def test_a_manifest_whose_chunks_do_not_cover_its_tensors_is_refused(
        tmp_path: Path, change: Callable[[Body], None], match: str) -> None:
    """Without the checksum (an older manifest, or one rewritten consistently), the
    coverage check still refuses it."""
    path, _state = _saved(tmp_path)
    _edit(path, change, keep_checksum=False)
    store = SnapshotStore(_small_config(tmp_path))
    with pytest.raises(IntegrityError, match=match) as info:
        store.load("s")
    assert MANIFEST in str(info.value)
    fails(run("--store", str(tmp_path / "d0"), "verify", "s"), 2, MANIFEST)
    fails(run("--store", str(tmp_path / "d0"), "ls"), 2, "damaged")


def test_null_manifest_is_an_integrity_error(tmp_path: Path) -> None:
    path, _state = _saved(tmp_path)
    path.write_text("null")
    with pytest.raises(IntegrityError, match="JSON object"):
        SnapshotStore(_small_config(tmp_path)).load("s")
    fails(run("--store", str(tmp_path / "d0"), "show", "s"), 2, MANIFEST)


def test_a_manifest_without_checksum_from_an_older_writer_still_loads(tmp_path: Path
                                                                      ) -> None:
    path, state = _saved(tmp_path)
    _edit(path, lambda b: None, keep_checksum=False)
    store = SnapshotStore(_small_config(tmp_path))
    assert_same(store.load("s"), state)
    store.verify("s")


def test_a_snapshot_saved_over_more_devices_than_configured_names_the_config(
        tmp_path: Path) -> None:
    two = config_from_dict({
        "device_groups": {"ckpt": {"role": "write", "devices": [str(tmp_path / "d0"),
                                                                 str(tmp_path / "d1")]}},
        "snapshot": {"chunk_bytes": "1MiB"}})
    SnapshotStore(two).save({"w": torch.randn(1_000_000)}, "s")
    one = SnapshotStore(_small_config(tmp_path))
    with pytest.raises(InvalidArgumentError, match="config that saved it"):
        one.load("s")
    fails(run("--store", str(tmp_path / "d0"), "restore", "s", str(tmp_path / "o.pt")), 1,
          "config that saved it")
