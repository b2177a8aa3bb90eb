"""Sharded checkpoints through torch.distributed.checkpoint (DCP): isolane's storage layer
against DCP's own FileSystemWriter and s3torchconnector's DCP writer.

Every rank is a real process in a gloo group; the state dict is FSDP2-shaped (each
weight a DTensor ``Shard(0)`` over ``init_device_mesh("cpu", (W,))``): bf16 weights and
their fp32 AdamW state (``exp_avg``, ``exp_avg_sq``, ``step``), ~2 GB at ``--scale 1``.
For each world size (``--ranks 2,4``) one group of workers runs every system, round after
round (``--repeats``), so the ratios compare runs of one moment:

- **save**: ``dcp.save`` until every rank has returned (``IsolaneStorageWriter`` commits
  its manifest, ``FileSystemWriter(sync_files=True)`` fsyncs every file; DCP's
  ``.metadata`` is written by the coordinator in both);
- **load**: ``dcp.load`` into preallocated DTensors of the same mesh, the page cache
  dropped first when the run may (root), then checked bit for bit outside the clock;
- **async_save blocking**: the time ``dcp.async_save`` holds the caller (until the
  tensors are staged), next to the same system's sync save;
- **LoRA re-save**: a frozen bf16 base (most of the bytes) plus small adapters with
  AdamW state; saved once, the adapters change, then the timed save of the new step.
  isolane links the chunks whose bytes did not change; a FileSystemWriter writes all.

The bound is the same run's O_DIRECT sequential write of the state's size into the
same folder (``dd``, and ``fio`` with 4 requests in flight when installed).

s3torchconnector's ``S3StorageWriter``/``S3StorageReader`` run against a SeaweedFS server
on loopback (``tests/support/seaweedfs.py``); its client gets the endpoint through its
``S3FileSystem(s3_client=...)`` (the writer's constructor takes only a region). The row
is left out, with the reason, when the package or ``weed`` is missing.

    python benchmarks/bench_dcp.py --quick                  # smoke test, seconds
    python benchmarks/bench_dcp.py --out docs/BENCHMARKS.md # ~2 GB, 3 repeats
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _quick
import _results
from _common import (
    GB,
    REPO_ROOT,
    RESULT_PREFIX,
    command_line,
    drop_page_cache,
    ensure_repo_importable,
    fmt_ratio,
    machine_description,
    markdown_table,
    measure_dd_write,
    measure_fio_write,
    now_text,
    print_report,
)

SECTION = "dcp"
BENCH = "dcp"  # benchmarks/results/dcp.json
SYSTEMS = ("isolane", "fs1", "fs4", "s3tc")
LABELS = {
    "isolane": "isolane `IsolaneStorageWriter`",
    "fs1": "DCP `FileSystemWriter` (1 thread, sync_files)",
    "fs4": "DCP `FileSystemWriter` (4 threads, sync_files)",
    "s3tc": "s3torchconnector `S3StorageWriter` (SeaweedFS, 4 threads)",
}
FS_SYSTEMS = ("fs1", "fs4")
FULL_BYTES = 2 * GB
LORA_RANK = 16
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


def _random_bits(shape: tuple[int, ...], dtype: Any, seed: int) -> Any:
    import torch

    bits = {torch.bfloat16: torch.int16, torch.float32: torch.int32}[dtype]
    gen = torch.Generator().manual_seed(seed)
    return torch.empty(shape, dtype=bits).random_(generator=gen).view(dtype)


def _sharded(local: Any, layer: Layer, mesh: Any) -> Any:
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                              shape=(layer.rows, layer.cols), stride=(layer.cols, 1))


def build_full_state(layers: list[Layer], mesh: Any, rank: int, world: int,
                     *, empty: bool = False) -> dict[str, Any]:
    """FSDP2's ``get_state_dict`` shape: bf16 weights, fp32 AdamW moments, all Shard(0)."""
    import torch

    def local(layer: Layer, dtype: Any, seed: int) -> Any:
        shape = (layer.rows // world, layer.cols)
        return torch.zeros(shape, dtype=dtype) if empty else _random_bits(shape, dtype, seed)

    model, state = {}, {}
    for i, layer in enumerate(layers):
        base = (i * 3) * 1000 + rank
        model[layer.name] = _sharded(local(layer, torch.bfloat16, base), layer, mesh)
        state[layer.name] = {
            "exp_avg": _sharded(local(layer, torch.float32, base + 1000), layer, mesh),
            "exp_avg_sq": _sharded(local(layer, torch.float32, base + 2000), layer, mesh),
            "step": torch.tensor(0.0 if empty else 100.0)}
    groups = [{"lr": 1e-4, "betas": (0.9, 0.95), "weight_decay": 0.1,
               "params": [layer.name for layer in layers]}]
    return {"model": model, "optim": {"state": state, "param_groups": groups}}


def build_lora_state(base: list[Layer], mesh: Any, rank: int, world: int, *,
                     empty: bool = False, adapter_seed: int = 0) -> dict[str, Any]:
    """A frozen bf16 base plus rank-``LORA_RANK`` adapters (A: r x cols, B: rows x r, both
    Shard(0)) with fp32 AdamW state; ``adapter_seed`` changes only the adapters."""
    import torch

    def make(layer: Layer, dtype: Any, seed: int) -> Any:
        shape = (layer.rows // world, layer.cols)
        data = torch.zeros(shape, dtype=dtype) if empty else _random_bits(shape, dtype, seed)
        return _sharded(data, layer, mesh)

    model, state, names = {}, {}, []
    for i, layer in enumerate(base):
        model[layer.name] = make(layer, torch.bfloat16, i * 1000 + rank)
        stem = layer.name.removesuffix(".weight")
        for part, rows, cols in (("lora_A", LORA_RANK * world, layer.cols),
                                 ("lora_B", layer.rows, LORA_RANK)):
            adapter = Layer(f"{stem}.{part}.weight", rows, cols)
            seed = 10**6 * (adapter_seed + 1) + i * 10 + (part == "lora_B") + rank * 100
            model[adapter.name] = make(adapter, torch.bfloat16, seed)
            state[adapter.name] = {"exp_avg": make(adapter, torch.float32, seed + 1),
                                   "exp_avg_sq": make(adapter, torch.float32, seed + 2),
                                   "step": torch.tensor(0.0 if empty else 1.0 + adapter_seed)}
            names.append(adapter.name)
    groups = [{"lr": 1e-4, "params": names}]
    return {"model": model, "optim": {"state": state, "param_groups": groups}}


def change_adapters(state: dict[str, Any], source: dict[str, Any]) -> None:
    """Copy ``source``'s adapter weights and their optimizer state into ``state``, in place
    (what an optimizer step does); the base weights are left alone."""
    for name, value in state["model"].items():
        if ".lora_" in name:
            value.to_local().copy_(source["model"][name].to_local())
    for name, moments in state["optim"]["state"].items():
        for key, value in moments.items():
            target = value.to_local() if hasattr(value, "to_local") else value
            incoming = source["optim"]["state"][name][key]
            target.copy_(incoming.to_local() if hasattr(incoming, "to_local") else incoming)


def iter_tensors(tree: Any) -> Iterator[Any]:
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(tree, dict):
        for value in tree.values():
            yield from iter_tensors(value)
    elif isinstance(tree, list):
        for value in tree:
            yield from iter_tensors(value)
    elif isinstance(tree, DTensor):
        yield tree.to_local()
    elif isinstance(tree, torch.Tensor):
        yield tree


def local_bytes(tree: Any) -> int:
    return sum(t.numel() * t.element_size() for t in iter_tensors(tree))


def same_bits(a: Any, b: Any) -> bool:
    import torch

    views = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    pairs = list(zip(iter_tensors(a), iter_tensors(b), strict=True))
    return all(x.dtype == y.dtype and torch.equal(x.view(views[x.element_size()]),
                                                 y.view(views[y.element_size()]))
               for x, y in pairs)


# -- the systems, as DCP writers and readers ---------------------------------------------
class Systems:
    """Makes each system's writer and reader for a checkpoint name, and removes it."""

    def __init__(self, folder: Path, s3: dict[str, str] | None) -> None:
        self.folder = folder
        self.s3 = s3
        self._store: Any = None

    @property
    def store(self) -> Any:
        if self._store is None:
            from isolane import SnapshotStore

            self._store = SnapshotStore(str(self.folder / "isolane"))
        return self._store

    def _s3_fs(self) -> Any:
        from s3torchconnector import S3ClientConfig
        from s3torchconnector._s3client import S3Client
        from s3torchconnector.dcp.s3_file_system import S3FileSystem

        assert self.s3 is not None
        client = S3Client(S3_REGION, endpoint=self.s3["endpoint"],
                          s3client_config=S3ClientConfig(force_path_style=True))
        return S3FileSystem(S3_REGION, s3_client=client)

    def writer(self, system: str, name: str, parent: str | None = None) -> Any:
        """``parent``: the checkpoint a re-save follows (isolane links its unchanged
        chunks; the other systems have no such notion)."""
        from torch.distributed.checkpoint import FileSystemWriter

        if system == "isolane":
            from isolane.integrations.dcp import IsolaneStorageWriter

            return IsolaneStorageWriter(self.store, name, parent=parent)
        if system in FS_SYSTEMS:
            return FileSystemWriter(self.folder / system / name, sync_files=True,
                                    thread_count=int(system[2:]))
        from s3torchconnector.dcp import S3StorageWriter

        assert self.s3 is not None
        writer = S3StorageWriter(S3_REGION, f"s3://{self.s3['bucket']}/{name}", thread_count=4)
        writer.fs = self._s3_fs()
        return writer

    def reader(self, system: str, name: str) -> Any:
        from torch.distributed.checkpoint import FileSystemReader

        if system == "isolane":
            from isolane.integrations.dcp import IsolaneStorageReader

            return IsolaneStorageReader(self.store, name)
        if system in FS_SYSTEMS:
            return FileSystemReader(self.folder / system / name)
        from s3torchconnector.dcp import S3StorageReader

        assert self.s3 is not None
        reader = S3StorageReader(S3_REGION, f"s3://{self.s3['bucket']}/{name}")
        reader.fs = self._s3_fs()
        return reader

    def remove(self, system: str, name: str) -> None:
        """Called on the coordinator only, between measurements."""
        if system == "isolane":
            self.store.delete(name)
        elif system in FS_SYSTEMS:
            shutil.rmtree(self.folder / system / name, ignore_errors=True)
        else:
            import s3fs

            assert self.s3 is not None
            fs = s3fs.S3FileSystem(key=S3_KEY, secret=S3_SECRET,
                                   client_kwargs={"endpoint_url": self.s3["endpoint"]})
            fs.rm(f"{self.s3['bucket']}/{name}", recursive=True)


# -- one rank ------------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    ensure_repo_importable()
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = args.rank, args.world
    spec = json.loads(args.spec)
    if spec.get("s3"):
        os.environ.setdefault("AWS_ACCESS_KEY_ID", S3_KEY)
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", S3_SECRET)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            init_method=f"tcp://127.0.0.1:{args.port}")
    mesh = init_device_mesh("cpu", (world,))
    # async_save's collectives run in a background thread: on a group of their own, or
    # they would be matched against this loop's barriers and reductions
    async_group = dist.new_group(backend="gloo")
    systems = Systems(Path(spec["folder"]), spec.get("s3"))
    names: list[str] = spec["systems"]
    if "isolane" in names:
        systems.store.list()  # opened before any clock starts, as a training job does
    full_layers = [Layer(**x) for x in spec["full_layers"]]
    lora_layers = [Layer(**x) for x in spec["lora_layers"]]

    def clock(fn: Callable[..., Any], *fn_args: Any) -> float:
        dist.barrier()
        start = time.perf_counter()
        fn(*fn_args)
        dist.barrier()
        return time.perf_counter() - start

    def slowest(seconds: float) -> float:
        value = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return float(value.item())

    def coordinator(fn: Callable[..., Any], *fn_args: Any) -> Any:
        """``fn`` on rank 0 alone, between barriers; its result on rank 0, else None."""
        dist.barrier()
        result = fn(*fn_args) if rank == 0 else None
        dist.barrier()
        return result

    def save(tree: Any, system: str, name: str, parent: str | None = None) -> None:
        dcp.save(tree, storage_writer=systems.writer(system, name, parent))

    def load(tree: Any, system: str, name: str) -> None:
        dcp.load(tree, storage_reader=systems.reader(system, name))

    def remove(system: str, *names_: str) -> None:
        for name in names_:
            systems.remove(system, name)

    def total_bytes(tree: Any) -> int:
        value = torch.tensor([local_bytes(tree)], dtype=torch.int64)
        dist.all_reduce(value)
        return int(value.item())

    state = build_full_state(full_layers, mesh, rank, world)
    into = build_full_state(full_layers, mesh, rank, world, empty=True)
    nbytes = total_bytes(state)
    runs: dict[str, dict[str, list[float]]] = {s: {} for s in names}
    checks: dict[str, list[bool]] = {s: [] for s in names}
    dropped = True

    def record(system: str, what: str, seconds: float) -> None:
        runs[system].setdefault(what, []).append(seconds)

    for rep in range(spec["repeats"]):
        for system in names:
            name = f"full-{rep}"
            record(system, "save", clock(save, state, system, name))
            page_cache_dropped = coordinator(drop_page_cache)
            dropped = dropped and (rank != 0 or bool(page_cache_dropped))
            record(system, "load", clock(load, into, system, name))
            checks[system].append(same_bits(state, into))
            for tensor in iter_tensors(into):
                tensor.zero_()
            coordinator(remove, system, name)
        for system in names:
            if system == "s3tc":
                continue  # its async path is DCP's own, measured on the file systems
            name = f"async-{rep}"
            dist.barrier()
            start = time.perf_counter()
            future = dcp.async_save(state, storage_writer=systems.writer(system, name),
                                    process_group=async_group)
            blocked = slowest(time.perf_counter() - start)
            future.result()
            dist.barrier()
            record(system, "async_block", blocked)
            record(system, "async_total", time.perf_counter() - start)
            coordinator(remove, system, name)
    del state, into

    # One state, as a training job has: its base tensors stay the same objects between
    # saves (isolane spots unchanged tensors without rereading them); the adapters and
    # their AdamW state change in place between the two saves of each round.
    lora = build_lora_state(lora_layers, mesh, rank, world, adapter_seed=0)
    adapter_values = [build_lora_state(lora_layers, mesh, rank, world, adapter_seed=seed)
                      for seed in (1, 2)]
    lora_bytes = total_bytes(lora)
    relinked: dict[str, list[int]] = {"written": [], "linked": []}
    for rep in range(spec["repeats"]):
        for system in names:
            first, second = f"lora-{rep}-a", f"lora-{rep}-b"
            clock(save, lora, system, first)
            change_adapters(lora, adapter_values[rep % 2])
            record(system, "resave", clock(save, lora, system, second, first))
            if system == "isolane":
                info = coordinator(systems.store.info, second)
                if info is not None:
                    relinked["written"].append(info.written_bytes)
                    relinked["linked"].append(info.linked_bytes)
            coordinator(remove, system, second, first)
    if systems._store is not None:
        systems.store.close()
    dist.barrier()
    if rank == 0:
        print(RESULT_PREFIX + json.dumps({
            "world": world, "nbytes": nbytes, "lora_bytes": lora_bytes, "relinked": relinked,
            "runs": runs, "checks": checks, "dropped": dropped}), flush=True)
    dist.destroy_process_group()


# -- the parent ------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_world(world: int, spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """``world`` worker processes; rank 0's result. Any rank failing fails the world.

    Their output goes to files (a full pipe would stall a rank inside a collective) and
    they die with this process."""
    ensure_repo_importable()
    from tests.support.procs import die_with_parent

    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "OMP_NUM_THREADS": "1"}
    logs = [Path(spec["folder"]) / f"world{world}-rank{r}.log" for r in range(world)]
    procs = []
    for rank, log in enumerate(logs):
        with open(log, "w") as out:
            procs.append(subprocess.Popen(
                [sys.executable, __file__, "--worker", "--rank", str(rank), "--world",
                 str(world), "--port", str(port), "--spec", json.dumps(spec)],
                stdout=out, stderr=subprocess.STDOUT, env=env, preexec_fn=die_with_parent))
    deadline = time.monotonic() + timeout_s
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{world} ranks did not finish in {timeout_s:.0f} s "
                           "(raise --timeout)") from None
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    outputs = [log.read_text(errors="replace") for log in logs]
    for rank, (proc, text) in enumerate(zip(procs, outputs, strict=True)):
        if proc.returncode != 0:
            tail = "\n".join(text.strip().splitlines()[-25:])
            raise RuntimeError(f"rank {rank} of {world} exited with {proc.returncode}:\n{tail}")
    for line in reversed(outputs[0].splitlines()):
        if line.startswith(RESULT_PREFIX):
            result: dict[str, Any] = json.loads(line[len(RESULT_PREFIX):])
            return result
    raise RuntimeError(f"rank 0 of {world} printed no result")


def isolane_skip_reason() -> str | None:
    ensure_repo_importable()
    try:
        import isolane.integrations.dcp  # noqa: F401
    except ImportError as exc:
        return f"isolane.integrations.dcp does not import here ({exc})"
    return None


def s3tc_skip_reason() -> str | None:
    try:
        import s3torchconnector.dcp  # noqa: F401
    except ImportError as exc:
        return (f"s3torchconnector does not import ({exc}); "
                "`scripts/setup bench` installs it")
    ensure_repo_importable()
    try:
        from tests.support.seaweedfs import find_weed

        find_weed()
    except (ImportError, RuntimeError, FileNotFoundError) as exc:
        return f"no SeaweedFS server here ({exc})"
    return None


@contextmanager
def seaweed(folder: Path, wanted: bool) -> Iterator[dict[str, str] | None]:
    if not wanted:
        yield None
        return
    from tests.support.seaweedfs import SeaweedServer

    with SeaweedServer(folder / "weed") as server:
        yield {"endpoint": server.endpoint_url, "bucket": server.create_bucket("dcp")}


def median(values: list[float] | None) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def runs_text(values: list[float] | None) -> str:
    return ", ".join(f"{v:.2f}" for v in values or []) or "-"


def rate(nbytes: int, seconds: float | None) -> str:
    return f"{nbytes / seconds / GB:.2f} GB/s" if seconds else "-"


def verdict(value: float | None, target: float, *, at_most: bool = False) -> str:
    if value is None:
        return "not measured"
    met = value <= target if at_most else value >= target
    return "met" if met else "missed"


def report_world(res: dict[str, Any], bound_s: dict[str, float], names: list[str]) -> str:
    world, nbytes, runs = res["world"], res["nbytes"], res["runs"]
    save = {s: median(runs[s].get("save")) for s in names}
    load = {s: median(runs[s].get("load")) for s in names}
    fs_save = min((save[s] for s in FS_SYSTEMS if save.get(s)), default=None)
    fs_load = min((load[s] for s in FS_SYSTEMS if load.get(s)), default=None)
    rows = []
    for s in names:
        checked = res["checks"][s]
        rows.append([LABELS[s], f"{save[s]:.2f} s" if save[s] else "-", rate(nbytes, save[s]),
                     fmt_ratio(fs_save / save[s]) if save[s] and fs_save else "-",
                     f"{load[s]:.2f} s" if load[s] else "-", rate(nbytes, load[s]),
                     fmt_ratio(fs_load / load[s]) if load[s] and fs_load else "-",
                     f"ok ({len(checked)} loads compared)" if checked and all(checked)
                     else "MISMATCH", f"{runs_text(runs[s].get('save'))} / "
                     f"{runs_text(runs[s].get('load'))}"])
    for tool, seconds in bound_s.items():
        rows.append([f"O_DIRECT sequential write, `{tool}` (bound)", f"{seconds:.2f} s",
                     rate(nbytes, seconds), fmt_ratio(fs_save / seconds) if fs_save else "-",
                     "-", "-", "-", "-", "-"])
    lines = [f"### {world} ranks: {nbytes / GB:.2f} GB sharded state "
             "(bf16 weights + fp32 AdamW, DTensor Shard(0))", "",
             markdown_table(["system", "save", "save rate", "save vs best FileSystemWriter",
                             "load", "load rate", "load vs best FileSystemReader", "check",
                             "runs (save / load, s)"], rows), ""]
    iso_save, iso_load = save.get("isolane"), load.get("isolane")
    save_ratio = fs_save / iso_save if iso_save and fs_save else None
    load_ratio = fs_load / iso_load if iso_load and fs_load else None
    lines.append(f"- {world} ranks, save: isolane vs best FileSystemWriter "
                 f"**{fmt_ratio(save_ratio)}** (target ≥ 1.30x: {verdict(save_ratio, 1.3)}); "
                 f"load: vs best FileSystemReader **{fmt_ratio(load_ratio)}** "
                 f"(target ≥ 1.30x: {verdict(load_ratio, 1.3)})")
    async_rows = []
    for s in names:
        blocked, sync = median(runs[s].get("async_block")), save[s]
        if blocked is None:
            continue
        share = blocked / sync if sync else None
        async_rows.append([LABELS[s], f"{blocked:.3f} s", f"{sync:.2f} s" if sync else "-",
                           fmt_ratio(share, percent=True) if share is not None else "-",
                           f"{median(runs[s].get('async_total')) or 0:.2f} s",
                           runs_text(runs[s].get("async_block"))])
    if async_rows:
        lines += ["", markdown_table(["system", "async_save blocking", "sync save",
                                      "blocking / sync save", "async until durable",
                                      "runs (blocking, s)"], async_rows), ""]
    iso_block = median(runs.get("isolane", {}).get("async_block"))
    share = iso_block / iso_save if iso_block is not None and iso_save else None
    lines.append(f"- {world} ranks, async_save blocking / sync save: **"
                 f"{fmt_ratio(share, percent=True) if share is not None else '-'}** "
                 f"(target ≤ 10 %: {verdict(share, 0.10, at_most=True)})")
    resave = {s: median(runs[s].get("resave")) for s in names}
    fs_resave = min((resave[s] for s in FS_SYSTEMS if resave.get(s)), default=None)
    lora_rows = [[LABELS[s], f"{resave[s]:.2f} s", rate(res["lora_bytes"], resave[s]),
                  fmt_ratio(fs_resave / resave[s]) if fs_resave else "-",
                  runs_text(runs[s].get("resave"))] for s in names if resave[s]]
    lines += ["", f"LoRA re-save ({res['lora_bytes'] / GB:.2f} GB state, frozen base "
              "unchanged, adapters changed):", "",
              markdown_table(["system", "re-save", "state / time", "vs best FileSystemWriter",
                              "runs (s)"], lora_rows), ""]
    iso_resave = resave.get("isolane")
    lora_ratio = fs_resave / iso_resave if iso_resave and fs_resave else None
    written, linked = res["relinked"]["written"], res["relinked"]["linked"]
    relink_text = (f"; isolane wrote {written[-1] / GB:.3f} GB and linked "
                   f"{linked[-1] / GB:.3f} GB from the first save" if written else "")
    lines.append(f"- {world} ranks, LoRA re-save: isolane vs best FileSystemWriter **"
                 f"{fmt_ratio(lora_ratio) if lora_ratio else '-'}** "
                 f"(target ≥ 10x: {verdict(lora_ratio, 10.0)}){relink_text}")
    return "\n".join(lines)


# -- the results page's rows, from the raw runs (``--json``) ----------------------------
SAVE_TARGET, LOAD_TARGET, ASYNC_TARGET, LORA_TARGET = 1.3, 1.3, 0.10, 10.0
FS_NAMES = {"fs1": "DCP FileSystemWriter (1 thread)", "fs4": "DCP FileSystemWriter (4 threads)"}


def _best(values: dict[str, float | None], among: tuple[str, ...]) -> tuple[str, float] | None:
    """The fastest of ``among`` that was measured: (system, seconds)."""
    found = [(system, seconds) for system in among if (seconds := values.get(system))]
    return min(found, key=lambda pair: pair[1], default=None)


def _bound_why(fs_name: str, fs_s: float, bound: tuple[str, float] | None,
               target: float) -> str | None:
    """Why a missed save target is what it is: the same run's O_DIRECT write limit."""
    if bound is None:
        return None
    tool, bound_s = bound
    if bound_s >= fs_s:  # the peer outran the O_DIRECT write: that run limits nothing
        return (f"this run's `{tool}` O_DIRECT write ({bound_s:.2f} s) was slower than "
                f"{fs_name} ({fs_s:.2f} s), so it is not this device's limit here and no "
                "same-run bound explains the gap")
    ceiling = fs_s / bound_s
    limit = f"this run's O_DIRECT write limit (`{tool}`, {bound_s:.2f} s)"
    if ceiling < target:
        return (f"{fs_name} is already at {bound_s / fs_s * 100:.0f} % of {limit}: "
                f"{target:g}x would exceed the device (at most {ceiling:.2f}x)")
    return f"{limit} allows up to {ceiling:.2f}x over {fs_name}"


def _speedup_row(common: dict[str, Any], measure: str, seconds: float, peer: str,
                 peer_seconds: float, target: float | None = None,
                 why: str | None = None) -> _results.Result:
    """isolane's seconds beside a peer's: the speedup, its target, ``why`` when missed."""
    ratio = peer_seconds / seconds
    met = None if target is None else ratio >= target
    return _results.Result(
        measure=measure, value=round(seconds, 3), peer=peer,
        peer_value=round(peer_seconds, 3), ratio=round(ratio, 2),
        target=None if target is None else f"≥ {target:g}x", met=met,
        why=why if met is False else None, **common)


def headline_rows(raw: dict[str, Any], where: dict[str, str]) -> list[_results.Result]:
    """The page's rows for each world size of ``raw`` (the ``--json`` document): save,
    load, async_save blocking, LoRA re-save and the save's share of the O_DIRECT bound,
    each against its peer or limit of the same run; a missed target says why when the
    run measured the limit behind it. ``where``: machine, date and command."""
    rows: list[_results.Result] = []
    for res, bounds in zip(raw["results"], raw["bounds"], strict=True):
        world, runs = res["world"], res["runs"]
        if "isolane" not in runs:
            raise ValueError(f"{world} ranks: isolane was not run, nothing to record "
                             f"({raw.get('skipped', {}).get('isolane', 'left out')})")
        differed = sorted(s for s, checks in res["checks"].items() if not all(checks))
        if differed:
            raise ValueError(f"{world} ranks: loads through {', '.join(differed)} did not "
                             "read back bit for bit; nothing recorded")
        save = {s: median(r.get("save")) for s, r in runs.items()}
        load = {s: median(r.get("load")) for s, r in runs.items()}
        resave = {s: median(r.get("resave")) for s, r in runs.items()}
        iso_save, iso_load = save["isolane"], load["isolane"]
        best_bound = min(bounds.items(), key=lambda pair: pair[1], default=None)
        state = f"{world} ranks, {res['nbytes'] / GB:.2f} GB FSDP2 state"
        row: dict[str, Any] = dict(area="Checkpoints", unit="s", **where)

        fs = _best(save, FS_SYSTEMS)
        if fs is not None and iso_save:
            rows.append(_speedup_row(
                row, f"DCP save, {state}, IsolaneStorageWriter", iso_save,
                f"best {FS_NAMES[fs[0]]}", fs[1], SAVE_TARGET,
                _bound_why(FS_NAMES[fs[0]], fs[1], best_bound, SAVE_TARGET)))
        s3_save = save.get("s3tc")
        if s3_save and iso_save:
            rows.append(_speedup_row(row, f"DCP save, {state}, IsolaneStorageWriter", iso_save,
                                     "s3torchconnector S3StorageWriter (SeaweedFS)", s3_save))
        fs_load = _best(load, FS_SYSTEMS)
        if fs_load is not None and iso_load:
            warm = None if res["dropped"] else (
                "not root: the page cache was not dropped, loads may read from memory")
            rows.append(_speedup_row(
                row, f"DCP load, {state}, IsolaneStorageReader", iso_load,
                f"best {FS_NAMES[fs_load[0]].replace('Writer', 'Reader')}", fs_load[1],
                LOAD_TARGET, warm))
        blocked = median(runs["isolane"].get("async_block"))
        if blocked is not None and iso_save:
            share = blocked / iso_save
            fs_block = {s: median(runs.get(s, {}).get("async_block")) for s in FS_SYSTEMS}
            dcp_own = min(((s, block / sync) for s in FS_SYSTEMS
                           if (block := fs_block[s]) is not None and (sync := save.get(s))),
                          key=lambda pair: pair[1], default=None)
            why = None if dcp_own is None else (
                f"async_save with {FS_NAMES[dcp_own[0]]} blocks "
                f"{dcp_own[1] * 100:.0f} % of its sync save in this run")
            met = share <= ASYNC_TARGET
            rows.append(_results.Result(
                measure=f"DCP async_save blocking, {state}, IsolaneStorageWriter",
                value=round(blocked, 3), peer="its sync save", peer_value=round(iso_save, 3),
                ratio=round(share * 100, 1), ratio_unit="%",
                target=f"≤ {ASYNC_TARGET * 100:.0f} %", met=met,
                why=None if met else why, **row))
        fs_resave = _best(resave, FS_SYSTEMS)
        iso_resave = resave.get("isolane")
        if fs_resave is not None and iso_resave:
            written, linked = res["relinked"]["written"], res["relinked"]["linked"]
            why = (f"isolane wrote {written[-1] / GB:.3f} GB and linked "
                   f"{linked[-1] / GB:.3f} GB of the {res['lora_bytes'] / GB:.2f} GB state"
                   if written else None)
            rows.append(_speedup_row(
                row, f"DCP LoRA re-save (adapters changed), {world} ranks, "
                f"{res['lora_bytes'] / GB:.2f} GB state, IsolaneStorageWriter", iso_resave,
                f"best {FS_NAMES[fs_resave[0]]}", fs_resave[1], LORA_TARGET, why))
        # a share of the device only where the O_DIRECT write bounds isolane's save
        if best_bound is not None and iso_save and best_bound[1] <= iso_save:
            tool, bound_s = best_bound
            rows.append(_results.Result(
                measure=f"DCP save, {state}, IsolaneStorageWriter, share of the device",
                value=round(iso_save, 3), peer=f"O_DIRECT sequential write ({tool})",
                peer_value=round(bound_s, 3), ratio=round(bound_s / iso_save * 100, 1),
                ratio_unit="%", **row))
    return rows


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _quick.add_argument(parser)
    parser.add_argument("--scale", type=float, default=1.0,
                        help="1.0 = ~2 GB sharded state and ~2 GB LoRA base")
    parser.add_argument("--ranks", default="2,4", help="world sizes, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help=f"subset of {','.join(SYSTEMS)}")
    parser.add_argument("--dir", type=Path, default=REPO_ROOT / ".bench" / "dcp",
                        help="scratch folder (emptied after the run)")
    parser.add_argument("--json", type=Path, default=None, help="write the raw runs here")
    parser.add_argument("--out", type=Path, default=None,
                        help="docs/BENCHMARKS.md: record the rows in results/dcp.json "
                             "and render the page; another file: write the report's section")
    parser.add_argument("--timeout", type=float, default=3600.0, help="per world size, s")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--spec", default="{}", help=argparse.SUPPRESS)
    return parser.parse_args(argv), parser


def main(argv: list[str] | None = None) -> int:
    args, parser = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    layers = 12
    if args.quick:
        _quick.enter(args, parser, files=())
        args.scale, args.repeats, layers = min(args.scale, 0.004), 1, 4
        args.ranks = "2"
    wanted = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(wanted) - set(SYSTEMS))
    if unknown:
        parser.error(f"unknown --systems {unknown}: choose from {','.join(SYSTEMS)}")
    skipped: dict[str, str] = {}
    for system, reason in (("isolane", isolane_skip_reason()), ("s3tc", s3tc_skip_reason())):
        if system in wanted and reason:
            skipped[system] = reason
    names = [s for s in wanted if s not in skipped]
    worlds = [int(w) for w in args.ranks.split(",") if w.strip()]
    folder: Path = args.dir
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    total_bytes = FULL_BYTES * args.scale
    results: list[dict[str, Any]] = []
    bounds: list[dict[str, float]] = []
    try:
        with seaweed(folder, "s3tc" in names) as s3:
            for world in worlds:
                spec = {
                    "folder": str(folder), "systems": names, "repeats": args.repeats,
                    "s3": s3,
                    "full_layers": [vars(x) for x in plan_layers(
                        total_bytes, world, bytes_per_param=10, count=layers)],
                    "lora_layers": [vars(x) for x in plan_layers(
                        total_bytes, world, bytes_per_param=2, count=layers, prefix="base")]}
                print(f"[{world} ranks] {', '.join(names)} ...", file=sys.stderr, flush=True)
                res = run_world(world, spec, args.timeout)
                bound = {"dd": measure_dd_write(folder / "dd.bin", res["nbytes"]).seconds}
                fio = measure_fio_write(folder / "fio.bin", res["nbytes"])
                if fio is not None:
                    bound["fio, 4 in flight"] = fio.seconds
                results.append(res)
                bounds.append(bound)
    finally:
        shutil.rmtree(folder, ignore_errors=True)

    import torch

    packages = {"torch": str(torch.__version__)}
    with_s3 = "s3tc" in names
    if with_s3:
        from importlib.metadata import version

        packages["s3torchconnector"] = version("s3torchconnector")
    date = now_text()
    parts = ["## Sharded checkpoints through DCP (`benchmarks/bench_dcp.py`)", "",
             f"Run {date}: `{command_line()}`. "
             f"{machine_description(args.dir.parent, packages)}", "",
             "Medians of the runs listed; every ratio compares runs of the same group of "
             "processes, interleaved round by round. Loads start with a dropped page cache "
             + ("(root)." if all(r["dropped"] for r in results) else
                "**only where the run may drop it: this run could not (not root), so "
                "loads may read from memory**."), ""]
    for system, reason in skipped.items():
        parts.append(f"- {LABELS[system]}: not run: {reason}.")
    if skipped:
        parts.append("")
    for res, bound in zip(results, bounds, strict=True):
        parts += [report_world(res, bound, names), ""]
    report = "\n".join(parts)
    raw = {"results": results, "bounds": bounds, "skipped": skipped}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(raw, indent=1))
    print_report(report, None if args.quick else args.out, SECTION)
    if args.out and _results.is_page(args.out):
        where = {"machine": machine_description(args.dir.parent, packages),
                 "date": date, "command": command_line()}
        _results.write_results(BENCH, headline_rows(raw, where))
    return 0


if __name__ == "__main__":
    sys.exit(main())
