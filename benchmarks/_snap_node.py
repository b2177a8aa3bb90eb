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
- **restore from the S3 mirror**: ``_snap_mirror.py`` (with the bound of this machine
  measured in the same rounds).

Each missed target gets its bound measured in the same run: the save_async copy alone
(``ClientStaging.stage`` of the same dict into its warm memory, nothing else running),
and the embedded LoRA re-save of the same dict (the same writer without the node).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _common as C
import _snap_mirror as SM
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
    lora_embedded_first: Series = field(default_factory=Series)
    lora_embedded_resave: Series = field(default_factory=Series)
    copy_alone: Series = field(default_factory=Series)  # save_async's copy, nothing else
    # the node store's own staging copy inside its save_async (timed on the caller's
    # thread), and again right after the upload (same buffers, no os.sync() before)
    node_stage_in_call: Series = field(default_factory=Series)
    node_stage_after: Series = field(default_factory=Series)
    mirror: SM.MirrorResults | None = None
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
    from isolane.client.snapshot_staging import ClientStaging
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
        staging = remote._staging
        real_stage = staging.stage

        def timed_stage(state_dict: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return real_stage(state_dict)
            finally:
                res.node_stage_in_call.add(time.perf_counter() - t0)

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
            probe = ClientStaging()  # the copy alone, into warm memory (the bound)
            probe.stage(state)
            t0 = time.perf_counter()
            probe.stage(state)
            res.copy_alone.add(time.perf_counter() - t0)
            probe.clear()
            del probe
            for who in order:
                store = embedded if who == "embedded" else remote
                staging.stage = timed_stage  # type: ignore[method-assign]
                os.sync()
                t0 = time.perf_counter()
                handle = (embedded.save_async(state, f"{name}-async", parent=False)
                          if who == "embedded" else remote.save_async(state, f"{name}-async"))
                blocked = time.perf_counter() - t0
                staging.stage = real_stage  # type: ignore[method-assign]
                handle.result()
                if who == "node":  # the call's own copy again: same buffers, same moment
                    t0 = time.perf_counter()
                    remote._staging.stage(state)
                    res.node_stage_after.add(time.perf_counter() - t0)
                (res.embedded_async if who == "embedded" else res.node_async).add(blocked)
                _same(state, store.load(f"{name}-async"))
                store.delete(f"{name}-async")
                log(f"round {rnd + 1}: {who} save_async blocked {blocked:.3f} s")
            remote.delete(name)  # no parent for the next round's save
            embedded.close()
            shutil.rmtree(base / f"embedded-{rnd}")
        del state
        remote.close()
    finally:
        node.stop()
        shutil.rmtree(base, ignore_errors=True)


def run_lora_part(args: argparse.Namespace, res: SnapResults) -> None:
    from isolane.client.snapshot_store import RemoteSnapshotStore

    base = args.dir / "snapshots-lora"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    node = _node(base / "node")
    try:
        remote = RemoteSnapshotStore(node.url, token="bench")
        run_lora(args, res, remote, base)
        remote.close()
    finally:
        node.stop()
        shutil.rmtree(base, ignore_errors=True)


def run_lora(args: argparse.Namespace, res: SnapResults, remote: Any, base: Path) -> None:
    from isolane.snapshot import SnapshotStore

    plan = S.plan_lora(1.0, base_bytes=int(args.lora_gb * 1e9))
    res.lora_text = plan.description
    state = S.build_state_dict(plan)
    res.lora_bytes = S.state_bytes(state)
    adapter = [S.get_path(state, p) for p in S.adapter_paths(plan)]
    res.adapter_bytes = sum(t.numel() * t.element_size() for t in adapter)

    def train() -> None:
        with torch.no_grad():
            for t in adapter:
                t.add_(0.5)  # the adapters train; the base stays frozen

    for rnd in range(args.repeats):
        embedded = SnapshotStore(str(base / f"lora-embedded-{rnd}"))
        order = ["embedded", "node"] if rnd % 2 == 0 else ["node", "embedded"]
        for who in order:
            if who == "embedded":  # the same writer without the node: its floor
                t0 = time.perf_counter()
                embedded.save(state, "e-0", parent=False)
                first = time.perf_counter() - t0
                train()
                t0 = time.perf_counter()
                embedded.save(state, "e-1")
                again = time.perf_counter() - t0
                res.lora_embedded_first.add(first)
                res.lora_embedded_resave.add(again)
                _same(state, embedded.load("e-1"))
                log(f"lora round {rnd + 1}: embedded first {first:.3f} s, re-save "
                    f"{again:.3f} s")
                continue
            first_name = f"lora-{rnd}-0"
            t0 = time.perf_counter()
            remote.save(state, first_name)
            seconds = time.perf_counter() - t0
            res.lora_first.add(seconds)
            train()
            again_name = f"lora-{rnd}-1"
            t0 = time.perf_counter()
            info = remote.save(state, again_name)
            seconds2 = time.perf_counter() - t0
            res.lora_resave.add(seconds2)
            _same(state, remote.load(again_name))
            train()
            third = f"lora-{rnd}-2"
            t0 = time.perf_counter()
            remote.save(state, third, change_detection="version")
            seconds3 = time.perf_counter() - t0
            res.lora_version.add(seconds3)
            _same(state, remote.load(third))
            log(f"lora round {rnd + 1}: first {seconds:.3f} s, re-save {seconds2:.3f} s "
                f"(linked {C.fmt_gb(info.linked_bytes)}), version mode {seconds3:.3f} s")
            for name in (first_name, again_name, third):
                remote.delete(name)
        embedded.close()
        shutil.rmtree(base / f"lora-embedded-{rnd}")


def report(res: SnapResults, command: str, machine: str) -> str:
    def rate(nbytes: int, series: Series) -> str:
        return C.fmt_rate(nbytes, series.median)

    def ratio(a: Series, b: Series) -> float:
        return b.median / a.median if a.median > 0 else float("nan")

    save_ratio = ratio(res.node_save, res.embedded_save)
    load_ratio = ratio(res.node_load, res.embedded_load)
    lora_ratio = ratio(res.lora_resave, res.lora_first)
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
        ["save_async's copy alone (ClientStaging.stage, warm memory, nothing else)",
         C.fmt_seconds(res.copy_alone.median), rate(res.nbytes, res.copy_alone),
         f"{ratio(res.node_save, res.copy_alone):.0%} of the node's sync save",
         res.copy_alone.text()],
        ["LoRA first save, embedded", C.fmt_seconds(res.lora_embedded_first.median),
         rate(res.lora_bytes, res.lora_embedded_first), "1.00x",
         res.lora_embedded_first.text()],
        ["LoRA re-save, embedded", C.fmt_seconds(res.lora_embedded_resave.median),
         rate(res.lora_bytes, res.lora_embedded_resave),
         f"{ratio(res.lora_embedded_resave, res.lora_embedded_first):.1f}x",
         res.lora_embedded_resave.text()],
    ]
    rows = [r for r in rows if r[1] not in ("", "nan")]

    def verdict(value: float, target: float) -> str:
        return "met" if value >= target else "NOT met"

    cold = ("with the page cache dropped first" if res.cold
            else "warm (no root to drop the page cache)")
    lines = [
        "### Snapshots through a node, and restores from the S3 mirror",
        "",
        f"Commands (one exclusive run per part): {command}.",
        "",
        machine,
        "",
        f"State dict: {C.fmt_gb(res.nbytes)} ({res.plan_text}); LoRA: "
        f"{C.fmt_gb(res.lora_bytes)} ({res.lora_text}), adapters "
        f"{C.fmt_gb(res.adapter_bytes)}. "
        f"One `isolane serve` on loopback, write group on the same disk as the embedded "
        f"store; loads {cold}, "
        "every page touched, every restore compared bit for bit. Medians of "
        f"{len(res.node_save.values)} rounds (peers alternate who goes first); ratio = "
        "peer time / this time.",
        "",
        C.markdown_table(["run", "median", "rate", "ratio", "runs (s)"], rows),
        "",
    ]
    if res.node_save.values:
        lines += [
            f"- save through a node: {save_ratio:.2f}x an embedded save (target 0.7x: "
            f"{verdict(save_ratio, 0.7)});",
            f"- load through a node: {load_ratio:.2f}x an embedded load (target 0.7x: "
            f"{verdict(load_ratio, 0.7)});",
            f"- save_async blocking: {node_async:.0%} of a sync save through the node, "
            f"{embedded_async:.0%} embedded (target 10 %: "
            f"{'met' if node_async <= 0.10 else 'NOT met'} / "
            f"{'met' if embedded_async <= 0.10 else 'NOT met'}); the call copies every "
            "tensor into warm staging memory (client memory for the node); the copy alone "
            "is measured below;",
        ]
    if res.lora_first.values:
        lines += [
            f"- LoRA re-save through a node: {lora_ratio:.1f}x faster than its first save "
            f"(target 10x: {verdict(lora_ratio, 10)}); with change_detection='version' "
            f"{ratio(res.lora_version, res.lora_first):.1f}x "
            f"({verdict(ratio(res.lora_version, res.lora_first), 10)});",
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
    copy_ratio = ratio(res.node_save, res.copy_alone)
    if res.copy_alone.values:
        lines.append(
            f"- the bound of save_async's blocking: copying the same bytes into warm "
            f"memory with nothing else running took {C.fmt_seconds(res.copy_alone.median)} s "
            f"({rate(res.nbytes, res.copy_alone)} GB/s, memory bandwidth on this machine), "
            f"{copy_ratio:.0%} of the node's sync save: a save_async that returns only once "
            f"the caller may change its tensors cannot block less than one copy of them; "
            f"the node's blocked time is {ratio(res.copy_alone, res.node_async):.2f}x that "
            "copy.")
    if res.node_stage_after.values and res.node_stage_in_call.values:
        inside = res.node_stage_in_call.median
        lines.append(
            f"- where the node's save_async blocks (timed on the caller's thread, "
            f"medians): its staging copy {C.fmt_seconds(inside)} s, the rest of the call "
            f"(checks, waiting for the previous upload, starting the upload thread) "
            f"{C.fmt_seconds(res.node_async.median - inside)} s; the same copy into the "
            f"same buffers, timed again right after the upload ended "
            f"{C.fmt_seconds(res.node_stage_after.median)} s, and the copy alone "
            f"{C.fmt_seconds(res.copy_alone.median)} s: the call's copy took "
            f"{inside / res.copy_alone.median:.2f}x the copy alone.")
        if node_async > 0.10:
            at_bound = copy_ratio > 0.10
            lines.append(
                f"- save_async through the node against its bound: it blocked "
                f"{ratio(res.copy_alone, res.node_async):.2f}x the copy alone, and the "
                f"copy alone is {copy_ratio:.0%} of the sync save, so 10 % is "
                + ("below one copy of the dict on this machine: out of reach of any "
                   "save_async that copies before it returns." if at_bound else
                   "above one copy: not at the bound yet."))
    elif res.node_stage_after.values:
        lines.append(
            f"- the node store's own staging copy into the same buffers, timed again right "
            f"after each upload ended (no `os.sync()` just before, as the rounds do before "
            f"each save_async): {C.fmt_seconds(res.node_stage_after.median)} s, against "
            f"the {C.fmt_seconds(res.node_async.median)} s the call blocked.")
    if res.lora_embedded_resave.values:
        lines.append(
            f"- the floor of the LoRA re-save: the embedded store's re-save of the same "
            f"dict (same writer, no node, no network) took "
            f"{C.fmt_seconds(res.lora_embedded_resave.median)} s "
            f"({ratio(res.lora_embedded_resave, res.lora_embedded_first):.1f}x its first "
            f"save); the node's took {C.fmt_seconds(res.lora_resave.median)} s, "
            f"{ratio(res.lora_embedded_resave, res.lora_resave):.2f}x the embedded one.")
    if res.mirror is not None:
        mirror_rows, mirror_lines = SM.report_lines(res.mirror)
        lines += ["", f"Restores from the S3 mirror: a {C.fmt_gb(res.mirror.nbytes)} snapshot "
                  f"({res.mirror.chunks} chunk objects) on SeaweedFS on loopback; ranged "
                  f"peers use {res.mirror.threads} threads / 8 MiB ranges; CPU = client + "
                  "weed CPU-s per GB (medians).", "",
                  C.markdown_table(["run", "median", "rate", "vs single stream",
                                    "CPU-s/GB client + weed", "runs (s)"], mirror_rows), ""]
        lines += [f"- {line}" for line in mirror_lines]
    lines += [f"- {note}" for note in res.notes]
    return "\n".join(lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--snapshots", action="store_true",
                        help="run the 'snapshots through a node' section instead")
    parser.add_argument("--gb", type=float, default=1.0,
                        help="--snapshots: size of the state dict (and of the LoRA base)")
    parser.add_argument("--lora-gb", type=float, default=3.0,
                        help="--snapshots: size of the LoRA base (bench_snapshot's plan: 3)")
    parser.add_argument("--mirror-gb", type=float, default=0.5,
                        help="--snapshots: size of the mirrored snapshot")
    parser.add_argument("--parts", default="node,lora,mirror",
                        help="--snapshots: which parts to run (node, lora, mirror); the "
                        "report holds every part stored in --snap-json")
    parser.add_argument("--snap-json", type=Path,
                        default=C.REPO_ROOT / ".bench" / "cluster-snapshots.json",
                        help="--snapshots: the parts' results (each run updates its parts)")


# Which SnapResults fields each part fills: a part's invocation stores them in the JSON
# file, the report is made from every part stored there (each part an exclusive run).
PART_FIELDS = {
    "node": ("nbytes", "plan_text", "cold", "embedded_save", "node_save", "embedded_load",
             "node_load", "embedded_async", "node_async", "embedded_load_cpu",
             "node_load_cpu", "copy_alone", "node_stage_in_call", "node_stage_after"),
    "lora": ("lora_bytes", "adapter_bytes", "lora_text", "lora_first", "lora_resave",
             "lora_version", "lora_embedded_first", "lora_embedded_resave"),
    "mirror": ("mirror",),
}


def _dump(res: SnapResults, part: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in PART_FIELDS[part]:
        value = getattr(res, name)
        if isinstance(value, Series):
            out[name] = value.values
        elif isinstance(value, SM.MirrorResults):
            out[name] = {"nbytes": value.nbytes, "chunks": value.chunks,
                         "threads": value.threads, "probes": value.probes,
                         "runs": {k: {"seconds": r.seconds, "cpu": r.cpu}
                                  for k, r in value.runs.items()}}
        else:
            out[name] = value
    return out


def _load(res: SnapResults, data: dict[str, Any]) -> None:
    for name, value in data.items():
        current = getattr(res, name)
        if isinstance(current, Series):
            setattr(res, name, Series(list(value)))
        elif name == "mirror":
            res.mirror = SM.MirrorResults(
                nbytes=value["nbytes"], chunks=value["chunks"], threads=value["threads"],
                runs={k: SM.MirrorRun(r["seconds"], [tuple(c) for c in r["cpu"]])
                      for k, r in value["runs"].items()},
                probes=value.get("probes") or {"open": [], "into": [], "hash": []})
        elif name.endswith("_cpu"):
            setattr(res, name, [tuple(c) for c in value])
        else:
            setattr(res, name, value)


def main(args: argparse.Namespace) -> int:
    import isolane

    repeats = args.repeats or (1 if args.quick else 5)
    args.repeats = repeats
    args.dir = args.dir.resolve()
    if args.quick:
        args.gb, args.mirror_gb = min(args.gb, 0.05), min(args.mirror_gb, 0.05)
        args.lora_gb = min(args.lora_gb, 0.05)
    res = SnapResults()
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = set(parts) - set(PART_FIELDS)
    if unknown:
        raise SystemExit(f"--parts: unknown {sorted(unknown)}; use {sorted(PART_FIELDS)}")
    stored: dict[str, Any] = {}
    if not args.quick and args.snap_json.exists():
        stored = json.loads(args.snap_json.read_text())
    for part in parts:
        {"node": run_node, "lora": run_lora_part,
         "mirror": lambda a, r: setattr(r, "mirror", SM.run_mirror(a, log, _same,
                                                                   _timed_load))}[part](
            args, res)
        stored[part] = {"command": C.command_line(), "at": C.now_text(),
                        "data": _dump(res, part)}
    if not args.quick:
        args.snap_json.parent.mkdir(parents=True, exist_ok=True)
        args.snap_json.write_text(json.dumps(stored))
    for part in PART_FIELDS:
        if part in stored:
            _load(res, stored[part]["data"])
    commands = [f"`{stored[p]['command']}` ({stored[p]['at']})" for p in PART_FIELDS
                if p in stored]
    packages = {"isolane": isolane.__version__}
    text = report(res, "; ".join(commands), C.machine_description(args.dir, packages))
    C.print_report(text, args.out, "cluster-snapshots")
    return 0
