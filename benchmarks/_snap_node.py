"""Snapshots through a storage node, and restores from the S3 mirror (a section of
``bench_cluster.py``: ``python benchmarks/bench_cluster.py --snapshots``).

Peers side by side, round by round, on one disk, every result checked bit for bit:

- **save / load through a node**: ``SnapshotStore(folder).save`` / ``.load`` embedded,
  against ``RemoteSnapshotStore(node).save`` / ``.load`` through one ``isolane serve``
  process on loopback whose write group is another folder of the same disk, same
  config (isolane's defaults); the same ``--gb`` dict (the ``mixed`` plan of
  bench_snapshot), page cache dropped before each load (root) and every page of the
  result touched;
- **save_async**: the time until ``save_async`` returns (every tensor copied into warm
  staging memory: the client's for the node) against the sync save, embedded and
  through the node, one warm-up async save before (steady state);
- **LoRA re-save through a node**: a frozen bf16 base plus fp32 adapters, saved through
  the node once in full (a fresh name, no parent) and then again after the adapters
  changed in place: the re-save sends the unchanged chunks as hashes (linked on the
  node) and only the adapters' bytes;
- **restore from the S3 mirror**: a snapshot mirrored to a SeaweedFS server on loopback
  (``tests/support/seaweedfs.py``), its local copy removed, restored by
  ``SnapshotStore.load`` (chunks in parallel on the read lane, each by concurrent ranged
  GETs) against a single-stream s3fs ``cat_file`` of the very same chunk objects, one
  after the other.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _common as C
import _statedicts as S
import torch


@dataclass
class Series:
    values: list[float] = field(default_factory=list)

    def add(self, value: float) -> None:
        self.values.append(value)

    @property
    def median(self) -> float:
        return statistics.median(self.values) if self.values else float("nan")

    def text(self) -> str:
        return ", ".join(f"{v:.3f}" for v in self.values)


@dataclass
class SnapResults:
    nbytes: int = 0
    lora_bytes: int = 0
    adapter_bytes: int = 0
    mirror_bytes: int = 0
    embedded_save: Series = field(default_factory=Series)
    node_save: Series = field(default_factory=Series)
    embedded_load: Series = field(default_factory=Series)
    node_load: Series = field(default_factory=Series)
    # save_async: seconds until the call returned (the tensors may then change)
    embedded_async: Series = field(default_factory=Series)
    node_async: Series = field(default_factory=Series)
    # CPU seconds (this process, the node) of each load, to show where a load's time goes
    embedded_load_cpu: list[tuple[float, float]] = field(default_factory=list)
    node_load_cpu: list[tuple[float, float]] = field(default_factory=list)
    lora_first: Series = field(default_factory=Series)
    lora_resave: Series = field(default_factory=Series)
    lora_version: Series = field(default_factory=Series)
    mirror_load: Series = field(default_factory=Series)
    single_get: Series = field(default_factory=Series)
    # CPU seconds (this process, the weed server) per run, to show what bounds them
    mirror_cpu: list[tuple[float, float]] = field(default_factory=list)
    single_cpu: list[tuple[float, float]] = field(default_factory=list)
    cold: bool = False
    plan_text: str = ""
    lora_text: str = ""
    notes: list[str] = field(default_factory=list)


def log(message: str) -> None:
    print(f"[snapshots] {message}", flush=True)


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    fa, fb = S.flatten(a), S.flatten(b)
    if list(fa) != list(fb):
        raise AssertionError("restored keys differ")
    for key, value in fa.items():
        other = fb[key]
        if isinstance(value, torch.Tensor):
            if not (value.dtype == other.dtype and value.shape == other.shape
                    and torch.equal(value.view(torch.uint8) if value.dtype.itemsize == 1
                                    else value, other)):
                raise AssertionError(f"{key} differs after the restore")
        elif value != other:
            raise AssertionError(f"{key} differs after the restore")


def _node(folder: Path) -> Any:
    from tests.support.node import NodeProcess, write_node_config

    config = write_node_config(folder, device_groups={
        "checkpoint": {"role": "write", "devices": [str(folder / "ckpt")]}}, snapshot={})
    return NodeProcess(config, token="bench").start()


def _timed_load(store: Any, name: str, cold: bool) -> tuple[float, Any]:
    if cold:
        C.drop_page_cache()
    t0 = time.perf_counter()
    state = store.load(name)
    S.touch_pages(state)
    return time.perf_counter() - t0, state


def run_node(args: argparse.Namespace, res: SnapResults) -> None:
    from isolane.client.snapshot_store import RemoteSnapshotStore
    from isolane.snapshot import SnapshotStore

    plan = S.plan_mixed(1.0, total_bytes=int(args.gb * 1e9))
    res.plan_text = plan.description
    state = S.build_state_dict(plan)
    res.nbytes = S.state_bytes(state)
    res.cold = C.drop_page_cache()
    base = args.dir / "snapshots"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    node = _node(base / "node")
    try:
        remote = RemoteSnapshotStore(node.url, token="bench")
        # Steady state, as a training loop that saves every N steps: one save_async
        # before the rounds warmed the client's staging memory (fresh pages fault).
        remote.save_async(state, "warm-up-async").result()
        remote.delete("warm-up-async")
        for rnd in range(args.repeats):
            embedded = SnapshotStore(str(base / f"embedded-{rnd}"))
            embedded.save_async(state, "warm-up-async", parent=False).result()
            embedded.delete("warm-up-async")
            name = f"round-{rnd}"
            order = ["embedded", "node"] if rnd % 2 == 0 else ["node", "embedded"]
            for who in order:
                t0 = time.perf_counter()
                if who == "embedded":
                    embedded.save(state, name, parent=False)
                else:
                    remote.save(state, name)
                seconds = time.perf_counter() - t0
                (res.embedded_save if who == "embedded" else res.node_save).add(seconds)
                log(f"round {rnd + 1}: {who} save {seconds:.3f} s")
            for who in order:
                cpu0 = (C.own_cpu_s(), C.process_cpu_s([node.pid]))
                seconds, back = _timed_load(embedded if who == "embedded" else remote, name,
                                            res.cold)
                used = (C.own_cpu_s() - cpu0[0], C.process_cpu_s([node.pid]) - cpu0[1])
                (res.embedded_load if who == "embedded" else res.node_load).add(seconds)
                (res.embedded_load_cpu if who == "embedded" else res.node_load_cpu).append(
                    used)
                _same(state, back)
                del back
                log(f"round {rnd + 1}: {who} load {seconds:.3f} s, CPU client "
                    f"{used[0]:.2f} s, node {used[1]:.2f} s")
            for who in order:
                store = embedded if who == "embedded" else remote
                os.sync()
                t0 = time.perf_counter()
                handle = (embedded.save_async(state, f"{name}-async", parent=False)
                          if who == "embedded" else remote.save_async(state, f"{name}-async"))
                blocked = time.perf_counter() - t0
                handle.result()
                (res.embedded_async if who == "embedded" else res.node_async).add(blocked)
                _same(state, store.load(f"{name}-async"))
                store.delete(f"{name}-async")
                log(f"round {rnd + 1}: {who} save_async blocked {blocked:.3f} s")
            remote.delete(name)  # no parent for the next round's save
            embedded.close()
            shutil.rmtree(base / f"embedded-{rnd}")
        del state
        run_lora(args, res, remote)
        remote.close()
    finally:
        node.stop()
        shutil.rmtree(base, ignore_errors=True)


def run_lora(args: argparse.Namespace, res: SnapResults, remote: Any) -> None:
    plan = S.plan_lora(1.0, base_bytes=int(args.gb * 1e9))
    res.lora_text = plan.description
    state = S.build_state_dict(plan)
    res.lora_bytes = S.state_bytes(state)
    adapter = [S.get_path(state, p) for p in S.adapter_paths(plan)]
    res.adapter_bytes = sum(t.numel() * t.element_size() for t in adapter)
    for rnd in range(args.repeats):
        first = f"lora-{rnd}-0"
        t0 = time.perf_counter()
        remote.save(state, first)
        seconds = time.perf_counter() - t0
        res.lora_first.add(seconds)
        with torch.no_grad():
            for t in adapter:
                t.add_(0.5)  # the adapters train; the base stays frozen
        again = f"lora-{rnd}-1"
        t0 = time.perf_counter()
        info = remote.save(state, again)
        seconds2 = time.perf_counter() - t0
        res.lora_resave.add(seconds2)
        _same(state, remote.load(again))
        with torch.no_grad():
            for t in adapter:
                t.add_(0.5)
        third = f"lora-{rnd}-2"
        t0 = time.perf_counter()
        remote.save(state, third, change_detection="version")
        seconds3 = time.perf_counter() - t0
        res.lora_version.add(seconds3)
        _same(state, remote.load(third))
        log(f"lora round {rnd + 1}: first {seconds:.3f} s, re-save {seconds2:.3f} s "
            f"(linked {C.fmt_gb(info.linked_bytes)}), version mode {seconds3:.3f} s")
        for name in (first, again, third):
            remote.delete(name)


def run_mirror(args: argparse.Namespace, res: SnapResults) -> None:
    import s3fs

    from isolane.config import config_from_dict
    from isolane.snapshot import SnapshotStore
    from tests.support.seaweedfs import SeaweedServer

    plan = S.plan_mixed(1.0, total_bytes=int(args.mirror_gb * 1e9))
    state = S.build_state_dict(plan)
    folder = args.dir / "mirror"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    with SeaweedServer(folder / "weed") as server:
        bucket = server.create_bucket("bench")
        url = f"s3://{bucket}/snapshots"
        options = server.storage_options
        config = config_from_dict({"device_groups": {
            "ckpt": {"role": "write", "devices": [str(folder / "local")]},
            "cold": {"role": "capacity", "devices": [url], "storage_options": options}}})
        store = SnapshotStore(config)
        store.save(state, "m", mirror=True)
        errors = store.wait_for_mirrors()
        if errors != {"m": None}:
            raise RuntimeError(f"mirror failed: {errors}")
        manifest = store.manifest("m")
        store.close()
        shutil.rmtree(folder / "local")
        res.mirror_bytes = sum(c.stored for c in manifest.chunks)
        keys = [f"{bucket}/snapshots/snapshots/m/{manifest.generation}/{c.key}"
                for c in manifest.chunks]
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
        for rnd in range(args.repeats):
            order = ["isolane", "s3fs"] if rnd % 2 == 0 else ["s3fs", "isolane"]
            for who in order:
                cpu0 = (C.own_cpu_s(), C.process_cpu_s([server.pid]))
                if who == "isolane":
                    fresh = SnapshotStore(config)
                    seconds, back = _timed_load(fresh, "m", False)
                    _same(state, back)
                    del back
                    fresh.close()
                    res.mirror_load.add(seconds)
                else:
                    t0 = time.perf_counter()
                    got = sum(len(fs.cat_file(k)) for k in keys)
                    seconds = time.perf_counter() - t0
                    if got != res.mirror_bytes:
                        raise AssertionError(f"s3fs read {got} of {res.mirror_bytes} bytes")
                    res.single_get.add(seconds)
                used = (C.own_cpu_s() - cpu0[0], C.process_cpu_s([server.pid]) - cpu0[1])
                (res.mirror_cpu if who == "isolane" else res.single_cpu).append(used)
                log(f"mirror round {rnd + 1}: {who} {seconds:.3f} s, CPU client "
                    f"{used[0]:.2f} s, weed {used[1]:.2f} s")


def report(res: SnapResults, command: str, machine: str) -> str:
    def rate(nbytes: int, series: Series) -> str:
        return C.fmt_rate(nbytes, series.median)

    def ratio(a: Series, b: Series) -> float:
        return b.median / a.median if a.median > 0 else float("nan")

    save_ratio = ratio(res.node_save, res.embedded_save)
    load_ratio = ratio(res.node_load, res.embedded_load)
    lora_ratio = ratio(res.lora_resave, res.lora_first)
    mirror_ratio = ratio(res.mirror_load, res.single_get)
    embedded_async = ratio(res.embedded_save, res.embedded_async)
    node_async = ratio(res.node_save, res.node_async)
    rows = [
        ["save, embedded", C.fmt_seconds(res.embedded_save.median),
         rate(res.nbytes, res.embedded_save), "1.00x", res.embedded_save.text()],
        ["save through the node", C.fmt_seconds(res.node_save.median),
         rate(res.nbytes, res.node_save), f"{save_ratio:.2f}x", res.node_save.text()],
        ["load, embedded", C.fmt_seconds(res.embedded_load.median),
         rate(res.nbytes, res.embedded_load), "1.00x", res.embedded_load.text()],
        ["load through the node", C.fmt_seconds(res.node_load.median),
         rate(res.nbytes, res.node_load), f"{load_ratio:.2f}x", res.node_load.text()],
        ["save_async, embedded: until it returned", C.fmt_seconds(res.embedded_async.median),
         "", f"{embedded_async:.0%} of its sync save", res.embedded_async.text()],
        ["save_async through the node: until it returned",
         C.fmt_seconds(res.node_async.median), "", f"{node_async:.0%} of its sync save",
         res.node_async.text()],
        ["LoRA first save through the node", C.fmt_seconds(res.lora_first.median),
         rate(res.lora_bytes, res.lora_first), "1.00x", res.lora_first.text()],
        ["LoRA re-save through the node", C.fmt_seconds(res.lora_resave.median),
         rate(res.lora_bytes, res.lora_resave), f"{lora_ratio:.1f}x",
         res.lora_resave.text()],
        ["LoRA re-save through the node, change_detection='version'",
         C.fmt_seconds(res.lora_version.median), rate(res.lora_bytes, res.lora_version),
         f"{ratio(res.lora_version, res.lora_first):.1f}x", res.lora_version.text()],
        ["S3 mirror: s3fs single-stream cat_file", C.fmt_seconds(res.single_get.median),
         rate(res.mirror_bytes, res.single_get), "1.00x", res.single_get.text()],
        ["S3 mirror: SnapshotStore.load (ranged GETs)", C.fmt_seconds(res.mirror_load.median),
         rate(res.mirror_bytes, res.mirror_load), f"{mirror_ratio:.2f}x",
         res.mirror_load.text()],
    ]

    def verdict(value: float, target: float) -> str:
        return "met" if value >= target else "NOT met"

    cold = ("with the page cache dropped first" if res.cold
            else "warm (no root to drop the page cache)")
    lines = [
        "### Snapshots through a node, and restores from the S3 mirror",
        "",
        f"Command: `{command}` ({C.now_text()}).",
        "",
        machine,
        "",
        f"State dict: {C.fmt_gb(res.nbytes)} ({res.plan_text}); LoRA: "
        f"{C.fmt_gb(res.lora_bytes)} ({res.lora_text}), adapters "
        f"{C.fmt_gb(res.adapter_bytes)}; mirror snapshot {C.fmt_gb(res.mirror_bytes)}. "
        f"One `isolane serve` on loopback, write group on the same disk as the embedded "
        f"store; loads {cold}, "
        "every page touched, every restore compared bit for bit. Medians of "
        f"{len(res.node_save.values)} rounds (peers alternate who goes first); ratio = "
        "peer time / this time.",
        "",
        C.markdown_table(["run", "median", "rate", "ratio", "runs (s)"], rows),
        "",
        f"- save through a node: {save_ratio:.2f}x an embedded save (target 0.7x: "
        f"{verdict(save_ratio, 0.7)});",
        f"- load through a node: {load_ratio:.2f}x an embedded load (target 0.7x: "
        f"{verdict(load_ratio, 0.7)});",
        f"- save_async blocking: {node_async:.0%} of a sync save through the node, "
        f"{embedded_async:.0%} embedded (target 10 %: "
        f"{'met' if node_async <= 0.10 else 'NOT met'} / "
        f"{'met' if embedded_async <= 0.10 else 'NOT met'}); the call copies every "
        "tensor into warm staging memory (client memory for the node), so it is bound "
        "by copy bandwidth: blocked / sync = save rate / copy rate;",
        f"- LoRA re-save through a node: {lora_ratio:.1f}x faster than its first save "
        f"(target 10x: {verdict(lora_ratio, 10)}); with change_detection='version' "
        f"{ratio(res.lora_version, res.lora_first):.1f}x "
        f"({verdict(ratio(res.lora_version, res.lora_first), 10)});",
        f"- restore from the S3 mirror: {mirror_ratio:.2f}x a single-stream s3fs get of "
        f"the same bytes (target 3x: {verdict(mirror_ratio, 3)}).",
    ]
    def cpu_per_gb(cpu: list[tuple[float, float]], which: int, nbytes: float) -> float:
        """Median CPU seconds per GB of one side (0: client, 1: server) of the runs."""
        return statistics.median(c[which] for c in cpu) / (nbytes / 1e9)

    if res.node_load_cpu and res.embedded_load_cpu:
        def load_cpu(cpu: list[tuple[float, float]], which: int) -> float:
            return cpu_per_gb(cpu, which, res.nbytes)

        lines.append(
            f"- CPU per GB loaded (medians): through the node "
            f"{load_cpu(res.node_load_cpu, 0):.2f} s in the client (receiving out of the "
            "sockets, faulting fresh memory, hashing) + "
            f"{load_cpu(res.node_load_cpu, 1):.2f} s in the node (page cache fill, "
            f"sendfile, TCP); embedded {load_cpu(res.embedded_load_cpu, 0):.2f} s. On 2 "
            "cores the node path is bound by the sum.")
    if res.mirror_cpu and res.single_cpu:
        def per_gb(cpu: list[tuple[float, float]], which: int) -> float:
            return cpu_per_gb(cpu, which, res.mirror_bytes)

        lines.append(
            f"- CPU per GB restored from the mirror (medians): SnapshotStore.load "
            f"{per_gb(res.mirror_cpu, 0):.2f} s in the client (s3fs/aiohttp on fsspec's "
            f"one IO thread, hashing, copies) + {per_gb(res.mirror_cpu, 1):.2f} s in "
            f"weed; the single-stream get {per_gb(res.single_cpu, 0):.2f} s + "
            f"{per_gb(res.single_cpu, 1):.2f} s. With 2 cores, both paths are bound by "
            "CPU rather than by one stream's latency, which is what parallel ranged "
            "GETs can hide.")
    lines += [f"- {note}" for note in res.notes]
    return "\n".join(lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--snapshots", action="store_true",
                        help="run the 'snapshots through a node' section instead")
    parser.add_argument("--gb", type=float, default=1.0,
                        help="--snapshots: size of the state dict (and of the LoRA base)")
    parser.add_argument("--mirror-gb", type=float, default=0.5,
                        help="--snapshots: size of the mirrored snapshot")
    parser.add_argument("--parts", default="node,mirror",
                        help="--snapshots: which parts to run (node, mirror)")


def main(args: argparse.Namespace) -> int:
    import isolane

    repeats = args.repeats or (1 if args.quick else 5)
    args.repeats = repeats
    if args.quick:
        args.gb, args.mirror_gb = min(args.gb, 0.05), min(args.mirror_gb, 0.05)
    res = SnapResults()
    parts = {p.strip() for p in args.parts.split(",")}
    if "node" in parts:
        run_node(args, res)
    if "mirror" in parts:
        run_mirror(args, res)
    packages = {"isolane": isolane.__version__}
    text = report(res, C.command_line(), C.machine_description(args.dir, packages))
    C.print_report(text, args.out, "cluster-snapshots")
    return 0
