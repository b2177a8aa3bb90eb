"""torch.distributed.checkpoint on isolane: real ranks (plain processes, gloo on CPU), a
real FSDP2 transformer with AdamW state, DTensors on a 2-D mesh. One world of 4 saves
(tests/integrations/dcp_worker.py, mode save4), one of 2 loads (load2), one of 8 loads
(load8), this process loads alone; the tests below read what each rank reported."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml
from click.testing import CliRunner

from isolane import SnapshotStore, opening
from isolane.cli.main import cli
from isolane.config import config_from_dict
from isolane.errors import InvalidArgumentError
from isolane.integrations.dcp import IsolaneStorageReader, IsolaneStorageWriter
from isolane.snapshot.dcp import LocalPartSaves
from isolane.snapshot.manifest import MANIFEST
from tests.support.node import NodeProcess, write_node_config
from tests.support.procs import run_ranks

WORKER = Path(__file__).with_name("dcp_worker.py")


def store_dict(root: Path) -> dict[str, Any]:
    return {"device_groups": {"ckpt": {"role": "write",
                                       "devices": [str(root / "a"), str(root / "b")]}},
            "snapshot": {"chunk_bytes": "1MiB", "pack_threshold": "4KiB"}}


def run_world(root: Path, mode: str, world: int, timeout_s: float = 150) -> list[int]:
    """Run ``mode`` on ``world`` ranks; their exit codes."""
    codes = []
    for code, err in run_ranks(WORKER, [str(root), mode], world, timeout_s):
        if code not in (0, -9):
            print(err)
        codes.append(code)
    return codes


def reports(root: Path, mode: str) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for path in root.glob(f"{mode}-rank-*.out"):
        out[int(path.stem.rsplit("-", 1)[1])] = path.read_text().splitlines()
    return out


def lines(root: Path, mode: str, prefix: str) -> list[str]:
    return [line for rank_lines in reports(root, mode).values() for line in rank_lines
            if line.startswith(prefix)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dcp")
    (root / "store.json").write_text(json.dumps(store_dict(root)))
    codes = run_world(root, "save4", 4)
    crashes = lines(root, "save4", "CRASH")
    assert not crashes, crashes[0]
    assert codes[3] == -9 and codes[:3] == [0, 0, 0], codes
    return root


@pytest.fixture(scope="module")
def loaded(saved: Path) -> Path:
    # the damage for the FLIP check: one byte of the 'flip' snapshot's only data chunk
    with SnapshotStore(config_from_dict(store_dict(saved))) as store:
        located = store.snapshot_files("flip")
        chunk = next(c for c in located.manifest.chunks if c.nbytes)
        path = Path(located.stores[chunk.device].local_path(f"{located.prefix}/{chunk.key}")
                    or "")
    data = bytearray(path.read_bytes())
    data[100] ^= 0x40
    path.write_bytes(bytes(data))
    codes = run_world(saved, "load2", 2)
    crashes = lines(saved, "load2", "CRASH")
    assert not crashes, crashes[0]
    assert codes == [0, 0], codes
    return saved


def open_store(root: Path) -> SnapshotStore:
    return SnapshotStore(config_from_dict(store_dict(root)))


def test_saved_at_four_loads_bit_exact_at_two(loaded: Path) -> None:
    got = lines(loaded, "load2", "LOAD")
    assert sorted(got) == sorted([f"LOAD {n} step={s} diff=''" for n, s in
                                  (("base", 1), ("again", 1), ("async", 2))] * 2), got


def test_saved_at_four_loads_bit_exact_at_eight(saved: Path) -> None:
    codes = run_world(saved, "load8", 8)
    crashes = lines(saved, "load8", "CRASH")
    assert not crashes, crashes[0]
    assert codes == [0] * 8
    assert lines(saved, "load8", "LOAD") == ["LOAD base step=1 diff=''"] * 8


def test_async_save_keeps_the_staged_values(loaded: Path) -> None:
    assert lines(loaded, "save4", "SAVED async") == ["SAVED async"] * 4
    assert lines(loaded, "load2", "LOAD async") == ["LOAD async step=2 diff=''"] * 2


def test_saved_at_four_loads_bit_exact_in_one_process(saved: Path) -> None:
    ref = torch.load(saved / "ref-base.pt", weights_only=True)
    with open_store(saved) as store:
        whole = store.load("base")  # native API, full tensors, no process group
        state: dict[str, Any] = {"model": {k: torch.zeros_like(v)
                                           for k, v in ref["model"].items()}}
        dcp.load(state, storage_reader=IsolaneStorageReader(store, "base"))
    assert whole["step"] == 1
    for key, value in ref["model"].items():
        assert torch.equal(whole["model"][key], value), key
        assert torch.equal(state["model"][key], value), key
    for param, moments in ref["optim"]["state"].items():
        for key, value in moments.items():
            assert torch.equal(whole["optim"]["state"][param][key], value), (param, key)


def test_an_unchanged_save_links_every_chunk(saved: Path) -> None:
    with open_store(saved) as store:
        base, again = store.info("base"), store.info("again")
    assert again.parent is not None and again.parent["name"] == "base"
    assert again.stored_bytes == base.stored_bytes > 0
    assert (again.written_bytes, again.linked_bytes) == (0, again.stored_bytes)


def test_dtensors_reshard_into_other_placements_and_meshes(loaded: Path) -> None:
    got = lines(loaded, "load2", "RESHARD")
    assert sorted(got) == sorted(["RESHARD S(1) True", "RESHARD R True", "RESHARD S(0) True",
                                  "RESHARD 2d True"] * 2), got
    assert lines(loaded, "save4", "TP2D") == ["TP2D tp2d True"] * 4


def test_wrong_shape_or_dtype_names_the_key(loaded: Path) -> None:
    shape = lines(loaded, "load2", "BAD shape")
    dtype = lines(loaded, "load2", "BAD dtype")
    assert len(shape) == len(dtype) == 2
    assert all("for w" in line and "[12, 11]" in line for line in shape), shape
    assert all("'w'" in line and "float64" in line for line in dtype), dtype


def test_a_flipped_byte_names_the_tensor_and_the_ranks_item(loaded: Path) -> None:
    got = lines(loaded, "load2", "FLIP")
    assert len(got) == 2
    for line in got:
        assert "IntegrityError" in line and "x@0" in line and "rank-0000" in line, line


def test_two_jobs_saving_one_name_one_wins(saved: Path) -> None:
    got = lines(saved, "save4", "RACE")
    won = {line.split()[1] for line in got if "won" in line}
    lost = [line for line in got if "lost" in line]
    assert len(won) == 1 and len(lost) == 2, got
    assert all("already exists" in line for line in lost), lost
    with open_store(saved) as store:
        job = store.load("race")["job"]
    assert torch.equal(job, torch.full((64,), float(won.pop())))


def test_a_rank_killed_mid_save_commits_nothing(saved: Path) -> None:
    doomed = lines(saved, "save4", "DOOMED")
    assert len(doomed) == 3 and all(line.startswith("DOOMED raised") for line in doomed)
    with open_store(saved) as store:
        names = {i.name for i in store.list()}
        assert "doomed" not in names and {"base", "again", "async"} <= names
        store.verify("base")
        swept = store.gc().swept_generations  # the ranks are gone: their leftovers go
        assert any(entry.startswith("local:doomed/") for entry in swept), swept


def test_the_cli_lists_shows_verifies_and_removes_a_dcp_checkpoint(saved: Path) -> None:
    (saved / "cli.yaml").write_text(json.dumps(store_dict(saved)))
    runner = CliRunner()
    base = ["--config", str(saved / "cli.yaml")]
    listed = runner.invoke(cli, [*base, "ls"])
    assert listed.exit_code == 0 and "base" in listed.output, listed.output
    shown = runner.invoke(cli, [*base, "show", "base"])
    assert shown.exit_code == 0 and "model.emb.weight@0,0" in shown.output, shown.output
    checked = runner.invoke(cli, [*base, "verify", "base"])
    assert checked.exit_code == 0, checked.output
    gone = runner.invoke(cli, [*base, "rm", "again"])
    assert gone.exit_code == 0, gone.output
    with open_store(saved) as store:
        assert "again" not in {i.name for i in store.list()}
        assert store.load("base")["step"] == 1  # the parent of a removed child is whole


class Opaque:
    """A value torch.load(weights_only=True) refuses."""


def test_byte_items_that_need_more_than_weights_only_are_refused(tmp_path: Path) -> None:
    with SnapshotStore(tmp_path) as store:
        dcp.save({"obj": Opaque(), "t": torch.ones(3)},
                 storage_writer=IsolaneStorageWriter(store, "opaque"))
        with pytest.raises(BaseException) as caught:  # DCP's CheckpointException
            dcp.load({"obj": None, "t": torch.zeros(3)},
                     storage_reader=IsolaneStorageReader(store, "opaque"))
        assert "weights_only" in str(caught.value) and "'obj'" in str(caught.value)
        store.save({"t": torch.ones(2)}, "plain")
        with pytest.raises(InvalidArgumentError, match="not saved through"):
            IsolaneStorageReader(store, "plain").read_metadata()


def test_a_rank_links_by_the_parent_chunks_its_coordinator_sent(tmp_path: Path) -> None:
    """Only the coordinator reads the parent's manifest: the other ranks link by the
    chunk list its ``Begun`` carries. Here the manifest is damaged once the coordinator
    has read it; a rank that read it again would fail."""
    config = config_from_dict({
        "device_groups": {"ckpt": {"role": "write", "devices": [str(tmp_path / "a")]}},
        "snapshot": {"chunk_bytes": "1MiB", "pack_threshold": "4KiB"}})
    state = {"w": torch.arange(1 << 19, dtype=torch.float32)}  # 2 MiB: two chunks
    with SnapshotStore(config) as coordinator, SnapshotStore(config) as rank:
        dcp.save(state, storage_writer=IsolaneStorageWriter(coordinator, "base"))
        begun = LocalPartSaves(coordinator).begin("next", overwrite=False, parent="base")
        assert begun.parent_chunks is not None and len(begun.parent_chunks) == 2
        (Path(coordinator.path("base")) / MANIFEST).write_bytes(b"{damaged")
        written = LocalPartSaves(rank).write_part("next", begun, 0, {"w": state["w"]},
                                                  overwrite=False)
    chunks = json.loads(written.part)["chunks"]
    assert len(chunks) == 2 and all(c["linked"] for c in chunks), chunks


def test_the_metadata_is_stored_as_json_in_the_manifest(saved: Path) -> None:
    with open_store(saved) as store:
        manifest = store.manifest("base")
    assert manifest.dcp is not None and manifest.dcp["version"] == 1
    entry = manifest.dcp["state_dict"]["model.emb.weight"]["tensor"]
    assert entry["size"] == [96, 32] and len(entry["chunks"]) == 4


def test_isolane_errors_cross_ranks_as_they_were_raised() -> None:
    # DCP pickles a rank's exception to send it to the others (in memory, never stored)
    import pickle

    from isolane import errors

    samples = [errors.SnapshotExistsError("race", "/x"), errors.IntegrityError("t", "bad"),
               errors.SnapshotNotFoundError("n", "/y"), errors.ConfigError("f", "p"),
               errors.UnsupportedValueError("[k]", "p"),
               errors.PayloadTooLargeError("body", 9, 1),
               errors.NodeUnavailableError("http://n", "down")]
    for err in samples:
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and str(back) == str(err)
        assert back.__dict__ == err.__dict__


def test_a_node_serves_a_dcp_checkpoint(saved: Path, tmp_path: Path) -> None:
    config = yaml.safe_load(write_node_config(tmp_path).read_text())
    config["device_groups"]["checkpoint"]["devices"] = [str(saved / "a"), str(saved / "b")]
    (tmp_path / "node.yaml").write_text(yaml.safe_dump(config))
    node = NodeProcess(tmp_path / "node.yaml").start()
    try:
        remote = opening.open_store(node.url)
        assert "base" in {i.name for i in remote.list()}
        remote.verify("base")
        got = remote.load("base")
    finally:
        node.stop()
    ref = torch.load(saved / "ref-base.pt", weights_only=True)
    assert got["step"] == 1
    for key, value in ref["model"].items():
        assert torch.equal(got["model"][key], value), key
