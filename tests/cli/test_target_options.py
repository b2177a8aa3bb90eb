"""``--store`` and ``--config`` are taken the same way by every command: before the
command (global) or after it (the command's own, which wins)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import click
import pytest
import torch

from isolane.cli.main import cli
from tests.cli.helpers import fails, ok, run


def leaf_commands(group: click.Group, prefix: tuple[str, ...] = ()
                  ) -> list[tuple[tuple[str, ...], click.Command]]:
    out = []
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            out += leaf_commands(command, (*prefix, name))
        else:
            out.append(((*prefix, name), command))
    return out


def test_every_command_takes_store_and_config() -> None:
    commands = leaf_commands(cli)
    assert len(commands) > 15
    for path, command in commands:
        flags = {opt for param in command.params for opt in param.opts}
        assert {"--store", "--config"} <= flags, path


def write_config(tmp_path: Path) -> str:
    path = tmp_path / "isolane.yaml"
    path.write_text("device_groups:\n"
                    f"  ckpt: {{role: write, devices: [{tmp_path / 'ckpt'}], threads: 3}}\n"
                    f"  kv: {{role: read, devices: [{tmp_path / 'kv'}], threads: 5}}\n")
    return str(path)


def test_lanes_and_kv_take_config_after_the_command(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    after = json.loads(ok(run("lanes", "stats", "--json", "--config", config)).stdout)
    before = json.loads(ok(run("--config", config, "lanes", "stats", "--json")).stdout)
    assert after["write"]["threads"] == before["write"]["threads"] == 3
    ok(run("lanes", "check", "--config", config))
    assert "no KV namespaces" in ok(run("kv", "ls", "--config", config)).stdout


def test_snapshot_commands_take_store_after_the_command(tmp_path: Path) -> None:
    store, other = str(tmp_path / "store"), str(tmp_path / "other")
    src = tmp_path / "w.pt"
    torch.save({"w": torch.arange(6.0)}, src)
    ok(run("save", str(src), "step-1", "--store", store))
    listed = ok(run("ls", "--json", "--store", store)).stdout
    assert [s["name"] for s in json.loads(listed)] == ["step-1"]
    # the command's own flag wins over the global one
    assert "step-1" in ok(run("--store", other, "ls", "--store", store)).stdout
    assert "step-1" not in ok(run("--store", store, "ls", "--store", other)).stdout
    ok(run("restore", "step-1", str(tmp_path / "back.pt"), "--store", store))
    assert torch.equal(torch.load(tmp_path / "back.pt")["w"], torch.arange(6.0))


@pytest.mark.parametrize("args", [
    ("ls", "--store", "a", "--config", "b.yaml"),
    ("lanes", "stats", "--config", "b.yaml", "--store", "a"),
])
def test_store_and_config_after_one_command_are_refused(args: tuple[str, ...]) -> None:
    fails(run(*args), 1, "--store and --config are mutually exclusive")


def test_kv_refuses_a_store_given_after_the_command(tmp_path: Path) -> None:
    fails(run("kv", "ls", "--store", str(tmp_path / "s")), 1,
          "--store names a snapshot store", "--config FILE")


@pytest.mark.parametrize("where", ["before", "after"])
def test_config_reaches_the_command_under_python_m(tmp_path: Path, where: str) -> None:
    # ``python -m isolane.cli.main`` (how nodes and workers are started) runs main as
    # __main__; the command modules import nothing from it (tests/test_architecture.py),
    # and the target must reach kv, lanes and serve given before or after the command.
    config = write_config(tmp_path)
    args = (["--config", config, "lanes", "stats", "--json"] if where == "before"
            else ["lanes", "stats", "--json", "--config", config])
    env = {k: v for k, v in os.environ.items() if k not in ("ISOLANE_STORE", "ISOLANE_CONFIG")}
    out = subprocess.run([sys.executable, "-m", "isolane.cli.main", *args], env=env,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert json.loads(out)["write"]["threads"] == 3
