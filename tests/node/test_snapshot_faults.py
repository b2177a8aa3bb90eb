"""Snapshot uploads and downloads that go wrong, with real node processes: a node killed
mid-upload, a client killed mid-upload, a disk that fills mid-upload, a wrong token,
chunk files damaged on the node. Nothing half-written ever becomes a snapshot, the
previous snapshot stays intact, and the client gets an error that says what happened."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from isolane.client.snapshot_store import RemoteSnapshotStore
from isolane.errors import (
    AuthenticationError,
    CapacityError,
    IntegrityError,
    NodeUnavailableError,
)
from tests.support.damage import flip_byte
from tests.support.node import NodeProcess, write_node_config
from tests.support.snapstreams import generation_files, upload_stream

TOKEN = "faults-token"


def _state(seed: int, mib: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {"model": {f"w{i}": torch.randn(256, 1024, generator=gen) for i in range(mib)},
            "small": torch.arange(10), "step": seed}


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["step"] == b["step"] and torch.equal(a["small"], b["small"])
    assert list(a["model"]) == list(b["model"])
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key


def _wait_gone(node: NodeProcess, name: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while generation_files(node, name) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert generation_files(node, name) == []


@pytest.fixture
def node(tmp_path: Path) -> Iterator[NodeProcess]:
    with NodeProcess(write_node_config(tmp_path), token=TOKEN) as proc:
        yield proc


def test_node_killed_mid_upload_commits_nothing_and_a_retry_saves(node: NodeProcess) -> None:
    store = RemoteSnapshotStore(node.url, token=TOKEN, retries=0)
    store.save(_state(1, 2), "before")
    state = _state(2, 48)

    def kill_half_way(done: int, total: int) -> None:
        if done > total // 2 and node.running:
            node.kill()

    with pytest.raises(NodeUnavailableError, match=node.url.removeprefix("http://")):
        store.save(state, "cut", progress=kill_half_way)
    assert any(generation_files(node, "cut"))  # the dead node left a partial generation
    node.start()
    assert [i.name for i in store.list()] == ["before"]  # nothing committed
    swept = store.gc()
    assert [g for g in swept.swept_generations if "cut/" in g]
    assert generation_files(node, "cut") == []
    store.save(state, "cut")  # the retry
    _same(state, store.load("cut"))
    _same(_state(1, 2), store.load("before"))
    store.close()


def test_client_killed_mid_upload_commits_nothing(node: NodeProcess, tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import os, signal, torch
        from isolane.client.snapshot_store import RemoteSnapshotStore
        state = {{"w": torch.randn(48 << 18)}}  # 48 MiB
        def die(done, total):
            if done > total // 2:
                os.kill(os.getpid(), signal.SIGKILL)
        RemoteSnapshotStore({node.url!r}, token={TOKEN!r}).save(state, "orphan", progress=die)
    """)
    proc = subprocess.run([sys.executable, "-c", script], env={**os.environ},
                          capture_output=True, timeout=120, check=False)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    _wait_gone(node, "orphan")  # the node removed the generation itself
    with RemoteSnapshotStore(node.url, token=TOKEN) as store:
        assert "orphan" not in [i.name for i in store.list()]
        state = {"w": torch.ones(1000)}
        store.save(state, "orphan")  # the node still serves, the name is free
        assert torch.equal(store.load("orphan")["w"], state["w"])


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 24 MiB tmpfs for the node's write group (the test needs root to mount it)."""
    mount = tmp_path / "small-disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m,mode=0700", "tmpfs",
                           str(mount)], capture_output=True, check=False)
    if done.returncode != 0:
        pytest.fail(f"cannot mount a tmpfs for the disk-full test: {done.stderr.decode()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_disk_full_mid_upload_keeps_the_previous_snapshot(tmp_path: Path,
                                                          small_disk: Path) -> None:
    config = write_node_config(tmp_path, device_groups={
        "checkpoint": {"role": "write", "devices": [str(small_disk / "ckpt")],
                       "direct_io": False}})
    with NodeProcess(config, token=TOKEN) as node, RemoteSnapshotStore(
            node.url, token=TOKEN) as store:
        before = _state(3, 6)
        store.save(before, "fits")
        big = _state(4, 40)  # 40 MiB on a 24 MiB disk
        with pytest.raises(CapacityError):
            store.save(big, "too-big")
        assert [i.name for i in store.list()] == ["fits"]
        _same(before, store.load("fits"))
        store.verify("fits")
        store.gc()
        folder = small_disk / "ckpt" / "snapshots" / "too-big"
        assert not folder.exists() or not any(p.is_file() for p in folder.rglob("*"))
        store.save(_state(5, 6), "fits-again", )  # the space came back
        _same(_state(5, 6), store.load("fits-again"))


def test_a_wrong_token_reads_and_writes_nothing(node: NodeProcess) -> None:
    with RemoteSnapshotStore(node.url, token=TOKEN) as good:
        good.save(_state(6, 1), "guarded")
    for token in ["wrong", None]:
        with RemoteSnapshotStore(node.url, token=token) as bad:
            for call in (bad.list, lambda b=bad: b.load("guarded"),
                         lambda b=bad: b.save(_state(7, 1), "intruder"),
                         lambda b=bad: b.delete("guarded"), bad.gc):
                with pytest.raises(AuthenticationError, match="token"):
                    call()
    assert generation_files(node, "intruder") == []
    with RemoteSnapshotStore(node.url, token=TOKEN) as good:
        assert [i.name for i in good.list()] == ["guarded"]


@pytest.mark.parametrize("damage", ["flipped", "deleted", "truncated"])
def test_a_damaged_chunk_file_on_the_node_names_the_tensor(node: NodeProcess,
                                                           damage: str) -> None:
    with RemoteSnapshotStore(node.url, token=TOKEN) as store:
        state = _state(8, 3)
        store.save(state, "hurt")
        chunk = next(p for p in generation_files(node, "hurt")
                     if "/w1/" in str(p) and p.name.startswith("c."))
        if damage == "flipped":
            flip_byte(chunk, 1000)
        elif damage == "deleted":
            chunk.unlink()
        else:
            os.truncate(chunk, chunk.stat().st_size // 2)
        with pytest.raises(IntegrityError, match=r"model\.w1"):
            store.load("hurt")
        with pytest.raises(IntegrityError, match=r"model\.w1"):
            store.verify("hurt")
        intact = store.load("hurt", keys=["model.w0", "model.w2"])
        assert torch.equal(intact["model"]["w2"], state["model"]["w2"])


def test_a_stalled_upload_is_dropped_and_frees_the_store(tmp_path: Path) -> None:
    config = write_node_config(tmp_path)
    with NodeProcess(config, token=TOKEN, args=("--upload-stall-timeout", "1")) as node:
        body = upload_stream(node, "stalled", {"w": torch.randn(1 << 20)})
        with socket.create_connection(("127.0.0.1", node.port), timeout=30) as sock:
            sock.sendall((f"PUT /v1/snapshots/stalled HTTP/1.1\r\nHost: x\r\nAuthorization: "
                          f"Bearer {TOKEN}\r\nContent-Length: {len(body)}\r\n\r\n").encode())
            sock.sendall(body[:len(body) // 2])  # then nothing
            answer = sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 400"), answer
        assert b"stalled" in answer
        _wait_gone(node, "stalled")
        with RemoteSnapshotStore(node.url, token=TOKEN) as store:
            store.save({"w": torch.ones(3)}, "after")  # the save slot is free again
            assert [i.name for i in store.list()] == ["after"]
