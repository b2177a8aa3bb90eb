#!/usr/bin/env python
"""Checkpoint save and restore: isolane against torch.save, DCP and the disk.

    python benchmarks/bench_snapshot.py --quick                      # smoke test, seconds
    python benchmarks/bench_snapshot.py --out docs/BENCHMARKS.md     # full run, ~4 GB dicts

Every system saves and restores the same state dicts (``_statedicts``), round by round,
the one going first rotating. Saves are timed until durable (every file and folder
fsynced), restores after ``drop_caches``, touching every page, compared bit for bit;
LoRA: re-saves with the adapter changed in place. The limits, in the same round: the
simplest writer of the same bytes (``_common.write_limit``: 64 MiB O_DIRECT ``pwrite``s
from 4 threads into one file, as in ``bench_dcp.py``) and a 4-thread O_DIRECT read of
isolane's own chunk files.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import warnings
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C
import _quick
import _results
import _statedicts as S
import numpy as np
import torch

C.ensure_repo_importable()

SYSTEMS = ("torch", "dcp4", "isolane")
# each system's restore modes (DCP's single-process load is not measured)
LOADS = {"torch": ("torch.load(weights_only=True)",), "dcp4": (),
         "isolane": ("load", "load(into=...)")}
TARGETS = {"save_vs_torch": 4.0, "save_vs_limit": 0.95, "restore_vs_torch": 1.5,
           "into_vs_read_limit": 0.85, "async_blocking": 0.10}
_T0 = time.perf_counter()

# single-process DCP: torch says so once per call; the benchmark knows
warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled")


class Runs(dict[str, list[float]]):
    """Every measurement's seconds by name (``save:torch``, ``limit:...``), logged."""

    def add(self, name: str, seconds: float) -> None:
        self.setdefault(name, []).append(seconds)
        print(f"[{time.perf_counter() - _T0:7.1f}s]   {name}: {seconds:.3f} s",
              file=sys.stderr, flush=True)

    def median(self, name: str) -> float | None:
        return statistics.median(self[name]) if self.get(name) else None


class System:
    """One system's saves into ``folder``; ``output(name)`` is what it wrote."""

    def __init__(self, key: str, folder: Path) -> None:
        self.key, self.folder = key, folder
        folder.mkdir(parents=True, exist_ok=True)
        self.store: Any = None
        if key == "isolane":
            from isolane.snapshot import SnapshotStore

            self.store = SnapshotStore(str(folder))

    def output(self, name: str) -> Path:
        if self.key == "isolane":
            return Path(self.store.path(name))  # linked chunks are hard links inside it
        return self.folder / (f"{name}.pt" if self.key == "torch" else name)

    def save(self, sd: Mapping[str, Any], name: str) -> None:
        if self.key == "torch":
            torch.save(sd, self.output(name))
        elif self.key == "dcp4":
            import torch.distributed.checkpoint as dcp

            dcp.save(dict(sd), storage_writer=dcp.FileSystemWriter(
                self.output(name), thread_count=4), no_dist=True)
        else:
            self.store.save(sd, name)

    def load(self, mode: str, name: str, into: dict[str, Any]) -> Mapping[Any, Any]:
        if self.key == "torch":
            return torch.load(self.output(name), weights_only=True)
        return self.store.load(name, into=into if "into" in mode else None)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
        C.remove_path(self.folder)


# -- the disk's limits, measured with the simplest code --------------------------------
def read_limit(folder: Path, nbytes: int) -> float:
    """Seconds of a cold 4-thread O_DIRECT read of the snapshot's chunk files into
    touched memory, scaled to ``nbytes``."""
    files = sorted((Path(d, f) for d, _s, names in os.walk(folder) for f in names
                    if f == "c" or f.startswith("c.")), key=lambda p: -p.stat().st_size)
    sizes = [-(-p.stat().st_size // 4096) * 4096 for p in files]
    buf = C.warm_memory(sum(sizes))
    view = memoryview(buf)
    offsets = np.cumsum([0, *sizes[:-1]]).tolist()

    def one(i: int) -> int:
        fd = os.open(files[i], os.O_RDONLY | os.O_DIRECT)
        try:
            return os.preadv(fd, [view[offsets[i]:offsets[i] + sizes[i]]], 0)
        finally:
            os.close(fd)

    try:
        C.drop_page_cache()
        start = time.perf_counter()
        with ThreadPoolExecutor(4) as pool:
            read = sum(pool.map(one, range(len(files))))
        return (time.perf_counter() - start) * nbytes / max(read, 1)
    finally:
        view.release()
        buf.close()


# -- measuring ---------------------------------------------------------------------------
def timed_save(system: System, sd: Mapping[str, Any], name: str) -> float:
    C.settle()
    start = time.perf_counter()
    system.save(sd, name)
    C.fsync_tree(system.output(name))
    return time.perf_counter() - start


def timed_async(system: System, sd: Mapping[str, Any], name: str) -> float:
    """Seconds until save_async returned, after a warm-up save_async (a loop's steady
    state). The first and last tensors change right after it returns: the snapshot must
    not see that."""
    system.store.save_async(sd, "warm-up", parent=False).result()
    system.store.delete("warm-up")
    probes = [S.tensors_of(sd)[0], S.tensors_of(sd)[-1]]
    C.settle()
    start = time.perf_counter()
    pending = system.store.save_async(sd, name, parent=False)
    blocked = time.perf_counter() - start
    S.flip_bits(probes, 4)
    try:
        pending.result()
        return blocked
    finally:
        S.flip_bits(probes, 4)


def timed_restore(system: System, mode: str, name: str, sd: Mapping[str, Any]) -> float:
    """A cold restore (page cache dropped), every page touched, compared bit for bit."""
    into = S.empty_like_tree(sd)
    C.drop_page_cache()
    start = time.perf_counter()
    restored = system.load(mode, name, into)
    S.touch_pages(restored)
    seconds = time.perf_counter() - start
    S.check_equal(sd, restored)
    return seconds


def mixed_round(key: str, rnd: int, sd: dict[str, Any], base: Path, runs: Runs) -> None:
    """One round of one system: save, every restore mode; then clean up."""
    system = System(key, base / f"mixed-{key}-r{rnd}")
    try:
        runs.add(f"save:{key}", timed_save(system, sd, "ckpt"))
        if key == "isolane":
            tensors = S.tensors_of(sd)
            S.flip_bits(tensors, 2)  # a state of its own, nothing to link
            try:
                runs.add("async-blocked:isolane", timed_async(system, sd, "ckpt-async"))
                S.check_equal(sd, system.store.load("ckpt-async"))
            finally:
                S.flip_bits(tensors, 2)
            runs.add("read-limit", read_limit(system.output("ckpt"), S.state_bytes(sd)))
        for mode in LOADS[key]:
            runs.add(f"restore:{key}:{mode}", timed_restore(system, mode, "ckpt", sd))
            gc.collect()  # free the restored copy before the next restore
    finally:
        system.close()


def lora_round(key: str, rnd: int, sd: dict[str, Any], adapter: list[torch.Tensor],
               saves: int, base: Path, runs: Runs) -> None:
    """``saves`` saves, the adapter changed in place in between (isolane keeps them all:
    a re-save links the unchanged chunks of the one before)."""
    system = System(key, base / f"lora-{key}-r{rnd}")
    try:
        for i in range(saves):
            if i:
                for t in adapter:
                    t.add_(1e-3)  # a training step changed the adapter, not the base
            sd["step"] = i
            runs.add(f"lora-{'resave' if i else 'first'}:{key}",
                     timed_save(system, sd, f"lora-{i}"))
            if i and key != "isolane":
                C.remove_path(system.output(f"lora-{i - 1}"))
        if rnd == 0 and key == "isolane":
            S.check_equal(sd, system.store.load(f"lora-{saves - 1}"))
    finally:
        system.close()


def run_case(case: str, args: argparse.Namespace, runs: Runs) -> S.StatePlan:
    gc.collect()  # the state dict of the case before
    plan = S.PLANS[case](args.scale)
    print(f"{case}: building {C.fmt_gb(plan.nbytes)} ({len(plan.tensors)} tensors)",
          file=sys.stderr, flush=True)
    sd = S.build_state_dict(plan)
    adapter = [S.get_path(sd, p) for p in S.adapter_paths(plan)]
    for rnd in range(args.repeats):
        if case == "mixed":
            runs.add("write-limit", C.write_limit(args.dir / "limit.bin", plan.nbytes))
            turn = rnd % len(SYSTEMS)  # who goes first rotates
            for key in SYSTEMS[turn:] + SYSTEMS[:turn]:
                mixed_round(key, rnd, sd, args.dir, runs)
        else:
            for key in ("torch", "isolane"):
                lora_round(key, rnd, sd, adapter, args.lora_saves, args.dir, runs)
    return plan


# -- the report --------------------------------------------------------------------------
def headline_rows(runs: Runs, plans: dict[str, S.StatePlan],
                  where: dict[str, str]) -> list[_results.Result]:
    """The page's rows: each isolane measure beside its same-run peer or limit."""
    rows: list[_results.Result] = []
    size = f"{C.fmt_gb(plans['mixed'].nbytes)} training state (bf16 weights + fp32 Adam)"

    def add(measure: str, iso: float | None, peer: str, peer_s: float | None,
            target: float = 0.0, *, kind: str = "x", why: str | None = None) -> None:
        """``kind``: "x" a speedup (no target: 0), "share" isolane's share of a limit,
        "blocked" the share of its sync save that save_async blocks."""
        if not iso or not peer_s:
            return
        if kind == "blocked":
            ratio, text, met = (round(iso / peer_s * 100), f"≤ {target * 100:.0f} %",
                                iso / peer_s <= target)
        elif kind == "share":
            ratio, text, met = (round(peer_s / iso * 100, 0), f"≥ {target * 100:.0f} %",
                                peer_s / iso * 100 >= target * 100)
        else:
            ratio, text, met = round(peer_s / iso, 2), f"≥ {target:g}x", peer_s / iso >= target
        rows.append(_results.Result(
            area="Checkpoints", measure=measure, value=round(iso, 3), unit="s", peer=peer,
            peer_value=round(peer_s, 3), ratio=ratio, ratio_unit="x" if kind == "x" else "%",
            target=text if target else None, met=met if target else None,
            why=why if target and not met else None, **where))

    iso = runs.median("save:isolane")
    add(f"save, {size}, until durable", iso, "torch.save", runs.median("save:torch"),
        TARGETS["save_vs_torch"])
    add("save, share of the device's write limit", iso, f"simple writer ({C.WRITE_LIMIT})",
        runs.median("write-limit"), TARGETS["save_vs_limit"], kind="share",
        why="isolane writes chunk files and a manifest, fsynced; the limit writes one file")
    add("save, against DCP", iso, "DCP FileSystemWriter, thread_count=4",
        runs.median("save:dcp4"))
    torch_load = LOADS["torch"][0]
    torch_r = runs.median(f"restore:torch:{torch_load}")
    add("load() into new tensors, cold page cache", runs.median("restore:isolane:load"),
        torch_load, torch_r, TARGETS["restore_vs_torch"],
        why="new tensors are fresh memory, faulted in page by page; load(into=...) avoids it")
    into = runs.median("restore:isolane:load(into=...)")
    add("load(into=...) into the model's tensors, cold page cache", into, torch_load,
        torch_r, TARGETS["restore_vs_torch"])
    add("load(into=...), share of the cold read limit of its chunk files", into,
        "plain O_DIRECT read, 4 threads", runs.median("read-limit"),
        TARGETS["into_vs_read_limit"], kind="share")
    add("save_async, time the training loop is blocked", runs.median("async-blocked:isolane"),
        "its sync save", iso, TARGETS["async_blocking"], kind="blocked")
    add("LoRA re-save (adapter changed)", runs.median("lora-resave:isolane"),
        "torch.save re-save", runs.median("lora-resave:torch"))
    return rows


def render(plans: dict[str, S.StatePlan], args: argparse.Namespace, machine: str) -> str:
    return "\n".join([
        "## Checkpoint save and restore (`benchmarks/bench_snapshot.py`)", "",
        f"Command: `{C.command_line()}`  ", f"Date: {C.now_text()}  ", f"Machine: {machine}",
        "", f"Medians of {args.repeats} run(s); 1 GB = 10^9 bytes. Saves are timed until "
        "durable; every timed write starts after `sync` and a short pause. Restores run "
        "after dropping the page cache (root), touch every page and are compared bit for "
        "bit. LoRA: a first save, then re-saves with the adapter changed in place. State "
        "dicts: " + "; ".join(f"{p.case}: {C.fmt_gb(p.nbytes)}, {len(p.tensors)} tensors, "
                              f"{p.description}" for p in plans.values()) + ".", ""])


# -- command line ------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    arg = p.add_argument
    arg("--scale", type=float, default=1.0, help="1.0 = ~4 GB mixed, ~3 GB LoRA base")
    arg("--repeats", type=int, default=3, help="runs per measurement (median)")
    arg("--dir", type=Path, default=C.REPO_ROOT / ".bench", help="scratch folder")
    arg("--out", type=Path, help="docs/BENCHMARKS.md records results/snapshot.json")
    arg("--lora-saves", type=int, default=5, help="saves in the LoRA sequence")
    _quick.add_argument(p)
    args = p.parse_args(argv)
    if args.quick:
        _quick.enter(args, p, files=())
        args.scale, args.repeats, args.lora_saves = 0.005, 1, 2  # a ~20 MB mixed state
    if args.scale <= 0 or args.repeats < 1 or args.lora_saves < 2:
        p.error("--scale must be > 0, --repeats >= 1 and --lora-saves >= 2")
    args.dir = args.dir.resolve()
    args.dir.mkdir(parents=True, exist_ok=True)
    runs = Runs()
    plans = {case: run_case(case, args, runs) for case in S.PLANS}
    machine = C.machine_description(args.dir, {"torch": torch.__version__})
    rows = headline_rows(runs, plans, {"machine": machine, "date": C.now_text(),
                                       "command": C.command_line()})
    C.publish("snapshot", render(plans, args, machine), rows, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
