"""One rank of a torch.distributed.checkpoint job on isolane, run by
tests/integrations/test_dcp.py as plain processes (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT set; gloo on CPU).

usage: dcp_worker.py <root> <mode>     the store's config is <root>/store.json; reports
                                       go to <root>/<mode>-rank-<r>.out, one per line
  save4   (4 ranks) FSDP2 transformer + AdamW: dcp.save 'base' (full tensors to
          ref-base.pt), again unchanged as 'again', one step then async_save 'async'
          with the parameters mutated right after staging (ref-async.pt), a 2-D (dp, tp)
          DTensor state through store.save as 'tp2d', 'flip' to damage, two 2-rank jobs
          saving 'race' at once, then 'doomed' with rank 3 SIGKILLed mid-save
  load8   (8 ranks) load 'base' into an FSDP2 model of 8 ranks and compare
  hosts   (2 ranks, each its own host: <root>/store-<r>.json, one S3 mirror) save twice,
          wait for the mirror, load on both hosts and compare
  node2   (2 ranks) the store is the node whose URL is in <root>/node-url: dcp.save
          'n-base' (full tensors to ref-base.pt), again unchanged as 'n-again', then
          'n-doomed' with rank 1 SIGKILLed mid-save
  load2   (2 ranks) load those into an FSDP2 model of 2 ranks and compare bit for bit;
          'tp2d' into other placements and a 1-D mesh; wrong shape and dtype; 'flip'
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

VOCAB, DIM = 96, 32


class TinyTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(DIM, 4, 4 * DIM, dropout=0.0, batch_first=True)
            for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def sharded_model(world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TinyTransformer()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (4, 8), generator=gen)
    model(x).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def state_of(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "step": step}


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    return {"model": msd, "optim": osd}


def flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: value}


def same(a: dict[str, Any], b: dict[str, Any]) -> str:
    """'' when every leaf is equal bit for bit, else the first key that differs."""
    fa, fb = flat(a), flat(b)
    if fa.keys() != fb.keys():
        return f"keys differ: {sorted(fa.keys() ^ fb.keys())[:3]}"
    for key, x in fa.items():
        y = fb[key]
        if isinstance(x, torch.Tensor):
            if not (x.dtype == y.dtype and x.shape == y.shape
                    and torch.equal(x.view(-1).view(torch.uint8) if x.dim() else x,
                                    y.view(-1).view(torch.uint8) if y.dim() else y)):
                return key
        elif x != y:
            return key
    return ""


class KillingPlanner(DefaultSavePlanner):
    """Rank ``victim`` dies (SIGKILL) while resolving its second item."""

    def __init__(self, victim: int) -> None:
        super().__init__()
        self.victim = victim
        self.resolved = 0

    def resolve_data(self, write_item: Any) -> Any:
        self.resolved += 1
        if dist.get_rank() == self.victim and self.resolved == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().resolve_data(write_item)


def describe(exc: BaseException) -> str:
    """The error of the lowest failed rank for DCP's CheckpointException (which holds
    every failed rank's), else ``exc``; class and message on one line."""
    failures = getattr(exc, "failures", None)
    first = failures[min(failures)][0] if failures else exc
    return f"{type(first).__name__}: {' '.join(str(first).split())[:600]}"


class Reporter:
    def __init__(self, root: Path, mode: str, rank: int) -> None:
        self.path = root / f"{mode}-rank-{rank}.out"

    def __call__(self, line: str) -> None:
        with open(self.path, "a") as f:
            f.write(line + "\n")


def tp_full() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {"w": torch.randn(12, 10, generator=gen),
            "b": torch.randn(10, generator=gen).to(torch.bfloat16)}


def tp_state(mesh: Any) -> dict[str, Any]:
    full = tp_full()
    return {"w": distribute_tensor(full["w"], mesh, [Shard(0), Shard(1)]),
            "b": distribute_tensor(full["b"], mesh, [Replicate(), Shard(0)]),
            "meta": {"lr": 0.5, "name": "tp"}}


def save4(root: Path, report: Reporter, store: Any) -> None:
    from isolane.integrations.dcp import IsolaneStorageWriter

    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = sharded_model(world)
    train_step(model, opt, 1)
    ref = full_state(model, opt)
    if rank == 0:
        torch.save(ref, root / "ref-base.pt")
    dcp.save(state_of(model, opt, 1), storage_writer=IsolaneStorageWriter(store, "base"))
    dcp.save(state_of(model, opt, 1), storage_writer=IsolaneStorageWriter(store, "again"))
    report("SAVED base again")

    train_step(model, opt, 2)
    ref = full_state(model, opt)
    if rank == 0:
        torch.save(ref, root / "ref-async.pt")
    writer = IsolaneStorageWriter(store, "async")
    fut = dcp.async_save(state_of(model, opt, 2), storage_writer=writer)
    with torch.no_grad():  # the training step goes on at once
        for p in model.parameters():
            p.add_(1.0)
    fut.result()
    report("SAVED async")

    mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    info = store.save(tp_state(mesh2d), "tp2d")
    report(f"TP2D {info.name} {info.tensors > 0}")
    dcp.save({"x": torch.arange(4096, dtype=torch.float32) + rank * 0},
             storage_writer=IsolaneStorageWriter(store, "flip"))

    # Two jobs, ranks {0, 1} and {2, 3}, save one name at once: one wins.
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = groups[rank // 2]
    try:
        dcp.save({"job": torch.full((64,), float(rank // 2))}, process_group=mine,
                 storage_writer=IsolaneStorageWriter(store, "race"))
        report(f"RACE {rank // 2} won")
    except BaseException as exc:
        report(f"RACE {rank // 2} lost {describe(exc)}")
    dist.barrier()

    # Rank 3 dies mid-save: nothing commits.
    try:
        dcp.save(state_of(model, opt, 3), planner=KillingPlanner(3),
                 storage_writer=IsolaneStorageWriter(store, "doomed"))
        report("DOOMED committed")
    except BaseException as exc:
        report(f"DOOMED raised {type(exc).__name__}")
        os._exit(0)  # the group is broken: leave without its teardown


def load2(root: Path, report: Reporter, store: Any) -> None:
    from isolane.integrations.dcp import IsolaneStorageReader

    world = dist.get_world_size()
    for name in ("base", "again", "async"):
        model, opt = sharded_model(world)
        train_step(model, opt, 9)  # optimizer state exists, values differ
        state = state_of(model, opt, 0)
        dcp.load(state, storage_reader=IsolaneStorageReader(store, name))
        ref = torch.load(root / f"ref-{'async' if name == 'async' else 'base'}.pt",
                         weights_only=True)
        report(f"LOAD {name} step={state['step']} diff={same(full_state(model, opt), ref)!r}")

    full = tp_full()
    mesh1 = init_device_mesh("cpu", (world,))
    for placements in ([Shard(1)], [Replicate()], [Shard(0)]):
        into = {"w": distribute_tensor(torch.zeros(12, 10), mesh1, placements),
                "b": distribute_tensor(torch.zeros(10, dtype=torch.bfloat16), mesh1,
                                       placements if placements != [Shard(1)] else [Shard(0)]),
                "meta": {"lr": 0.0, "name": ""}}
        got = store.load("tp2d", into=into)
        ok = (torch.equal(got["w"].full_tensor(), full["w"])
              and torch.equal(got["b"].full_tensor(), full["b"]) and got["meta"]["lr"] == 0.5)
        report(f"RESHARD {placements[0]} {ok}")
    mesh2 = init_device_mesh("cpu", (1, world), mesh_dim_names=("a", "b"))
    into = {"w": distribute_tensor(torch.zeros(12, 10), mesh2, [Replicate(), Shard(1)]),
            "b": distribute_tensor(torch.zeros(10, dtype=torch.bfloat16), mesh2,
                                   [Shard(0), Replicate()])}
    got = store.load("tp2d", into=into)
    report(f"RESHARD 2d {torch.equal(got['w'].full_tensor(), full['w'])}")

    for label, bad in (("shape", {"w": distribute_tensor(torch.zeros(12, 11), mesh1,
                                                         [Shard(0)])}),
                       ("dtype", {"w": distribute_tensor(torch.zeros(12, 10,
                                                                     dtype=torch.float64),
                                                         mesh1, [Shard(0)])})):
        try:
            store.load("tp2d", into=bad)
            report(f"BAD {label} loaded")
        except BaseException as exc:
            report(f"BAD {label} {type(exc).__name__}: {' '.join(str(exc).split())[:600]}")
    try:
        dcp.load({"x": torch.zeros(4096)}, storage_reader=IsolaneStorageReader(store, "flip"))
        report("FLIP loaded")
    except BaseException as exc:  # DCP's CheckpointException holds each rank's error
        report(f"FLIP {describe(exc)}")


def load_base(root: Path, report: Reporter, store: Any) -> None:
    """Load 'base' into an FSDP2 model of this world's size and compare."""
    from isolane.integrations.dcp import IsolaneStorageReader

    model, opt = sharded_model(dist.get_world_size())
    train_step(model, opt, 9)
    state = state_of(model, opt, 0)
    dcp.load(state, storage_reader=IsolaneStorageReader(store, "base"))
    ref = torch.load(root / "ref-base.pt", weights_only=True)
    report(f"LOAD base step={state['step']} diff={same(full_state(model, opt), ref)!r}")


def hosts(root: Path, report: Reporter, store: Any) -> None:
    """Each rank is a host of its own: its store's write group is its own folder, the
    mirror (S3) is shared."""
    from isolane.integrations.dcp import IsolaneStorageReader, IsolaneStorageWriter

    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = sharded_model(world)
    train_step(model, opt, 1)
    ref = full_state(model, opt)
    for name in ("h1", "h2"):  # h2: unchanged, rank 0's part linked from h1
        dcp.save(state_of(model, opt, 1), storage_writer=IsolaneStorageWriter(store, name))
        errors = store.wait_for_mirrors(timeout=120)  # rank 0: the manifest; others: parts
        report(f"MIRRORED {name} {sorted(errors.values(), key=str)}")
    dist.barrier()
    for name in ("h1", "h2"):
        model2, opt2 = sharded_model(world)
        train_step(model2, opt2, 9)
        state = state_of(model2, opt2, 0)
        dcp.load(state, storage_reader=IsolaneStorageReader(store, name))
        where = store.info(name).location
        report(f"HOSTLOAD {name} {where} diff={same(full_state(model2, opt2), ref)!r}")
    if rank == 0:
        info = store.info("h2")
        report(f"LINKED {info.linked_bytes > 0}")


def node2(root: Path, report: Reporter, store: Any) -> None:
    from isolane.integrations.dcp import IsolaneStorageWriter

    url = (root / "node-url").read_text().strip()
    model, opt = sharded_model(dist.get_world_size())
    train_step(model, opt, 1)
    ref = full_state(model, opt)
    if dist.get_rank() == 0:
        torch.save(ref, root / "ref-base.pt")
    for name in ("n-base", "n-again"):
        writer = IsolaneStorageWriter(url, name)
        dcp.save(state_of(model, opt, 1), storage_writer=writer)
        report(f"SAVED {name} {writer.info is not None}")
    try:
        dcp.save(state_of(model, opt, 3), planner=KillingPlanner(1),
                 storage_writer=IsolaneStorageWriter(url, "n-doomed"))
        report("DOOMED committed")
    except BaseException as exc:
        report(f"DOOMED raised {type(exc).__name__}")
        os._exit(0)  # the group is broken: leave without its teardown


def main() -> None:
    from isolane import SnapshotStore
    from isolane.config import config_from_dict

    root, mode = Path(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    report = Reporter(root, mode, rank)
    own = root / f"store-{rank}.json"  # a host of its own
    config = own if own.exists() else root / "store.json"
    store = SnapshotStore(config_from_dict(json.loads(config.read_text())))
    try:
        modes = {"save4": save4, "load2": load2, "load8": load_base, "hosts": hosts,
                 "node2": node2}
        modes[mode](root, report, store)
    except Exception:
        report("CRASH " + traceback.format_exc().replace("\n", " | "))
        raise
    store.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
