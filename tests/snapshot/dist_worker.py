"""One rank of a multi-rank save or load, run by tests/snapshot/test_distributed.py under
torchrun (or as plain processes with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set).

usage: dist_worker.py <store folder> <mode>     (reports go to stdout and to
                                                <store folder>/rank-<r>.out)
  save      save 'ckpt' with this rank's pieces, then the same as 'again'
  load      load 'ckpt' and compare with this rank's state: reports 'MATCH <rank> <bool>'
  kill      save 'base', then 'next' with rank 1 dying after its first chunk;
            rank 0 reports 'RAISED <class>: <message>'
  kill-all  save 'base', then 'next' with every rank dying after its first chunk
  errors    save 'base', then three saves that fail on one rank: reports
            'E<n> <rank> <exception class>' for each, then 'LIST <names>'
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from isolane.config import Config, config_from_dict
from isolane.snapshot.sharding import Shard

ROWS = 1001  # uneven on purpose: rank 0 of 2 holds one row more
EMB_ROWS = 37


def store_config(root: Path) -> Config:
    return config_from_dict({
        "device_groups": {"ckpt": {"role": "write", "devices": [str(root / "a"),
                                                                 str(root / "b")]}},
        "snapshot": {"chunk_bytes": "1MiB", "pack_threshold": "64KiB"}})


def full_state(step: int) -> dict[str, torch.Tensor]:
    """The unsplit model every rank holds a piece of."""
    gen = torch.Generator().manual_seed(step)
    return {"w": torch.randn(ROWS, 1536, generator=gen),  # ~3 MiB a rank: 3 chunks each
            "emb": torch.randn(EMB_ROWS, 8, generator=gen).to(torch.bfloat16),  # packed
            "bias": torch.randn(512, generator=gen)}  # replicated on every rank


def local_state(step: int, rank: int, world: int) -> dict[str, Any]:
    full = full_state(step)
    return {"model": {"w": full["w"].tensor_split(world)[rank].clone(),
                      "emb": full["emb"].tensor_split(world)[rank].clone(),
                      "bias": full["bias"]},
            "step": step, "rank": rank}


def shards(rank: int, world: int) -> dict[str, Shard]:
    return {"model.w": Shard.even(rank, world, ROWS),
            "model.emb": Shard.even(rank, world, EMB_ROWS)}


def report(root: Path, rank: int, line: str) -> None:
    """One line into this rank's own file: ranks under torchrun share a stdout, where
    their lines can run into each other."""
    with open(root / f"rank-{rank}.out", "a") as f:
        f.write(line + "\n")
    print(line, flush=True)


def main() -> None:
    import torch.distributed as dist

    from isolane import SnapshotStore
    from isolane.errors import IsolaneError

    root, mode = Path(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    store = SnapshotStore(store_config(root))
    if mode == "save":
        store.save(local_state(1, rank, world), "ckpt", {"loss": 0.5},
                   shards=shards(rank, world))
        # Same bytes again: every rank links its chunks from the parent 'ckpt'.
        store.save(local_state(1, rank, world), "again", shards=shards(rank, world))
    elif mode == "load":
        got = store.load("ckpt")
        want = local_state(1, rank, world)
        same = (got["step"] == want["step"] and got["rank"] == rank and all(
            torch.equal(got["model"][k].view(torch.uint8) if k == "emb" else got["model"][k],
                        want["model"][k].view(torch.uint8) if k == "emb" else want["model"][k])
            and got["model"][k].dtype == want["model"][k].dtype for k in want["model"]))
        report(root, rank, f"MATCH {rank} {same}")
    elif mode in ("kill", "kill-all"):
        store.save(local_state(1, rank, world), "base", shards=shards(rank, world))
        dies = mode == "kill-all" or rank == 1

        def die(_done: int, _total: int) -> None:
            os._exit(9)

        try:
            store.save(local_state(2, rank, world), "next", shards=shards(rank, world),
                       progress=die if dies else None)
        except IsolaneError as exc:
            report(root, rank, f"RAISED {type(exc).__name__}: {exc}")
            os._exit(0)  # the process group is broken: skip its teardown
        report(root, rank, "COMMITTED")
    elif mode == "errors":
        state = local_state(1, rank, world)
        store.save(state, "base", shards=shards(rank, world))
        bad_total = {**shards(rank, world)}
        if rank == 1:  # fits this rank's rows, but the pieces no longer tile the tensor
            bad_total["model.w"] = Shard(bad_total["model.w"].offset, ROWS + 5)
        unknown = {"model.nope": Shard(0, 1)} if rank == 1 else shards(rank, world)
        attempts = [("base", shards(rank, world)), ("bad", bad_total), ("bad2", unknown)]
        for n, (name, spec) in enumerate(attempts, 1):
            try:
                store.save(state, name, shards=spec)
                report(root, rank, f"E{n} {rank} none")
            except IsolaneError as exc:
                report(root, rank, f"E{n} {rank} {type(exc).__name__}")
        report(root, rank, "LIST " + ",".join(i.name for i in store.list()))
    store.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
