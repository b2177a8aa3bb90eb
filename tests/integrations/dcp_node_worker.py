"""One rank of a DCP job through a storage node, run by
tests/integrations/test_dcp_node_reads.py as plain processes (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT set; gloo on CPU).

usage: dcp_node_worker.py <root> <mode>   the node's URL is in <root>/node-url; reports
                                          go to <root>/<mode>-rank-<r>.out
  save4  (4 ranks) DTensors of ``full_state`` (Shard(0), uneven; a replicated one) and a
         step count, saved through the node as 'r4'
  load2  (2 ranks) 'r4' into Shard(0) DTensors (the node's bytes sent during that load
         reported by rank 0 as SERVED), then into Shard(1); each compared bit for bit
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import urllib.request
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

ROW = 1 << 18  # fp32 elements: a row is 1 MiB, one chunk of the node's config


def full_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {"w": torch.randn(10, ROW, generator=g),  # 4 ranks: 3, 3, 3, 1 rows
            "b": torch.randn(64, 1024, generator=g).to(torch.bfloat16),  # packed shards
            "r": torch.randn(16, generator=g)}


def sharded(mesh: Any, placement: Any, zeros: bool) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for key, value in full_state().items():
        value = torch.zeros_like(value) if zeros else value
        state[key] = distribute_tensor(value, mesh, [Replicate() if key == "r" else placement])
    state["step"] = 0 if zeros else 7
    return state


def served(url: str) -> int:
    with urllib.request.urlopen(f"{url}/v1/stats", timeout=30) as answer:
        return int(json.loads(answer.read())["totals"]["bytes_out"])


def check(state: dict[str, Any]) -> str:
    full = full_state()
    for key, value in state.items():
        if key == "step":
            if value != 7:
                return f"step={value}"
            continue
        assert isinstance(value, DTensor)
        got = value.full_tensor()
        if not torch.equal(got.view(-1).view(torch.uint8), full[key].view(-1).view(torch.uint8)):
            return key
    return ""


def main() -> None:
    from isolane.integrations.dcp import IsolaneStorageReader, IsolaneStorageWriter

    root, mode = Path(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    out = root / f"{mode}-rank-{rank}.out"

    def report(line: str) -> None:
        with open(out, "a") as f:
            f.write(line + "\n")

    url = (root / "node-url").read_text().strip()
    mesh = init_device_mesh("cpu", (world,))
    try:
        if mode == "save4":
            dcp.save(sharded(mesh, Shard(0), zeros=False),
                     storage_writer=IsolaneStorageWriter(url, "r4"))
            report("SAVED")
        else:
            state = sharded(mesh, Shard(0), zeros=True)
            dist.barrier()
            before = served(url) if rank == 0 else 0
            dcp.load(state, storage_reader=IsolaneStorageReader(url, "r4"))
            dist.barrier()
            if rank == 0:
                report(f"SERVED {served(url) - before}")
            report(f"ROWS {check(state)!r}")
            state = sharded(mesh, Shard(1), zeros=True)
            dcp.load(state, storage_reader=IsolaneStorageReader(url, "r4"))
            report(f"COLUMNS {check(state)!r}")
    except Exception:
        report("CRASH " + traceback.format_exc().replace("\n", " | "))
        raise
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
