"""Read/write isolation across processes: KV read latency while checkpoints are saved.

An inference workload (8 threads of ``KVPool.get_blocks([key])``, 64 KiB blocks,
Zipf(1.0) keys over the corpus, no memory tier, O_DIRECT reads: every call reads the
device) runs beside a checkpoint save loop (a fp32 state dict, full writes) on one
host config, in three layouts:

  (a) the save loop in the same process as the reads (one shared scheduler);
  (b) the save loop in another process;
  (c) the save loop as a 2-rank torchrun job (gloo; both ranks write their half of
      one distributed snapshot), beside the reader process;

each with: no isolation (one shared FIFO pool, no governor), per-process lanes (lanes
and a governor per process), the host lane plane (lanes, one host governor over every
process), and an oracle sweep of static write caps (lanes, no governor; the cap is for
the host: each rank of (c) gets half). The oracle is the highest cap whose read p99
meets the SLO, ``--slo-factor`` x the layout's idle p99. Every run is fresh processes
started together; medians over rounds, the plane's and the caps' rounds interleaved.
Each layout is one invocation whose results are kept in ``--dir``; ``--report`` prints
every layout measured so far, draws the CDF plot and, with ``--out docs/BENCHMARKS.md``,
records the rows in ``benchmarks/results/isolation.json``.

    python benchmarks/bench_isolation.py --quick                 # smoke test, ~2 min
    python benchmarks/bench_isolation.py --layout a              # then b, then c
    python benchmarks/bench_isolation.py --report --out docs/BENCHMARKS.md \\
        --plot docs/isolation_cdf.png
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.metadata
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
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
LAYOUTS = {"a": "(a) same process", "b": "(b) another process",
           "c": "(c) 2-rank torchrun job"}
MODES: dict[str, dict[str, Any]] = {
    "none": {"label": "no isolation", "isolation": False, "governor": False,
             "host_plane": False},
    "lanes": {"label": "per-process lanes", "isolation": True, "governor": True,
              "host_plane": False},
    "plane": {"label": "host lane plane", "isolation": True, "governor": True,
              "host_plane": True},
}
# Rows that judge the oracle target (the governor and the static caps) get --repeats
# rounds; the others (solo, no isolation, per-process lanes) --side-repeats.
SIDE_ROWS = {"solo", "none", "lanes"}
TARGETS = {"p99_vs_idle": 1.5, "save_vs_oracle": 0.9}


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

    base = [sys.executable, str(Path(__file__).resolve()), "worker"]
    if layout == "a" and reads and saves:
        spawn([*base, "both", str(run_dir), "both", json.dumps(spec)], ["both"])
    else:
        if reads:
            spawn([*base, "reader", str(run_dir), "reader", json.dumps(spec)], ["reader"])
        if saves and layout == "c":
            spawn([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                   "--master-addr", "127.0.0.1", "--master-port", str(C.free_port()),
                   *base[1:], "saver", str(run_dir), "saver", json.dumps(spec)],
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
    rates = [math.inf if r is None else r for r in saver.get("rate_series") or []]
    return {"latencies_us": lat, "lane_latencies_us": lane, "written_bytes": written,
            "save_gbps": written / args.duration / C.GB if saves and saver else None,
            "rate_median_mb": statistics.median(rates) / MB if rates else None}


def pct(latencies: list[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(latencies), q)) if latencies else None


def median(values: list[float | None]) -> float | None:
    real = [v for v in values if v is not None]
    return statistics.median(real) if real else None


def fill_corpus(root: Path, kv_dir: Path, blocks: int) -> None:
    from isolane.config import config_from_dict
    from isolane.kvpool.pool import KVPool


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


# -- the worker processes -----------------------------------------------------------------
def block_key(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


def zipf_draw(n: int, seed: int) -> Any:
    weights = 1.0 / np.arange(1, n + 1)
    cdf = np.cumsum(weights) / weights.sum()
    perm = np.random.default_rng(seed).permutation(n)
    rng = np.random.default_rng(seed + 1)
    return lambda: int(perm[min(int(np.searchsorted(cdf, rng.random())), n - 1)])


def wait_start(run_dir: Path, name: str) -> float:
    (run_dir / f"{name}.ready").write_text("1")
    start = run_dir / "start"
    deadline = time.monotonic() + 300
    while not start.exists():
        if time.monotonic() > deadline:
            raise SystemExit("no start signal in 300 s")
        time.sleep(0.005)
    return float(start.read_text())


def run_reader(pool: Any, spec: dict[str, Any], start: float, stop_at: float) -> list[float]:
    lat: list[list[float]] = [[] for _ in range(8)]

    def reader(i: int) -> None:
        draw = zipf_draw(spec["blocks"], spec["seed"] * 100 + i)
        out = lat[i]
        while (now := time.monotonic()) < stop_at:
            key = block_key(draw())
            t0 = time.perf_counter()
            got = pool.get_blocks([key])[0]
            dt = time.perf_counter() - t0
            if got is None:
                raise SystemExit(f"block {key.hex()} missing from the corpus")
            if now >= start:
                out.append(dt * 1e6)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
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
    """``worker ROLE RUN_DIR NAME SPEC_JSON``: one process of a run. ROLE ``reader`` (8
    threads of ``get_blocks([key])``), ``saver`` (the save loop; under torchrun every rank
    saves its part of one distributed snapshot) or ``both`` (one process, one scheduler).
    It writes ``NAME.ready`` once set up, waits for ``start`` (a CLOCK_MONOTONIC time
    shared by all processes) and writes ``NAME.json`` with its results."""
    role, run_dir_s, name, spec_json = argv[:4]
    run_dir = Path(run_dir_s)
    spec = json.loads(spec_json)
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
    mode = spec["mode"]
    scheduler = LaneScheduler(config, isolation=mode["isolation"], governor=mode["governor"])
    pool = store = None
    if role in ("reader", "both"):
        pool = KVPool(config, namespace="bench", memory_budget=0, direct_reads=True,
                      scheduler=scheduler, **BYTE_BLOCKS)
    if role in ("saver", "both"):
        store = SnapshotStore(config, scheduler=scheduler)
    scheduler.join_host()
    # What the governor measures: each KV get's submit-to-completion in the read lane
    # (the callers' own CPU around it is not in it), over the same measured seconds.
    lane_us: list[float] = []
    measured = [float("inf"), float("-inf")]
    if pool is not None and scheduler.governor is not None:
        scheduler.governor.read.listeners.append(
            lambda seconds, _n, now: lane_us.append(seconds * 1e6)
            if measured[0] <= now < measured[1] else None)
    start = wait_start(run_dir, name)
    stop_at = start + spec["seconds"]
    measured[:] = [start, stop_at]
    out: dict[str, Any] = {}
    errors: list[BaseException] = []

    def saver() -> None:
        try:
            run_saver(store, spec, stop_at, rank)
        except BaseException as exc:
            errors.append(exc)

    def meter() -> None:  # the write lane's bytes inside the measured run, and what
        lane = scheduler.lanes["write"]  # the governor did: its host write rate every 0.1 s
        bucket = lane.bucket  # its bytes are counted per paced slice (1-4 MiB), the
        # lane's per finished job (a 64 MiB chunk: 6 % of a 5 s run at 0.2 GB/s)

        def moved() -> int:
            return bucket.consumed_bytes if bucket is not None else lane.counters.bytes

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

    metering = threading.Thread(target=meter) if store is not None else None
    if metering is not None:
        metering.start()
    thread = threading.Thread(target=saver) if store is not None else None
    if thread is not None:
        thread.start()
    if pool is not None:
        out["latencies_us"] = run_reader(pool, spec, start, stop_at)
        out["lane_latencies_us"] = list(lane_us)
    if thread is not None:
        thread.join()
    if metering is not None:
        metering.join()
    if errors:
        raise errors[0]
    if store is not None and rank == 0:
        for info in store.list():
            store.delete(info.name)
    (run_dir / f"{name}.json").write_text(json.dumps(out))
    if pool is not None:
        pool.close()
    scheduler.close()
    if "WORLD_SIZE" in os.environ:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    return 0


# -- one layout ----------------------------------------------------------------------------
def measure_layout(args: argparse.Namespace, layout: str) -> dict[str, Any]:
    kv_dir = args.dir / "kv"
    fill_corpus(args.dir, kv_dir, args.blocks)
    caps = [float(c) for c in args.caps.split(",") if c]
    lanes = MODES["lanes"]
    # each layout's first governed run starts cold; its later runs warm, from the host
    # limit the previous one settled at (lanes/memory.py)
    for memory in (args.dir / "planes").rglob("*.plane.memory"):
        memory.unlink()
    rows: dict[str, list[dict[str, Any]]] = {"idle": []}
    for r in range(args.idle_repeats):
        rows["idle"].append(run(args, layout, kv_dir=kv_dir, reads=True, saves=False,
                                slo_ms=5.0, mode=lanes, cap_mb=None, seed=r))
    idle_p99 = median([pct(x["latencies_us"], 99) for x in rows["idle"]])
    if idle_p99 is None:
        raise RuntimeError("the idle runs recorded no reads")
    slo_ms = idle_p99 * args.slo_factor / 1e3
    lane_idle = median([pct(x["lane_latencies_us"], 99) for x in rows["idle"]])
    # The governor measures the read lane's submit-to-completion, without the callers'
    # CPU around it: its SLO is the same margin over idle, added to the idle lane p99.
    gov_slo_ms = slo_ms if lane_idle is None else (
        lane_idle + (args.slo_factor - 1) * idle_p99) / 1e3
    log(f"{layout}: idle p99 {idle_p99:.0f} us (lane {lane_idle or 0:.0f} us) -> SLO "
        f"{slo_ms:.2f} ms, governor's {gov_slo_ms:.2f} ms")
    plan: list[tuple[str, dict[str, Any], float | None]] = [
        ("solo", {**lanes, "governor": False}, None)]
    plan += [(key, mode, None) for key, mode in MODES.items()]
    plan += [(f"cap {c:g}", {**lanes, "governor": False}, c) for c in caps]
    if args.quick and layout != "a":  # the other rows are layout a's, in seconds
        plan = [step for step in plan if step[0] == "plane"]
    for r in range(args.repeats):
        for key, mode, cap in plan:
            if key in SIDE_ROWS and r >= args.side_repeats:
                continue
            res = run(args, layout, kv_dir=kv_dir, reads=key != "solo", saves=True,
                      slo_ms=gov_slo_ms, mode=mode, cap_mb=cap, seed=r)
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
def fmt_us(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def fmt_rate(mb: float | None) -> str:
    if mb is None:
        return "-"
    return "unlimited" if math.isinf(mb) else f"{mb:.0f}"


def summarize(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out = {}
    for key, runs in data["rows"].items():
        out[key] = {"p50": median([pct(r["latencies_us"], 50) for r in runs]),
                    "p99": median([pct(r["latencies_us"], 99) for r in runs]),
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


def row_label(key: str, oracle: str | None) -> str:
    if key in MODES:
        return str(MODES[key]["label"])
    return f"static cap {key[4:]} MB/s" + (" (oracle)" if key == oracle else "")


def render(datas: list[dict[str, Any]]) -> str:
    first = datas[0]
    parts = [
        "## Read/write isolation across processes: KV reads under checkpoint saves "
        "(`benchmarks/bench_isolation.py`)", "",
        "Commands: " + "; ".join(f"`{d['command']}` ({d['date']})" for d in datas) + "  ",
        f"Machine: {first['machine']}", "",
        f"Workload: {first['blocks']} KV blocks of 64 KiB read by 8 threads calling "
        "`KVPool.get_blocks([key])` with Zipf(1.0) keys, memory tier 0 B, O_DIRECT; a save "
        f"loop of a {first['state_gb']:g} GB fp32 state dict in the layout named. Save GB/s "
        "= bytes the write lanes moved during the run / its seconds. Runs of "
        f"{first['duration_s']:g} s after {first['governed_warmup_s']:g} s of warm-up, "
        f"medians of {first['repeats']} rounds for the plane and the caps (interleaved), "
        f"{first['side_repeats']} for the other rows. SLO = {first['slo_factor']:g} x the "
        "layout's idle p99; *oracle*: the highest static cap whose p99 meets it."]
    for data in datas:
        s = summarize(data)
        idle, solo = s["idle"]["p99"], s.get("solo", {}).get("gbps")
        oracle = oracle_of(data, s)
        oracle_gbps = s[oracle]["gbps"] if oracle else None
        rows = [["KV reads alone (idle)", fmt_us(s["idle"]["p50"]), fmt_us(idle), "1.00x",
                 "-", "-", "-", "-"],
                ["save loop alone (lanes, no cap)", "-", "-", "-",
                 f"{solo:.2f}" if solo else "-", "100 %", "-", "-"]]
        for key in [*MODES, *(f"cap {c:g}" for c in data["caps_mb"])]:
            if key in s:
                row = s[key]
                rows.append([row_label(key, oracle), fmt_us(row["p50"]), fmt_us(row["p99"]),
                             C.fmt_ratio(C.ratio(row["p99"], idle)),
                             "-" if row["gbps"] is None else f"{row['gbps']:.2f}",
                             C.fmt_ratio(C.ratio(row["gbps"], solo), percent=True),
                             C.fmt_ratio(C.ratio(row["gbps"], oracle_gbps), percent=True),
                             key[4:] if key.startswith("cap ") else fmt_rate(row["rate_mb"])])
        parts += ["", f"### {LAYOUTS[data['layout']]}", "",
                  f"Idle p99 {fmt_us(idle)} µs; SLO {data['slo_ms']:.2f} ms; the governor's "
                  f"`read_p99_slo_ms` {data['governor_slo_ms']:.2f}.", "",
                  C.markdown_table(["run", "p50 µs", "p99 µs", "p99 vs idle", "save GB/s",
                                    "vs solo", "vs oracle", "governor rate MB/s"], rows)]
    return "\n".join(parts)


def headline_rows(datas: list[dict[str, Any]]) -> list[_results.Result]:
    """Per layout: the plane's read p99 against idle and against no isolation, and its
    save throughput against the oracle cap's, all from that layout's run."""
    out: list[_results.Result] = []
    for data in datas:
        s = summarize(data)
        where = {"machine": data["machine"], "date": data["date"], "command": data["command"]}
        name = LAYOUTS[data["layout"]]
        plane, idle = s.get("plane", {}), s["idle"]["p99"]
        if plane.get("p99") is None or idle is None:
            continue
        p99 = round(plane["p99"])
        out.append(_results.Result(
            area="Isolation", measure=f"{name}: KV read p99 under saves / idle, host lane "
            "plane", value=p99, unit="µs", peer="KV reads alone (idle)",
            peer_value=round(idle), ratio=round(plane["p99"] / idle, 2),
            target=f"≤ {TARGETS['p99_vs_idle']}x",
            met=plane["p99"] / idle <= TARGETS["p99_vs_idle"], **where))
        for key in ("none", "lanes"):
            if s.get(key, {}).get("p99"):
                out.append(_results.Result(
                    area="Isolation", measure=f"{name}: KV read p99 under saves, host lane "
                    "plane", value=p99, unit="µs", peer=MODES[key]["label"],
                    peer_value=round(s[key]["p99"]), ratio=round(s[key]["p99"] / plane["p99"], 2),
                    **where))
        oracle = oracle_of(data, s)
        if oracle and plane.get("gbps") and s[oracle]["gbps"]:
            share = plane["gbps"] / s[oracle]["gbps"]
            met = share >= TARGETS["save_vs_oracle"]
            out.append(_results.Result(
                area="Isolation", measure=f"{name}: save throughput within the SLO / the "
                "oracle cap", value=round(plane["gbps"], 2), unit="GB/s",
                peer=f"best static cap meeting the SLO ({oracle[4:]} MB/s)",
                peer_value=round(s[oracle]["gbps"], 2), ratio=round(share * 100),
                ratio_unit="%", target=f"≥ {TARGETS['save_vs_oracle'] * 100:.0f} %", met=met,
                why=None if met or plane.get("rate_mb") is None else
                f"the host write limit held a median {fmt_rate(plane['rate_mb'])} MB/s "
                f"against the oracle's {oracle[4:]}", **where))
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
            label = ("reads alone" if key == "idle" else row_label(key, oracle)
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
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        return worker(argv[1:])
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--dir", type=Path, default=C.REPO_ROOT / ".bench" / "isolation")
    p.add_argument("--layout", default="", help="comma list of a, b, c to measure")
    p.add_argument("--corpus-gb", type=float, default=1.0)
    p.add_argument("--state-gb", type=float, default=0.4,
                   help="the save loop's state dict: 0.4 GB puts several saves in a run")
    p.add_argument("--duration", type=float, default=4.0, help="measured seconds a run")
    p.add_argument("--warmup", type=float, default=1.5,
                   help="seconds the reads run alone before an idle run's measured seconds")
    p.add_argument("--governed-warmup", type=float, default=5.0,
                   help="the warm-up of every run with saves: a fresh governor converges "
                   "in it; static caps get the same window")
    p.add_argument("--repeats", type=int, default=5,
                   help="rounds of the host plane and every static cap, interleaved")
    p.add_argument("--side-repeats", type=int, default=2,
                   help="rounds of the other rows (solo, no isolation, per-process lanes)")
    p.add_argument("--idle-repeats", type=int, default=3,
                   help="rounds of the reads alone (their median p99 sets the SLO)")
    p.add_argument("--slo-factor", type=float, default=1.4)
    p.add_argument("--caps", default="100,200,300,400,600,800",
                   help="static caps to sweep, MB/s")
    p.add_argument("--report", action="store_true", help="print what was measured")
    p.add_argument("--out", type=Path, help="docs/BENCHMARKS.md records the rows in "
                   "benchmarks/results/isolation.json; another file gets the report")
    p.add_argument("--plot", type=Path, help="the latency CDFs, one panel a layout (PNG)")
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
        data = measure_layout(args, layout)
        kept = args.dir / f"layout-{layout}.json"
        kept.write_text(json.dumps(data))
        log(f"kept {kept}")
    if args.report:
        datas = [json.loads((args.dir / f"layout-{k}.json").read_text())
                 for k in LAYOUTS if (args.dir / f"layout-{k}.json").exists()]
        if not datas:
            p.error(f"nothing measured in {args.dir}; run with --layout first")
        rows = headline_rows(datas)
        C.print_report(render(datas) + "\n\n" + _results.rows_markdown(rows), args.out,
                       "isolation")
        if args.out and _results.is_page(args.out):
            _results.write_results("isolation", rows)
        if args.plot:
            plot(datas, args.plot)
    with contextlib.suppress(OSError):
        shutil.rmtree(args.dir / "runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
