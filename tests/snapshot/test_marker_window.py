"""A save killed while it publishes its writing marker leaves nothing gc keeps.

The marker (``_writing.json``) tells gc that a live writer owns a generation folder.
A writer killed after the folder appeared but before its marker did would leave a
folder gc cannot judge (no manifest, no marker) and keeps for ``gc_grace_s``. The
child processes below stop or die exactly at the step that publishes the marker (a
rename), on a real filesystem.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from isolane import SnapshotStore
from isolane.config import config_from_dict
from isolane.snapshot.names import ROOT, new_generation, prefix_of

CHILD = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {repo!r})
    from isolane.snapshot.marker import mark_writing
    from isolane.storage.local import LocalBlobStore
    store = LocalBlobStore({root!r})
    def publish(*args, **kwargs):  # the step that makes the marker visible
        print("PUBLISHING", flush=True)
        os.kill(os.getpid(), signal.{signal})
    os.rename = os.replace = publish
    mark_writing(store, {prefix!r})
    print("UNREACHED", flush=True)
""")


def _store(root: Path) -> SnapshotStore:
    return SnapshotStore(config_from_dict({
        "device_groups": {"ckpt": {"role": "write", "devices": [str(root)]}}}))


def _start_child(root: Path, prefix: str, sig: str) -> subprocess.Popen[str]:
    repo = str(Path(__file__).resolve().parents[2])
    code = CHILD.format(repo=repo, root=str(root), prefix=prefix, signal=sig)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "PUBLISHING"
    return child


def _leftovers(root: Path, name: str) -> list[str]:
    folder = root / ROOT / name
    return sorted(os.listdir(folder)) if folder.exists() else []


def test_writer_killed_while_publishing_its_marker_is_swept_at_once(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.save({"w": torch.arange(4.0)}, "keep")  # default gc_grace_s: an hour
    prefix = prefix_of("next", new_generation())
    child = _start_child(tmp_path, prefix, "SIGKILL")
    child.wait()
    assert child.returncode == -signal.SIGKILL
    assert [i.name for i in store.list()] == ["keep"]
    store.gc()
    assert _leftovers(tmp_path, "next") == []  # no markerless folder kept for an hour
    assert torch.equal(store.load("keep")["w"], torch.arange(4.0))


def test_writer_stopped_while_publishing_is_left_alone_until_it_dies(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = _store(tmp_path)
    prefix = prefix_of("next", new_generation())
    child = _start_child(tmp_path, prefix, "SIGSTOP")
    try:
        with caplog.at_level(logging.WARNING):
            store.gc()
            assert store.list() == []
        assert _leftovers(tmp_path, "next") != []  # a live writer's work is not swept
        assert "not a generation folder" not in caplog.text  # nor reported as foreign
    finally:
        child.kill()
        child.wait()
    deadline = time.monotonic() + 5
    while _leftovers(tmp_path, "next") and time.monotonic() < deadline:
        store.gc()
    assert _leftovers(tmp_path, "next") == []
