"""``isolane --store http://HOST:PORT <command>``: every snapshot command against a real
node (token from ISOLANE_TOKEN); URLs the CLI cannot serve are refused, never listed as
an empty store."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.cli.helpers import fails, ok, run
from tests.support.node import NodeProcess, write_node_config

TOKEN = "cli-node-token"


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    folder = tmp_path_factory.mktemp("cli-node")
    config = write_node_config(folder, device_groups={
        "checkpoint": {"role": "write", "devices": [str(folder / "ckpt")]},
        "cold": {"role": "capacity", "devices": [str(folder / "cold")]},
    })
    with NodeProcess(config, token=TOKEN) as proc:
        yield proc


def _state(seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(512, 1024, generator=gen), "b": torch.randn(8)},
            "step": seed}


def test_every_snapshot_command_works_on_a_node(node: NodeProcess, tmp_path: Path) -> None:
    env = {"ISOLANE_TOKEN": TOKEN}
    at = ("--store", node.url)
    src = tmp_path / "ckpt.pt"
    torch.save(_state(1), src)
    saved = ok(run(*at, "save", str(src), "n-1", "--metadata", '{"step": 1}', env=env)).stdout
    assert "saved 'n-1'" in saved and node.url in saved
    torch.save({**_state(1), "step": 2}, src)  # same tensors: every chunk linked
    out = ok(run(*at, "save", str(src), "n-2", "--async", env=env)).stdout
    assert "async: the caller was blocked" in out and "incremental" in out
    listed = json.loads(ok(run(*at, "ls", "--json", env=env)).stdout)
    assert [i["name"] for i in listed] == ["n-1", "n-2"]
    assert listed[1]["linked_bytes"] >= 512 * 1024 * 4
    assert "n-1" in ok(run(*at, "ls", env=env)).stdout
    shown = json.loads(ok(run(*at, "show", "n-1", "--json", env=env)).stdout)
    assert shown["metadata"] == {"step": 1} and shown["path"].startswith(node.url)
    assert {k["key"] for k in shown["keys"]} == {"model.w", "model.b"}
    assert "model.w" in ok(run(*at, "show", "n-1", env=env)).stdout
    assert "ok 'n-1'" in ok(run(*at, "verify", "n-1", env=env)).stdout
    dest = tmp_path / "back.pt"
    ok(run(*at, "restore", "n-2", str(dest), env=env))
    back = torch.load(dest, weights_only=True)
    assert torch.equal(back["model"]["w"], _state(1)["model"]["w"]) and back["step"] == 2
    mirrored = ok(run(*at, "mirror", env=env)).stdout
    assert "mirrored 'n-1'" in mirrored and "mirrored 'n-2'" in mirrored
    assert "already mirrored" in ok(run(*at, "mirror", env=env)).stdout
    assert json.loads(ok(run(*at, "ls", "--json", env=env)).stdout)[0]["mirrored"] is True
    assert "removed snapshot 'n-1'" in ok(run(*at, "gc", "--keep-last", "1", env=env)).stdout
    ok(run(*at, "rm", "n-2", "--yes", env=env))
    assert "no snapshots in" in ok(run(*at, "ls", env=env)).stdout
    fails(run(*at, "show", "n-2", env=env), 1, "n-2")


def test_urls_the_cli_cannot_serve_are_refused(node: NodeProcess) -> None:
    fails(run("--store", node.url, "ls", env={"ISOLANE_TOKEN": "wrong"}), 1, "bearer token")
    fails(run("--store", node.url, "ls", env={"ISOLANE_TOKEN": None}), 1, "ISOLANE_TOKEN")
    fails(run("--store", f"{node.url}/snapshots", "ls", env={"ISOLANE_TOKEN": TOKEN}), 1,
          "storage node", "http://HOST:PORT")
    fails(run("--store", "http://127.0.0.1:9", "ls", env={"ISOLANE_TOKEN": TOKEN}), 1,
          "127.0.0.1:9")


def test_mirror_on_a_node_without_a_capacity_group(tmp_path: Path) -> None:
    with NodeProcess(write_node_config(tmp_path), token=TOKEN) as plain:
        fails(run("--store", plain.url, "mirror", env={"ISOLANE_TOKEN": TOKEN}), 1,
              "no capacity group")
