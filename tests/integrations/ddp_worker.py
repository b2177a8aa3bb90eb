"""Run by tests/integrations/test_ddp_callbacks.py under torchrun (2 ranks, gloo):
every rank calls PeriodicSnapshot.step like a DDP training loop does."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from isolane import SnapshotStore
from isolane.integrations.callbacks import PeriodicSnapshot


def main(root: str, async_: bool) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)  # replicas: the same weights on every rank
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    store = SnapshotStore(root)
    saver = PeriodicSnapshot(store, every_n_steps=2, keep_last=2, async_=async_)
    for step in range(1, 7):
        model.weight.data.add_(step)
        saver.step(step, model, optimizer)
    saver.wait()
    dist.barrier()
    if dist.get_rank() == 0:
        print("SNAPSHOTS", sorted(info.name for info in store.list()), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] == "async")
