"""``isolane kv``: CliRunner on real (tiny) KV pools in tmp_path, picked with --config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from isolane.kvpool.pool import KVPool
from tests.cli.helpers import CLEAN_ENV, fails, ok, run
from tests.support.damage import flip_byte

CT = 16  # tokens a block: a (2, 2, 16, 4, 8) float32 block is 4 KiB


def write_config(tmp_path: Path, devices: int = 1) -> str:
    folders = ", ".join(str(tmp_path / f"kv{i}") for i in range(devices))
    path = tmp_path / "isolane.yaml"
    path.write_text(f"device_groups:\n  kv: {{role: read, devices: [{folders}]}}\n")
    return str(path)


def fill(config: str, namespace: str, prompts: int = 1, tokens: int = 64) -> KVPool:
    """An open pool holding ``prompts`` prompts of ``tokens`` tokens (the caller closes)."""
    pool = KVPool(config, namespace=namespace, chunk_tokens=CT)
    gen = torch.Generator().manual_seed(0)
    for p in range(prompts):
        pool.put(list(range(1000 * p, 1000 * p + tokens)),
                 torch.randn(2, 2, tokens, 4, 8, generator=gen))
    return pool


@pytest.fixture
def config(tmp_path: Path) -> str:
    path = write_config(tmp_path)
    fill(path, "llama").close()  # 4 blocks
    fill(path, "other/model", tokens=32).close()  # 2 blocks
    return path


def test_ls_table_and_json(config: str) -> None:
    lines = ok(run("--config", config, "kv", "ls")).stdout.splitlines()
    assert lines[0].split() == ["NAMESPACE", "DTYPE", "BLOCK", "SHAPE", "BLOCKS", "DISK"]
    assert lines[1].split()[:2] == ["llama", "float32"] and "(2, 2, 16, 4, 8)" in lines[1]
    assert lines[2].split()[0] == "other/model"
    listed = {n["namespace"]: n for n in json.loads(
        ok(run("--config", config, "kv", "ls", "--json")).stdout)}
    assert set(listed) == {"llama", "other/model"}
    assert listed["llama"]["blocks"] == 4 and listed["other/model"]["blocks"] == 2
    assert listed["llama"]["block_shape"] == [2, 2, CT, 4, 8]
    assert listed["llama"]["disk_bytes"] > 4 * 4096
    # the env variable works as the flag does
    assert "llama" in ok(run("kv", "ls", env={"ISOLANE_CONFIG": config})).stdout


def test_ls_with_two_devices_shows_bytes_per_device(tmp_path: Path) -> None:
    config = write_config(tmp_path, devices=2)
    fill(config, "llama", prompts=4, tokens=16).close()  # each prompt lands on one device
    entry = json.loads(ok(run("--config", config, "kv", "ls", "--json")).stdout)[0]
    assert entry["blocks"] == 4 and len(entry["devices"]) == 2
    assert sum(d["bytes"] for d in entry["devices"]) == entry["disk_bytes"]
    out = ok(run("--config", config, "kv", "ls")).stdout
    assert out.splitlines()[0].split()[-3:] == ["DISK", "DEV0", "DEV1"]
    assert f"DEV0 = {tmp_path / 'kv0'}" in out and f"DEV1 = {tmp_path / 'kv1'}" in out


def test_stats_text_and_json(config: str) -> None:
    out = ok(run("--config", config, "kv", "stats")).stdout
    assert "namespace 'llama': chunk_tokens 16, policy s3fifo" in out
    assert "namespace 'other/model'" in out and "4 blocks" in out and "empty in the CLI" in out
    stats = json.loads(ok(run("--config", config, "kv", "stats", "--namespace", "llama",
                              "--json")).stdout)
    assert [s["namespace"] for s in stats] == ["llama"]
    assert stats[0]["chunk_tokens"] == CT and stats[0]["memory"]["policy"] == "s3fifo"
    assert stats[0]["memory"]["blocks"] == 0  # a fresh process: the memory tier is empty
    assert [d["blocks"] for d in stats[0]["disk"]] == [4]
    assert "empty" in ok(run("kv", "stats", "--help")).stdout


def test_verify_ok_then_exit_2_on_a_flipped_byte_in_a_sealed_segment(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    pool = fill(config, "llama")
    key = pool.block_keys(list(range(64)))[1]
    pool.logs[0].rotate()  # seal: in the live segment a flipped byte reads as a torn tail
    location = pool.logs[0].locate(key)
    assert location is not None
    pool.close()
    fill(config, "other", tokens=32).close()
    out = ok(run("--config", config, "kv", "verify")).stdout
    assert "ok 'llama': 4 blocks checked" in out and "ok 'other': 2 blocks checked" in out
    segment = (tmp_path / "kv0" / "kvpool" / "llama" / "segments"
               / f"seg-{location.segment_id:08d}.sealed")
    flip_byte(segment, location.value_offset + 3)
    result = fails(run("--config", config, "kv", "verify"), 2, "1 damaged KV block",
                   "dropped")
    assert "damaged 'llama': 1 of 4 blocks failed their checksum and were dropped" \
        in result.stdout
    assert "ok 'other'" in result.stdout
    # dropped: the next run finds 3 intact blocks
    report = json.loads(ok(run("--config", config, "kv", "verify", "--namespace", "llama",
                               "--json")).stdout)
    assert report == {"ok": True, "checked": 3, "damaged": 0,
                      "namespaces": [{"namespace": "llama", "checked": 3, "damaged": 0,
                                      "dropped_earlier": []}]}


def test_verify_json_on_damage(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    pool = fill(config, "llama")
    pool.logs[0].rotate()
    location = pool.logs[0].locate(pool.block_keys(list(range(64)))[0])
    assert location is not None
    pool.close()
    flip_byte(tmp_path / "kv0" / "kvpool" / "llama" / "segments"
              / f"seg-{location.segment_id:08d}.sealed", location.value_offset)
    result = fails(run("--config", config, "kv", "verify", "--json"), 2, "dropped")
    report = json.loads(result.stdout)
    assert report["ok"] is False and report["damaged"] == 1 and report["checked"] == 4


def test_compact(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    pool = fill(config, "llama", prompts=4, tokens=16)  # 4 one-block prompts
    for p in range(3):
        pool.delete(list(range(1000 * p, 1000 * p + 16)))
    pool.logs[0].rotate()  # a sealed segment with a quarter of it live
    pool.close()
    out = ok(run("--config", config, "kv", "compact")).stdout
    assert "compacted 'llama': 1 segment(s)" in out
    assert "nothing to compact in 'llama'" in ok(run("--config", config, "kv", "compact",
                                                     "--namespace", "llama")).stdout
    with KVPool(config, namespace="llama", chunk_tokens=CT) as pool:  # the live block stays
        assert pool.lookup(list(range(3000, 3016))) == CT
        assert pool.lookup(list(range(0, 16))) == 0
    fails(run("--config", config, "kv", "compact", "--min-live-ratio", "2"), 1)


def test_evict(config: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # without a terminal there is no question
    out = ok(run("--config", config, "kv", "evict", "--namespace", "other/model")).stdout
    assert "dropped KV namespace 'other/model': 2 blocks" in out
    listed = json.loads(ok(run("--config", config, "kv", "ls", "--json")).stdout)
    assert [n["namespace"] for n in listed] == ["llama"]
    fails(run("--config", config, "kv", "evict", "--namespace", "ghost"), 1,
          "error: KV namespace 'ghost' not found", "isolane kv ls")
    fails(run("--config", config, "kv", "evict"), 1, "Missing option '--namespace'")
    # on a terminal it asks; "no" keeps the namespace
    monkeypatch.setattr("isolane.cli.kv.interactive", lambda: True)
    result = run("--config", config, "kv", "evict", "--namespace", "llama", input="n\n")
    assert result.exit_code == 1 and "drop KV namespace 'llama' (4 blocks" in result.stdout
    assert "llama" in ok(run("--config", config, "kv", "ls")).stdout
    out = ok(run("--config", config, "kv", "evict", "--namespace", "llama",
                 input="y\n")).stdout
    assert "dropped KV namespace 'llama': 4 blocks" in out
    out = ok(run("--config", config, "kv", "ls")).stdout
    assert "no KV namespaces" in out


def test_unknown_namespace_exits_1_and_creates_nothing(config: str, tmp_path: Path) -> None:
    for cmd in ("stats", "verify", "compact"):
        fails(run("--config", config, "kv", cmd, "--namespace", "ghost"), 1,
              "error: KV namespace 'ghost' not found", "isolane kv ls")
    assert sorted(p.name for p in (tmp_path / "kv0" / "kvpool").iterdir()) \
        == ["llama", "other%2Fmodel"]


def test_store_is_refused(config: str, tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    for cmd in ("ls", "stats", "verify", "compact"):
        fails(run("--store", store, "kv", cmd), 1, "error: --store names a snapshot store",
              "--config FILE")
    fails(run("--store", store, "kv", "evict", "--namespace", "llama", "--yes"), 1, "--store")
    fails(run("kv", "ls", env={"ISOLANE_STORE": store}), 1, "unset ISOLANE_STORE", "--config")
    assert not Path(store).exists()
    # a flag --config wins over the variable, as for the snapshot commands
    assert "llama" in ok(run("--config", config, "kv", "ls",
                             env={"ISOLANE_STORE": store})).stdout


def test_default_pool_under_isolane_home(tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    monkeypatch.setenv("ISOLANE_HOME", str(home))
    assert "no KV namespaces" in ok(run("kv", "ls")).stdout
    assert "no KV namespaces" in ok(run("kv", "verify")).stdout
    assert not home.exists()  # looking creates nothing
    with KVPool(namespace="default", chunk_tokens=CT) as pool:
        pool.put(list(range(16)), torch.zeros(2, 2, 16, 4, 8))
    assert (home / "kv" / "kvpool" / "default").is_dir()
    listed = json.loads(ok(run("kv", "ls", "--json")).stdout)
    assert [(n["namespace"], n["blocks"]) for n in listed] == [("default", 1)]


def test_config_without_read_group_and_quiet(config: str, tmp_path: Path) -> None:
    no_read = tmp_path / "write-only.yaml"
    no_read.write_text(f"device_groups:\n  ckpt: {{role: write, devices: [{tmp_path / 'w'}]}}\n")
    fails(run("--config", str(no_read), "kv", "ls"), 1, "no group has role 'read'")
    assert ok(run("--config", config, "-q", "kv", "verify")).stdout == ""
    assert ok(run("--config", config, "-q", "kv", "compact")).stdout == ""
    assert "llama" in ok(run("--config", config, "-q", "kv", "ls")).stdout  # requested data
    fails(run("--config", config, "kv", "nosuchcommand"), 1)


def test_kv_help_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "import isolane.cli.main as m\n"
        "kv = m.cli.commands['kv']\n"
        "runner = CliRunner()\n"
        "for args in (['kv', '--help'], *(['kv', c, '--help'] for c in kv.commands)):\n"
        "    result = runner.invoke(m.cli, args, env={'ISOLANE_STORE': None,\n"
        "                                             'ISOLANE_CONFIG': None})\n"
        "    assert result.exit_code == 0, (args, result.output)\n"
        "    assert 'Usage:' in result.output\n"
        "assert sorted(kv.commands) == ['compact', 'evict', 'ls', 'stats', 'verify']\n"
        "heavy = [n for n in ('torch', 'isolane.kvpool.pool', 'isolane.snapshot', 'zarr')\n"
        "         if n in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in CLEAN_ENV}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)


def test_a_namespace_open_elsewhere_is_refused(config: str) -> None:
    with KVPool(config, namespace="llama", chunk_tokens=CT):  # as a running node holds it
        for cmd in (["ls"], ["verify"], ["evict", "--namespace", "llama"]):
            fails(run("--config", config, "kv", *cmd), 1, "is open in another SegmentLog")
    assert "llama" in ok(run("--config", config, "kv", "ls")).stdout


@pytest.mark.parametrize("namespace", ["..", ".", "a/../..", "../kv0", "x\n", "/abs", ""])
def test_evict_of_a_crafted_namespace_is_refused_and_deletes_nothing(
        config: str, tmp_path: Path, namespace: str) -> None:
    canary = tmp_path / "kv0" / "canary"
    canary.write_text("keep me")
    (tmp_path / "kv0" / "namespace.json").write_text(  # as a put to '..' would leave it
        '{"dtype": "float32", "shape": [2, 2, 4, 8], "chunk_tokens": 16, "token_dim": 2}')
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    for cmd in (["evict", "--yes"], ["verify"], ["stats"], ["compact"]):
        result = run("--config", config, "kv", *cmd, "--namespace", namespace)
        fails(result, 1, "invalid KV namespace")
        assert "Traceback" not in result.output
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before
    assert canary.read_text() == "keep me"


def test_damaged_namespace_file_and_foreign_folders_are_named_without_traceback(
        config: str, tmp_path: Path) -> None:
    root = tmp_path / "kv0" / "kvpool"
    (root / "llama" / "namespace.json").write_text("{not json")
    (root / "%zz").mkdir()
    (root / "%zz" / "namespace.json").write_text("{}")
    result = run("--config", config, "kv", "ls")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "other/model" in result.stdout and "llama" not in result.stdout
    assert f"{root / 'llama' / 'namespace.json'}" in result.stderr
    assert "isolane kv evict --namespace llama" in result.stderr
    assert "%zz' is not a KV namespace folder" in result.stderr
    assert "move it out" in result.stderr
    for cmd in ("stats", "verify"):
        result = run("--config", config, "kv", cmd, "--namespace", "llama")
        fails(result, 2, "namespace.json", "isolane kv evict --namespace llama")
        assert "Traceback" not in result.output
    result = run("--config", config, "kv", "evict", "--namespace", "llama", "--yes")
    assert result.exit_code == 0, result.output  # the way out works
    assert not (root / "llama").exists()
    result = ok(run("--config", config, "kv", "stats"))
    assert "%zz' is not a KV namespace folder" in result.stderr


@pytest.mark.parametrize("opened_first", [False, True])
def test_verify_counts_records_the_open_scan_dropped(tmp_path: Path, opened_first: bool) -> None:
    config = write_config(tmp_path)
    pool = fill(config, "llama")  # 4 blocks, still in the live segment
    keys = pool.block_keys(list(range(64)))
    middle, last = pool.logs[0].locate(keys[1]), pool.logs[0].locate(keys[3])
    assert middle is not None and last is not None
    pool.close()
    live = next((tmp_path / "kv0" / "kvpool" / "llama" / "segments").glob("*.live"))
    flip_byte(live, middle.value_offset + 3)  # damage mid-segment: skipped by the scan
    flip_byte(live, last.value_offset + 3)  # damage in the last record: cut as a tail
    if opened_first:  # e.g. a node opened the pool (and dropped them) before verify runs
        KVPool(config, namespace="llama", chunk_tokens=CT).close()
    result = fails(run("--config", config, "kv", "verify", "--json"), 2, "dropped")
    report = json.loads(result.stdout)
    assert report["ok"] is False and report["damaged"] == 2 and report["checked"] == 2
    assert [d["offset"] for d in report["namespaces"][0]["dropped_earlier"]] == [
        middle.record_offset, last.record_offset]
    # reported once, then cleared: the blocks read as misses and are put again
    out = ok(run("--config", config, "kv", "verify")).stdout
    assert "ok 'llama': 2 blocks checked" in out


def test_verify_text_names_records_dropped_earlier(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    pool = fill(config, "llama")
    middle = pool.logs[0].locate(pool.block_keys(list(range(64)))[1])
    assert middle is not None
    pool.close()
    live = next((tmp_path / "kv0" / "kvpool" / "llama" / "segments").glob("*.live"))
    flip_byte(live, middle.value_offset + 3)
    result = fails(run("--config", config, "kv", "verify"), 2, "1 damaged KV block")
    assert (f"damaged 'llama': 1 record(s) dropped earlier, when the segments were opened "
            f"or read (segment {middle.segment_id} at offset {middle.record_offset}"
            ) in result.stdout


@pytest.mark.parametrize("read", ["get", "get_into"])
def test_verify_reports_a_block_a_serving_process_dropped_as_damaged(tmp_path: Path,
                                                                       read: str) -> None:
    config = write_config(tmp_path)
    pool = fill(config, "llama")
    tokens = list(range(64))
    pool.logs[0].rotate()
    location = pool.logs[0].locate(pool.block_keys(tokens)[2])
    assert location is not None
    pool.close()
    flip_byte(tmp_path / "kv0" / "kvpool" / "llama" / "segments"
              / f"seg-{location.segment_id:08d}.sealed", location.value_offset + 9)
    with KVPool(config, namespace="llama", chunk_tokens=CT, memory_budget=0) as serving:
        if read == "get":
            assert serving.get(tokens)[0] == 2 * CT  # the damaged block ends the prefix
        else:
            assert serving.get_into(tokens, torch.zeros(2, 2, 64, 4, 8)) == 2 * CT
    result = fails(run("--config", config, "kv", "verify", "--json"), 2, "dropped")
    report = json.loads(result.stdout)
    assert report["damaged"] == 1 and report["checked"] == 3
    assert report["namespaces"][0]["dropped_earlier"][0]["offset"] == location.record_offset
    ok(run("--config", config, "kv", "verify"))  # reported once
