"""The soak's 2-rank training job: run by ``soak.py`` under torchrun (gloo on CPU).

usage: torchrun --nproc-per-node 2 _soak_dist.py <run folder>

Saves in a loop, every rank its rows of ``w`` (``Shard``-marked) and the replicated
``bias``; rank 0 journals each acknowledged save to ``journal/dist.jsonl``. Stops
when ``ctl/stop-dist`` exists (rank 0 decides, every rank follows). A rank killed by
the soak breaks the group: torchrun then ends the job and the soak starts it again.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._soak_data import (
    Journal,
    dist_full_state,
    run_paths,
    state_bytes,
    write_json,
)


def main() -> None:
    import torch.distributed as dist

    from isolane import SnapshotStore
    from isolane.errors import IsolaneError
    from isolane.snapshot.sharding import Shard

    run = Path(sys.argv[1])
    paths = run_paths(run)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    journal = Journal(paths["journal"] / "dist.jsonl") if rank == 0 else None
    hb = paths["hb"] / f"dist-rank{rank}"
    store = SnapshotStore(str(paths["embedded_config"]))
    i = 0
    while True:
        i += 1
        order: list[object] = [None, None]
        if rank == 0:
            stop = (paths["ctl"] / "stop-dist").exists()
            order = [None if stop else f"dist-{os.getpid()}-{i}",
                     (os.getpid() % 100_000) * 100_000 + i]
        dist.broadcast_object_list(order, src=0)
        name, seed = order
        if name is None:
            break
        assert isinstance(name, str) and isinstance(seed, int)
        full = dist_full_state(seed)
        state = {"model": {"w": full["w"].tensor_split(world)[rank].clone(),
                           "bias": full["bias"]}, "step": seed, "rank": rank}
        write_json(hb, {"op": "save", "since": time.time(), "pid": os.getpid()})
        try:
            info = store.save(state, name, {"seed": seed},
                              shards={"model.w": Shard.even(rank, world, 1001)})
        except IsolaneError as exc:
            if journal is not None:
                journal.write("fail", name=name, seed=seed,
                              error=f"{type(exc).__name__}: {str(exc)[:300]}")
        except Exception as exc:  # a raw error breaks the group: journal it, then die
            Journal(paths["journal"] / f"dist-rank{rank}.jsonl").write(
                "raw", op="save", error=f"{type(exc).__name__}: {exc}"[:500])
            raise
        else:
            if journal is not None:
                journal.write("ack", name=name, seed=seed, kind="dist",
                              generation=info.generation, bytes=state_bytes(full),
                              linked=info.linked_bytes, store="embedded")
        write_json(hb, {"op": None, "since": time.time(), "pid": os.getpid()})
        time.sleep(0.5)
    store.close()
    dist.destroy_process_group()
    if journal is not None:
        journal.write("exit")


if __name__ == "__main__":
    main()
