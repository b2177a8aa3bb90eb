"""Snapshots through a storage node, and restores from the S3 mirror (a section of
``bench_cluster.py``: ``python benchmarks/bench_cluster.py --snapshots``).

Peers side by side, round by round, on one disk, every result checked bit for bit:

- **save / load through a node**: ``SnapshotStore(folder).save`` / ``.load`` embedded,
  against ``RemoteSnapshotStore(node).save`` / ``.load`` through one ``isolane serve``
  process on loopback whose write group is another folder of the same disk (isolane's
  defaults); the same ``--gb`` dict (bench_snapshot's ``mixed`` plan), page cache
  dropped before each load (root) and every page of the result touched;
- **save_async**: the time until ``save_async`` returns against the sync save, embedded
  and through the node, after one warm-up async save (steady state); its bound: the
  copy alone (``ClientStaging.stage`` of the same dict into warm memory);
- **LoRA re-save through a node**: a frozen bf16 base plus fp32 adapters, saved through
  the node once in full and again after the adapters changed in place (the unchanged
  chunks go as hashes, linked on the node); its floor: the embedded store's re-save;
- **restore from the S3 mirror**: ``_snap_mirror.py``.

Each part (``--parts``) is an exclusive run; its results are kept in ``--snap-json`` and
the report (and, with ``--out docs/BENCHMARKS.md``, the rows) is made from every part
kept there.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _common as C
import _results
import _snap_mirror as SM
import _statedicts as S
import torch

BENCH = "cluster_snapshots"  # benchmarks/results/cluster_snapshots.json
PARTS = ("node", "lora", "mirror")
Runs = dict[str, list[float]]
# A save with no parent (the node's names have none unless one is given)
FRESH: dict[str, dict[str, Any]] = {"embedded": {"parent": False}, "node": {}}


def log(message: str) -> None:
    print(f"[snapshots] {message}", flush=True)


def _node(folder: Path) -> Any:
    from tests.support.node import NodeProcess, write_node_config

    config = write_node_config(folder, device_groups={
        "checkpoint": {"role": "write", "devices": [str(folder / "ckpt")]}}, snapshot={})
    return NodeProcess(config, token="bench").start()


def _timed(runs: Runs, name: str, fn: Callable[[], Any]) -> Any:
    t0 = time.perf_counter()
    value = fn()
    runs.setdefault(name, []).append(time.perf_counter() - t0)
    log(f"{name}: {runs[name][-1]:.3f} s")
    return value


def _touched(state: Any) -> Any:
    S.touch_pages(state)
    return state


def run_node(args: argparse.Namespace) -> dict[str, Any]:
    from isolane.client.snapshot_staging import ClientStaging
    from isolane.client.snapshot_store import RemoteSnapshotStore
    from isolane.snapshot import SnapshotStore

    state = S.build_state_dict(S.plan_mixed(1.0, total_bytes=int(args.gb * 1e9)))
    runs: Runs = {}
    cold = C.drop_page_cache()
    base = args.dir / "snapshots"
    shutil.rmtree(base, ignore_errors=True)
    node = _node(base / "node")
    try:
        remote = RemoteSnapshotStore(node.url, token="bench")
        # Steady state, as a training loop saving every N steps: one save_async first
        # warms the client's staging memory (fresh pages fault).
        remote.save_async(state, "warm-up").result()
        remote.delete("warm-up")
        for rnd in range(args.repeats):
            embedded = SnapshotStore(str(base / f"embedded-{rnd}"))
            embedded.save_async(state, "warm-up", parent=False).result()
            embedded.delete("warm-up")
            stores = {"embedded": embedded, "node": remote}
            order = ["embedded", "node"] if rnd % 2 == 0 else ["node", "embedded"]
            for who in order:
                _timed(runs, f"{who} save", lambda s=stores[who], n=f"r{rnd}", o=FRESH[who]:
                       s.save(state, n, **o))
            for who in order:
                if cold:
                    C.drop_page_cache()
                back = _timed(runs, f"{who} load", lambda s=stores[who], n=f"r{rnd}":
                              _touched(s.load(n)))
                S.check_equal(state, back)
                del back
            probe = ClientStaging()  # the copy alone, into warm memory (the bound)
            probe.stage(state)
            _timed(runs, "copy alone", lambda p=probe: p.stage(state))
            probe.clear()
            for who in order:
                os.sync()
                handle = _timed(runs, f"{who} save_async", lambda s=stores[who],
                                n=f"r{rnd}-async", o=FRESH[who]: s.save_async(state, n, **o))
                handle.result()
                S.check_equal(state, stores[who].load(f"r{rnd}-async"))
                stores[who].delete(f"r{rnd}-async")
            remote.delete(f"r{rnd}")  # no parent for the next round's save
            embedded.close()
            shutil.rmtree(base / f"embedded-{rnd}")
        remote.close()
    finally:
        node.stop()
        shutil.rmtree(base, ignore_errors=True)
    return {"nbytes": S.state_bytes(state), "cold": cold, "runs": runs}


def run_lora(args: argparse.Namespace) -> dict[str, Any]:
    from isolane.client.snapshot_store import RemoteSnapshotStore
    from isolane.snapshot import SnapshotStore

    plan = S.plan_lora(1.0, base_bytes=int(args.lora_gb * 1e9))
    state = S.build_state_dict(plan)
    adapter = [S.get_path(state, p) for p in S.adapter_paths(plan)]
    runs: Runs = {}
    base = args.dir / "snapshots-lora"
    shutil.rmtree(base, ignore_errors=True)
    node = _node(base / "node")
    try:
        remote = RemoteSnapshotStore(node.url, token="bench")
        for rnd in range(args.repeats):
            embedded = SnapshotStore(str(base / f"embedded-{rnd}"))
            stores = {"embedded": embedded, "node": remote}
            for who in ["embedded", "node"] if rnd % 2 == 0 else ["node", "embedded"]:
                store = stores[who]
                _timed(runs, f"{who} LoRA first save", lambda s=store, n=f"l{rnd}-0",
                       o=FRESH[who]: s.save(state, n, **o))
                with torch.no_grad():
                    for t in adapter:
                        t.add_(0.5)  # the adapters train; the base stays frozen
                _timed(runs, f"{who} LoRA re-save",
                       lambda s=store, n=f"l{rnd}-1": s.save(state, n))
                S.check_equal(state, store.load(f"l{rnd}-1"))
                for name in (f"l{rnd}-0", f"l{rnd}-1"):
                    store.delete(name)
            embedded.close()
        remote.close()
    finally:
        node.stop()
        shutil.rmtree(base, ignore_errors=True)
    return {"lora_bytes": S.state_bytes(state), "runs": runs}


def _median(data: dict[str, Any], name: str) -> float:
    values = data["runs"].get(name)
    return statistics.median(values) if values else float("nan")


def report(stored: dict[str, Any], machine: str) -> str:
    lines = ["### Snapshots through a node, and restores from the S3 mirror", "",
             "Commands (one exclusive run per part): " + "; ".join(
                 f"`{stored[p]['command']}` ({stored[p]['at']})" for p in stored) + ".",
             "", machine, "",
             "One `isolane serve` on loopback, write group on the same disk as the embedded "
             "store; every restore compared bit for bit; peers alternate who goes first.",
             ""]
    rows, bullets = [], []
    for part in ("node", "lora"):
        if part in stored:
            data = stored[part]["data"]
            size = data.get("nbytes") or data.get("lora_bytes")
            rows += [[name, C.fmt_seconds(_median(data, name)),
                      C.fmt_rate(size, _median(data, name)),
                      ", ".join(f"{v:.3f}" for v in values)]
                     for name, values in data["runs"].items()]
    if "node" in stored:
        d = stored["node"]["data"]
        node_save = _median(d, "node save")
        bullets += [
            f"save through a node: {_median(d, 'embedded save') / node_save:.2f}x an "
            "embedded save (target 0.7x);",
            f"load through a node: {_median(d, 'embedded load') / _median(d, 'node load'):.2f}x "
            "an embedded load (target 0.7x)"
            + ("" if d["cold"] else ", warm: no root to drop the page cache") + ";",
            f"the bound of save_async's blocking: copying the same bytes into warm memory "
            f"with nothing else running took {C.fmt_seconds(_median(d, 'copy alone'))} s, "
            f"{_median(d, 'copy alone') / node_save:.0%} of the node's sync save; the "
            f"node's save_async blocked {_median(d, 'node save_async') / node_save:.0%} "
            "(target 10 %)."]
    if "lora" in stored:
        d = stored["lora"]["data"]
        bullets.append(
            f"the floor of the LoRA re-save: the embedded store's re-save of the same dict "
            f"took {C.fmt_seconds(_median(d, 'embedded LoRA re-save'))} s; the node's "
            f"{C.fmt_seconds(_median(d, 'node LoRA re-save'))} s, "
            f"{_median(d, 'node LoRA first save') / _median(d, 'node LoRA re-save'):.1f}x "
            "faster than its first save (target 10x).")
    lines += [C.markdown_table(["run", "median s", "GB/s", "runs (s)"], rows), ""]
    if "mirror" in stored:
        mirror_rows, mirror_lines = SM.report_lines(stored["mirror"]["data"])
        lines += [C.markdown_table(["run", "median", "rate", "vs single stream",
                                    "CPU-s/GB client + weed", "runs (s)"], mirror_rows), ""]
        bullets += mirror_lines
    return "\n".join(lines + [f"- {b}" for b in bullets]) + "\n"


def headline_rows(stored: dict[str, Any], machine: str) -> list[_results.Result]:
    rows: list[_results.Result] = []

    def add(part: str, measure: str, value: float, peer: str, peer_value: float,
            ratio: float, target: str, met: bool, **extra: Any) -> None:
        rows.append(_results.Result(
            area="Checkpoints", measure=measure, value=round(value, 3), unit="s",
            machine=machine, date=stored[part]["at"], command=stored[part]["command"],
            peer=peer, peer_value=round(peer_value, 3), target=target, met=met,
            ratio=ratio, **extra))

    if "node" in stored:
        d = stored["node"]["data"]
        gb = d["nbytes"] / 1e9
        for what, note in (("save", "loopback"), ("load", "cold page cache")):
            node, embedded = _median(d, f"node {what}"), _median(d, f"embedded {what}")
            add("node", f"{what} through a node ({gb:.2f} GB, {note})", node,
                f"embedded {what}", embedded, round(embedded / node, 2), "≥ 0.7x",
                embedded / node >= 0.7)
        blocked, sync = _median(d, "node save_async"), _median(d, "node save")
        add("node", "save_async through a node: time until the call returns / sync save",
            blocked, "its sync save through the node", sync, round(blocked / sync * 100),
            "≤ 10 %", blocked / sync <= 0.10, ratio_unit="%")
    if "lora" in stored:
        d = stored["lora"]["data"]
        again, first = _median(d, "node LoRA re-save"), _median(d, "node LoRA first save")
        add("lora", "LoRA re-save through a node vs its first save", again,
            "first save through the node", first, round(first / again, 2), "≥ 10x",
            first / again >= 10)
    if "mirror" in stored:
        s = SM.summary(d := stored["mirror"]["data"])
        iso = s["speedup"]["isolane"]
        add("mirror", f"restore from the S3 mirror ({s['gb']:.2f} GB, SeaweedFS on loopback)",
            s["median"]["isolane"], "s3fs, one stream", s["median"]["s3fs, one stream"],
            round(iso, 2), "≥ 3x", iso >= 3, why=None if iso >= 3 else (
                f"the S3 server itself takes {s['weed']:.2f} CPU-s a GB on the {s['cores']} "
                f"shared cores, so no client passes {s['bound']:.1f}x here; the fastest "
                f"measured (raw ranged GETs) reached {s['speedup']['raw ranged GETs']:.2f}x"))
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--snapshots", action="store_true",
                        help="run the 'snapshots through a node' section instead")
    parser.add_argument("--gb", type=float, default=1.0,
                        help="--snapshots: size of the state dict")
    parser.add_argument("--lora-gb", type=float, default=3.0,
                        help="--snapshots: size of the LoRA base (bench_snapshot's plan: 3)")
    parser.add_argument("--mirror-gb", type=float, default=0.5,
                        help="--snapshots: size of the mirrored snapshot")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help="--snapshots: which parts to run (node, lora, mirror); the "
                        "report holds every part stored in --snap-json")
    parser.add_argument("--snap-json", type=Path,
                        default=C.REPO_ROOT / ".bench" / "cluster-snapshots.json",
                        help="--snapshots: the parts' results (each run updates its parts)")


def main(args: argparse.Namespace) -> int:
    import isolane

    args.repeats = args.repeats or (1 if args.quick else 5)
    args.dir = args.dir.resolve()
    if args.quick:
        args.gb, args.mirror_gb = min(args.gb, 0.05), min(args.mirror_gb, 0.05)
        args.lora_gb = min(args.lora_gb, 0.05)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if unknown := set(parts) - set(PARTS):
        raise SystemExit(f"--parts: unknown {sorted(unknown)}; use {', '.join(PARTS)}")
    stored: dict[str, Any] = {}
    if not args.quick and args.snap_json.exists():
        stored = json.loads(args.snap_json.read_text())
    runners = {"node": run_node, "lora": run_lora,
               "mirror": lambda a: SM.run_mirror(a, log)}
    for part in parts:
        stored[part] = {"command": C.command_line(), "at": C.now_text(),
                        "data": runners[part](args)}
    if not args.quick:
        args.snap_json.parent.mkdir(parents=True, exist_ok=True)
        args.snap_json.write_text(json.dumps(stored))
    stored = {p: stored[p] for p in PARTS if p in stored}
    machine = C.machine_description(args.dir, {"isolane": isolane.__version__})
    rows = headline_rows(stored, machine)
    C.print_report(report(stored, machine) + "\n" + _results.rows_markdown(rows), args.out,
                   "cluster-snapshots")
    if args.out and _results.is_page(args.out) and rows:
        _results.write_results(BENCH, rows)
    return 0
