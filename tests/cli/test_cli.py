"""The ``isolane`` command line, through click's CliRunner on real stores and files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from isolane.cli.progress import ProgressBar, human_bytes
from tests.cli.helpers import CLEAN_ENV, fails, ok, run


def same(a: Any, b: Any) -> None:
    """Bit-exact equality of nested states."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                           b.contiguous().reshape(-1).view(torch.uint8))
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (a.keys(), b.keys())
        for k in a:
            same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            same(x, y)
    else:
        assert a == b and type(a) is type(b)


@pytest.fixture
def store(tmp_path: Path) -> str:
    return str(tmp_path / "store")


@pytest.fixture
def state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {"w": torch.randn(300, 1000, generator=g),  # 1.2 MB: its own array
                  "b": torch.randn(300, generator=g),
                  "half": torch.randn(8, 8, generator=g).to(torch.bfloat16)},
        "ids": torch.arange(10),
        "step": 7,
    }


def test_pt_round_trip(tmp_path: Path, store: str, state: dict[str, Any]) -> None:
    src = tmp_path / "ckpt.pt"
    torch.save(state, src)
    out = ok(run("--store", store, "save", str(src), "s1", "--metadata", '{"step": 7}')).stdout
    assert "saved 's1': 4 tensors" in out and "GB/s" in out and "written" in out
    dest = tmp_path / "back.pt"
    out = ok(run("--store", store, "restore", "s1", str(dest))).stdout
    assert "GB/s" in out
    same(state, torch.load(dest, weights_only=True))
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_safetensors_round_trip(tmp_path: Path, store: str, state: dict[str, Any]) -> None:
    flat = {"model.w": state["model"]["w"], "model.b": state["model"]["b"], "ids": state["ids"]}
    src = tmp_path / "model.safetensors"
    save_file(flat, src)
    ok(run("--store", store, "save", str(src), "st"))
    dest = tmp_path / "back.safetensors"
    ok(run("--store", store, "restore", "st", str(dest)))
    same(flat, load_file(dest))
    # nested snapshot -> flat keys
    ok(run("--store", store, "show", "st"))


def test_hf_folder_with_two_shards(tmp_path: Path, store: str) -> None:
    folder = tmp_path / "hf-model"
    folder.mkdir()
    shard1 = {"embed.weight": torch.randn(50, 16), "layers.0.w": torch.randn(16, 16)}
    shard2 = {"layers.1.w": torch.randn(16, 16), "lm_head.weight": torch.randn(50, 16)}
    save_file(shard1, folder / "model-00001-of-00002.safetensors")
    save_file(shard2, folder / "model-00002-of-00002.safetensors")
    (folder / "config.json").write_text("{}")
    out = ok(run("--store", store, "save", str(folder), "hf")).stdout
    assert "2 files" in out and "4 tensors" in out
    dest = tmp_path / "merged.safetensors"
    ok(run("--store", store, "restore", "hf", str(dest)))
    same({**shard1, **shard2}, load_file(dest))


def test_hf_folder_of_bin_shards_ignores_other_bins(tmp_path: Path, store: str) -> None:
    folder = tmp_path / "bin-model"
    folder.mkdir()
    shard1, shard2 = {"a": torch.ones(3)}, {"b": torch.zeros(2, 2)}
    torch.save(shard1, folder / "pytorch_model-00001-of-00002.bin")
    torch.save(shard2, folder / "pytorch_model-00002-of-00002.bin")
    torch.save({"args": torch.nn.Identity()}, folder / "training_args.bin")  # not read
    ok(run("--store", store, "save", str(folder), "bins"))
    dest = tmp_path / "b.pt"
    ok(run("--store", store, "restore", "bins", str(dest)))
    same({**shard1, **shard2}, torch.load(dest, weights_only=True))


def test_hf_folder_with_duplicate_keys_is_refused(tmp_path: Path, store: str) -> None:
    folder = tmp_path / "dup"
    folder.mkdir()
    save_file({"x": torch.ones(2)}, folder / "a.safetensors")
    save_file({"x": torch.zeros(2)}, folder / "b.safetensors")
    fails(run("--store", store, "save", str(folder), "dup"), 1,
          "error: key 'x' is in both a.safetensors and b.safetensors")


def test_restore_keys_subset(tmp_path: Path, store: str, state: dict[str, Any]) -> None:
    src = tmp_path / "ckpt.pt"
    torch.save(state, src)
    ok(run("--store", store, "save", str(src), "s"))
    dest = tmp_path / "sub.safetensors"
    ok(run("--store", store, "restore", "s", str(dest), "--keys", "model.w,ids"))
    same({"model.w": state["model"]["w"], "ids": state["ids"]}, load_file(dest))
    dest_pt = tmp_path / "sub.pt"
    ok(run("--store", store, "restore", "s", str(dest_pt), "--keys", "model"))
    same({"model": state["model"]}, torch.load(dest_pt, weights_only=True))
    fails(run("--store", store, "restore", "s", str(tmp_path / "x.pt"), "--keys", "nope"), 1,
          "error: snapshot 's' has no key 'nope'")


def test_safetensors_refuses_non_tensor_leaves_and_clones_tied(
        tmp_path: Path, store: str, state: dict[str, Any]) -> None:
    src = tmp_path / "ckpt.pt"
    tied = torch.randn(4, 4)
    torch.save({**state, "tied_a": tied, "tied_b": tied}, src)
    ok(run("--store", store, "save", str(src), "s"))
    fails(run("--store", store, "restore", "s", str(tmp_path / "x.safetensors")), 1,
          "key 'step' holds a int", "restore to .pt")
    assert not (tmp_path / "x.safetensors").exists()
    dest = tmp_path / "tied.safetensors"
    ok(run("--store", store, "restore", "s", str(dest), "--keys", "tied_a,tied_b"))
    same({"tied_a": tied, "tied_b": tied}, load_file(dest))


def test_ls_show_verify_json(tmp_path: Path, store: str, state: dict[str, Any]) -> None:
    src = tmp_path / "ckpt.pt"
    torch.save(state, src)
    ok(run("--store", store, "save", str(src), "one", "--metadata", '{"lr": 0.1}'))
    ok(run("--store", store, "save", str(src), "two", "--async"))
    listed = json.loads(ok(run("--store", store, "ls", "--json")).stdout)
    assert [i["name"] for i in listed] == ["one", "two"]
    assert listed[1]["linked_bytes"] > 0  # unchanged chunks of 'one' were linked
    assert listed[0]["tensors"] == 4 and listed[0]["where"] == "local"
    table = ok(run("--store", store, "ls")).stdout
    assert table.splitlines()[0].split() == ["NAME", "CREATED", "SIZE", "WRITTEN", "TENSORS",
                                              "WHERE"]
    shown = json.loads(ok(run("--store", store, "show", "one", "--json")).stdout)
    assert shown["metadata"] == {"lr": 0.1}
    keys = {k["key"]: k for k in shown["keys"]}
    assert keys["model.w"]["shape"] == [300, 1000] and keys["model.half"]["dtype"] == "bfloat16"
    assert Path(shown["path"]).is_dir()
    shown2 = json.loads(ok(run("--store", store, "show", "two", "--json")).stdout)
    assert shown2["parent"]["name"] == "one"
    verified = json.loads(ok(run("--store", store, "verify", "one", "--json")).stdout)
    assert verified["ok"] is True and verified["bytes"] > 0
    assert "model.w" in ok(run("--store", store, "show", "one")).stdout


def test_verify_exits_2_on_a_flipped_byte(tmp_path: Path, store: str,
                                         state: dict[str, Any]) -> None:
    src = tmp_path / "ckpt.pt"
    torch.save(state, src)
    ok(run("--store", store, "save", str(src), "s"))
    ok(run("--store", store, "verify", "s"))
    path = Path(json.loads(ok(run("--store", store, "show", "s", "--json")).stdout)["path"])
    chunks = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.endswith(".json"))
    assert chunks, list(path.rglob("*"))
    data = bytearray(chunks[0].read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunks[0].write_bytes(bytes(data))
    fails(run("--store", store, "verify", "s"), 2, "error: integrity check failed")
    result = fails(run("--store", store, "verify", "s", "--json"), 2)
    assert json.loads(result.stdout)["ok"] is False
    fails(run("--store", store, "restore", "s", str(tmp_path / "x.pt")), 2)


def test_user_errors_exit_1(tmp_path: Path, store: str, state: dict[str, Any]) -> None:
    src = tmp_path / "ckpt.pt"
    torch.save(state, src)
    ok(run("--store", store, "save", str(src), "s"))
    for cmd in (["show", "ghost"], ["verify", "ghost"], ["rm", "ghost"],
                ["restore", "ghost", str(tmp_path / "g.pt")]):
        fails(run("--store", store, *cmd), 1, "error: snapshot 'ghost' not found",
              "isolane ls")
    for bad in ("a/b", "..", "x\x01y"):
        fails(run("--store", store, "save", str(src), bad), 1, "error: invalid snapshot name")
    fails(run("--store", store, "save", str(src), "s"), 1, "already exists", "--overwrite")
    ok(run("--store", store, "save", str(src), "s", "--overwrite"))
    odd = tmp_path / "weights.npz"
    odd.write_bytes(b"x")
    fails(run("--store", store, "save", str(odd), "n"), 1, "unsupported file type '.npz'")
    fails(run("--store", store, "save", str(tmp_path / "missing.pt"), "n"), 1,
          "does not exist")
    fails(run("--store", store, "save", str(src), "n", "--metadata", "[1]"), 1,
          "JSON object")
    fails(run("--store", store, "save", str(src)), 1, "Missing argument")  # usage error
    fails(run("--store", store, "restore", "s", str(tmp_path / "x.npy")), 1,
          ".pt or .safetensors")
    dest = tmp_path / "exists.pt"
    dest.write_bytes(b"keep me")
    fails(run("--store", store, "restore", "s", str(dest)), 1, "already exists", "--overwrite")
    assert dest.read_bytes() == b"keep me"
    ok(run("--store", store, "restore", "s", str(dest), "--overwrite"))
    same(state, torch.load(dest, weights_only=True))
    fails(run("--store", store, "--config", str(tmp_path / "c.yaml"), "ls"), 1,
          "mutually exclusive")
    fails(run("--store", store, "nosuchcommand"), 1)
    fails(run("--config", str(tmp_path / "missing.yaml"), "ls"), 1, "does not exist")


def test_never_unpickles_objects(tmp_path: Path, store: str) -> None:
    src = tmp_path / "obj.pt"
    torch.save({"layer": torch.nn.Linear(2, 2)}, src)
    fails(run("--store", store, "save", str(src), "obj"), 1, "weights_only=True",
          "torch.nn.modules.linear.Linear")
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a safetensors file at all")
    fails(run("--store", store, "save", str(garbage), "g"), 1, "not a readable safetensors")


def test_store_from_env_and_flag_precedence(tmp_path: Path, state: dict[str, Any],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "ckpt.pt"
    torch.save(state, src)
    env_store, flag_store = str(tmp_path / "env"), str(tmp_path / "flag")
    ok(run("save", str(src), "from-env", env={"ISOLANE_STORE": env_store}))
    assert "from-env" in ok(run("--store", env_store, "ls")).stdout
    ok(run("--store", flag_store, "save", str(src), "from-flag",
           env={"ISOLANE_STORE": env_store}))
    names = [i["name"] for i in json.loads(ok(run("--store", flag_store, "ls", "--json")).stdout)]
    assert names == ["from-flag"]
    # no flag, no env: the embedded default under $ISOLANE_HOME
    monkeypatch.setenv("ISOLANE_HOME", str(tmp_path / "home"))
    ok(run("save", str(src), "default"))
    assert (tmp_path / "home" / "checkpoints" / "snapshots" / "default").is_dir()
    fails(run("ls", env={"ISOLANE_STORE": env_store, "ISOLANE_CONFIG": "x.yaml"}), 1,
          "both set")


def test_rm_and_gc(tmp_path: Path, store: str, state: dict[str, Any]) -> None:
    src = tmp_path / "ckpt.pt"
    torch.save(state, src)
    for name in ("a", "b", "c"):
        ok(run("--store", store, "save", str(src), name))
    assert "removed 'a'" in ok(run("--store", store, "rm", "a")).stdout  # no TTY: no prompt
    out = ok(run("--store", store, "gc", "--keep-last", "1")).stdout
    assert "removed snapshot 'b'" in out
    assert [i["name"] for i in json.loads(ok(run("--store", store, "ls", "--json")).stdout)] \
        == ["c"]
    assert "nothing to remove" in ok(run("--store", store, "gc")).stdout
    fails(run("--store", store, "gc", "--keep-last", "0"), 1)
    ok(run("--store", store, "rm", "c", "--yes"))
    assert "no snapshots" in ok(run("--store", store, "ls")).stdout


def test_mirror(tmp_path: Path, store: str, state: dict[str, Any]) -> None:
    src = tmp_path / "ckpt.pt"
    torch.save(state, src)
    ok(run("--store", store, "save", str(src), "s"))
    fails(run("--store", store, "mirror"), 1, "no capacity group", "--config")
    config = tmp_path / "isolane.yaml"
    config.write_text("device_groups:\n"
                      "  checkpoint: {role: write, devices: [./ckpt]}\n"
                      "  cold: {role: capacity, devices: [./cold]}\n")
    env = {"ISOLANE_CONFIG": str(config)}
    ok(run("save", str(src), "m", env=env))
    assert "mirrored 'm'" in ok(run("mirror", env=env)).stdout
    listed = json.loads(ok(run("ls", "--json", env=env)).stdout)
    assert listed[0]["mirrored"] is True and listed[0]["where"] == "local+mirror"
    assert "already mirrored" in ok(run("mirror", env=env)).stdout


def test_demo_runs_end_to_end_twice(tmp_path: Path, store: str) -> None:
    for _ in range(2):  # re-running overwrites the demo's own snapshots
        out = ok(run("--store", store, "demo", "--size-mb", "8")).stdout
        assert "bit-exact" in out and "incremental" in out and "GB/s" in out
        assert "gc --keep-last 1: removed demo-step-1" in out
    listed = json.loads(ok(run("--store", store, "ls", "--json")).stdout)
    assert [i["name"] for i in listed] == ["demo-step-2"]
    assert listed[0]["linked_bytes"] > listed[0]["written_bytes"]
    # a store with the user's own snapshots: the demo removes only its own step 1
    src = tmp_path / "mine.safetensors"
    save_file({"w": torch.ones(4)}, src)
    ok(run("--store", store, "save", str(src), "mine"))
    out = ok(run("--store", store, "demo", "--size-mb", "8")).stdout
    assert "removed demo-step-1 only" in out
    listed = json.loads(ok(run("--store", store, "ls", "--json")).stdout)
    assert sorted(i["name"] for i in listed) == ["demo-step-2", "mine"]


def test_quiet_silences_information(tmp_path: Path, store: str, state: dict[str, Any]) -> None:
    src = tmp_path / "ckpt.pt"
    torch.save(state, src)
    assert ok(run("--store", store, "--quiet", "save", str(src), "s")).stdout == ""
    assert ok(run("--store", store, "-q", "verify", "s")).stdout == ""
    assert "s" in ok(run("--store", store, "-q", "ls")).stdout


def test_progress_bar_renders_gb_per_s() -> None:
    bar = ProgressBar("saving x", None)
    text = bar.render(512 << 20, 1 << 30, 0.5)
    assert text.startswith("saving x [") and " 50%" in text and "1.07 GB/s" in text
    assert "512.0 MiB / 1.0 GiB" in text
    bar(1, 2)  # no stream: a no-op
    assert human_bytes(1023) == "1023 B" and human_bytes(1536) == "1.5 KiB"


def test_help_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "import isolane.cli.main as m\n"
        "runner = CliRunner()\n"
        "for args in (['--help'], *([c, '--help'] for c in m.cli.commands)):\n"
        "    result = runner.invoke(m.cli, args, env={'ISOLANE_STORE': None,\n"
        "                                             'ISOLANE_CONFIG': None})\n"
        "    assert result.exit_code == 0, (args, result.output)\n"
        "    assert 'Usage:' in result.output\n"
        "heavy = [n for n in ('torch', 'isolane.snapshot', 'zarr', 'safetensors')\n"
        "         if n in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in CLEAN_ENV}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)
