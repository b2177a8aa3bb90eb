"""One rank of a TorchTitan job checkpointing through ``IsolaneCheckpointManager``, run by
tests/integrations/test_torchtitan.py as plain processes (gloo on CPU).

usage: torchtitan_worker.py <root> <mode>   the store is the folder <root>/store; reports
                                            go to <root>/<mode>-rank-<r>.out
  save  (2 ranks) an FSDP2 model and TorchTitan's OptimizersContainer and
        LRSchedulersContainer; TorchTitan's CheckpointManager.save at steps 1, 2 (async)
        and 3 with keep_latest_k=2; full state of step 3 to ref.pt
  load  (1 rank) a fresh manager loads the newest step into a new model and compares
"""

from __future__ import annotations

import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def build(world: int) -> tuple[nn.Module, Any, Any]:
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    config = OptimizersContainer.Config(implementation="for-loop", param_groups=[
        ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})])
    optimizers = OptimizersContainer(config, model_parts=[model])
    return model, optimizers, LRSchedulersContainer(optimizers, lambda step: 1.0 / (1 + step))


def manager(root: Path, model: nn.Module, optimizers: Any, schedulers: Any,
            async_mode: str = "disabled") -> Any:
    from torchtitan.components.checkpointer.dcp import CheckpointManager

    from isolane.integrations.torchtitan import IsolaneCheckpointManager

    config = CheckpointManager.Config(enable=True, folder="ckpt", interval=1, keep_latest_k=2,
                                      async_mode=async_mode)
    return IsolaneCheckpointManager(config, store=root / "store", dataloader=None,
                                    model_parts=[model], optimizers=optimizers,
                                    lr_schedulers=schedulers, states={}, sd_adapter=None,
                                    base_folder=str(root))


def train(model: nn.Module, optimizers: Any, schedulers: Any, step: int) -> None:
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
    model(x).pow(2).mean().backward()
    optimizers.step()
    optimizers.zero_grad()
    schedulers.step()


def full(model: nn.Module, optimizers: Any) -> dict[str, Any]:
    msd, osd = get_state_dict(model, optimizers.optimizers,
                              options=StateDictOptions(full_state_dict=True))
    return {"model": msd, "optim": osd}


def save(root: Path, report: Any) -> None:
    model, optimizers, schedulers = build(dist.get_world_size())
    titan = manager(root, model, optimizers, schedulers, async_mode="async")
    for step in (1, 2, 3):
        train(model, optimizers, schedulers, step)
        report(f"SAVED {step} {titan.save(step)}")
        titan.maybe_wait_for_saving()
    ref = full(model, optimizers)
    if dist.get_rank() == 0:
        torch.save({**ref, "lr": schedulers.schedulers[0].get_last_lr()}, root / "ref.pt")
    titan.close()


def load(root: Path, report: Any) -> None:
    model, optimizers, schedulers = build(1)
    titan = manager(root, model, optimizers, schedulers)
    loaded = titan.load()
    ref = torch.load(root / "ref.pt", weights_only=True)
    got = full(model, optimizers)
    same_model = all(torch.equal(got["model"][k], v) for k, v in ref["model"].items())
    same_optim = all(torch.equal(got["optim"]["state"][p][k], v)
                     for p, moments in ref["optim"]["state"].items()
                     for k, v in moments.items())
    report(f"LOAD {loaded} model={same_model} optim={same_optim} "
           f"lr={schedulers.schedulers[0].get_last_lr() == ref['lr']} "
           f"step={titan._find_load_step()}")
    titan.close()


def main() -> None:
    root, mode = Path(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    path = root / f"{mode}-rank-{dist.get_rank()}.out"

    def report(line: str) -> None:
        with open(path, "a") as f:
            f.write(line + "\n")

    try:
        {"save": save, "load": load}[mode](root, report)
    except Exception:
        report("CRASH " + traceback.format_exc().replace("\n", " | "))
        raise
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
