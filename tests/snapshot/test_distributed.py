"""Multi-rank checkpoints: real ranks (torchrun, gloo on CPU) save in parallel, rank 0
commits; loads with the same world size, with one process, and resliced for four."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from isolane import SnapshotStore
from isolane.errors import InvalidArgumentError
from tests.snapshot.dist_worker import full_state, local_state, store_config
from tests.support.procs import free_ports

WORKER = Path(__file__).with_name("dist_worker.py")
REPO = Path(__file__).resolve().parents[2]


def _torchrun(root: Path, mode: str) -> subprocess.CompletedProcess[str]:
    port = free_ports(1)[0]
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", str(port), str(WORKER), str(root),
         mode], capture_output=True, text=True, timeout=120, cwd=REPO)


def _reported(root: Path) -> set[str]:
    return {line for path in root.glob("rank-*.out") for line in path.read_text().splitlines()}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dist")
    run = _torchrun(root, "save")
    assert run.returncode == 0, run.stderr[-3000:]
    return root


def test_each_rank_loads_its_own_pieces_with_the_same_world_size(saved: Path) -> None:
    run = _torchrun(saved, "load")
    assert run.returncode == 0, run.stderr[-3000:]
    assert {"MATCH 0 True", "MATCH 1 True"} <= _reported(saved)


def test_one_process_gets_split_tensors_reassembled(saved: Path) -> None:
    full = full_state(1)
    with SnapshotStore(store_config(saved)) as store:
        got = store.load("ckpt")
        info = store.info("ckpt")
        store.verify("ckpt")
    for key in ("w", "emb", "bias"):
        assert got["model"][key].dtype == full[key].dtype
        assert torch.equal(_bits(got["model"][key]), _bits(full[key])), key
    assert (got["step"], got["rank"]) == (1, 0)  # non-tensor leaves as rank 0 saved them
    assert info.metadata == {"loss": 0.5}
    assert info.tensors == 6  # three a rank


def test_an_unchanged_multi_rank_save_links_every_chunk(saved: Path) -> None:
    with SnapshotStore(store_config(saved)) as store:
        first, again = store.info("ckpt"), store.info("again")
        assert again.parent == {"name": "ckpt", "generation": first.generation}
        assert again.stored_bytes == first.stored_bytes > 0
        assert (again.linked_bytes, again.written_bytes) == (again.stored_bytes, 0)
        assert torch.equal(store.load("again")["model"]["w"], full_state(1)["w"])


def test_four_ranks_get_their_rows_of_each_split_tensor(saved: Path) -> None:
    full = full_state(1)
    with SnapshotStore(store_config(saved)) as store:
        for rank in range(4):
            got = store.load("ckpt", keys=["model.w", "model.emb", "model.bias"],
                             shard=(rank, 4))
            for key in ("w", "emb"):
                want = full[key].tensor_split(4)[rank]
                assert torch.equal(_bits(got["model"][key]), _bits(want)), (rank, key)
            assert torch.equal(got["model"]["bias"], full["bias"])  # replicated: whole
            assert set(got) == {"model"}


def test_explicit_shard_with_the_saved_world_size_is_that_rank_as_saved(saved: Path) -> None:
    with SnapshotStore(store_config(saved)) as store:
        got = store.load("ckpt", shard=(1, 2))
        with pytest.raises(InvalidArgumentError, match="shard rank 2"):
            store.load("ckpt", shard=(2, 2))
    want = local_state(1, 1, 2)
    assert got["rank"] == 1
    assert torch.equal(got["model"]["w"], want["model"]["w"])


def test_a_failure_on_one_rank_fails_the_save_on_every_rank(tmp_path: Path) -> None:
    run = _torchrun(tmp_path, "errors")
    assert run.returncode == 0, run.stderr[-3000:]
    lines = _reported(tmp_path)
    # Name taken: rank 0 refuses before anyone writes.
    assert {"E1 0 SnapshotExistsError", "E1 1 DistributedSaveError"} <= lines
    # Pieces that do not tile the tensor: rank 0 refuses to commit what was written.
    assert {"E2 0 DistributedSaveError", "E2 1 DistributedSaveError"} <= lines
    # A local error on rank 1 (unknown key in shards=): its own error there.
    assert {"E3 0 DistributedSaveError", "E3 1 InvalidArgumentError"} <= lines
    assert "LIST base" in lines
    assert sorted(p.name for p in (tmp_path / "a" / "snapshots").iterdir()) == ["base"]


def test_a_rank_killed_mid_save_commits_nothing(tmp_path: Path) -> None:
    # Plain processes rather than torchrun, which would kill rank 0 as soon as rank 1
    # dies: here rank 0 must notice by itself, refuse to commit and clean up.
    port = free_ports(1)[0]
    procs = [subprocess.Popen(
        [sys.executable, str(WORKER), str(tmp_path), "kill"], cwd=REPO, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}) for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert procs[1].returncode == 9, outs[1][1][-3000:]
    assert procs[0].returncode == 0, outs[0][1][-3000:]
    assert "RAISED DistributedSaveError" in outs[0][0]
    assert "COMMITTED" not in outs[0][0]
    with SnapshotStore(store_config(tmp_path)) as store:
        assert [i.name for i in store.list()] == ["base"]
        base = store.load("base")
        assert torch.equal(base["model"]["w"], full_state(1)["w"])
        assert store.gc().swept_generations == ()  # rank 0 already removed its leftovers
    assert not (tmp_path / "a" / "snapshots" / "next").exists()
    assert not (tmp_path / "b" / "snapshots" / "next").exists()


def test_leftovers_of_a_save_whose_ranks_all_died_are_swept_by_gc(tmp_path: Path) -> None:
    run = _torchrun(tmp_path, "kill-all")
    assert run.returncode != 0
    assert "COMMITTED" not in _reported(tmp_path)
    leftover = tmp_path / "a" / "snapshots" / "next"
    assert any(leftover.iterdir())  # chunks written before the ranks died
    with SnapshotStore(store_config(tmp_path)) as store:
        assert [i.name for i in store.list()] == ["base"]
        report = store.gc()
        assert [s.split("/")[0] for s in report.swept_generations] == ["local:next"]
        assert torch.equal(store.load("base")["model"]["w"], full_state(1)["w"])
    assert not leftover.exists()
    assert not (tmp_path / "b" / "snapshots" / "next").exists()
