"""Read/write isolation across processes: KV read latency while checkpoints are saved.

8 threads of ``KVPool.get_blocks([key])`` (64 KiB blocks, Zipf(1.0) keys, O_DIRECT, no
memory tier) beside a loop saving a fp32 state dict, in three layouts: (a) one process
and scheduler, (b) two processes, (c) the saves as a 2-rank torchrun job. Each with no
isolation, per-process lanes, the host lane plane, and a sweep of static write caps for
the host (lanes, no governor); the oracle is the highest cap whose read p99 meets the SLO
(``--slo-factor`` x idle p99). Runs are fresh processes started together; medians over
rounds. Each layout is kept in ``--dir``; ``--report`` prints them all and plots CDFs.

    python benchmarks/bench_isolation.py --quick                 # smoke test, ~2 min
    python benchmarks/bench_isolation.py --layout a              # then b, then c
    python benchmarks/bench_isolation.py --report --out docs/BENCHMARKS.md \\
        --plot docs/isolation_cdf.png
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import _common as C
import _quick
import _results
import numpy as np
from _kv_bytes import BYTE_BLOCKS, fix_layout

C.ensure_repo_importable()

BLOCK = 64 << 10
MB = 1e6
LAYOUTS = {"a": "(a) same process", "b": "(b) another process", "c": "(c) 2-rank torchrun job"}
LABELS = {"none": "no isolation", "lanes": "per-process lanes", "plane": "host lane plane"}
# (isolation, governor, host plane) of each run; the static caps: lanes only
MODES = {"none": (False, False, False), "lanes": (True, True, False), "plane": (True, True, True)}
STATIC = (True, False, False)
# --side-repeats rounds; the plane and the caps (judged by the oracle) get --repeats
SIDE_ROWS = {"none", "lanes"}
TARGETS = {"p99_vs_idle": 1.5, "save_vs_oracle": 0.9}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- runs ----------------------------------------------------------------------------------
def config_dict(root: Path, kv_dir: Path, slo_ms: float, mode: tuple[bool, bool, bool],
                cap_bytes: float | None = None) -> dict[str, Any]:
    qos: dict[str, Any] = {"read_p99_slo_ms": slo_ms, "host_plane": mode[2],
                           "governor": mode[1]}
    if cap_bytes is not None:
        qos["write_bandwidth_max"] = int(cap_bytes)
        qos["write_bandwidth_min"] = int(min(100 << 20, cap_bytes))
    return {"home": str(root), "qos": qos, "device_groups": {
        "ckpt": {"role": "write", "devices": [str(root / "ckpt")]},
        "kv": {"role": "read", "devices": [str(kv_dir)], "threads": 8}}}


def run(args: argparse.Namespace, layout: str, saves: bool, slo_ms: float,
        mode: tuple[bool, bool, bool], cap_mb: float | None, seed: int) -> dict[str, Any]:
    """One run: fresh processes, started together; returns latencies and save GB/s."""
    run_dir = args.dir / "runs" / f"{layout}-{time.monotonic_ns()}"
    run_dir.mkdir(parents=True)
    world = 2 if layout == "c" else 1
    cap = None if cap_mb is None else cap_mb * MB / world
    spec = json.dumps({"config": config_dict(args.dir, args.dir / "kv", slo_ms, mode, cap),
                       "mode": mode, "blocks": args.blocks, "seconds": args.duration,
                       "seed": seed, "state_bytes": int(args.state_gb * C.GB)})
    # the limit a run settled at, kept beside the plane, warm-starts the next governed run
    env = {**os.environ, "ISOLANE_PLANE_DIR": str(args.dir / "planes" / "current"),
           "PYTHONPATH": str(C.REPO_ROOT)}
    env.pop("WORLD_SIZE", None)
    worker = [str(Path(__file__).resolve()), "worker"]
    roles = ([("both", ["both"])] if layout == "a" and saves else
             [("reader", ["reader"])] + [("saver", ["saver-r0", "saver-r1"] if
                                          layout == "c" else ["saver"])] * saves)
    procs, expected = [], []
    for role, names in roles:
        torchrun = ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                    "127.0.0.1", "--master-port", str(C.free_port())] * (len(names) == 2)
        procs.append(subprocess.Popen([sys.executable, *torchrun, *worker, role,
                                       str(run_dir), role, spec], env=env, cwd=C.REPO_ROOT))
        expected += names
    try:
        deadline = time.monotonic() + 240
        while not all((run_dir / f"{n}.ready").exists() for n in expected):
            if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
                raise RuntimeError(f"a worker of {run_dir.name} failed to start")
            time.sleep(0.01)
        # Counted after the warm-up (not each fresh process's first cut); every run with
        # saves gets the governed one, so the save loop's phases fall alike in its window.
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
    saver = results.get("both") or results.get("saver") or results.get("saver-r0") or {}
    # the write lanes' bytes inside the run: a save under a low cap outlasts a run
    written = sum(r.get("written_bytes", 0) for n, r in results.items() if n != "reader")
    rates = [math.inf if r is None else r for r in saver.get("rate_series") or []]
    return {"latencies_us": [x for r in results.values() for x in r.get("latencies_us", [])],
            "lane_latencies_us": [x for r in results.values()
                                  for x in r.get("lane_latencies_us", [])],
            "written_bytes": written,
            "save_gbps": written / args.duration / C.GB if saves and saver else None,
            "rate_median_mb": statistics.median(rates) / MB if rates else None}


def pct(latencies: list[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(latencies), q)) if latencies else None


def median(values: list[float | None]) -> float | None:
    real = [v for v in values if v is not None]
    return statistics.median(real) if real else None


def block_key(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


def fill_corpus(root: Path, blocks: int) -> None:
    from isolane.config import config_from_dict
    from isolane.kvpool.pool import KVPool

    config = config_from_dict(config_dict(root, root / "kv", 5.0, MODES["lanes"]))
    with KVPool(config, namespace="bench", memory_budget=0, **BYTE_BLOCKS) as pool:
        if sum(len(lg) for lg in pool.logs) >= blocks:
            return
        fix_layout(pool, BLOCK)
        rng = np.random.default_rng(0)
        for start in range(0, blocks, 256):
            n = min(256, blocks - start)
            data = rng.integers(0, 255, size=(n, BLOCK), dtype=np.uint8)
            pool.put_blocks([block_key(start + j) for j in range(n)], list(data))
    C.fsync_tree(root / "kv")


# -- the worker processes -----------------------------------------------------------------
def run_reader(pool: Any, spec: dict[str, Any], start: float, stop_at: float) -> list[float]:
    """8 threads of ``get_blocks([key])``, Zipf(1.0) keys; latencies (µs) after ``start``."""
    n = spec["blocks"]
    weights = 1.0 / np.arange(1, n + 1)
    cdf = np.cumsum(weights) / weights.sum()
    lat: list[list[float]] = [[] for _ in range(8)]

    def reader(i: int) -> None:
        seed = spec["seed"] * 100 + i
        perm = np.random.default_rng(seed).permutation(n)
        rng = np.random.default_rng(seed + 1)
        while (now := time.monotonic()) < stop_at:
            key = block_key(int(perm[min(int(np.searchsorted(cdf, rng.random())), n - 1)]))
            t0 = time.perf_counter()
            got = pool.get_blocks([key])[0]
            dt = time.perf_counter() - t0
            if got is None:
                raise SystemExit(f"block {key.hex()} missing from the corpus")
            if now >= start:
                lat[i].append(dt * 1e6)

    with ThreadPoolExecutor(8) as threads:
        list(threads.map(reader, range(8)))
    return [x for part in lat for x in part]


def run_saver(store: Any, spec: dict[str, Any], stop_at: float, rank: int) -> None:
    import torch

    world = int(os.environ.get("WORLD_SIZE", "1"))
    per = 64 << 20
    count = max(1, spec["state_bytes"] // world // per)
    state = {f"r{rank}.layer{i}": torch.empty(per // 4).fill_(float(i + rank))
             for i in range(count)}
    n = 0
    while True:
        go = time.monotonic() < stop_at
        if world > 1:  # every rank must agree to start one more collective save
            import torch.distributed as dist

            flag = torch.tensor([1 if go else 0])
            dist.broadcast(flag, 0)
            go = bool(flag.item())
        if not go:
            break
        store.save(state, f"loop-{n}", parent=False, mirror=False, overwrite=True)
        if n and rank == 0:
            store.delete(f"loop-{n - 1}")
        n += 1


def worker(argv: list[str]) -> int:
    """``worker ROLE RUN_DIR NAME SPEC_JSON``: a ``reader``, ``saver`` or ``both``; writes
    ``NAME.ready``, waits for ``start`` (a monotonic time) and writes ``NAME.json``."""
    role, run_dir, name, spec = argv[0], Path(argv[1]), argv[2], json.loads(argv[3])
    from isolane.config import config_from_dict
    from isolane.kvpool.pool import KVPool
    from isolane.lanes.scheduler import LaneScheduler
    from isolane.snapshot.store import SnapshotStore

    rank = int(os.environ.get("RANK", "0"))
    if "WORLD_SIZE" in os.environ:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        name = f"{name}-r{rank}"
    config = config_from_dict(spec["config"])
    isolation, governor, _host = spec["mode"]
    scheduler = LaneScheduler(config, isolation=isolation, governor=governor)
    pool = store = None
    if role in ("reader", "both"):
        pool = KVPool(config, namespace="bench", memory_budget=0, direct_reads=True,
                      scheduler=scheduler, **BYTE_BLOCKS)
    if role in ("saver", "both"):
        store = SnapshotStore(config, scheduler=scheduler)
    scheduler.join_host()
    # what the governor measures: a get's time in the read lane, without the caller's CPU
    lane_us: list[float] = []
    measured = [float("inf"), float("-inf")]
    if pool is not None and scheduler.governor is not None:
        scheduler.governor.read.listeners.append(
            lambda seconds, _n, now: lane_us.append(seconds * 1e6)
            if measured[0] <= now < measured[1] else None)
    (run_dir / f"{name}.ready").write_text("1")
    deadline = time.monotonic() + 300
    while not (run_dir / "start").exists():
        if time.monotonic() > deadline:
            raise SystemExit("no start signal in 300 s")
        time.sleep(0.005)
    start = float((run_dir / "start").read_text())
    stop_at = start + spec["seconds"]
    measured[:] = [start, stop_at]
    out: dict[str, Any] = {}

    def meter() -> None:
        """The write lane's bytes in the run, per paced slice (a 64 MiB job is 6 % of a
        5 s run at 0.2 GB/s), and the governor's host write rate every 0.1 s."""
        lane = scheduler.lanes["write"]

        def moved() -> int:
            return lane.bucket.consumed_bytes if lane.bucket is not None else (
                lane.counters.bytes)

        time.sleep(max(0.0, start - time.monotonic()))
        before = moved()
        series: list[float | None] = []
        while time.monotonic() < stop_at:
            gov = scheduler.stats()["governor"]
            host = gov.get("host") or {}
            rate = (host["write_rate_bytes_per_s"] if host.get("joined")
                    else gov.get("write_rate_bytes_per_s"))
            series.append(None if rate is None else float(rate))
            time.sleep(max(0.0, min(0.1, stop_at - time.monotonic())))
        out["written_bytes"] = moved() - before
        out["rate_series"] = series

    with ThreadPoolExecutor(2) as threads:
        saving = [threads.submit(meter), threads.submit(run_saver, store, spec, stop_at,
                                                        rank)] if store is not None else []
        if pool is not None:
            out["latencies_us"] = run_reader(pool, spec, start, stop_at)
            out["lane_latencies_us"] = list(lane_us)
        for job in saving:
            job.result()  # a failed save raises here
    if store is not None and rank == 0:
        for info in store.list():
            store.delete(info.name)
    (run_dir / f"{name}.json").write_text(json.dumps(out))
    if pool is not None:
        pool.close()
    scheduler.close()
    if "WORLD_SIZE" in os.environ:
        dist.barrier()
        dist.destroy_process_group()
    return 0


# -- one layout ----------------------------------------------------------------------------
def measure_layout(args: argparse.Namespace, layout: str) -> dict[str, Any]:
    fill_corpus(args.dir, args.blocks)
    caps = [float(c) for c in args.caps.split(",") if c]
    # a layout's first governed run starts cold, the later ones warm
    for memory in (args.dir / "planes").rglob("*.plane.memory"):
        memory.unlink()
    idle = [run(args, layout, False, 5.0, MODES["lanes"], None, r)
            for r in range(args.idle_repeats)]
    idle_p99 = median([pct(x["latencies_us"], 99) for x in idle])
    if idle_p99 is None:
        raise RuntimeError("the idle runs recorded no reads")
    slo_ms = idle_p99 * args.slo_factor / 1e3
    lane_idle = median([pct(x["lane_latencies_us"], 99) for x in idle])
    # the governor's SLO: the same margin over idle, added to the idle read lane's p99
    gov_slo_ms = slo_ms if lane_idle is None else (
        lane_idle + (args.slo_factor - 1) * idle_p99) / 1e3
    log(f"{layout}: idle p99 {idle_p99:.0f} us (lane {lane_idle or 0:.0f} us) -> SLO "
        f"{slo_ms:.2f} ms, governor's {gov_slo_ms:.2f} ms")
    plan = [*((key, mode, None) for key, mode in MODES.items()),
            *((f"cap {c:g}", STATIC, c) for c in caps)]
    if args.quick and layout != "a":  # the other rows are layout a's, in seconds
        plan = [step for step in plan if step[0] == "plane"]
    rows: dict[str, list[dict[str, Any]]] = {"idle": idle}
    for r in range(args.repeats):
        for key, mode, cap in plan:
            if key in SIDE_ROWS and r >= args.side_repeats:
                continue
            res = run(args, layout, True, gov_slo_ms, mode, cap, r)
            rows.setdefault(key, []).append(res)
            log(f"{layout} round {r} {key}: p99 {pct(res['latencies_us'], 99) or 0:.0f} us, "
                f"save {res['save_gbps'] or 0:.2f} GB/s")
    return {"layout": layout, "slo_ms": slo_ms, "governor_slo_ms": gov_slo_ms,
            "lane_idle_p99_us": lane_idle, "idle_p99_us": idle_p99, "caps_mb": caps,
            "rows": rows, "command": C.command_line(), "date": C.now_text(),
            "duration_s": args.duration, "governed_warmup_s": 0.3 + args.governed_warmup,
            "repeats": args.repeats, "side_repeats": args.side_repeats,
            "blocks": args.blocks, "state_gb": args.state_gb, "slo_factor": args.slo_factor,
            "machine": C.machine_description(
                args.dir, {"torch": importlib.metadata.version("torch")})}


# -- report --------------------------------------------------------------------------------
def fmt_mb(mb: float | None) -> str:
    return "-" if mb is None else "unlimited" if math.isinf(mb) else f"{mb:.0f}"


def summarize(data: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], str | None]:
    """Each row's medians over its rounds, and the oracle: the highest static cap whose
    median read p99 meets the SLO."""
    s = {key: {"p99": median([pct(r["latencies_us"], 99) for r in runs]),
               "gbps": median([r["save_gbps"] for r in runs]),
               "rate_mb": median([r.get("rate_median_mb") for r in runs])}
         for key, runs in data["rows"].items()}
    met = [f"cap {c:g}" for c in data["caps_mb"] if (p99 := s.get(f"cap {c:g}", {}).get(
        "p99")) is not None and p99 <= data["slo_ms"] * 1e3]
    return s, (met[-1] if met else None)


def render(datas: list[dict[str, Any]]) -> str:
    first = datas[0]
    return "\n".join([
        "## Read/write isolation across processes: KV reads under checkpoint saves "
        "(`benchmarks/bench_isolation.py`)", "",
        "Commands: " + "; ".join(f"`{d['command']}` ({d['date']})" for d in datas) + "  ",
        f"Machine: {first['machine']}", "",
        f"Workload: {first['blocks']} KV blocks of 64 KiB read by 8 threads calling "
        "`KVPool.get_blocks([key])` with Zipf(1.0) keys, memory tier 0 B, O_DIRECT; a save "
        f"loop of a {first['state_gb']:g} GB fp32 state dict in the layout named. Runs of "
        f"{first['duration_s']:g} s after {first['governed_warmup_s']:g} s of warm-up, "
        f"medians of {first['repeats']} rounds for the plane and the caps (interleaved), "
        f"{first['side_repeats']} for the other rows. SLO = {first['slo_factor']:g} x the "
        "layout's idle p99 (" + ", ".join(f"{d['layout']}: {d['slo_ms']:.2f} ms"
                                           for d in datas) + "); *oracle*: the highest "
        "static cap whose p99 meets it."])


def headline_rows(datas: list[dict[str, Any]]) -> list[_results.Result]:
    """Per layout: the plane's read p99 against idle and against no isolation, and its
    save throughput against the oracle cap's, all from that layout's run."""
    out: list[_results.Result] = []
    for data in datas:
        s, oracle = summarize(data)
        where = {"machine": data["machine"], "date": data["date"], "command": data["command"],
                 "area": "Isolation"}
        name = LAYOUTS[data["layout"]]
        plane, idle = s.get("plane", {}), s["idle"]["p99"]
        if plane.get("p99") is None or idle is None:
            continue
        p99 = round(plane["p99"])
        out.append(_results.Result(
            measure=f"{name}: KV read p99 under saves / idle, host lane plane", value=p99,
            unit="µs", peer="KV reads alone (idle)", peer_value=round(idle),
            ratio=round(plane["p99"] / idle, 2), target=f"≤ {TARGETS['p99_vs_idle']}x",
            met=plane["p99"] / idle <= TARGETS["p99_vs_idle"], **where))
        out += [_results.Result(
            measure=f"{name}: KV read p99 under saves, host lane plane", value=p99, unit="µs",
            peer=LABELS[key], peer_value=round(s[key]["p99"]),
            ratio=round(s[key]["p99"] / plane["p99"], 2), **where)
            for key in ("none", "lanes") if s.get(key, {}).get("p99")]
        if oracle and plane.get("gbps") and s[oracle]["gbps"]:
            share = plane["gbps"] / s[oracle]["gbps"]
            met = share >= TARGETS["save_vs_oracle"]
            out.append(_results.Result(
                measure=f"{name}: save throughput within the SLO / the oracle cap",
                value=round(plane["gbps"], 2), unit="GB/s",
                peer=f"best static cap meeting the SLO ({oracle[4:]} MB/s)",
                peer_value=round(s[oracle]["gbps"], 2), ratio=round(share * 100),
                ratio_unit="%", target=f"≥ {TARGETS['save_vs_oracle'] * 100:.0f} %", met=met,
                why=None if met or plane.get("rate_mb") is None else
                f"the host write limit held a median {fmt_mb(plane['rate_mb'])} MB/s "
                f"against the oracle's {oracle[4:]}: {GAP}", **where))
    return out


def _gap() -> str:
    from isolane.lanes.control import CUT_EVIDENCE, GROW_HOLD_S, HOLD_BELOW, MAX_MEASURED_GROWTH

    return (f"the law is slow to grow and quick to cut: at most +{MAX_MEASURED_GROWTH:.0%} "
            f"per {GROW_HOLD_S:g} s of reads under {HOLD_BELOW:g}x the SLO at one rate, a "
            f"cut on any window of {CUT_EVIDENCE} reads over it")


GAP = _gap()


def plot(datas: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(datas), figsize=(5.5 * len(datas), 4.5), squeeze=False)
    for ax, data in zip(axes[0], datas, strict=True):
        _s, oracle = summarize(data)
        for key in ["idle", "none", "lanes", "plane", *([oracle] if oracle else [])]:
            runs = data["rows"].get(key)
            values = np.sort(np.asarray(runs[len(runs) // 2]["latencies_us"] if runs else []))
            if len(values):
                ax.plot(values / 1e3, np.arange(1, len(values) + 1) / len(values),
                        label={"idle": "reads alone", **LABELS}.get(key, f"oracle {key} MB/s"))
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
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        return worker(argv[1:])
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    arg = p.add_argument
    arg("--dir", type=Path, default=C.REPO_ROOT / ".bench" / "isolation")
    arg("--layout", default="", help="comma list of a, b, c to measure")
    arg("--corpus-gb", type=float, default=1.0)
    arg("--state-gb", type=float, default=0.4, help="the save loop's state dict")
    arg("--duration", type=float, default=4.0, help="measured seconds a run")
    arg("--warmup", type=float, default=1.5, help="reads alone before an idle run, s")
    arg("--governed-warmup", type=float, default=5.0, help="warm-up of a run with saves, s")
    arg("--repeats", type=int, default=5, help="rounds of the plane and the static caps")
    arg("--side-repeats", type=int, default=2, help="rounds of none and lanes")
    arg("--idle-repeats", type=int, default=3, help="rounds of the reads alone")
    arg("--slo-factor", type=float, default=1.4)
    arg("--caps", default="100,200,300,400,600,800", help="static caps to sweep, MB/s")
    arg("--report", action="store_true", help="print what was measured")
    arg("--out", type=Path, help="docs/BENCHMARKS.md records results/isolation.json")
    arg("--plot", type=Path, help="the latency CDFs, one panel a layout (PNG)")
    _quick.add_argument(p)
    args = p.parse_args(argv)
    if args.quick:  # every layout (b, c: the plane only), one cap, the report and the plot
        root = _quick.enter(args, p, files=())
        args.corpus_gb, args.state_gb, args.repeats, args.side_repeats = 0.02, 0.05, 1, 1
        args.idle_repeats = 1
        args.duration, args.warmup, args.governed_warmup, args.caps = 0.5, 0.1, 0.1, "200"
        args.layout, args.report = args.layout or ",".join(LAYOUTS), True
        args.plot = args.plot or root / "cdf.png"
    args.blocks = int(args.corpus_gb * C.GB) // BLOCK
    args.dir.mkdir(parents=True, exist_ok=True)
    for layout in [x for x in args.layout.split(",") if x]:
        if layout not in LAYOUTS:
            p.error(f"unknown layout {layout!r}; layouts: a, b, c")
        kept = args.dir / f"layout-{layout}.json"
        kept.write_text(json.dumps(measure_layout(args, layout)))
        log(f"kept {kept}")
    if args.report:
        datas = [json.loads((args.dir / f"layout-{k}.json").read_text())
                 for k in LAYOUTS if (args.dir / f"layout-{k}.json").exists()]
        if not datas:
            p.error(f"nothing measured in {args.dir}; run with --layout first")
        rows = headline_rows(datas)
        C.publish("isolation", render(datas), rows, args.out)
        if args.plot:
            plot(datas, args.plot)
    shutil.rmtree(args.dir / "runs", ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
