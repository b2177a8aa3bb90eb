"""Read/write isolation across processes: KV read latency while checkpoints are saved.

An inference workload (8 threads of ``KVPool.get_blocks([key])``, 64 KiB blocks,
Zipf(1.0) keys over the corpus, no memory tier, O_DIRECT reads: every call reads the
device) runs beside a checkpoint save loop (a fp32 state dict, full writes) on one
host config, in three layouts:

  (a) the save loop in the same process as the reads (one shared scheduler);
  (b) the save loop in another process;
  (c) the save loop as a 2-rank torchrun job (gloo; both ranks write their half of
      one distributed snapshot), beside the reader process;

each with: no isolation (one shared FIFO pool, no governor), per-process lanes (the
design before the host plane: lanes and a governor per process), the host lane plane
(lanes, one host governor over every process), and an oracle sweep of static write
caps (lanes, no governor; the cap is for the host: each rank of (c) gets half). The
oracle is the highest cap whose read p99 meets the SLO; the SLO is ``--slo-factor``
x the idle p99 of that layout's run. Every run is fresh processes started together;
medians over rounds, rounds interleaved. Each layout is one invocation (a few
minutes) whose results are kept in ``--dir``; ``--report`` renders the markdown
section and the CDF plot from every layout measured so far.

    python benchmarks/bench_isolation.py --layout a   # then b, then c
    python benchmarks/bench_isolation.py --report --out docs/BENCHMARKS.md \\
        --plot docs/isolation_cdf.png
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import _common as C
import _quick
import numpy as np

C.ensure_repo_importable()

from isolane.lanes.control import (  # noqa: E402
    GROW_GAIN,
    HOLD_BELOW,
    MAX_MEASURED_GROWTH,
)

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_iso_worker.py"
BLOCK = 64 << 10
MB = 1e6
LAYOUTS = {"a": "(a) same process", "b": "(b) another process",
           "c": "(c) 2-rank torchrun job"}
MODES: dict[str, dict[str, Any]] = {
    "none": {"label": "no isolation", "isolation": False, "governor": False,
             "host_plane": False},
    "lanes": {"label": "per-process lanes", "isolation": True, "governor": True,
              "host_plane": False},
    # The host plane under the latency-target law: the targets' row.
    "plane": {"label": "host lane plane", "isolation": True, "governor": True,
              "host_plane": True},
}
# Rows that judge the oracle target (the governor and the static caps) get --repeats
# rounds; the others (idle, solo, no isolation, per-process lanes) --side-repeats.
SIDE_ROWS = {"idle", "solo", "none", "lanes"}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- configs and runs --------------------------------------------------------------------
def config_dict(root: Path, kv_dir: Path, *, slo_ms: float, mode: dict[str, Any],
                cap_bytes: float | None = None) -> dict[str, Any]:
    qos: dict[str, Any] = {"read_p99_slo_ms": slo_ms, "host_plane": mode["host_plane"],
                           "governor": mode["governor"]}
    if cap_bytes is not None:
        qos["write_bandwidth_max"] = int(cap_bytes)
        qos["write_bandwidth_min"] = int(min(100 << 20, cap_bytes))
    return {"home": str(root), "qos": qos, "device_groups": {
        "ckpt": {"role": "write", "devices": [str(root / "ckpt")]},
        "kv": {"role": "read", "devices": [str(kv_dir)], "threads": 8}}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def run(args: argparse.Namespace, layout: str, *, kv_dir: Path, reads: bool, saves: bool,
        slo_ms: float, mode: dict[str, Any], cap_mb: float | None, seed: int
        ) -> dict[str, Any]:
    """One run: fresh processes, started together; returns latencies and save GB/s."""
    root = args.dir
    run_dir = root / "runs" / f"{layout}-{time.monotonic_ns()}"
    run_dir.mkdir(parents=True)
    world = 2 if layout == "c" else 1
    cap = None if cap_mb is None else cap_mb * MB / world
    spec = {"config": config_dict(root, kv_dir, slo_ms=slo_ms, mode=mode, cap_bytes=cap),
            "mode": mode, "blocks": args.blocks, "seconds": args.duration, "seed": seed,
            "state_bytes": int(args.state_gb * C.GB)}
    # The settled limit a run remembers beside the plane (lanes/memory.py) warm-starts
    # the next governed run.
    planes = root / "planes" / "current"
    env = {**os.environ, "ISOLANE_PLANE_DIR": str(planes),
           "PYTHONPATH": str(C.REPO_ROOT)}
    env.pop("WORLD_SIZE", None)
    procs: list[subprocess.Popen[bytes]] = []
    expected: list[str] = []

    def spawn(cmd: list[str], names: list[str]) -> None:
        procs.append(subprocess.Popen(cmd, env=env, cwd=C.REPO_ROOT))
        expected.extend(names)

    base = [sys.executable, str(WORKER)]
    if layout == "a" and reads and saves:
        spawn([*base, "both", str(run_dir), "both", json.dumps(spec)], ["both"])
    else:
        if reads:
            spawn([*base, "reader", str(run_dir), "reader", json.dumps(spec)], ["reader"])
        if saves and layout == "c":
            spawn([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                   "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                   str(WORKER), "saver", str(run_dir), "saver", json.dumps(spec)],
                  ["saver-r0", "saver-r1"])
        elif saves:
            spawn([*base, "saver", str(run_dir), "saver", json.dumps(spec)], ["saver"])
    try:
        deadline = time.monotonic() + 240
        while not all((run_dir / f"{n}.ready").exists() for n in expected):
            if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
                raise RuntimeError(f"a worker of {run_dir.name} failed to start")
            time.sleep(0.01)
        # Saves and reads begin at once; latencies and bytes count from the start,
        # after the warm-up (the steady state, not each fresh process's first cut).
        # Every run with saves gets the same window (the governed warm-up): the save
        # loop's phases (a save's end and commit, the next one's staging, deleting the
        # one before) must fall alike into the static caps' and the governor's windows.
        warmup = args.governed_warmup if saves else args.warmup
        (run_dir / "start.tmp").write_text(repr(time.monotonic() + 0.3 + warmup))
        os.replace(run_dir / "start.tmp", run_dir / "start")
        for proc in procs:
            if proc.wait(timeout=args.duration + 240) != 0:
                raise RuntimeError(f"a worker of {run_dir.name} exited {proc.returncode}")
        results = {n: json.loads((run_dir / f"{n}.json").read_text()) for n in expected}
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        shutil.rmtree(run_dir, ignore_errors=True)
    lat = [x for r in results.values() for x in r.get("latencies_us", [])]
    lane = [x for r in results.values() for x in r.get("lane_latencies_us", [])]
    saver = results.get("both") or results.get("saver") or results.get("saver-r0") or {}
    # Bytes the write lanes moved inside the run (every rank's), not whole saves: a
    # 1.6 GB save under a low cap takes longer than a run.
    written = sum(r.get("written_bytes", 0) for n, r in results.items() if n != "reader")
    gbps = written / args.duration / C.GB if saves and saver else None
    series = saver.get("rate_series") or []
    rates = [math.inf if r is None else r for r in series]
    cpu = [r["cpu_s"] for n, r in results.items() if n != "reader" and "cpu_s" in r]
    return {"latencies_us": lat, "lane_latencies_us": lane, "save_gbps": gbps,
            "saves": saver.get("saves"),
            "saver_cpu_s": sum(cpu) if cpu else None, "written_bytes": written,
            "rate_median_mb": statistics.median(rates) / MB if rates else None,
            "rate_series_mb": [None if r is None else r / MB for r in series],
            "warm_start_mb": None if saver.get("warm_start") is None
            else saver["warm_start"] / MB,
            "decisions": saver.get("decisions", [])}


def pct(latencies: list[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(latencies), q)) if latencies else None


def median(values: list[float | None]) -> float | None:
    real = [v for v in values if v is not None]
    return statistics.median(real) if real else None


def fill_corpus(root: Path, kv_dir: Path, blocks: int) -> None:
    from isolane.config import config_from_dict
    from isolane.kvpool.pool import KVPool

    sys.path.insert(0, str(HERE))
    from _iso_worker import block_key
    from _kv_bytes import BYTE_BLOCKS, fix_layout

    config = config_from_dict(config_dict(root, kv_dir, slo_ms=5.0, mode=MODES["lanes"]))
    with KVPool(config, namespace="bench", memory_budget=0, **BYTE_BLOCKS) as pool:
        if sum(len(lg) for lg in pool.logs) >= blocks:
            return
        fix_layout(pool, BLOCK)
        rng = np.random.default_rng(0)
        for start in range(0, blocks, 256):
            n = min(256, blocks - start)
            data = rng.integers(0, 255, size=(n, BLOCK), dtype=np.uint8)
            pool.put_blocks([block_key(start + j) for j in range(n)], list(data))
    C.fsync_tree(kv_dir)


# -- one layout ----------------------------------------------------------------------------
def measure_layout(args: argparse.Namespace, layout: str) -> dict[str, Any]:
    kv_dir = args.dir / "kv"
    if not args.add:  # an --add run reads the corpus its layout's first run filled
        fill_corpus(args.dir, kv_dir, args.blocks)
    caps = [float(c) for c in args.caps.split(",") if c]
    lanes = MODES["lanes"]
    rows: dict[str, list[dict[str, Any]]] = {"idle": [], "solo": []}
    kept: dict[str, Any] | None = None
    if args.add:  # more rows for a kept layout: its idle runs and SLO
        kept = json.loads((args.dir / f"layout-{layout}.json").read_text())
        rows = kept["rows"]
        if args.replace:  # re-measure these rows (e.g. after a change of the law)
            for key in args.add.split(","):
                rows.pop(key, None)
                if key == "plane":  # ... from a cold start, as in a layout's first run
                    for memory in (args.dir / "planes").rglob("*.plane.memory"):
                        memory.unlink()
        # --add "cap X" may extend the kept sweep (e.g. higher caps until one fails)
        added = {float(k[4:]) for k in args.add.split(",") if k.startswith("cap ")}
        caps = kept["caps_mb"] = sorted(set(kept["caps_mb"]) | added)
    if not kept:  # each layout's first governed run starts cold; its later runs warm,
        # from the host limit the previous one settled at (lanes/memory.py)
        for memory in (args.dir / "planes").rglob("*.plane.memory"):
            memory.unlink()
    for r in range(0 if kept else args.idle_repeats):
        rows["idle"].append(run(args, layout, kv_dir=kv_dir, reads=True, saves=False,
                                slo_ms=5.0, mode=lanes, cap_mb=None, seed=r))
    idle_p99 = median([pct(x["latencies_us"], 99) for x in rows["idle"]])
    if idle_p99 is None:
        raise RuntimeError("the idle runs recorded no reads")
    slo_ms = idle_p99 * args.slo_factor / 1e3
    lane_idle = median([pct(x["lane_latencies_us"], 99) for x in rows["idle"]])
    gov_slo_ms = slo_ms
    if args.governor_slo == "lane" and lane_idle is not None:
        # The same margin over idle, in what the governor measures (the read lane's
        # submit-to-completion, without the callers' CPU around it).
        gov_slo_ms = (lane_idle + (args.slo_factor - 1) * idle_p99) / 1e3
    log(f"{layout}: idle p99 {idle_p99:.0f} us (lane {lane_idle or 0:.0f} us) -> SLO "
        f"{slo_ms:.2f} ms, governor's {gov_slo_ms:.2f} ms")
    plan: list[tuple[str, dict[str, Any], float | None]] = [
        ("solo", {**lanes, "governor": False}, None)]
    plan += [(key, mode, None) for key, mode in MODES.items()]
    plan += [(f"cap {c:g}", {**lanes, "governor": False}, c) for c in caps]
    if args.quick and layout != "a":  # the other modes are layout a's, in seconds
        plan = [step for step in plan if step[0] in ("solo", "plane")]
    if args.skip:  # rows a later --add invocation measures (each run under 5 minutes)
        plan = [step for step in plan if step[0] not in args.skip.split(",")]
    if args.rows or args.add:  # a trial of some rows, or rows added to a kept layout
        named = (args.rows or args.add).split(",")
        plan = [step for step in plan if step[0] in named]
    for r in range(args.repeats):
        for key, mode, cap in plan:
            if key in SIDE_ROWS and r >= args.side_repeats:
                continue
            res = run(args, layout, kv_dir=kv_dir, reads=key != "solo", saves=True,
                      slo_ms=gov_slo_ms, mode=mode, cap_mb=cap, seed=r)
            rows.setdefault(key, []).append(res)
            log(f"{layout} round {r} {key}: p99 {pct(res['latencies_us'], 99) or 0:.0f} us, "
                f"save {res['save_gbps'] or 0:.2f} GB/s")
    if kept is not None:
        kept["skipped"] = [k for k in kept.get("skipped", []) if k not in rows]
        kept.setdefault("extra_commands", []).append(C.command_line())
        # which command measured each row (1-based into extra_commands; absent: the
        # first), so the report can say when a ratio mixes invocations
        sources = kept.setdefault("row_sources", {})
        for key, _mode, _cap in plan:
            sources[key] = len(kept["extra_commands"])
        kept.setdefault("extra_commits", []).append(git_commit())
        return kept
    data = {"layout": layout, "save_metric": "write-bucket bytes", "slo_ms": slo_ms,
            "governor_slo_ms": gov_slo_ms, "lane_idle_p99_us": lane_idle,
            "governor_slo": args.governor_slo,
            "idle_p99_us": idle_p99, "caps_mb": caps,
            "rows": rows, "command": C.command_line(), "date": C.now_text(),
            # rows left for a later --add: the report names those never added (session
            # 7's (c) skipped none,lanes and its --add named only two caps)
            "skipped": [k for k in args.skip.split(",") if k and k not in rows],
            "duration_s": args.duration, "warmup_s": 0.3 + args.warmup,
            "governed_warmup_s": 0.3 + args.governed_warmup,
            "repeats": args.repeats, "side_repeats": args.side_repeats,
            "blocks": args.blocks,
            "state_gb": args.state_gb, "slo_factor": args.slo_factor,
            "machine": C.machine_description(args.dir, {"torch": torch_version()}),
            "commit": git_commit()}
    if args.tmpfs and layout == "b":
        oracle = oracle_of(data, summarize(data))
        tmpfs_rows(args, layout, rows, gov_slo_ms, float(oracle[4:]) if oracle else None)
    return data


def tmpfs_rows(args: argparse.Namespace, layout: str, rows: dict[str, list[dict[str, Any]]],
               slo_ms: float, cap_mb: float | None = None) -> None:
    """The KV group on a tmpfs: reads alone, with the save loop under the plane, and
    (``cap_mb``: the layout's oracle cap) with the saves at that static cap: whether
    the CPU the saves take at the rate the SLO allows still moves the read tail."""
    tmpfs = mount_tmpfs(int(args.blocks * BLOCK * 1.3) + (256 << 20))
    if tmpfs is None:
        return
    try:
        fill_corpus(args.dir, tmpfs / "kv", args.blocks)
        rows["tmpfs idle"], rows["tmpfs plane"] = [], []
        if cap_mb is not None:
            rows["tmpfs cap"] = []
        for r in range(args.side_repeats):
            if cap_mb is not None:
                rows["tmpfs cap"].append(run(
                    args, layout, kv_dir=tmpfs / "kv", reads=True, saves=True,
                    slo_ms=slo_ms, mode={**MODES["lanes"], "governor": False},
                    cap_mb=cap_mb, seed=r))
            rows["tmpfs idle"].append(run(
                args, layout, kv_dir=tmpfs / "kv", reads=True, saves=False,
                slo_ms=slo_ms, mode=MODES["lanes"], cap_mb=None, seed=r))
            rows["tmpfs plane"].append(run(
                args, layout, kv_dir=tmpfs / "kv", reads=True, saves=True,
                slo_ms=slo_ms, mode=MODES["plane"], cap_mb=None, seed=r))
            log(f"tmpfs round {r}: idle p99 "
                f"{pct(rows['tmpfs idle'][-1]['latencies_us'], 99) or 0:.0f} us, with saves "
                f"{pct(rows['tmpfs plane'][-1]['latencies_us'], 99) or 0:.0f} us")
    finally:
        subprocess.run(["umount", str(tmpfs)], check=False)


def mount_tmpfs(size_bytes: int) -> Path | None:
    path = Path("/mnt/isolane-bench-kv")
    path.mkdir(parents=True, exist_ok=True)
    if subprocess.run(["mountpoint", "-q", str(path)], check=False).returncode == 0:
        return path
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs",
                           str(path)], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        log(f"no tmpfs ({proc.stderr.strip()}): tmpfs rows skipped")
        return None
    return path


def torch_version() -> str:
    from importlib.metadata import version

    return version("torch")


def git_commit() -> str:
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, cwd=C.REPO_ROOT, check=False)
    return proc.stdout.strip() or "unknown"


# -- report --------------------------------------------------------------------------------
def fmt_us(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def fmt_rate(mb: float | None) -> str:
    if mb is None:
        return "-"
    return "unlimited" if math.isinf(mb) else f"{mb:.0f}"


ISSUE_STATE_GB = 1.6  # the save loop's dict in issue 10's text
FLOOR_MB = (100 << 20) / MB  # qos.write_bandwidth_min's default: the plane rows' floor


def governor_story(runs: list[dict[str, Any]]) -> str | None:
    """What the host governor did in the runs of a row (from its host write rate,
    sampled every 0.1 s, and the decisions it kept): one sentence."""
    series = [x for r in runs for x in r.get("rate_series_mb") or []]
    if not series:
        return None
    n = len(series)
    unlimited = sum(1 for x in series if x is None) / n
    limited = sorted(x for x in series if x is not None)
    at_floor = sum(1 for x in limited if x <= FLOOR_MB * 1.02) / n
    downs = ups = 0
    for r in runs:
        seq = [math.inf if x is None else x for x in r.get("rate_series_mb") or []]
        downs += sum(1 for a, b in itertools.pairwise(seq) if b < a)
        ups += sum(1 for a, b in itertools.pairwise(seq) if b > a)
    text = (f"over {n / 10:.0f} s of {len(runs)} runs the host write rate was unlimited "
            f"{unlimited:.0%} of the time and at the floor ({FLOOR_MB:.0f} MB/s) "
            f"{at_floor:.0%}")
    if limited:
        q = lambda f: limited[min(len(limited) - 1, int(f * len(limited)))]  # noqa: E731
        text += (f"; when limited: p10 {q(0.1):.0f}, median {q(0.5):.0f}, p90 "
                 f"{q(0.9):.0f} MB/s")
    text += f"; it changed {downs} times down and {ups} times up"
    warm = [r["warm_start_mb"] for r in runs if r.get("warm_start_mb")]
    if any("warm_start_mb" in r for r in runs):
        text += (f"; {len(warm)} of {len(runs)} runs started from the last settled host "
                 "limit remembered beside the plane"
                 + (f" ({', '.join(f'{x:.0f}' for x in warm)} MB/s)" if warm else "")
                 + (", the others from unlimited" if len(warm) < len(runs) else ""))
    reasons = [d.get("reason", "") for r in runs for d in r.get("decisions") or []]
    cuts = [x for x in reasons if x.startswith("cut")]
    grows = [x for x in reasons if x.startswith("increase")]
    if reasons:
        text += (f" (of its last kept decisions {len(cuts)} cuts, {len(grows)} increases"
                 + (f"; e.g. \"{cuts[-1]}\"" if cuts else "")
                 + (f", \"{grows[-1]}\"" if grows else "") + ")")
    return text


def rounds_within(data: dict[str, Any], row: dict[str, Any]) -> str:
    """How many of a row's rounds had their p99 within the SLO: "3 of 5"."""
    p99s = [x for x in row.get("p99s") or [] if x is not None]
    ok = sum(1 for x in p99s if x <= data["slo_ms"] * 1e3)
    return f"{ok} of {len(p99s)}"


def floor_story(data: dict[str, Any], runs: list[dict[str, Any]]) -> str | None:
    """The read-lane p99s the host governor judged while at (or within 30 % of) the
    floor, as a share of its SLO: whether the tail still moved with the write rate."""
    slo = data.get("governor_slo_ms")
    near = [float(d["p99_ms"]) / slo for r in runs for d in r.get("decisions") or []
            if slo and isinstance(d.get("p99_ms"), int | float)
            and isinstance(d.get("old"), int | float) and d["old"] <= 1.3 * (100 << 20)]
    if not near:
        return None
    near.sort()
    slow = HOLD_BELOW - 0.1 / GROW_GAIN  # over this, a growth step is under 10 %
    held = sum(1 for x in near if x >= slow)
    mid = statistics.median(near)
    return (f"at or near the floor ({FLOOR_MB:.0f}-{1.3 * FLOOR_MB:.0f} MB/s) the "
            f"read-lane p99s it judged were {near[0]:.2f}-{near[-1]:.2f}x its SLO "
            f"(median {mid:.2f}x; {held} of {len(near)} at or over {slow:.2f}x, where a "
            f"growth step ({GROW_GAIN:g} x the distance under {HOLD_BELOW:g}x, "
            f"{MAX_MEASURED_GROWTH:.0%} at most) is under 10 %)"
            + (": even at the floor the read tail sits near the hold band, so the law "
               "climbs back only in small steps" if mid >= slow else ""))


def within_slo(data: dict[str, Any], row: dict[str, Any]) -> bool:
    return row.get("p99") is not None and row["p99"] <= data["slo_ms"] * 1e3


def judged_p99s(runs: list[dict[str, Any]]) -> list[float]:
    """The p99s (ms) the host governor's kept decisions were taken on while the rate
    was limited (not the first cut from unlimited)."""
    return sorted(float(d["p99_ms"]) for r in runs for d in r.get("decisions") or []
                  if isinstance(d.get("p99_ms"), int | float) and d.get("old") is not None)


def summarize(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out = {}
    for key, runs in data["rows"].items():
        out[key] = {"p50": median([pct(r["latencies_us"], 50) for r in runs]),
                    "p99": median([pct(r["latencies_us"], 99) for r in runs]),
                    "p999": median([pct(r["latencies_us"], 99.9) for r in runs]),
                    "p99s": [pct(r["latencies_us"], 99) for r in runs],
                    "lane_p99": median([pct(r.get("lane_latencies_us") or [], 99)
                                        for r in runs]),
                    "cpu_s_per_gb": median([r["saver_cpu_s"] / (r["written_bytes"] / C.GB)
                                            for r in runs if r.get("saver_cpu_s")
                                            and r.get("written_bytes")]),
                    "gbps": median([r["save_gbps"] for r in runs]),
                    "rate_mb": median([r.get("rate_median_mb") for r in runs])}
    return out


def oracle_of(data: dict[str, Any], s: dict[str, dict[str, Any]]) -> str | None:
    """The highest static cap whose median read p99 meets the SLO."""
    best = None
    for cap in data["caps_mb"]:
        row = s.get(f"cap {cap:g}")
        if row and row["p99"] is not None and row["p99"] <= data["slo_ms"] * 1e3:
            best = f"cap {cap:g}"
    return best


def row_label(key: str) -> str:
    return str(MODES[key]["label"])


def render(datas: list[dict[str, Any]], report_dir: str | None = None) -> str:
    first = datas[0]
    found = re.search(r"--dir (\S+)", first["command"])
    report_dir = report_dir or (found.group(1) if found else None)
    parts = [
        "## Read/write isolation across processes: KV reads under checkpoint saves "
        "(`benchmarks/bench_isolation.py`)",
        "",
        "Commands (one exclusive run each): "
        + "; ".join(f"`{c}`" for d in datas
                    for c in dict.fromkeys([d["command"], *d.get("extra_commands", [])]))
        + "; then `python benchmarks/bench_isolation.py --report "
        + (f"--dir {report_dir} " if report_dir else "")
        + "--out docs/BENCHMARKS.md --plot docs/isolation_cdf.png` (this text is generated "
          "from their data)  ",
        "Dates: " + ", ".join(f"{d['layout']}: {d['date']}" for d in datas) + "  ",
        *(f"Rows of {d['layout']}: {d['renamed_rows']}  " for d in datas
          if d.get("renamed_rows")),
        f"Machine: {first['machine']}  ",
        f"isolane: commit {first['commit']}"
        + ("".join(f"; {d['layout']}'s later commands: commit " + ", ".join(later)
                   for d in datas
                   if (later := sorted(set(d.get("extra_commits", [])) - {d["commit"]})))),
        "",
        f"Workload: {first['blocks']} KV blocks of 64 KiB ({first['blocks'] * BLOCK / C.GB:.2f}"
        " GB) read by 8 threads of an inference process calling `KVPool.get_blocks([key])` "
        "with Zipf(1.0) keys, memory tier 0 B and O_DIRECT reads; a save loop of a "
        f"{first['state_gb']:g} GB fp32 state dict (full writes, `parent=False`) in the "
        "layout named"
        + (f" (the issue fixes the reads, not the dict's size; it names {ISSUE_STATE_GB:g} "
           "GB, but a 5 s window then holds one or two saves, and which phases of them it "
           "catches (writes, commit, the delete of the save before, the next staging) "
           "made the rounds' throughput too coarse to resolve 90 % of the oracle: "
           f"{first['state_gb']:g} GB saves put several in each window)"
           if first["state_gb"] < ISSUE_STATE_GB else "")
        + "; save GB/s = bytes the write lanes moved during the run "
        + ("(reserved from their token buckets, in the 1-4 MiB slices the writes are paced "
           "in; the no-isolation row, which has none, counts finished 64 MiB jobs)"
           if first.get("save_metric") == "write-bucket bytes" else "(chunk granularity)")
        + " / the run's seconds. KV and checkpoint folders share one disk. Runs of "
        f"{first['duration_s']:g} s measured after {first.get('warmup_s', 0.3):g} s of "
        "reads and saves (the steady state"
        + (f"; {first['governed_warmup_s']:g} s for every row with saves, so that every "
           "row's window covers the same phase of the save loop, and the governor has "
           "converged: every run starts fresh governors; the first of each layout "
           "converges from unlimited, the later ones start from the host limit the "
           "previous run settled at, remembered beside the plane"
           if first.get("governed_warmup_s", first.get("warmup_s")) != first.get("warmup_s")
           else "") + "), medians of "
        + (f"{first['repeats']} rounds for the host plane and the static caps, "
           f"{first['side_repeats']} for the other rows (the plane's and the caps' rounds "
           "interleaved round by round: each round runs the plane and every cap once, in "
           "turn; the oracle and the plane are both judged on the median p99 of their "
           "rounds"
           if "side_repeats" in first else f"{first['repeats']} rounds (rounds interleaved")
        + ", fresh processes for every run). SLO = "
        f"{first['slo_factor']:g} x that layout's idle p99. Static caps are for the host "
        "(each rank of (c) gets half). *oracle*: the highest static cap whose p99 meets the "
        "SLO.",
    ]
    targets = []
    for data in datas:
        s = summarize(data)
        layout = data["layout"]
        idle, solo = s["idle"]["p99"], s["solo"]["gbps"]
        oracle = oracle_of(data, s)
        oracle_gbps = s[oracle]["gbps"] if oracle else None
        rows = [["KV reads alone (idle)", fmt_us(s["idle"]["p50"]), fmt_us(idle),
                 fmt_us(s["idle"]["p999"]), "1.00x", fmt_us(s["idle"]["lane_p99"]),
                 "-", "-", "-", "-", ", ".join(fmt_us(x) for x in s["idle"]["p99s"]), "-"],
                ["save loop alone (lanes, no cap)", "-", "-", "-", "-", "-",
                 f"{solo:.2f}" if solo else "-", "100 %", "-", "-", "-", "-"]]
        keys = [*MODES, *(f"cap {c:g}" for c in data["caps_mb"]), "tmpfs idle",
                "tmpfs plane", "tmpfs cap"]
        for key in keys:
            if key not in s:
                continue
            row = s[key]
            label = (row_label(key) if key in MODES else
                     f"static cap {key[4:]} MB/s" + (" (oracle)" if key == oracle else "")
                     if key.startswith("cap") else
                     "KV on tmpfs: reads alone" if key == "tmpfs idle" else
                     "KV on tmpfs: host lane plane" if key == "tmpfs plane" else
                     "KV on tmpfs: static cap at the oracle's")
            rows.append([label, fmt_us(row["p50"]), fmt_us(row["p99"]), fmt_us(row["p999"]),
                         C.fmt_ratio(C.ratio(row["p99"], idle)), fmt_us(row["lane_p99"]),
                         "-" if row["gbps"] is None else f"{row['gbps']:.2f}",
                         C.fmt_ratio(C.ratio(row["gbps"], solo), percent=True),
                         C.fmt_ratio(C.ratio(row["gbps"], oracle_gbps), percent=True),
                         key[4:] if key.startswith("cap ") else fmt_rate(row["rate_mb"]),
                         ", ".join(fmt_us(x) for x in row["p99s"]),
                         rounds_within(data, row)])
        parts += ["", f"### {LAYOUTS[layout]}", "",
                  f"Idle p99 {fmt_us(idle)} µs; SLO {data['slo_ms']:.2f} ms"
                  + (f"; idle read-lane p99 {fmt_us(data['lane_idle_p99_us'])} µs, the "
                     f"governor's `read_p99_slo_ms` {data['governor_slo_ms']:.2f}"
                     if data.get("lane_idle_p99_us") else "") + "."
                  + ("" if data.get("save_metric") else
                     " **Save GB/s here counts whole saves committed inside a run** (this "
                     "layout was measured before the byte meter): a 1.6 GB save slower than "
                     "a run counts 0, so low caps read 0.00 and the rates are coarse."), "",
                  C.markdown_table(["run", "p50 µs", "p99 µs", "p999 µs", "p99 vs idle",
                                    "lane p99 µs", "save GB/s", "vs solo", "vs oracle",
                                    "governor rate MB/s", "p99 of each round (µs)",
                                    "rounds within SLO"], rows)]
        plane = s.get("plane", {})
        r1 = C.ratio(plane.get("p99"), idle)
        r2 = C.ratio(plane.get("gbps"), solo)
        r3 = C.ratio(plane.get("gbps"), oracle_gbps)
        targets += [
            [LAYOUTS[layout], "host plane: read p99 / idle", C.fmt_ratio(r1), "≤ 1.5x",
             "yes" if r1 is not None and r1 <= 1.5 else "**no**"],
            [LAYOUTS[layout], "host plane: save / solo", C.fmt_ratio(r2, percent=True),
             "≥ 50 %", "yes" if r2 is not None and r2 >= 0.5 else "**no**"],
            [LAYOUTS[layout], "host plane: save / oracle cap (while meeting the SLO)",
             C.fmt_ratio(r3, percent=True), "≥ 90 %",
             "**no** (no static cap met the SLO)" if not oracle else
             "**no** (the plane's p99 is over the SLO)" if not within_slo(data, plane) else
             "yes" if r3 is not None and r3 >= 0.9 else "**no**"],
            [LAYOUTS[layout], "host plane p99 within the SLO",
             f"{fmt_us(plane.get('p99'))} µs", f"≤ {data['slo_ms'] * 1e3:.0f} µs",
             "yes" if plane.get("p99") is not None and plane["p99"] <= data["slo_ms"] * 1e3
             else "**no**"],
        ]
        for key in ("none", "lanes"):
            if key in s:
                targets.append([LAYOUTS[layout], f"{MODES[key]['label']}: read p99 / idle",
                                C.fmt_ratio(C.ratio(s[key]["p99"], idle)), "", ""])
    parts += ["", "![KV read latency CDFs per layout](isolation_cdf.png)", "",
              "### Targets", "",
              C.markdown_table(["layout", "ratio", "value", "target", "met"], targets),
              "", "### Reading the numbers", "", *reading(datas)]
    return "\n".join(parts)


def reading(datas: list[dict[str, Any]]) -> list[str]:
    """Sentences drawn from the data (nothing here is typed in by hand)."""
    out = []
    for data in datas:
        s = summarize(data)
        idle, solo = s["idle"]["p99"], s["solo"]["gbps"]
        oracle = oracle_of(data, s)

        def p99x(key: str, s: dict[str, dict[str, Any]] = s,
                 idle: float | None = idle) -> str:
            if key not in s:
                return "(not measured)"
            return C.fmt_ratio(C.ratio(s[key].get("p99"), idle))

        plane = s.get("plane", {})
        line = (f"- **{LAYOUTS[data['layout']]}**: under the save loop the KV read p99 is "
                f"{p99x('none')} idle without isolation, {p99x('lanes')} with per-process "
                f"lanes and {p99x('plane')} with the host lane plane (SLO "
                f"{data['slo_factor']:g}x); the saves keep "
                f"{C.fmt_ratio(C.ratio(plane.get('gbps'), solo), percent=True)} of their solo "
                "throughput with the plane")
        if oracle:
            cap = s[oracle]
            line += (f", against {C.fmt_ratio(C.ratio(cap['gbps'], solo), percent=True)} at "
                     f"the oracle's static cap of {oracle[4:]} MB/s (p99 "
                     f"{C.fmt_ratio(C.ratio(cap['p99'], idle))})")
        else:
            caps = sorted(data["caps_mb"])
            lowest = s.get(f"cap {caps[0]:g}", {}) if caps else {}
            line += ("; **no static cap of the sweep met the SLO, so there is no oracle** "
                     f"(caps {', '.join(f'{c:g}' for c in caps)} MB/s: read p99 "
                     + ", ".join(p99x(f"cap {c:g}") for c in caps)
                     + f" idle; even the lowest, {caps[0]:g} MB/s = "
                     f"{C.fmt_ratio(C.ratio(lowest.get('gbps'), solo), percent=True)} of solo, "
                     f"gave {p99x(f'cap {caps[0]:g}')}): on this disk at this SLO no static "
                     f"write rate down to {caps[0]:g} MB/s keeps the reads within it, so "
                     "the SLO is out of reach of rate limiting at any useful save speed"
                     if caps else "")
        if plane.get("rate_mb") is not None:
            line += ("; the host governor's write rate ran at a median "
                     f"{fmt_rate(plane['rate_mb'])} MB/s")
        out.append(line + ".")
        sources = data.get("row_sources") or {}
        if oracle and sources.get("plane", 0) != sources.get(oracle, 0):
            def which(key: str, sources: dict[str, int] = sources,
                      data: dict[str, Any] = data) -> str:
                i = sources.get(key, 0)
                return (f"`{data['extra_commands'][i - 1]}`" if i else "the layout's first "
                        "command")
            out.append(
                f"- **Not the same rounds in {LAYOUTS[data['layout']]}**: the host lane "
                f"plane's rows come from {which('plane')}, the oracle cap's from "
                f"{which(oracle)}, so the plane's share of the oracle mixes invocations "
                "(the machine's state between them can move the governor more than a "
                "change of the law does).")
        if data.get("skipped"):
            out.append(f"- Not measured in {LAYOUTS[data['layout']]}: "
                       + ", ".join(data["skipped"]) + " (left by `--skip` for a later "
                       "`--add` that did not run).")
        story = governor_story(data["rows"].get("plane", []))
        if story:
            floor = floor_story(data, data["rows"].get("plane", []))
            out.append(f"- What the host governor did in {LAYOUTS[data['layout']]}: {story}"
                       + (f"; {floor}" if floor else "") + ".")
        out += bounds(data, s, oracle)
    return out


def bounds(data: dict[str, Any], s: dict[str, dict[str, Any]], oracle: str | None
           ) -> list[str]:
    """Why a missed target is missed, from this layout's same-run rows."""
    out = []
    name = LAYOUTS[data["layout"]]
    idle, solo = s["idle"]["p99"], s["solo"]["gbps"]
    plane = s.get("plane", {})
    plane_runs = data["rows"].get("plane", [])
    ok = [f"cap {c:g}" for c in data["caps_mb"] if within_slo(data, s.get(f"cap {c:g}", {}))]
    if oracle and solo and (C.ratio(plane.get("gbps"), solo) or 0) < 0.5:
        best = max((s[k]["gbps"] or 0) / solo for k in ok)
        over = [f"{k[4:]} MB/s: {C.fmt_ratio(C.ratio(s[k]['p99'], idle))}"
                for k in (f"cap {c:g}" for c in data["caps_mb"]) if k in s and k not in ok]
        if over and max(data["caps_mb"]) > float(oracle[4:]):
            out.append(
                f"- Save ≥ 50 % of solo in {name} is out of reach of any rate limiter at "
                f"this SLO on this disk: the highest static cap that meets the SLO saves "
                f"{best:.0%} of solo (the sweep: {', '.join(k[4:] for k in ok)} MB/s meet "
                f"it; {', '.join(over)} of idle p99 do not).")
        else:
            out.append(
                f"- Save ≥ 50 % of solo in {name}: every static cap of the sweep met the "
                f"SLO, the highest ({oracle[4:]} MB/s) saving {best:.0%} of solo, so this "
                "run does not show whether a higher cap would save half of solo within "
                "it.")
    lane_idle = data.get("lane_idle_p99_us")
    if lane_idle and idle:
        rows = [(k, s[k]) for k in ("plane", oracle or "") if k in s and s[k]["lane_p99"]]
        out.append(
            f"- What the governor measures in {name}: the read lane's p99 (a KV get's "
            f"submit-to-completion) is {fmt_us(lane_idle)} µs idle against "
            f"{fmt_us(idle)} µs for the client's whole `get_blocks` call; "
            + "; ".join(f"{row_label(k) if k in MODES else 'the oracle cap'}: lane "
                        f"{fmt_us(r['lane_p99'])} µs, client {fmt_us(r['p99'])} µs"
                        for k, r in rows)
            + f". The rest is the reader process's own CPU (8 threads, 2 cores). The "
            f"governor's SLO ({data['governor_slo_ms']:.2f} ms) is "
            + ("the SLO's margin over idle added to the idle lane p99."
               if data.get("governor_slo") == "lane" else "the client SLO itself."))
    judged = judged_p99s(data["rows"].get("plane", []))
    cap_mb = float(oracle[4:]) if oracle else None
    if (judged and not within_slo(data, plane) and cap_mb is not None
            and plane.get("rate_mb") is not None and plane["rate_mb"] > cap_mb):
        out.append(
            f"- Why the plane misses the SLO in {name}: its median rate "
            f"({fmt_rate(plane['rate_mb'])} MB/s) is above the oracle's cap ({cap_mb:g} "
            f"MB/s); the p99s it judged ranged {judged[0]:.1f}-{judged[-1]:.1f} ms against "
            f"its SLO of {data['governor_slo_ms']:.1f} ms.")
    if oracle and within_slo(data, plane):
        share = C.ratio(plane.get("gbps"), s[oracle]["gbps"])
        if share is not None and share < 0.9:
            caps = [f"cap {c:g}" for c in data["caps_mb"] if f"cap {c:g}" in s]
            use = C.ratio((plane.get("gbps") or 0) * C.GB / MB, plane.get("rate_mb"))
            out.append(
                f"- Why the plane saves {share:.0%} of the oracle's throughput in {name} "
                f"while meeting the SLO (p99 {C.fmt_ratio(C.ratio(plane['p99'], idle))}): "
                f"its host write limit ran at a median {fmt_rate(plane['rate_mb'])} MB/s "
                f"against the oracle's {oracle[4:]}, and the saves used "
                + (f"{use:.0%}" if use is not None else "-")
                + " of it (static caps: "
                + ", ".join(f"{k[4:]} MB/s moved {(s[k]['gbps'] or 0) * C.GB / MB:.0f}"
                            for k in caps)
                + "). "
                + (f"Its read-lane p99 over the runs was {lane_r:.2f}x its own SLO, inside "
                   f"the band ({HOLD_BELOW:g}-1x) where the law holds rather than grows: "
                   if (lane_r := C.ratio(plane.get("lane_p99"),
                                         data.get("governor_slo_ms", 0) * 1e3)) is not None
                   and lane_r >= HOLD_BELOW else "")
                + ("a" if lane_r is not None and lane_r >= HOLD_BELOW else "A")
                + " governor "
                + (f"({warm} of {len(plane_runs)} runs started warm, from the last "
                   "settled limit) " if (warm := sum(1 for r in plane_runs
                                                     if r.get("warm_start_mb")))
                   else "(every run started cold, from unlimited) ")
                + f"grows only on seconds of good reads and holds in the {HOLD_BELOW:g}-1x "
                "band wherever it enters it; and the saves use a limit only in part "
                "(between a save's last write and the next one's first: its commit, the "
                "delete of the save before, the next staging), as the static caps show. "
                "Rounds within the SLO (each judged on its own p99, as the oracle and the "
                "governor are judged on the median of theirs): the plane "
                + rounds_within(data, s["plane"]) + "; "
                + "; ".join(f"{k[4:]} MB/s {rounds_within(data, s[k])} "
                            f"({', '.join(fmt_us(x) for x in s[k]['p99s'])} µs)"
                            for k in caps)
                + f" (SLO {data['slo_ms'] * 1e3:.0f} µs).")
    if "tmpfs plane" in s and "tmpfs idle" in s:
        t_idle, t_plane = s["tmpfs idle"]["p99"], s["tmpfs plane"]["p99"]
        line = (f"- With the KV group on a tmpfs (RAM: no device shared with the saves) the "
                f"read p99 goes from {fmt_us(t_idle)} to {fmt_us(t_plane)} µs "
                f"({C.fmt_ratio(C.ratio(t_plane, t_idle))}) under the save loop with the "
                f"plane, which lets the saves run at {fmt_rate(s['tmpfs plane']['rate_mb'])} "
                "MB/s there (no device to protect)")
        cpu = s["tmpfs plane"].get("cpu_s_per_gb")
        if cpu:
            line += (f"; the saver process spends {cpu:.2f} CPU s per GB written (staging "
                     "copy, xxh3 hash, syscalls)")
        capped = s.get("tmpfs cap")
        if capped and capped["p99"] is not None:
            line += (f". At the oracle's static cap the tmpfs read p99 is "
                     f"{fmt_us(capped['p99'])} µs "
                     f"({C.fmt_ratio(C.ratio(capped['p99'], t_idle))} of tmpfs idle)"
                     + (f", the saver at {capped['cpu_s_per_gb']:.2f} CPU s per GB"
                        if capped.get("cpu_s_per_gb") else "")
                     + ": at the rates the SLO allows, the saves' CPU "
                     + ("moves the read tail little; the tail on the disk is the device's"
                        if (C.ratio(capped["p99"], t_idle) or 9) <= 1.15 else
                        "still moves the read tail"))
        out.append(line + ".")
    return out


def plot(datas: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(datas), figsize=(5.5 * len(datas), 4.5), squeeze=False)
    for ax, data in zip(axes[0], datas, strict=True):
        s = summarize(data)
        oracle = oracle_of(data, s)
        keys = ["idle", "none", "lanes", "plane", *([oracle] if oracle else [])]
        for key in keys:
            runs = data["rows"].get(key)
            if not runs:
                continue
            values = np.sort(np.asarray(runs[len(runs) // 2]["latencies_us"]))
            if not len(values):
                continue
            label = ("reads alone" if key == "idle" else row_label(key)
                     if key in MODES else f"oracle {key} MB/s")
            ax.plot(values / 1e3, np.arange(1, len(values) + 1) / len(values), label=label)
        ax.axvline(data["slo_ms"], color="grey", linestyle=":", label="SLO")
        ax.set_xscale("log")
        ax.set_ylim(0.5, 1.001)
        ax.set_xlabel("KV read latency (ms, log)")
        ax.set_ylabel("fraction of reads")
        ax.set_title(f"{LAYOUTS[data['layout']]}: reads + saves", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--dir", type=Path, default=C.REPO_ROOT / ".bench" / "isolation")
    p.add_argument("--layout", default="", help="comma list of a, b, c to measure")
    p.add_argument("--corpus-gb", type=float, default=1.0)
    p.add_argument("--state-gb", type=float, default=1.6)
    p.add_argument("--duration", type=float, default=8.0, help="seconds a run")
    p.add_argument("--warmup", type=float, default=1.5,
                   help="seconds saves and reads run before a run's measured seconds")
    p.add_argument("--governed-warmup", type=float, default=None,
                   help="the warm-up of every run with saves (default: --warmup): seconds "
                   "for a fresh governor to converge; static caps get the same window")
    p.add_argument("--repeats", type=int, default=5,
                   help="rounds of the rows the oracle target judges: the host plane and "
                   "every static cap, interleaved round by round")
    p.add_argument("--side-repeats", type=int, default=3,
                   help="rounds of the other rows (idle, solo, no isolation, per-process "
                   "lanes, the tmpfs rows)")
    p.add_argument("--idle-repeats", type=int, default=3,
                   help="rounds of the reads alone (their median p99 sets the SLO)")
    p.add_argument("--slo-factor", type=float, default=1.4)
    p.add_argument("--caps", default="25,50,100,200,400",
                   help="static caps to sweep, MB/s")
    p.add_argument("--tmpfs", action="store_true",
                   help="layout b also with the KV group on a tmpfs (needs root)")
    p.add_argument("--tmpfs-only", action="store_true",
                   help="add only the tmpfs rows to the kept layout (b) results")
    p.add_argument("--governor-slo", choices=["lane", "client"], default="lane",
                   help="the governor's qos.read_p99_slo_ms: the SLO's margin over idle "
                   "added to the idle read-lane p99 (lane), or the SLO itself (client)")
    p.add_argument("--add", default="",
                   help="run these rows (e.g. none,lanes) into the kept layout's results, "
                   "with its idle runs and SLO")
    p.add_argument("--skip", default="", help="rows to leave for a later --add")
    p.add_argument("--replace", action="store_true",
                   help="with --add: drop the kept runs of those rows first (re-measure "
                   "them, e.g. after a change of the law; the commit is kept)")
    p.add_argument("--rows", default="",
                   help="only these rows (e.g. plane,cap 200): a trial, not a report")
    p.add_argument("--report", action="store_true", help="render what was measured")
    p.add_argument("--out", type=Path)
    p.add_argument("--section", default="isolation")
    p.add_argument("--plot", type=Path)
    _quick.add_argument(p)
    args = p.parse_args(argv)
    if args.quick:  # every layout (b, c: solo and plane), one cap, the report and the plot
        root = _quick.enter(args, p, files=())
        args.corpus_gb, args.state_gb, args.repeats, args.side_repeats = 0.02, 0.05, 1, 1
        args.idle_repeats = 1
        args.duration, args.warmup, args.caps = 0.5, 0.1, "200"
        args.layout, args.report = args.layout or ",".join(LAYOUTS), True
        args.plot = args.plot or root / "cdf.png"
    if args.governed_warmup is None:
        args.governed_warmup = args.warmup
    args.blocks = int(args.corpus_gb * C.GB) // BLOCK
    args.dir.mkdir(parents=True, exist_ok=True)
    if args.tmpfs_only:  # add the tmpfs rows to a measured layout (b)
        path = args.dir / "layout-b.json"
        data = json.loads(path.read_text())
        oracle = oracle_of(data, summarize(data))
        tmpfs_rows(args, "b", data["rows"], data.get("governor_slo_ms", data["slo_ms"]),
                   float(oracle[4:]) if oracle else None)
        data.setdefault("extra_commands", []).append(C.command_line())
        path.write_text(json.dumps(data))
    for layout in [x for x in args.layout.split(",") if x]:
        if layout not in LAYOUTS:
            p.error(f"unknown layout {layout!r}; layouts: a, b, c")
        data = measure_layout(args, layout)
        kept = args.dir / (f"trial-{layout}.json" if args.rows else f"layout-{layout}.json")
        kept.write_text(json.dumps(data))
        log(f"kept {kept}")
        if args.rows:
            print(render([data]))
    if args.report:
        datas = [json.loads((args.dir / f"layout-{k}.json").read_text())
                 for k in LAYOUTS if (args.dir / f"layout-{k}.json").exists()]
        if not datas:
            p.error(f"nothing measured in {args.dir}; run with --layout first")
        C.print_report(render(datas, str(args.dir)), args.out, args.section)
        if args.plot:
            plot(datas, args.plot)
    with contextlib.suppress(OSError):
        shutil.rmtree(args.dir / "runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
