#!/usr/bin/env python
"""Checkpoint save and restore: isolane against torch.save, safetensors, DCP and the disk.

    python benchmarks/bench_snapshot.py --quick                      # smoke test, seconds
    python benchmarks/bench_snapshot.py --out docs/BENCHMARKS.md     # full run, ~4 GB dicts

Every system saves and restores the same in-memory state dicts (``_statedicts``), round
by round, the one going first rotating, so that a noisy neighbour hits all alike.

- **limit**: the fastest simple writer of the same bytes in the same round (``pwrite``
  loops of 8/32/64 MiB O_DIRECT requests from 1 and 4 threads, ``dd`` and ``fio`` when
  installed), and a plain 4-thread O_DIRECT read of isolane's own chunk files.
- **save**: from the call until durable (the benchmark fsyncs every file and folder
  written, inside the timing), into a new, empty folder; isolane also a second save into
  the same store and ``save_async`` (until it returns, then until durable).
- **restore**: after ``drop_caches``, touching every page, compared bit for bit.
- **peak RSS**: each isolane save once more in a fresh process.
- **LoRA**: saves of a frozen base + adapter, the adapter changed in place in between.

Outputs go to ``--dir`` (default ``.bench/``, gitignored) and are deleted after use.
"""

from __future__ import annotations

import argparse
import gc
import json
import mmap
import os
import sys
import time
import traceback
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C
import _quick
import _results
import _statedicts as S
import numpy as np
import safetensors
import torch

C.ensure_repo_importable()

SECTION = "snapshot"
SYSTEMS = ("torch", "safetensors", "dcp1", "dcp4", "isolane", "isolane-version")
LORA_SKIP = ("dcp1",)  # five full re-saves per round: the LoRA case keeps the main peers
MIXED_SKIP = ("isolane-version",)  # every tensor changes between mixed saves: same as hash
QUICK_SCALE = 0.005  # ~20 MB mixed state dict
TARGETS = {"save_vs_torch": 4.0, "save_vs_limit": 0.95, "restore_vs_torch": 1.5,
           "into_vs_read_limit": 0.85, "async_blocking": 0.10}
INTO_MODE = 2  # index of load(into=...) among IsolaneSaver.restore_modes()
MiB = 1 << 20
# After a big scratch file is deleted, the disk (ext4 mounted with ``discard``) still trims
# its blocks for a while after ``sync`` returned: every timed write starts after settle().
SETTLE_S = 0.5
_T0 = time.perf_counter()

# single-process DCP: torch says so once per call; the benchmark knows
warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled")


def log(message: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f}s] {message}", file=sys.stderr, flush=True)


# -- the systems under test, behind one interface --------------------------------------
@dataclass(frozen=True)
class RestoreMode:
    """``load(name, template)`` returns the state dict; ``template`` is a preallocated
    copy for loaders that fill one in place, else None."""

    label: str
    load: Callable[[str, dict[str, Any] | None], Mapping[Any, Any]]
    needs_template: bool = False
    note: str = ""


class Pending(Protocol):
    def result(self) -> object: ...


class Saver(ABC):
    """Construct on an empty folder -> ``save`` (distinct names) -> restores -> ``close``.
    The benchmark makes a save durable by fsyncing ``output(name)`` inside the timing."""

    label = ""
    async_label = ""
    incremental = False     # later saves may reuse earlier ones: keep them
    reuses_buffers = False  # keeps state across saves: a second save is measured too

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)

    @abstractmethod
    def save(self, state_dict: Mapping[str, Any], name: str) -> None: ...

    @abstractmethod
    def output(self, name: str) -> Path: ...

    @abstractmethod
    def restore_modes(self) -> list[RestoreMode]: ...

    def remove(self, name: str) -> None:
        C.remove_path(self.output(name))

    def close(self) -> None:  # noqa: B027 - most savers hold nothing open
        pass


class TorchSaver(Saver):
    label = "torch.save"

    def output(self, name: str) -> Path:
        return self.folder / f"{name}.pt"

    def save(self, state_dict: Mapping[str, Any], name: str) -> None:
        torch.save(state_dict, self.output(name))

    def restore_modes(self) -> list[RestoreMode]:
        return [RestoreMode("torch.load(weights_only=True)",
                            lambda name, _: torch.load(self.output(name), weights_only=True)),
                RestoreMode("torch.load(weights_only=True, mmap=True)",
                            lambda name, _: torch.load(self.output(name), weights_only=True,
                                                       mmap=True),
                            note="lazy: pays its reads when the pages are touched")]


class SafetensorsSaver(Saver):
    label = "safetensors save_file"
    META_KEY = "bench.non_tensor_leaves"

    def output(self, name: str) -> Path:
        return self.folder / f"{name}.safetensors"

    def save(self, state_dict: Mapping[str, Any], name: str) -> None:
        from safetensors.torch import save_file

        leaves = dict(S.iter_leaves(state_dict))
        tensors = {S.path_text(p): v for p, v in leaves.items() if isinstance(v, torch.Tensor)}
        other = {S.path_text(p): v for p, v in leaves.items() if not isinstance(v, torch.Tensor)}
        save_file(tensors, str(self.output(name)), metadata={self.META_KEY: json.dumps(other)})

    def _load(self, name: str, _template: dict[str, Any] | None) -> dict[str, Any]:
        from safetensors import safe_open
        from safetensors.torch import load_file

        path = str(self.output(name))
        flat: dict[str, Any] = dict(load_file(path))
        with safe_open(path, framework="pt") as f:
            flat.update(json.loads((f.metadata() or {}).get(self.META_KEY, "{}")))
        nested: dict[str, Any] = {}
        for key, value in flat.items():
            S.set_path(nested, tuple(key.split("/")), value)
        return nested

    def restore_modes(self) -> list[RestoreMode]:
        return [RestoreMode("safetensors load_file", self._load,
                            note="the nested dict flattened to '/'-joined keys")]


class DcpSaver(Saver):
    """torch.distributed.checkpoint in one process (``no_dist=True``); with 4 threads it
    also offers ``dcp.async_save`` (a fresh CPU copy on every call, written in a thread)."""

    def __init__(self, folder: Path, threads: int) -> None:
        super().__init__(folder)
        self.threads = threads
        self.label = f"DCP save, thread_count={threads}"
        self.async_label = f"DCP async_save, thread_count={threads}" if threads > 1 else ""

    def output(self, name: str) -> Path:
        return self.folder / name

    def _writer(self, name: str) -> Any:
        from torch.distributed.checkpoint import FileSystemWriter

        return FileSystemWriter(self.output(name), thread_count=self.threads)

    def save(self, state_dict: Mapping[str, Any], name: str) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(dict(state_dict), storage_writer=self._writer(name), no_dist=True)

    def save_async(self, state_dict: Mapping[str, Any], name: str) -> Pending:
        import torch.distributed.checkpoint as dcp

        pending: Pending = dcp.async_save(dict(state_dict), storage_writer=self._writer(name),
                                          no_dist=True)
        return pending

    def _load(self, name: str, template: dict[str, Any] | None) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader

        if template is None:
            raise TypeError("DCP loads into a preallocated state dict; pass a template")
        dcp.load(template, storage_reader=FileSystemReader(self.output(name)), no_dist=True)
        return template

    def restore_modes(self) -> list[RestoreMode]:
        return [RestoreMode(f"DCP load (written with thread_count={self.threads})", self._load,
                            needs_template=True, note="into a preallocated, touched state dict")]


class IsolaneSaver(Saver):
    label = "isolane SnapshotStore.save"
    async_label = "isolane SnapshotStore.save_async"
    incremental = True
    reuses_buffers = True

    def __init__(self, folder: Path, change_detection: str = "hash") -> None:
        from isolane.snapshot import SnapshotStore

        super().__init__(folder)
        self.change_detection = change_detection
        if change_detection != "hash":
            self.label += f"(change_detection={change_detection!r})"
        self.store = SnapshotStore(str(self.folder))
        self._async_warm = False

    def output(self, name: str) -> Path:
        return Path(self.store.path(name))  # linked chunks are hard links inside it

    def save(self, state_dict: Mapping[str, Any], name: str) -> None:
        self.store.save(state_dict, name, change_detection=self.change_detection)

    def save_async(self, state_dict: Mapping[str, Any], name: str) -> Pending:
        if not self._async_warm:  # steady state: a training loop saving every N steps
            self.store.save_async(state_dict, "warm-up-async", parent=False).result()
            self.store.delete("warm-up-async")
            self._async_warm = True
        pending: Pending = self.store.save_async(state_dict, name, parent=False)
        return pending

    def restore_modes(self) -> list[RestoreMode]:
        return [RestoreMode("isolane SnapshotStore.load", lambda name, _: self.store.load(name)),
                RestoreMode("isolane SnapshotStore.load(mmap=True)",
                            lambda name, _: self.store.load(name, mmap=True)),
                RestoreMode("isolane SnapshotStore.load(into=...)",
                            lambda name, template: self.store.load(name, into=template),
                            needs_template=True, note="into a preallocated, touched state dict")]

    def remove(self, name: str) -> None:
        pass  # incremental: later snapshots link its chunks; the folder goes at the end

    def close(self) -> None:
        self.store.close()


def make_saver(key: str, folder: Path) -> Saver:
    makers: dict[str, Callable[[], Saver]] = {
        "torch": lambda: TorchSaver(folder), "safetensors": lambda: SafetensorsSaver(folder),
        "dcp1": lambda: DcpSaver(folder, 1), "dcp4": lambda: DcpSaver(folder, 4),
        "isolane": lambda: IsolaneSaver(folder),
        "isolane-version": lambda: IsolaneSaver(folder, "version")}
    return makers[key]()


# -- the disk's limits, measured with the simplest code --------------------------------
def settle() -> None:
    os.sync()
    time.sleep(SETTLE_S)


def warm_memory(nbytes: int, *, random: bool = False) -> mmap.mmap:
    """Private anonymous memory advised MADV_HUGEPAGE (as isolane's staging), touched."""
    buf = mmap.mmap(-1, max(nbytes, mmap.PAGESIZE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(mmap.MADV_HUGEPAGE)
    view = np.frombuffer(buf, dtype=np.uint8)
    if random:
        view[:] = np.random.default_rng(13).integers(0, 256, len(buf), dtype=np.uint8)
    else:
        view[::mmap.PAGESIZE] = 0
    return buf


def pwrite_loop(path: Path, nbytes: int, source: memoryview, block: int, threads: int
                ) -> float:
    """Write ``nbytes`` (whole blocks) O_DIRECT into a new file, thread k blocks k, k +
    threads, ...; seconds until the final fsync returned, scaled to ``nbytes``."""
    blocks = -(-nbytes // block)
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    try:
        def run(first: int) -> None:
            for b in range(first, blocks, threads):
                done = 0
                while done < block:
                    done += os.pwrite(fd, source[done:block], b * block + done)

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(run, range(threads)))
        os.fsync(fd)
    finally:
        os.close(fd)
    return (time.perf_counter() - start) * nbytes / (blocks * block)


def read_limit(folder: Path, nbytes: int) -> float:
    """Cold O_DIRECT read of the snapshot's chunk files, 4 threads, into touched memory;
    seconds, scaled to ``nbytes`` (the state dict's size)."""
    files = sorted((Path(d, f) for d, _s, names in os.walk(folder) for f in names
                    if f == "c" or f.startswith("c.")), key=lambda p: -p.stat().st_size)
    sizes = [-(-p.stat().st_size // 4096) * 4096 for p in files]
    buf = warm_memory(sum(sizes))
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


# -- results -----------------------------------------------------------------------------
@dataclass
class Row:
    label: str
    note: str = ""
    seconds: C.Samples = field(default_factory=C.Samples)
    blocked: C.Samples = field(default_factory=C.Samples)  # async: until save_async returned
    verdicts: list[S.Verdict] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def median(self) -> float | None:
        return self.seconds.median if self.seconds else None

    def check_text(self) -> str:
        if self.errors:
            return "ERROR: " + self.errors[0]
        failed = [v for v in self.verdicts if not v.ok]
        shown = failed or self.verdicts[-1:]
        return shown[0].text() if shown else ""


class Rows(dict[str, Row]):
    def row(self, key: str, label: str, note: str = "") -> Row:
        return self.setdefault(key, Row(label, note))

    def median(self, key: str) -> float | None:
        return self[key].median if key in self else None


@dataclass
class Results:
    plans: dict[str, S.StatePlan] = field(default_factory=dict)
    limits: Rows = field(default_factory=Rows)
    saves: Rows = field(default_factory=Rows)
    restores: Rows = field(default_factory=Rows)
    rss: dict[str, dict[str, Any]] = field(default_factory=dict)
    lora_full: Rows = field(default_factory=Rows)
    lora_resave: Rows = field(default_factory=Rows)
    cache_dropped: bool = True


# -- measuring ---------------------------------------------------------------------------
def timed_save(saver: Saver, sd: Mapping[str, Any], name: str) -> float:
    settle()
    start = time.perf_counter()
    saver.save(sd, name)
    C.fsync_tree(saver.output(name))
    return time.perf_counter() - start


def timed_async(saver: Any, sd: Mapping[str, Any], name: str,
                probes: list[torch.Tensor]) -> tuple[float, float]:
    """(seconds until save_async returned, until durable). Right after it returns the
    probes change (undone after ``result()``): the snapshot must not see that."""
    settle()
    start = time.perf_counter()
    pending = saver.save_async(sd, name)
    blocked = time.perf_counter() - start
    S.flip_bits(probes, 4)
    try:
        pending.result()
        C.fsync_tree(saver.output(name))
        return blocked, time.perf_counter() - start
    finally:
        S.flip_bits(probes, 4)


def restore_once(saver: Saver, mode_index: int, name: str, sd: Mapping[str, Any], *,
                 cold: bool) -> tuple[float, S.Verdict, bool]:
    mode = saver.restore_modes()[mode_index]
    template = S.empty_like_tree(sd) if mode.needs_template else None
    dropped = C.drop_page_cache() if cold else False

    def load() -> Mapping[Any, Any]:
        restored = mode.load(name, template)
        S.touch_pages(restored)
        return restored

    seconds, restored = C.timed(load)
    return seconds, S.compare(sd, restored), dropped


def mixed_round(key: str, rnd: int, sd: dict[str, Any], base: Path, res: Results) -> None:
    """One round of one system: save, extra saves, every restore mode; then clean up."""
    folder = base / f"mixed-{key}-r{rnd}"
    C.remove_path(folder)
    saver = make_saver(key, folder)
    tensors = S.tensors_of(sd)
    try:
        row = res.saves.row(key, saver.label)
        row.seconds.add(timed_save(saver, sd, "ckpt"))
        log(f"  {saver.label}: {row.seconds.values[-1]:.2f} s")
        if saver.reuses_buffers:
            S.flip_bits(tensors, 1)  # every element changes: nothing to dedup against
            try:
                res.saves.row(f"{key}:2nd", f"{saver.label}, 2nd save, same store",
                              "every tensor changed since the 1st save").seconds.add(
                                  timed_save(saver, sd, "ckpt-2nd"))
            finally:
                S.flip_bits(tensors, 1)
        if saver.async_label:
            S.flip_bits(tensors, 2)  # a third distinct state
            try:
                arow = res.saves.row(f"{key}:async", saver.async_label,
                                     "blocked = until the call returned; median = durable")
                blocked, total = timed_async(saver, sd, "ckpt-async", [tensors[0], tensors[-1]])
                arow.blocked.add(blocked)
                arow.seconds.add(total)
                if rnd == 0:
                    arow.verdicts.append(restore_once(saver, 0, "ckpt-async", sd,
                                                      cold=False)[1])
            finally:
                S.flip_bits(tensors, 2)
        if key == "isolane":
            res.limits.row("read", "plain read of isolane's chunk files, O_DIRECT, 4 threads "
                           "(limit)").seconds.add(read_limit(saver.output("ckpt"),
                                                             S.state_bytes(sd)))
        for index, mode in enumerate(saver.restore_modes()):
            rrow = res.restores.row(f"{key}:{index}", mode.label, mode.note)
            seconds, verdict, dropped = restore_once(saver, index, "ckpt", sd, cold=True)
            gc.collect()  # free the restored copy before the next restore
            res.cache_dropped &= dropped
            rrow.seconds.add(seconds)
            rrow.verdicts.append(verdict)
            log(f"  {mode.label}: {seconds:.2f} s, {verdict.text()}")
    finally:
        saver.close()
        C.remove_path(folder)


def lora_round(key: str, rnd: int, sd: dict[str, Any], adapter: list[torch.Tensor],
               saves: int, base: Path, res: Results) -> None:
    folder = base / f"lora-{key}-r{rnd}"
    C.remove_path(folder)
    saver = make_saver(key, folder)
    try:
        full = res.lora_full.row(key, saver.label)
        again = res.lora_resave.row(key, saver.label)
        for i in range(saves):
            if i:
                for t in adapter:
                    t.add_(1e-3)  # a training step changed the adapter, not the base
            sd["step"] = i
            (again if i else full).seconds.add(timed_save(saver, sd, f"lora-{i}"))
            if i and not saver.incremental:
                saver.remove(f"lora-{i - 1}")
        if rnd == 0:
            again.verdicts.append(restore_once(saver, 0, f"lora-{saves - 1}", sd,
                                               cold=False)[1])
    finally:
        saver.close()
        C.remove_path(folder)


def guarded(rows: Rows, key: str, fn: Callable[[], None]) -> None:
    """Run one system's round; a failure is recorded in its row, the others go on."""
    try:
        fn()
    except Exception as exc:  # report any system's failure in the table, keep measuring
        traceback.print_exc()
        rows.row(key, key).errors.append(f"{type(exc).__name__}: {exc}"[:200])


def measure_limits(nbytes: int, path: Path, source: memoryview, res: Results) -> None:
    for threads in (1, 4):
        for mib in (8, 32, 64):
            C.remove_path(path)
            settle()
            try:
                seconds = pwrite_loop(path, nbytes, source, mib * MiB, threads)
            finally:
                C.remove_path(path)
            res.limits.row(f"pwrite-{mib}m-{threads}t", f"pwrite loop, {mib} MiB O_DIRECT, "
                           f"{threads} thread(s) (limit)", "one new file, fsync at the end"
                           ).seconds.add(seconds)
    for measure in (C.measure_dd_write, C.measure_fio_write):
        settle()
        limit = measure(path, nbytes)
        if limit is not None:
            res.limits.row(limit.tool, f"{limit.tool} O_DIRECT sequential write (limit)",
                           f"`{limit.command}`").seconds.add(limit.seconds * nbytes / limit.nbytes)


def run_mixed(args: argparse.Namespace, systems: list[str], res: Results) -> None:
    plan = res.plans["mixed"] = S.plan_mixed(args.scale)
    log(f"mixed: building {C.fmt_gb(plan.nbytes)} ({len(plan.tensors)} tensors)")
    sd = S.build_state_dict(plan)
    source = warm_memory(64 * MiB, random=True)
    for rnd in range(args.repeats):
        log(f"mixed: round {rnd + 1}/{args.repeats}")
        measure_limits(plan.nbytes, args.dir / "limit.bin", memoryview(source), res)
        turn = rnd % len(systems)  # who goes first rotates: no system always follows another
        for key in systems[turn:] + systems[:turn]:
            if key not in MIXED_SKIP:
                guarded(res.saves, key, lambda key=key, rnd=rnd: mixed_round(
                    key, rnd, sd, args.dir, res))


def measure_rss(args: argparse.Namespace, res: Results) -> None:
    """Each isolane save once more in a fresh process (after the rounds' state dict is
    freed), for its peak RSS."""
    for use_async in (False, True):
        name = "isolane:async" if use_async else "isolane"
        argv = [str(Path(__file__).resolve()), "--child", "--scale", str(args.scale),
                "--dir", str(args.dir)] + (["--async"] if use_async else [])
        try:
            res.rss[name] = C.run_child(argv)
        except RuntimeError as exc:
            res.rss[name] = {"error": str(exc).splitlines()[-1][:200]}


def run_lora(args: argparse.Namespace, systems: list[str], res: Results) -> None:
    plan = res.plans["lora"] = S.plan_lora(args.scale)
    log(f"lora: building {C.fmt_gb(plan.nbytes)} ({len(plan.tensors)} tensors)")
    sd = S.build_state_dict(plan)
    adapter = [S.get_path(sd, p) for p in S.adapter_paths(plan)]
    for rnd in range(args.repeats):
        log(f"lora: round {rnd + 1}/{args.repeats}")
        for key in (k for k in systems if k not in LORA_SKIP):
            guarded(res.lora_full, key, lambda key=key, rnd=rnd: lora_round(
                key, rnd, sd, adapter, args.lora_saves, args.dir, res))


def child_save(args: argparse.Namespace) -> None:
    """``--child``: build the mixed state dict, save it once with isolane, report the
    peak RSS (``VmHWM`` reset after building: Linux carries the parent's peak into a
    child's ``ru_maxrss``)."""
    plan = S.plan_mixed(args.scale)
    sd = S.build_state_dict(plan)
    folder = args.dir / f"rss-{os.getpid()}"
    saver = IsolaneSaver(folder)
    gc.collect()
    rss_before = C.current_rss_bytes()
    reset = C.reset_peak_rss()
    try:
        if args.use_async:
            timed_async(saver, sd, "rss", [S.tensors_of(sd)[0]])
        else:
            timed_save(saver, sd, "rss")
        peak = C.hwm_rss_bytes()
    finally:
        saver.close()
        C.remove_path(folder)
    C.emit_result({"sd_bytes": plan.nbytes, "rss_before": rss_before, "peak_rss": peak,
                   "peak_reset": reset})


# -- the report --------------------------------------------------------------------------
def fastest_limit(res: Results) -> tuple[str, float] | None:
    writes = [(r.label.removesuffix(" (limit)"), r.median) for k, r in res.limits.items()
              if k != "read" and r.median]
    return min(writes, key=lambda w: w[1]) if writes else None  # type: ignore[return-value]


def headline_rows(res: Results, where: dict[str, str]) -> list[_results.Result]:
    """The page's rows: each isolane measure beside its same-run peer or limit."""
    rows: list[_results.Result] = []
    if "mixed" not in res.plans:
        return rows
    size = f"{C.fmt_gb(res.plans['mixed'].nbytes)} training state (bf16 weights + fp32 Adam)"
    saves, restores = res.saves, res.restores

    def add(measure: str, iso: float | None, peer: str, peer_s: float | None, *,
            target: float | None = None, share: bool = False, why: str | None = None) -> None:
        if not iso or not peer_s:
            return
        ratio = peer_s / iso * (100 if share else 1)
        text = None if target is None else (f"≥ {target * 100:.0f} %" if share
                                            else f"≥ {target:g}x")
        met = None if target is None else ratio >= target * (100 if share else 1)
        rows.append(_results.Result(
            area="Checkpoints", measure=measure, value=round(iso, 3), unit="s", peer=peer,
            peer_value=round(peer_s, 3), ratio=round(ratio, 2 if not share else 0),
            ratio_unit="%" if share else "x", target=text, met=met,
            why=why if met is False else None, **where))

    iso = saves.median("isolane")
    add(f"save, {size}, until durable", iso, "torch.save", saves.median("torch"),
        target=TARGETS["save_vs_torch"])
    if (limit := fastest_limit(res)) is not None:
        add("save, share of the device's write limit", iso,
            f"fastest simple writer ({limit[0]})", limit[1], target=TARGETS["save_vs_limit"],
            share=True, why="isolane writes chunk files and a manifest, fsynced; the limit "
            "writes one file")
    add("save, against DCP", iso, "DCP FileSystemWriter, thread_count=4", saves.median("dcp4"))
    torch_r = restores.median("torch:0")
    add("load() into new tensors, cold page cache", restores.median("isolane:0"),
        "torch.load(weights_only=True)", torch_r, target=TARGETS["restore_vs_torch"],
        why="new tensors are fresh memory, faulted in page by page; load(into=...) avoids it")
    into = restores.median(f"isolane:{INTO_MODE}")
    add("load(into=...) into the model's tensors, cold page cache", into,
        "torch.load(weights_only=True)", torch_r, target=TARGETS["restore_vs_torch"])
    add("load(into=...), share of the cold read limit of its chunk files", into,
        "plain O_DIRECT read, 4 threads", res.limits.median("read"),
        target=TARGETS["into_vs_read_limit"], share=True)
    arow = saves.get("isolane:async")
    if arow and arow.blocked and iso:
        blocked = arow.blocked.median
        rows.append(_results.Result(
            area="Checkpoints", measure="save_async, time the training loop is blocked",
            value=round(blocked, 3), unit="s", peer="its sync save", peer_value=round(iso, 3),
            ratio=round(blocked / iso * 100), ratio_unit="%",
            target=f"≤ {TARGETS['async_blocking'] * 100:.0f} %",
            met=blocked / iso <= TARGETS["async_blocking"], **where))
    add("LoRA re-save (adapter changed)", res.lora_resave.median("isolane"),
        "torch.save re-save", res.lora_resave.median("torch"))
    return rows


def render(res: Results, args: argparse.Namespace, machine: str) -> str:
    out = ["## Checkpoint save and restore (`benchmarks/bench_snapshot.py`)", "",
           f"Command: `{C.command_line()}`  ", f"Date: {C.now_text()}  ",
           f"Machine: {machine}", "",
           f"Medians of {args.repeats} run(s); 1 GB = 10^9 bytes. Saves are timed until "
           "durable; every timed write starts after `sync` and a short pause. Restores run "
           "after dropping the page cache" + ("" if res.cache_dropped else
                                              " (**refused: not root — restores ran warm**)")
           + ", touch every page and are compared bit for bit.", "",
           "### State dicts", "", C.markdown_table(
               ["case", "size", "tensors", "contents"],
               [[p.case, C.fmt_gb(p.nbytes), len(p.tensors), p.description]
                for p in res.plans.values()]), ""]
    if "mixed" in res.plans:
        nbytes = res.plans["mixed"].nbytes
        torch_s, torch_r = res.saves.median("torch"), res.restores.median("torch:0")
        out += [f"### Save: mixed ({C.fmt_gb(nbytes)})", "", C.markdown_table(
            ["system", "median s", "GB/s", "blocked s", "runs (s)", "speedup vs torch.save",
             "check", "notes"],
            [[r.label, C.fmt_seconds(r.median), C.fmt_rate(nbytes, r.median),
              C.fmt_seconds(r.blocked.median) if r.blocked else "", r.seconds.runs_text(),
              C.fmt_ratio(C.ratio(torch_s, r.median)), r.check_text(), r.note]
             for r in [*res.limits.values(), *res.saves.values()]]), ""]
        out += ["### Restore: mixed (cold page cache)", "", C.markdown_table(
            ["system", "median s", "GB/s", "runs (s)", "speedup vs torch.load", "check",
             "notes"],
            [[r.label, C.fmt_seconds(r.median), C.fmt_rate(nbytes, r.median),
              r.seconds.runs_text(), C.fmt_ratio(C.ratio(torch_r, r.median)), r.check_text(),
              r.note] for r in res.restores.values()]), ""]
        if res.rss:
            out += ["### Peak memory of one save (mixed, fresh process)", "",
                    "`VmHWM` after the state dict was built and the peak reset.", "",
                    C.markdown_table(["system", "peak RSS", "added by the save", "notes"], [
                        [res.saves[n].label if n in res.saves else n,
                         *([C.fmt_gb(r["peak_rss"]), C.fmt_gb(r["peak_rss"] - r["rss_before"]),
                            "" if r["peak_reset"] else "peak not reset"] if "error" not in r
                           else ["", "", "ERROR: " + r["error"]])]
                        for n, r in res.rss.items()]), ""]
    if "lora" in res.plans:
        nbytes = res.plans["lora"].nbytes
        torch_re = res.lora_resave.median("torch")
        out += [f"### LoRA: {args.lora_saves} saves, adapter changed in between "
                f"({C.fmt_gb(nbytes)})", "", C.markdown_table(
                    ["system", "1st save s", "re-save median s", "re-saves (s)",
                     "re-save speedup vs own 1st", "re-save speedup vs torch.save", "check"],
                    [[full.label, C.fmt_seconds(full.median), C.fmt_seconds(again.median),
                      again.seconds.runs_text(), C.fmt_ratio(C.ratio(full.median, again.median)),
                      C.fmt_ratio(C.ratio(torch_re, again.median)),
                      full.check_text() or again.check_text()]
                     for key, full in res.lora_full.items()
                     for again in [res.lora_resave.get(key, Row(full.label))]]), ""]
    out += ["### Ratios", "", C.markdown_table(["ratio", "value"], ratio_rows(res)), ""]
    return "\n".join(out)


def ratio_rows(res: Results) -> list[list[str]]:
    saves, restores = res.saves, res.restores
    iso, torch_r = saves.median("isolane"), restores.median("torch:0")
    limit = fastest_limit(res)
    pairs: list[tuple[str, float | None, bool]] = [
        ("isolane save vs torch.save (speedup)", C.ratio(saves.median("torch"), iso), False),
        ("isolane save vs DCP thread_count=4 (speedup)", C.ratio(saves.median("dcp4"), iso),
         False),
        ("isolane save, share of the write limit (fastest simple writer)",
         C.ratio(limit[1] if limit else None, iso), True),
        ("isolane restore vs torch.load (speedup)",
         C.ratio(torch_r, restores.median("isolane:0")), False),
        ("isolane restore (into=...) vs torch.load (speedup)",
         C.ratio(torch_r, restores.median(f"isolane:{INTO_MODE}")), False),
        ("isolane restore (into=...), share of the cold read limit of its chunk files",
         C.ratio(res.limits.median("read"), restores.median(f"isolane:{INTO_MODE}")), True),
        ("isolane LoRA re-save vs its full save (speedup)",
         C.ratio(res.lora_full.median("isolane"), res.lora_resave.median("isolane")), False),
        ("isolane LoRA re-save vs torch.save re-save (speedup)",
         C.ratio(res.lora_resave.median("torch"), res.lora_resave.median("isolane")), False)]
    for key, name in (("isolane", "isolane save_async"), ("dcp4", "DCP async_save")):
        row = saves.get(f"{key}:async")
        pairs.append((f"{name} blocking time / its sync save",
                      C.ratio(row.blocked.median if row and row.blocked else None,
                              saves.median(key)), True))
    return [[label, C.fmt_ratio(value, percent=percent)] for label, value, percent in pairs]


# -- command line ------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", type=float, default=1.0,
                   help="state dict size factor: 1.0 = ~4 GB mixed, ~3 GB LoRA base")
    p.add_argument("--repeats", type=int, default=3, help="runs per measurement (median)")
    p.add_argument("--dir", type=Path, default=C.REPO_ROOT / ".bench",
                   help="scratch folder for the saves (deleted after each)")
    p.add_argument("--out", type=Path, help="docs/BENCHMARKS.md records the headline rows "
                   "in benchmarks/results/snapshot.json; another file gets the report")
    p.add_argument("--cases", default="mixed,lora", help="comma list: mixed, lora")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma list from: {', '.join(SYSTEMS)}")
    p.add_argument("--lora-saves", type=int, default=5, help="saves in the LoRA sequence")
    p.add_argument("--no-rss", dest="rss", action="store_false",
                   help="skip the peak-RSS child processes")
    p.add_argument("--json", type=Path, help="also write the raw measurements here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--async", dest="use_async", action="store_true", help=argparse.SUPPRESS)
    _quick.add_argument(p)
    args = p.parse_args(argv)
    if args.quick:
        _quick.enter(args, p)
        args.scale, args.repeats, args.lora_saves = QUICK_SCALE, 1, 2
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    args.cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    if not set(args.systems) <= set(SYSTEMS) or not set(args.cases) <= set(S.PLANS):
        p.error(f"--systems from {', '.join(SYSTEMS)}; --cases from {', '.join(S.PLANS)}")
    if args.scale <= 0 or args.repeats < 1 or args.lora_saves < 2:
        p.error("--scale must be > 0, --repeats >= 1 and --lora-saves >= 2")
    args.dir = args.dir.resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    if args.child:
        child_save(args)
        return 0
    res = Results()
    if "mixed" in args.cases:
        run_mixed(args, args.systems, res)
        gc.collect()
        if args.rss and "isolane" in args.systems:
            measure_rss(args, res)
    if "lora" in args.cases:
        run_lora(args, args.systems, res)
    machine = C.machine_description(args.dir, {"torch": torch.__version__,
                                               "safetensors": safetensors.__version__})
    rows = headline_rows(res, {"machine": machine, "date": C.now_text(),
                               "command": C.command_line()})
    C.print_report(render(res, args, machine) + "\n" + _results.rows_markdown(rows),
                   args.out, SECTION)
    if args.out and _results.is_page(args.out):
        _results.write_results(SECTION, rows)
    if args.json:
        args.json.write_text(json.dumps({
            "sizes": {k: p.nbytes for k, p in res.plans.items()}, "rss": res.rss,
            **{name: {k: {"label": v.label, "seconds": v.seconds.values,
                          "blocked": v.blocked.values, "check": v.check_text()}
                      for k, v in getattr(res, name).items()}
               for name in ("limits", "saves", "restores", "lora_full", "lora_resave")}},
            indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
