"""Run by tests/integrations/test_sharded_recipes.py under torchrun (gloo, CPU): a small
FSDP2 model (``fully_shard`` over ``init_device_mesh("cpu", (W,))``) trained with AdamW,
checkpointed with ``ShardedCheckpoint``.

    sharded_worker.py STORE OUT train STEPS   # train from scratch, save every 2 steps
                                              # (the last save async), write the weights
    sharded_worker.py STORE OUT resume STEPS  # resume from the newest snapshot, finish

Each run writes OUT/<mode>-rank<r>.pt: the full weights and optimizer moments after every
step (gathered from the shards), and the losses, for the test to compare.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from isolane.integrations.sharded_loop import ShardedCheckpoint


def build(mesh: object) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 8))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(step * 100 + rank))


def full(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


def snapshot_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, object]:
    weights = {k: full(v.detach()).clone() for k, v in model.state_dict().items()}
    moments = {}
    for i, param in enumerate(model.parameters()):
        state = optimizer.state.get(param, {})
        if "exp_avg" in state:
            moments[f"{i}.exp_avg"] = full(state["exp_avg"]).clone()
            moments[f"{i}.exp_avg_sq"] = full(state["exp_avg_sq"]).clone()
    return {"weights": weights, "moments": moments}


def main(store: str, out: str, mode: str, steps: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = build(mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = ShardedCheckpoint(store, every_n_steps=2, keep_last=2)
    start = ckpt.resume(model, optimizer) if mode == "resume" else 0
    record: dict[str, object] = {"start": start, "losses": {},
                                 "after": {start: snapshot_of(model, optimizer)}}
    for step in range(start + 1, steps + 1):
        loss = model(batch(step, rank)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        record["losses"][step] = loss.item()  # type: ignore[index]
        record["after"][step] = snapshot_of(model, optimizer)  # type: ignore[index]
        ckpt.async_ = mode == "train" and step == steps - 2
        ckpt.step(step, model, optimizer)
        # the loop goes on while an async save runs: a changed parameter must not reach it
    ckpt.close()
    torch.save(record, Path(out) / f"{mode}-rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
