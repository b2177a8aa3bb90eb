"""Run by tests/integrations/test_sharded_recipes.py under torchrun (2 ranks, gloo, CPU):
Lightning's ModelParallelStrategy, through ``IsolaneModelParallelStrategy``, trains a small
FSDP2 module and checkpoints every 2 steps (top 2 by step, plus ``last.ckpt``). Every
epoch is one step of the same batch, so a resumed run's losses depend only on the state
it restored.

    lightning_dcp_worker.py STORE ROOT OUT STEPS [CKPT_PATH]

With CKPT_PATH (a checkpoint file, or ``last``) it resumes from there. Each rank writes
OUT/<fit|resume>-rank<r>.pt: the step it started at, the full weights it started from
and ended with, its losses, the final learning rate.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from isolane.integrations.lightning_dcp import IsolaneModelParallelStrategy


def full_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in module.state_dict().items()}


class Net(L.LightningModule):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.GELU(),
                                       torch.nn.Linear(width, 4))
        self.record: dict[str, Any] = {"losses": {}}

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def on_train_start(self) -> None:
        self.record["start"] = self.global_step
        self.record["first"] = full_weights(self.net)

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        loss = self.net(batch[0]).pow(2).mean()
        self.record["losses"][self.global_step + 1] = loss.item()
        return loss

    def on_train_end(self) -> None:
        self.record["last"] = full_weights(self.net)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler,
                                                         "interval": "step"}}


def main(store: str, root: str, out: str, steps: int, resume: str | None) -> None:
    torch.set_num_threads(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(16, 16, generator=torch.Generator().manual_seed(1)))
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=False)
    checkpoints = ModelCheckpoint(dirpath=Path(root) / "ckpt", every_n_train_steps=2,
                                  save_top_k=2, monitor="step", mode="max", save_last=True)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=steps, logger=False,
        strategy=IsolaneModelParallelStrategy(store, data_parallel_size=2,
                                              tensor_parallel_size=1),
        callbacks=[checkpoints], enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=root)
    module = Net()
    trainer.fit(module, loader, ckpt_path=resume)
    record = dict(module.record, lr=trainer.optimizers[0].param_groups[0]["lr"],
                  best=checkpoints.best_model_path)
    name = "resume" if resume else "fit"
    torch.save(record, Path(out) / f"{name}-rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]),
         sys.argv[5] if len(sys.argv) > 5 else None)
