"""Crash and damage: killed saves, full disks and flipped bytes never tear a snapshot."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from isolane import SnapshotStore
from isolane.config import config_from_dict
from isolane.errors import CapacityError, IntegrityError
from tests.snapshot.conftest import assert_same
from tests.support.damage import flip_byte


def _state(seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {"model": {f"w{i}": torch.randn(256, 1024, generator=gen) for i in range(24)},
            "small": {f"b{i}": torch.randn(64, generator=gen) for i in range(50)},
            "step": seed}


def _config(root: Path) -> Any:
    return config_from_dict({
        "device_groups": {"ckpt": {"role": "write", "devices": [str(root / "a"),
                                                                 str(root / "b")]}},
        "snapshot": {"chunk_bytes": "1MiB", "pack_threshold": "64KiB"}})


CHILD = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {repo!r})
    from tests.snapshot.test_faults import _config, _state
    from isolane import SnapshotStore
    from pathlib import Path
    store = SnapshotStore(_config(Path({root!r})))
    def progress(done, total):
        print("P", done, total, flush=True)
        time.sleep(0.01)
    if {use_async}:
        handle = store.save_async(_state(2), "next", progress=progress)
        print("STAGED", flush=True)
        handle.result()
    else:
        store.save(_state(2), "next", progress=progress)
    print("COMMITTED", flush=True)
    time.sleep(60)
""")


@pytest.mark.parametrize(("kill_after", "use_async"), [
    (1, False), (8, False), (16, False), ("last", False), ("COMMITTED", False),
    ("STAGED", True), (10, True)])
def test_sigkill_during_save_never_tears_a_snapshot(
        tmp_path: Path, kill_after: int | str, use_async: bool) -> None:
    store = SnapshotStore(_config(tmp_path))
    store.save(_state(1), "prev")
    repo = str(Path(__file__).resolve().parents[2])
    code = CHILD.format(repo=repo, root=str(tmp_path), use_async=use_async)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    seen = 0
    for line in child.stdout:
        if line.startswith("P "):  # progress lines only, not other output
            seen += 1
            _, done, total = line.split()
            last = done == total
        if (kill_after == seen or (kill_after == "last" and line.startswith("P ") and last)
                or line.strip() == kill_after):
            break
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert child.returncode == -signal.SIGKILL

    after = SnapshotStore(_config(tmp_path))
    names = [i.name for i in after.list()]
    assert names[0] == "prev" and set(names) <= {"prev", "next"}
    assert_same(_state(1), after.load("prev"))
    if kill_after == "COMMITTED":
        assert names == ["prev", "next"]
    if isinstance(kill_after, int):
        assert seen == kill_after  # really killed mid-save, not after it
    if "next" in names:
        assert_same(_state(2), after.load("next"))
        after.verify("next")
    after.gc()
    for device in ("a", "b"):
        gens = list((tmp_path / device / "snapshots").glob("*/*"))
        assert len(gens) == len(names), gens  # leftovers of the killed save are swept
    assert_same(_state(1), after.load("prev"))


def test_disk_full_mid_save_keeps_previous_snapshot(tmpfs: Any) -> None:
    where = tmpfs("24m")
    config = config_from_dict({
        "device_groups": {"ckpt": {"role": "write", "devices": [str(where)]}},
        "snapshot": {"chunk_bytes": "1MiB"}})
    store = SnapshotStore(config)
    prev = {"w": torch.randn(1 << 20)}  # 4 MiB
    store.save(prev, "prev")
    with pytest.raises(CapacityError, match="full") as err:
        store.save({"w": torch.randn(8 << 20)}, "huge", parent=False)  # 32 MiB
    assert "isolane gc" in str(err.value)
    assert [i.name for i in store.list()] == ["prev"]
    assert_same(prev, store.load("prev"))
    assert [p.name for p in (where / "snapshots").iterdir()] == ["prev"]
    store.save({"w": torch.randn(1 << 20)}, "after")  # space came back: saving works again


def test_flipped_byte_in_a_chunk_fails_verify_and_load(tmp_path: Path) -> None:
    store = SnapshotStore(_config(tmp_path))
    store.save(_state(1), "s")
    manifest = store.manifest("s")
    chunk = next(c for c in manifest.chunks if c.key.startswith("model/w7/"))
    device = tmp_path / ("a" if chunk.device == 0 else "b")
    flip_byte(device / "snapshots" / "s" / manifest.generation / chunk.key, 12345)
    with pytest.raises(IntegrityError, match=r"model\.w7") as err:
        store.verify("s")
    assert chunk.key in str(err.value)
    with pytest.raises(IntegrityError, match=r"model\.w7"):
        store.load("s")
    # Other tensors are still readable on their own.
    assert_same(_state(1)["model"]["w3"], store.load("s", keys=["model.w3"])["model"]["w3"])


def test_flipped_byte_in_a_pack_and_truncated_or_missing_chunks(tmp_path: Path) -> None:
    store = SnapshotStore(_config(tmp_path))
    store.save(_state(1), "s")
    manifest = store.manifest("s")
    gen_dir = {d: tmp_path / d / "snapshots" / "s" / manifest.generation for d in ("a", "b")}
    pack = next(t for t in manifest.tensors if t.key == "small.b3").pack
    assert pack is not None
    pack_chunk = next(c for c in manifest.chunks if c.key == f"{pack.array}/c.0")
    flip_byte(gen_dir["ab"[pack_chunk.device]] / pack_chunk.key, pack.offset + 5)
    with pytest.raises(IntegrityError, match=r"small\.b3"):
        store.load("s", keys=["small.b3"])
    with pytest.raises(IntegrityError):
        store.load("s", keys=["small"])
    chunk = next(c for c in manifest.chunks if c.key.startswith("model/w1/"))
    path = gen_dir["ab"[chunk.device]] / chunk.key
    os.truncate(path, 100)
    with pytest.raises(IntegrityError, match=r"truncated|holds"):
        store.load("s", keys=["model.w1"])
    with pytest.raises(IntegrityError):
        store.verify("s")
    path.unlink()
    with pytest.raises(IntegrityError, match="missing"):
        store.load("s", keys=["model.w1"])


def test_corrupt_manifest_is_an_integrity_error(tmp_path: Path) -> None:
    store = SnapshotStore(str(tmp_path))
    store.save({"w": torch.ones(3)}, "s")
    manifest_path = Path(store.path("s")) / "isolane.json"
    body = json.loads(manifest_path.read_text())
    body["version"] = 99
    manifest_path.write_text(json.dumps(body))
    with pytest.raises(IntegrityError, match="upgrade isolane"):
        SnapshotStore(str(tmp_path)).load("s")
