"""Sharded checkpoints through torch.distributed.checkpoint (DCP): isolane's storage layer
against DCP's FileSystemWriter (1 and 4 threads) and s3torchconnector's DCP writer (on
SeaweedFS, ``tests/support/seaweedfs.py``; left out, with the reason, when missing).

Every rank is a real process in a gloo group; the state dict is FSDP2-shaped (DTensors
``Shard(0)`` over ``init_device_mesh("cpu", (W,))``): bf16 weights and their fp32 AdamW
state, ~2 GB at ``--scale 1``. For each world size one group of workers runs every system
round after round, so the ratios compare runs of one moment. ``--parts``:

- **save**: ``dcp.save`` until every rank returned (``FileSystemWriter(sync_files=True)``),
  then ``dcp.load`` into preallocated DTensors after dropping the page cache (when root),
  checked bit for bit outside the clock. The bound: the same bytes through a 4-thread
  loop of 64 MiB O_DIRECT ``pwrite``s into one file, fsynced, plus DCP's own floor (the
  same ``dcp.save`` through a writer that writes nothing), both in the same round;
- **async**: the time ``dcp.async_save`` holds the caller, beside the sync save. The
  copying floor: every rank copies its state into tensors it already holds, all ranks at
  once, as any staging that lets training go on must;
- **lora**: a frozen bf16 base plus adapters with AdamW state, saved once; the adapters
  change in place, then the timed save of the new step (isolane links the unchanged
  chunks). DCP's own floor: the same ``dcp.save`` through a writer that writes nothing;
  the hashing floor: every rank hashes its whole state (xxh3-128, two threads each, no
  I/O), as an incremental save must to find what changed, all ranks at once.

The ranks collect garbage between runs, outside the clock, and not inside them (automatic
collection off, as TorchTitan's ``GarbageCollector`` runs training), for every system.

    python benchmarks/bench_dcp.py --quick                  # smoke test, seconds
    python benchmarks/bench_dcp.py --out docs/BENCHMARKS.md # ~2 GB, 5 repeats
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C
import _quick
import _results

SYSTEMS = ("isolane", "fs1", "fs4", "s3tc")
NAMES = {"isolane": "isolane IsolaneStorageWriter",
         "fs1": "DCP FileSystemWriter (1 thread)", "fs4": "DCP FileSystemWriter (4 threads)",
         "s3tc": "s3torchconnector S3StorageWriter (SeaweedFS)",
         "limit": C.WRITE_LIMIT,
         "noop": "no-op StorageWriter (DCP's own floor)",
         "hash": "xxh3-128 of every rank's state, all ranks at once (no I/O)",
         "copy": "copy_ of every rank's state into tensors it holds, all ranks at once"}
FS_SYSTEMS = ("fs1", "fs4")
PARTS = ("save", "async", "lora")
LORA_RANK = 16
SAVE_TARGET, LOAD_TARGET, ASYNC_TARGET, LORA_TARGET = 1.3, 1.3, 0.10, 10.0
S3_REGION = "us-east-1"
S3_KEY, S3_SECRET = "isolane-test", "isolane-test-secret"  # SeaweedFS without identities


# -- the state dicts, planned as data and built from a seed on every rank ---------------
@dataclass(frozen=True)
class Layer:
    name: str
    rows: int
    cols: int


def plan_layers(total_bytes: float, world: int, *, bytes_per_param: int, count: int = 12,
                prefix: str = "layers") -> list[Layer]:
    """``count`` square-ish weights whose parameters at ``bytes_per_param`` add up to about
    ``total_bytes``; rows a multiple of 64 * world so every rank's Shard(0) is whole."""
    params = max(total_bytes / bytes_per_param / count, 1.0)
    step = 64 * world
    rows = max(step, int(math.sqrt(params)) // step * step)
    cols = max(64, int(params / rows) // 64 * 64)
    return [Layer(f"{prefix}.{i}.weight", rows, cols) for i in range(count)]


def build_state(layers: list[Layer], mesh: Any, rank: int, world: int, *,
                empty: bool = False, lora_seed: int | None = None) -> dict[str, Any]:
    """FSDP2's ``get_state_dict`` shape: bf16 weights with fp32 AdamW moments, all
    Shard(0) DTensors of random bits (``empty``: zeros). ``lora_seed``: ``layers`` are a
    frozen base; rank-``LORA_RANK`` adapters (A: r x cols, B: rows x r) get the moments,
    and the seed changes only them."""
    import torch
    from torch.distributed.tensor import DTensor, Shard

    def shard(layer: Layer, dtype: Any, seed: int) -> Any:
        shape = (layer.rows // world, layer.cols)
        if empty:
            local = torch.zeros(shape, dtype=dtype)
        else:
            bits = {torch.bfloat16: torch.int16, torch.float32: torch.int32}[dtype]
            gen = torch.Generator().manual_seed(seed)
            local = torch.empty(shape, dtype=bits).random_(generator=gen).view(dtype)
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                  shape=(layer.rows, layer.cols), stride=(layer.cols, 1))

    model, state = {}, {}

    def trained(layer: Layer, seed: int, moments: int, step: float) -> None:
        model[layer.name] = shard(layer, torch.bfloat16, seed)
        state[layer.name] = {"exp_avg": shard(layer, torch.float32, seed + moments),
                             "exp_avg_sq": shard(layer, torch.float32, seed + 2 * moments),
                             "step": torch.tensor(step)}

    if lora_seed is None:
        for i, layer in enumerate(layers):
            trained(layer, i * 3000 + rank, 1000, 0.0 if empty else 100.0)
        groups = [{"lr": 1e-4, "betas": (0.9, 0.95), "weight_decay": 0.1,
                   "params": [layer.name for layer in layers]}]
        return {"model": model, "optim": {"state": state, "param_groups": groups}}
    for i, layer in enumerate(layers):
        model[layer.name] = shard(layer, torch.bfloat16, i * 1000 + rank)
        stem = layer.name.removesuffix(".weight")
        for part, rows, cols in (("lora_A", LORA_RANK * world, layer.cols),
                                 ("lora_B", layer.rows, LORA_RANK)):
            seed = 10**6 * (lora_seed + 1) + i * 10 + (part == "lora_B") + rank * 100
            trained(Layer(f"{stem}.{part}.weight", rows, cols), seed, 1, 1.0 + lora_seed)
    return {"model": model, "optim": {"state": state, "param_groups": [
        {"lr": 1e-4, "params": list(state)}]}}


def iter_tensors(tree: Any) -> Iterator[Any]:
    """Every tensor of ``tree`` (DTensors as their local shards), in order."""
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(tree, dict | list):
        for value in tree.values() if isinstance(tree, dict) else tree:
            yield from iter_tensors(value)
    elif isinstance(tree, DTensor):
        yield tree.to_local()
    elif isinstance(tree, torch.Tensor):
        yield tree


def change_adapters(state: dict[str, Any], source: dict[str, Any]) -> None:
    """Copy ``source``'s adapters and their AdamW state (the keys of the optimizer's state)
    into ``state`` in place, as an optimizer step does; the base is left alone."""
    def adapters(sd: dict[str, Any]) -> list[Any]:
        return [[sd["model"][k], sd["optim"]["state"][k]] for k in sd["optim"]["state"]]

    for into, value in zip(iter_tensors(adapters(state)), iter_tensors(adapters(source)),
                           strict=True):
        into.copy_(value)


def hash_state(tree: Any, threads: int = 2) -> None:
    """xxh3-128 of every tensor's bytes on ``threads`` threads (xxhash releases the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    import torch
    import xxhash

    views = [memoryview(t.detach().contiguous().view(-1).view(torch.uint8).numpy())
             for t in iter_tensors(tree) if t.numel()]
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda view: xxhash.xxh3_128(view).hexdigest(), views))


def copy_state(source: Any, into: Any) -> None:
    """Every tensor of ``source`` copied into its match in ``into`` (DTensors' local
    shards)."""
    for src, dst in zip(iter_tensors(source), iter_tensors(into), strict=True):
        dst.copy_(src)


def same_bits(a: Any, b: Any) -> bool:
    import torch

    views = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    return all(x.dtype == y.dtype and torch.equal(x.view(views[x.element_size()]),
                                                 y.view(views[y.element_size()]))
               for x, y in zip(iter_tensors(a), iter_tensors(b), strict=True))


# -- the systems, as DCP writers and readers ---------------------------------------------
def noop_writer() -> Any:
    """DCP's own floor: a ``StorageWriter`` that plans like any other, resolves every item
    and returns valid ``WriteResult``s, but writes nothing."""
    import torch
    from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
    from torch.futures import Future

    def nothing(*_args: Any, **_kw: Any) -> None:
        return None

    def same(_self: Any, plan: Any) -> Any:
        return plan

    class NoopWriter(StorageWriter):
        reset = set_up_storage_writer = finish = nothing
        validate_checkpoint_id = classmethod(nothing)
        prepare_local_plan = prepare_global_plan = same

        def write_data(self, plan: Any, planner: Any) -> Any:
            results = []
            for item in plan.items:
                data = planner.resolve_data(item)
                size = (data.numel() * data.element_size() if isinstance(data, torch.Tensor)
                        else data.getbuffer().nbytes)
                results.append(WriteResult(index=item.index, size_in_bytes=size,
                                           storage_data=None))
            fut: Future[list[Any]] = Future()
            fut.set_result(results)
            return fut

    return NoopWriter()


class Systems:
    """Each system's writer and reader for a checkpoint name, and its removal."""

    def __init__(self, folder: Path, s3: dict[str, str] | None, isolane: bool) -> None:
        self.folder, self.s3, self.store = folder, s3, None
        if isolane:
            from isolane import SnapshotStore

            self.store = SnapshotStore(str(folder / "isolane"))
            self.store.list()  # opened before any clock starts, as a training job does

    def _s3(self, make: Any, name: str, **kw: Any) -> Any:
        from s3torchconnector import S3ClientConfig
        from s3torchconnector._s3client import S3Client
        from s3torchconnector.dcp.s3_file_system import S3FileSystem

        assert self.s3 is not None
        made = make(S3_REGION, f"s3://{self.s3['bucket']}/{name}", **kw)
        # the writer's constructor takes only a region: the endpoint goes in by its client
        made.fs = S3FileSystem(S3_REGION, s3_client=S3Client(
            S3_REGION, endpoint=self.s3["endpoint"],
            s3client_config=S3ClientConfig(force_path_style=True)))
        return made

    def open(self, system: str, name: str, *, write: bool = True,
             parent: str | None = None) -> Any:
        """A DCP storage writer (``write``) or reader; ``parent``: the checkpoint a re-save
        follows (isolane links its unchanged chunks; the others have no such notion)."""
        import torch.distributed.checkpoint as dcp

        if system == "noop":
            return noop_writer()
        if system == "isolane":
            from isolane.integrations import dcp as ours

            return (ours.IsolaneStorageWriter(self.store, name, parent=parent) if write
                    else ours.IsolaneStorageReader(self.store, name))
        if system in FS_SYSTEMS:
            path = self.folder / system / name
            return (dcp.FileSystemWriter(path, sync_files=True, thread_count=int(system[2:]))
                    if write else dcp.FileSystemReader(path))
        from s3torchconnector import dcp as s3dcp

        return (self._s3(s3dcp.S3StorageWriter, name, thread_count=4) if write
                else self._s3(s3dcp.S3StorageReader, name))

    def remove(self, system: str, name: str) -> None:
        if system == "isolane":
            self.store.delete(name)
        elif system in FS_SYSTEMS:
            shutil.rmtree(self.folder / system / name, ignore_errors=True)
        elif system == "s3tc":
            import s3fs

            assert self.s3 is not None
            s3fs.S3FileSystem(key=S3_KEY, secret=S3_SECRET, client_kwargs={
                "endpoint_url": self.s3["endpoint"]}).rm(f"{self.s3['bucket']}/{name}",
                                                         recursive=True)


# -- one rank ------------------------------------------------------------------------------
def worker(rank: int, world: int, port: int, spec: dict[str, Any]) -> None:
    """One rank (a process of its own, dying with the parent); rank 0 writes the result."""
    C.ensure_repo_importable()
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from tests.support.procs import die_with_parent

    die_with_parent()
    if spec.get("s3"):
        os.environ.setdefault("AWS_ACCESS_KEY_ID", S3_KEY)
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", S3_SECRET)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            init_method=f"tcp://127.0.0.1:{port}")
    mesh = init_device_mesh("cpu", (world,))
    # async_save's collectives run in a background thread: on a group of their own, or
    # they would be matched against this loop's barriers and reductions
    async_group = dist.new_group(backend="gloo")
    folder = Path(spec["folder"])
    names: list[str] = spec["systems"]
    systems = Systems(folder, spec.get("s3"), "isolane" in names)
    repeats = {part: spec["repeats"] if part in spec["parts"] else 0 for part in PARTS}
    runs: dict[str, dict[str, list[float]]] = {s: {} for s in [*names, "limit", "noop",
                                                                "hash", "copy"]}
    checks: dict[str, list[bool]] = {s: [] for s in names}
    result: dict[str, Any] = {"world": world, "runs": runs, "checks": checks,
                              "dropped": True, "written": [], "linked": []}

    # As in a training job that schedules its collections (TorchTitan's GarbageCollector):
    # a full collection of torch's ~300k objects takes 0.2-0.3 s here, and would land
    # at random inside some rank's timed save and hold every rank at the next collective
    gc.disable()

    def clock(fn: Callable[..., Any], *fn_args: Any) -> float:
        gc.collect()
        dist.barrier()
        start = time.perf_counter()
        fn(*fn_args)
        dist.barrier()
        return time.perf_counter() - start

    def coordinator(fn: Callable[..., Any], *fn_args: Any) -> Any:
        """``fn`` on rank 0 alone, between barriers; its result on rank 0, else None."""
        dist.barrier()
        value = fn(*fn_args) if rank == 0 else None
        dist.barrier()
        return value

    def save(tree: Any, system: str, name: str, parent: str | None = None) -> None:
        dcp.save(tree, storage_writer=systems.open(system, name, parent=parent))

    def load(tree: Any, system: str, name: str) -> None:
        dcp.load(tree, storage_reader=systems.open(system, name, write=False))

    def remove(system: str, *checkpoints: str) -> None:
        for name in checkpoints:
            systems.remove(system, name)
        C.settle()

    def total_bytes(tree: Any) -> int:
        value = torch.tensor([sum(t.numel() * t.element_size() for t in iter_tensors(tree))])
        dist.all_reduce(value)
        return int(value.item())

    def record(system: str, what: str, seconds: float | None) -> None:
        if seconds is not None:
            runs[system].setdefault(what, []).append(seconds)

    full_layers = [Layer(**x) for x in spec["full_layers"]]
    full = repeats["save"] or repeats["async"]  # each part builds only the state it saves
    state = build_state(full_layers, mesh, rank, world) if full else {}
    into = build_state(full_layers, mesh, rank, world, empty=True) if full else {}
    result["nbytes"] = total_bytes(state)
    for rep in range(repeats["save"]):
        record("limit", "save", coordinator(C.write_limit, folder / "limit.bin",
                                            result["nbytes"]))
        record("noop", "save", clock(save, state, "noop", "-"))
        for system in names:
            record(system, "save", clock(save, state, system, f"full-{rep}"))
            dropped = coordinator(C.drop_page_cache)
            result["dropped"] = result["dropped"] and (rank != 0 or bool(dropped))
            record(system, "load", clock(load, into, system, f"full-{rep}"))
            checks[system].append(same_bits(state, into))
            for tensor in iter_tensors(into):
                tensor.zero_()
            coordinator(remove, system, f"full-{rep}")
    for rep in range(repeats["async"]):
        record("copy", "async_block", clock(copy_state, state, into))
        for system in names:
            if system == "s3tc":
                continue  # its async path is DCP's own, measured on the file systems
            gc.collect()
            dist.barrier()
            start = time.perf_counter()
            future = dcp.async_save(state, storage_writer=systems.open(system, f"a-{rep}"),
                                    process_group=async_group)
            blocked = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(blocked, op=dist.ReduceOp.MAX)  # the slowest rank's
            future.result()
            dist.barrier()
            record(system, "async_block", float(blocked.item()))
            coordinator(remove, system, f"a-{rep}")
    del state, into

    # One state, as a training job has: its base tensors stay the same objects between
    # saves; the adapters and their AdamW state change in place between the two saves.
    lora_layers = [Layer(**x) for x in spec["lora_layers"] if repeats["lora"]]
    lora = build_state(lora_layers, mesh, rank, world, lora_seed=0)
    steps = [build_state(lora_layers, mesh, rank, world, lora_seed=s) for s in (1, 2)]
    result["lora_bytes"] = total_bytes(lora)
    for rep in range(repeats["lora"]):
        record("noop", "resave", clock(save, lora, "noop", "-"))
        record("hash", "resave", clock(hash_state, lora))
        for system in names:
            first, second = f"lora-{rep}-a", f"lora-{rep}-b"
            clock(save, lora, system, first)
            change_adapters(lora, steps[rep % 2])
            record(system, "resave", clock(save, lora, system, second, first))
            if system == "isolane" and (info := coordinator(systems.store.info, second)):
                result["written"].append(info.written_bytes)
                result["linked"].append(info.linked_bytes)
            coordinator(remove, system, second, first)
    if systems.store is not None:
        systems.store.close()
    dist.barrier()
    if rank == 0:
        Path(spec["result"]).write_text(json.dumps(result))
    dist.destroy_process_group()


# -- the parent ------------------------------------------------------------------------------
def run_world(world: int, spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """``world`` ranks, each a spawned process; rank 0's result. A rank failing raises
    with its traceback and stops the others."""
    import torch.multiprocessing as mp

    result = Path(spec["folder"]) / f"world{world}.json"
    os.environ["OMP_NUM_THREADS"] = "1"  # the ranks' own: they share the machine's cores
    ranks = mp.start_processes(worker, (world, C.free_port(), {**spec, "result": str(result)}),
                               nprocs=world, join=False)
    deadline = time.monotonic() + timeout_s
    while not ranks.join(timeout=5.0):
        if time.monotonic() > deadline:
            for proc in ranks.processes:
                proc.kill()
            raise RuntimeError(f"{world} ranks did not finish in {timeout_s:.0f} s "
                               "(raise --timeout)")
    found: dict[str, Any] = json.loads(result.read_text())
    return found


def s3tc_missing() -> str | None:
    """Why s3torchconnector's writer cannot run here, or None."""
    try:
        import s3torchconnector.dcp  # noqa: F401

        from tests.support.seaweedfs import find_weed

        find_weed()
    except ImportError as exc:
        return f"it does not import here ({exc}); `scripts/setup bench` installs it"
    except (RuntimeError, FileNotFoundError) as exc:
        return f"no SeaweedFS server here ({exc})"
    return None


# -- the report and the results page's rows ------------------------------------------------
def median(values: list[float] | None) -> float | None:
    return statistics.median(values) if values else None


def _row(where: dict[str, str], measure: str, value: float, peer: str, peer_value: float,
         target: float | None = None, why: str | None = None, *,
         share: bool = False) -> _results.Result:
    """isolane's seconds beside a peer's: the speedup (``share``: the peer's blocking
    share of its sync save), its target, ``why`` when missed."""
    ratio = value / peer_value * 100 if share else peer_value / value
    met = None if target is None else (ratio <= target * 100 if share else ratio >= target)
    return _results.Result(
        area="Checkpoints", unit="s", measure=measure, value=round(value, 3), peer=peer,
        peer_value=round(peer_value, 3), ratio=round(ratio, 1 if share else 2),
        ratio_unit="%" if share else "x",
        target=None if target is None else (f"≤ {target * 100:.0f} %" if share
                                            else f"≥ {target:g}x"),
        met=met, why=why if met is False else None, **where)


def headline_rows(raw: dict[str, Any], where: dict[str, str]) -> list[_results.Result]:
    """The page's rows for each world size of ``raw`` (every rank 0's result), each
    against its peer, limit or floor of the same run; a missed target says why."""
    rows: list[_results.Result] = []
    for res in raw["results"]:
        world, runs = res["world"], res["runs"]
        if not runs.get("isolane"):
            raise ValueError(f"{world} ranks: isolane was not run, nothing to record "
                             f"({raw.get('skipped', {}).get('isolane', 'left out')})")
        differed = sorted(s for s, done in res["checks"].items() if not all(done))
        if differed:
            raise ValueError(f"{world} ranks: loads through {', '.join(differed)} did not "
                             "read back bit for bit; nothing recorded")
        med = {what: {s: median(r.get(what)) for s, r in runs.items()}
               for what in ("save", "load", "async_block", "resave")}

        def best(what: str, med: dict[str, dict[str, float | None]] = med
                 ) -> tuple[str, float] | None:
            found = [(s, v) for s in FS_SYSTEMS if (v := med[what].get(s))]
            return min(found, key=lambda pair: pair[1], default=None)

        state = f"{world} ranks, {res.get('nbytes', 0) / C.GB:.2f} GB FSDP2 state"
        iso, limit = med["save"].get("isolane"), med["save"].get("limit")
        if iso and (fs := best("save")):
            why = None
            if limit:
                why = f"this run's {NAMES['limit']} wrote the same bytes in {limit:.2f} s: "
                if fs[1] <= limit:
                    why += f"slower than {NAMES[fs[0]]}, so it bounds nothing here"
                else:
                    floor = limit  # what no writer goes below here
                    why += f"at most {fs[1] / limit:.2f}x over {NAMES[fs[0]]}"
                    if noop := med["save"].get("noop"):
                        floor += noop
                        why += (f"; DCP's own floor (the same dcp.save through a no-op "
                                f"StorageWriter), which every writer pays besides its "
                                f"writes, took {noop:.3f} s: with it, at most "
                                f"{fs[1] / floor:.2f}x")
                    why += (f", below the {SAVE_TARGET:g}x target"
                            if fs[1] / floor < SAVE_TARGET
                            else f"; isolane reached {floor / iso * 100:.0f} % of that bound")
            rows.append(_row(where, f"DCP save, {state}, IsolaneStorageWriter", iso,
                             f"best {NAMES[fs[0]]}", fs[1], SAVE_TARGET, why))
        if iso and (s3 := med["save"].get("s3tc")):
            rows.append(_row(where, f"DCP save, {state}, IsolaneStorageWriter", iso,
                             NAMES["s3tc"], s3))
        if (iso_load := med["load"].get("isolane")) and (fs := best("load")):
            warm = None if res["dropped"] else (
                "not root: the page cache was not dropped, loads may read from memory")
            rows.append(_row(where, f"DCP load, {state}, IsolaneStorageReader", iso_load,
                             f"best {NAMES[fs[0]].replace('Writer', 'Reader')}", fs[1],
                             LOAD_TARGET, warm))
        if iso and (blocked := med["async_block"].get("isolane")):
            own = [(s, b / sync) for s in FS_SYSTEMS
                   if (b := med["async_block"].get(s)) and (sync := med["save"].get(s))]
            why = "; ".join(
                [f"async_save with {NAMES[s]} blocks {share * 100:.0f} % of its sync save "
                 "in this run" for s, share in sorted(own, key=lambda pair: pair[1])[:1]] +
                [f"copying every rank's state once, all ranks at once (no I/O), as staging "
                 f"must, took {copied:.3f} s: {copied / iso * 100:.0f} % of the sync save"
                 for copied in [med["async_block"].get("copy")] if copied]) or None
            rows.append(_row(where, f"DCP async_save blocking, {state}, IsolaneStorageWriter",
                             blocked, "its sync save", iso, ASYNC_TARGET, why, share=True))
        if (resave := med["resave"].get("isolane")) and (fs := best("resave")):
            gb = res["lora_bytes"] / C.GB
            why = "; ".join(
                [f"isolane wrote {res['written'][-1] / C.GB:.3f} GB and linked "
                 f"{res['linked'][-1] / C.GB:.3f} GB of the {gb:.2f} GB state"] * bool(
                     res["written"]) +
                [f"DCP's own floor (the same dcp.save through a no-op StorageWriter) is "
                 f"{noop:.3f} s: at most {fs[1] / noop:.2f}x"
                 for noop in [med["resave"].get("noop")] if noop] +
                [f"hashing every byte on all ranks at once (xxh3-128, no I/O), as finding "
                 f"what changed needs, took {hashed:.3f} s; with DCP's floor at most "
                 f"{fs[1] / (hashed + noop):.2f}x"
                 for hashed, noop in [(med["resave"].get("hash"), med["resave"].get("noop"))]
                 if hashed and noop]) or None
            rows.append(_row(where, f"DCP LoRA re-save (adapters changed), {world} ranks, "
                             f"{gb:.2f} GB state, IsolaneStorageWriter", resave,
                             f"best {NAMES[fs[0]]}", fs[1], LORA_TARGET, why))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    arg = parser.add_argument
    _quick.add_argument(parser)
    arg("--scale", type=float, default=1.0, help="1.0 = ~2 GB sharded state and LoRA base")
    arg("--ranks", default="2,4", help="world sizes, comma-separated")
    arg("--repeats", type=int, default=5)
    arg("--systems", default=",".join(SYSTEMS), help=f"subset of {','.join(SYSTEMS)}")
    arg("--parts", default=",".join(PARTS), help=f"subset of {','.join(PARTS)}")
    arg("--dir", type=Path, default=C.REPO_ROOT / ".bench" / "dcp",
        help="scratch folder (emptied after the run)")
    arg("--out", type=Path, default=None, help="docs/BENCHMARKS.md: record the rows in "
        "results/dcp.json and render the page; another file: write the report's section")
    arg("--timeout", type=float, default=3600.0, help="per world size, s")
    args = parser.parse_args(argv)
    C.ensure_repo_importable()
    layers = 12
    if args.quick:
        _quick.enter(args, parser, files=())
        args.scale, args.repeats, layers, args.ranks = min(args.scale, 0.004), 1, 4, "2"
    wanted = [s.strip() for s in args.systems.split(",") if s.strip()]
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    for given, known, option in ((wanted, SYSTEMS, "--systems"), (parts, PARTS, "--parts")):
        if unknown := sorted(set(given) - set(known)):
            parser.error(f"unknown {option} {unknown}: choose from {','.join(known)}")
    skipped = {s: reason for s in wanted if s == "s3tc" and (reason := s3tc_missing())}
    names = [s for s in wanted if s not in skipped]
    folder: Path = args.dir
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    total = 2 * C.GB * args.scale
    results = []
    try:
        with ExitStack() as stack:
            s3 = None
            if "s3tc" in names:
                from tests.support.seaweedfs import SeaweedServer

                server = stack.enter_context(SeaweedServer(folder / "weed"))
                s3 = {"endpoint": server.endpoint_url, "bucket": server.create_bucket("dcp")}
            for world in (int(w) for w in args.ranks.split(",") if w.strip()):
                spec = {"folder": str(folder), "systems": names, "parts": parts,
                        "repeats": args.repeats, "s3": s3,
                        "full_layers": [vars(x) for x in plan_layers(
                            total, world, bytes_per_param=10, count=layers)],
                        "lora_layers": [vars(x) for x in plan_layers(
                            total, world, bytes_per_param=2, count=layers, prefix="base")]}
                print(f"[{world} ranks] {', '.join(names)}: {', '.join(parts)} ...",
                      file=sys.stderr, flush=True)
                results.append(run_world(world, spec, args.timeout))
    finally:
        shutil.rmtree(folder, ignore_errors=True)

    import torch

    packages = {"torch": str(torch.__version__)}
    if "s3tc" in names:
        from importlib.metadata import version

        packages["s3torchconnector"] = version("s3torchconnector")
    machine = C.machine_description(args.dir.parent, packages)
    where = {"machine": machine, "date": C.now_text(), "command": C.command_line()}
    raw = {"results": results, "skipped": skipped}
    rows = headline_rows(raw, where)
    report = "\n\n".join(
        ["## Sharded checkpoints through DCP (`benchmarks/bench_dcp.py`)",
         f"Run {where['date']}: `{where['command']}`. {machine} Medians; the ratios compare "
         "runs of the same group of processes, interleaved round by round; every load "
         "compared bit for bit.",
         *(f"- {NAMES[s]}: not run: {reason}." for s, reason in skipped.items())])
    C.publish("dcp", report, rows, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
