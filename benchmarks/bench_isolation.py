"""Read/write isolation: KV random-read latency while checkpoints are saved.

A KV random-read workload (64 KiB blocks, Zipf(1.0) over the corpus, 8 concurrent
callers of ``KVPool.get_blocks``, memory tier 0 B and O_DIRECT reads, so every call is
a real device read) runs alone, then together with a continuous checkpoint save loop
(``SnapshotStore.save`` of a multi-GB state dict, full writes, through the write lane),
in three modes of one process-wide ``LaneScheduler`` shared by the pool and the store:

  (a) no isolation: one shared pool of workers, no priorities, no governor;
  (b) lanes: separate worker pools and budgets per lane, no governor;
  (c) lanes + governor: AIMD on the KV read p99 against ``qos.read_p99_slo_ms``.

and once more with the read group on another filesystem (a tmpfs) to show physical
isolation. Reports KV read p50/p99/p999 and checkpoint GB/s for each (medians over
rounds), and draws the read-latency CDFs into one PNG. The SLO is set from the idle
run: ``--slo-factor`` x the idle p99, the way an operator would set it.

    python benchmarks/bench_isolation.py --out docs/BENCHMARKS.md --plot docs/isolation_cdf.png
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _common as C
import numpy as np

C.ensure_repo_importable()

import torch  # noqa: E402

from isolane.config import Config, config_from_dict  # noqa: E402
from isolane.kvpool.pool import KVPool  # noqa: E402
from isolane.lanes.scheduler import LaneScheduler  # noqa: E402
from isolane.snapshot.store import SnapshotStore  # noqa: E402

BLOCK = 64 << 10
TMPFS = Path("/mnt/isolane-bench-kv")

MODES: dict[str, dict[str, Any]] = {
    "a": {"label": "(a) no isolation: shared workers, no governor",
          "isolation": False, "governor": False},
    "b": {"label": "(b) lanes, no governor", "isolation": True, "governor": False},
    "c": {"label": "(c) lanes + governor", "isolation": True, "governor": True},
}


# -- setup -------------------------------------------------------------------------------
def make_config(root: Path, kv_dir: Path, *, slo_ms: float, read_threads: int) -> Config:
    return config_from_dict({
        "home": str(root),
        "device_groups": {
            "ckpt": {"role": "write", "devices": [str(root / "ckpt")]},
            "kv": {"role": "read", "devices": [str(kv_dir)], "threads": read_threads},
        },
        "qos": {"read_p99_slo_ms": slo_ms},
    })


def block_key(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


def fill_corpus(config: Config, blocks: int) -> None:
    with KVPool(config, namespace="bench", memory_budget=0) as pool:
        if sum(len(lg) for lg in pool.logs) >= blocks:
            return
        rng = np.random.default_rng(0)
        batch = 256
        for start in range(0, blocks, batch):
            n = min(batch, blocks - start)
            data = rng.integers(0, 255, size=(n, BLOCK), dtype=np.uint8)
            pool.put_blocks([block_key(start + j) for j in range(n)], list(data))
    C.fsync_tree(Path(config.require_group("read").devices[0]))


def make_state_dict(nbytes: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    per = 64 << 20
    return {f"layer{i}.weight": torch.randn(per // 2, generator=gen).to(torch.bfloat16)
            for i in range(max(1, nbytes // per))}


def zipf_sampler(n: int, s: float, seed: int) -> Callable[[], int]:
    weights = 1.0 / np.arange(1, n + 1) ** s
    cdf = np.cumsum(weights) / weights.sum()
    perm = np.random.default_rng(seed).permutation(n)  # hot blocks spread over the log
    rng = np.random.default_rng(seed + 1)

    def draw() -> int:
        return int(perm[min(int(np.searchsorted(cdf, rng.random())), n - 1)])

    return draw


# -- workloads ---------------------------------------------------------------------------
@dataclasses.dataclass
class RunResult:
    latencies_us: list[float]
    ckpt_bytes: int
    ckpt_seconds: float
    saves: int
    governor_rates: list[float]

    def percentile(self, q: float) -> float | None:
        if not self.latencies_us:
            return None
        return float(np.percentile(np.asarray(self.latencies_us), q))

    @property
    def ckpt_gbps(self) -> float | None:
        return self.ckpt_bytes / self.ckpt_seconds / C.GB if self.ckpt_seconds else None


def run(config: Config, mode: dict[str, Any], *, kv: bool, save: bool, duration: float,
        blocks: int, concurrency: int, state: dict[str, torch.Tensor], seed: int) -> RunResult:
    scheduler = LaneScheduler(config, isolation=mode["isolation"], governor=mode["governor"])
    pool = KVPool(config, namespace="bench", memory_budget=0, direct_reads=True,
                  scheduler=scheduler)
    store = SnapshotStore(config, scheduler=scheduler)
    stop = threading.Event()
    lat: list[list[float]] = [[] for _ in range(concurrency)]
    errors: list[BaseException] = []
    saved = {"bytes": 0, "seconds": 0.0, "saves": 0}
    rates: list[float] = []
    state_bytes = sum(t.numel() * t.element_size() for t in state.values())

    def reader(i: int) -> None:
        draw = zipf_sampler(blocks, 1.0, seed * 100 + i)
        out = lat[i]
        try:
            while not stop.is_set():
                key = block_key(draw())
                t0 = time.perf_counter()
                got = pool.get_blocks([key])[0]
                out.append((time.perf_counter() - t0) * 1e6)
                if got is None:
                    raise AssertionError(f"block {key.hex()} missing")
        except BaseException as exc:
            errors.append(exc)

    def saver() -> None:
        n = 0
        try:
            while not stop.is_set():
                t0 = time.perf_counter()
                store.save(state, f"loop-{n}", parent=False, mirror=False)
                dt = time.perf_counter() - t0
                if stop.is_set() and kv:
                    break  # a save cut by the end of the run is not counted
                saved["bytes"] += state_bytes
                saved["seconds"] += dt
                saved["saves"] += 1
                if n:
                    store.delete(f"loop-{n - 1}")
                n += 1
        except BaseException as exc:
            errors.append(exc)

    def governor_probe() -> None:
        while not stop.wait(0.25):
            gov = scheduler.stats().get("governor", {})
            rate = gov.get("write_rate_bytes_per_s")
            if rate is not None:
                rates.append(float(rate))

    threads = []
    if kv:
        threads += [threading.Thread(target=reader, args=(i,)) for i in range(concurrency)]
    if save:
        threads.append(threading.Thread(target=saver))
    threads.append(threading.Thread(target=governor_probe))
    for t in threads:
        t.start()
    time.sleep(duration)
    stop.set()
    for t in threads:
        t.join()
    for name in store.list():
        store.delete(name.name if hasattr(name, "name") else str(name))
    pool.close()
    scheduler.close()
    if errors:
        raise errors[0]
    return RunResult([x for part in lat for x in part], int(saved["bytes"]),
                     float(saved["seconds"]), int(saved["saves"]), rates)


# -- tmpfs for the physical-isolation run ------------------------------------------------
def mount_tmpfs(size_bytes: int) -> Path | None:
    TMPFS.mkdir(parents=True, exist_ok=True)
    if subprocess.run(["mountpoint", "-q", str(TMPFS)], check=False).returncode == 0:
        return TMPFS
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs",
                           str(TMPFS)], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        print(f"no tmpfs ({proc.stderr.strip()}): physical run skipped", file=sys.stderr)
        return None
    return TMPFS


def unmount_tmpfs() -> None:
    subprocess.run(["umount", str(TMPFS)], check=False)


# -- report ------------------------------------------------------------------------------
def fmt_us(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def median_of(values: list[float | None]) -> float | None:
    real = [v for v in values if v is not None]
    return statistics.median(real) if real else None


def plot(cdfs: dict[str, list[float]], path: Path, slo_us: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for label, values in cdfs.items():
        xs = np.sort(np.asarray(values))
        ys = np.arange(1, len(xs) + 1) / len(xs)
        ax.plot(xs / 1000, ys, label=label)
    ax.axvline(slo_us / 1000, color="grey", linestyle=":", label="read p99 SLO")
    ax.set_xscale("log")
    ax.set_xlabel("KV read latency (ms, log scale)")
    ax.set_ylabel("fraction of reads")
    ax.set_ylim(0.5, 1.001)
    ax.set_title("KV 64 KiB random reads (Zipf 1.0, 8 callers), with and without a "
                 "concurrent checkpoint save", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, default=C.REPO_ROOT / ".bench" / "isolation")
    p.add_argument("--corpus-gb", type=float, default=2.0)
    p.add_argument("--state-gb", type=float, default=2.0)
    p.add_argument("--duration", type=float, default=15.0, help="seconds a run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--slo-factor", type=float, default=1.25)
    p.add_argument("--no-physical", action="store_true")
    p.add_argument("--modes", default="a,b,c", help="comma list of a, b, c")
    p.add_argument("--switch-interval-ms", type=float,
                   help="sys.setswitchinterval for this process (Python's default: 5 ms)")
    p.add_argument("--quick", action="store_true", help="smoke test (~1 min)")
    p.add_argument("--out", type=Path)
    p.add_argument("--section", default="isolation")
    p.add_argument("--plot", type=Path)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if args.quick:
        args.corpus_gb, args.state_gb, args.repeats = 0.2, 0.25, 1
        args.duration = min(args.duration, 3.0)

    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1000)
    modes = {k: MODES[k] for k in args.modes.split(",")}
    root = args.dir
    root.mkdir(parents=True, exist_ok=True)
    blocks = int(args.corpus_gb * C.GB) // BLOCK
    state = make_state_dict(int(args.state_gb * C.GB))
    state_bytes = sum(t.numel() * t.element_size() for t in state.values())
    log = lambda msg: print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)  # noqa: E731

    disk_config = make_config(root, root / "kv", slo_ms=5.0, read_threads=args.concurrency)
    log(f"filling {blocks} blocks of 64 KiB on {root / 'kv'}")
    fill_corpus(disk_config, blocks)
    common = {"duration": args.duration, "blocks": blocks, "concurrency": args.concurrency,
              "state": state}

    # Idle first: it sets the SLO the governor defends.
    idle_runs = [run(disk_config, MODES["b"], kv=True, save=False, seed=r, **common)
                 for r in range(args.repeats)]
    idle_p99 = median_of([r.percentile(99) for r in idle_runs])
    assert idle_p99 is not None
    slo_ms = idle_p99 * args.slo_factor / 1000
    log(f"idle p99 {idle_p99:.0f} us -> SLO {slo_ms:.2f} ms")
    config = make_config(root, root / "kv", slo_ms=slo_ms, read_threads=args.concurrency)

    results: dict[str, dict[str, list[RunResult]]] = {}
    for key, mode in modes.items():
        results[key] = {"solo_save": [], "together": []}
        for r in range(args.repeats):
            solo = run(config, mode, kv=False, save=True, seed=r, **common)
            log(f"{key} round {r}: save alone {solo.ckpt_gbps or 0:.2f} GB/s")
            both = run(config, mode, kv=True, save=True, seed=r, **common)
            log(f"{key} round {r}: together p99 {both.percentile(99) or 0:.0f} us, save "
                f"{both.ckpt_gbps or 0:.2f} GB/s")
            results[key]["solo_save"].append(solo)
            results[key]["together"].append(both)

    physical: dict[str, list[RunResult]] = {}
    tmpfs_bytes = int(args.corpus_gb * C.GB * 1.3) + (256 << 20)
    tmpfs = None if args.no_physical else mount_tmpfs(tmpfs_bytes)
    if tmpfs is not None:
        try:
            phys_config = make_config(root, tmpfs / "kv", slo_ms=slo_ms,
                                      read_threads=args.concurrency)
            log("physical isolation: read group on tmpfs")
            fill_corpus(phys_config, blocks)
            physical = {"idle": [], "together": []}
            for r in range(args.repeats):
                physical["idle"].append(run(phys_config, MODES["c"], kv=True, save=False,
                                            seed=r, **common))
                physical["together"].append(run(phys_config, MODES["c"], kv=True, save=True,
                                                seed=r, **common))
        finally:
            unmount_tmpfs()

    report = render(args, idle_runs, results, physical, slo_ms, state_bytes, blocks)
    print(report)
    if args.out:
        C.replace_section(args.out, args.section, report)
        log(f"wrote section '{args.section}' of {args.out}")
    if args.plot:
        cdfs = {"KV reads alone (idle)": idle_runs[len(idle_runs) // 2].latencies_us}
        for key, mode in MODES.items():
            if key not in results:
                continue
            runs = results[key]["together"]
            cdfs[f"with a save: {mode['label']}"] = runs[len(runs) // 2].latencies_us
        plot(cdfs, args.plot, slo_ms * 1000)
        log(f"wrote {args.plot}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary(idle_runs, results, physical, slo_ms), indent=1))
    return 0


def summary(idle: list[RunResult], results: dict[str, dict[str, list[RunResult]]],
            physical: dict[str, list[RunResult]], slo_ms: float) -> dict[str, Any]:
    def pct(runs: list[RunResult]) -> dict[str, float | None]:
        return {f"p{q}": median_of([r.percentile(q) for r in runs]) for q in (50, 99, 99.9)}

    return {
        "slo_ms": slo_ms, "idle": pct(idle),
        "modes": {k: {"together": pct(v["together"]),
                      "save_gbps_solo": median_of([r.ckpt_gbps for r in v["solo_save"]]),
                      "save_gbps_together": median_of([r.ckpt_gbps for r in v["together"]])}
                  for k, v in results.items()},
        "physical": {k: pct(v) for k, v in physical.items()},
    }


def render(args: argparse.Namespace, idle: list[RunResult],
           results: dict[str, dict[str, list[RunResult]]],
           physical: dict[str, list[RunResult]], slo_ms: float, state_bytes: int,
           blocks: int) -> str:
    def row(label: str, runs: list[RunResult], save_runs: list[RunResult] | None,
            solo: float | None) -> list[object]:
        p = [median_of([r.percentile(q) for r in runs]) for q in (50, 99, 99.9)]
        gbps = median_of([r.ckpt_gbps for r in save_runs]) if save_runs else None
        idle_p99 = median_of([r.percentile(99) for r in idle])
        return [label, fmt_us(p[0]), fmt_us(p[1]), fmt_us(p[2]),
                C.fmt_ratio(C.ratio(p[1], idle_p99)) if runs else "-",
                "-" if gbps is None else f"{gbps:.2f}",
                C.fmt_ratio(C.ratio(gbps, solo), percent=True) if gbps and solo else "-",
                ", ".join(fmt_us(r.percentile(99)) for r in runs) or "-"]

    headers = ["run", "p50 µs", "p99 µs", "p999 µs", "p99 vs idle", "save GB/s",
               "save vs its solo", "p99 of each round (µs)"]
    rows: list[list[object]] = [row("KV reads alone (idle)", idle, None, None)]
    for key, mode in MODES.items():
        if key not in results:
            continue
        solo_runs = results[key]["solo_save"]
        solo = median_of([r.ckpt_gbps for r in solo_runs])
        rows.append([f"{mode['label']}: save alone", "-", "-", "-", "-",
                     "-" if solo is None else f"{solo:.2f}", "100 %", "-"])
        rows.append(row(f"{mode['label']}: KV reads + save", results[key]["together"],
                        results[key]["together"], solo))
    targets = []
    gov = results["c"]
    p99_c = median_of([r.percentile(99) for r in gov["together"]])
    idle_p99 = median_of([r.percentile(99) for r in idle])
    share = C.ratio(median_of([r.ckpt_gbps for r in gov["together"]]),
                    median_of([r.ckpt_gbps for r in gov["solo_save"]]))
    r1 = C.ratio(p99_c, idle_p99)
    targets.append(["(c) KV p99 under a save / idle p99", C.fmt_ratio(r1), "≤ 1.5x",
                    "yes" if r1 is not None and r1 <= 1.5 else "**no**"])
    targets.append(["(c) save throughput under KV reads / save alone",
                    C.fmt_ratio(share, percent=True), "≥ 50 %",
                    "yes" if share is not None and share >= 0.5 else "**no**"])
    for key in ("a", "b"):
        if key not in results:
            continue
        p99 = median_of([r.percentile(99) for r in results[key]["together"]])
        targets.append([f"({key}) KV p99 under a save / idle p99 (what users suffer)",
                        C.fmt_ratio(C.ratio(p99, idle_p99)), "", ""])
    rates = [x for r in gov["together"] for x in r.governor_rates]
    phys_rows = []
    if physical:
        phys_rows = [row("read group on tmpfs: KV reads alone", physical["idle"], None, None),
                     row("read group on tmpfs: KV reads + save (lanes + governor)",
                         physical["together"], physical["together"],
                         median_of([r.ckpt_gbps for r in gov["solo_save"]]))]
    parts = [
        "## Read/write isolation: KV reads under a checkpoint save "
        "(`benchmarks/bench_isolation.py`)",
        "",
        f"Command: `{C.command_line()}`  ",
        f"Date: {C.now_text()}  ",
        "Machine: " + C.machine_description(args.dir, {"torch": torch.__version__}) + "  ",
        f"isolane: commit {git_commit()}",
        "",
        f"Workload: {blocks} KV blocks of 64 KiB ({blocks * BLOCK / C.GB:.2f} GB) read by "
        f"{args.concurrency} threads calling `KVPool.get_blocks([key])` with Zipf(1.0) keys, "
        "memory tier 0 B and O_DIRECT reads (`direct_reads=True`: every call reads the "
        f"device); a checkpoint loop saving a {state_bytes / C.GB:.2f} GB bf16 state dict "
        "(full writes, `parent=False`, the previous snapshot deleted after each) through "
        f"the write lane. Runs of {args.duration:.0f} s, medians of {args.repeats} rounds. "
        "Pool and store share one `LaneScheduler` per run, built in the mode named. "
        f"SLO: `qos.read_p99_slo_ms` = {slo_ms:.2f} ms = {args.slo_factor} x the idle p99. "
        "Checkpoint and KV folders are on the same disk unless stated (only the tmpfs rows "
        "have physically separate storage).",
        "",
        C.markdown_table(headers, rows + phys_rows),
        "",
        "![KV read latency CDFs](isolation_cdf.png)",
        "",
        "### Targets",
        "",
        C.markdown_table(["ratio", "value", "target", "met"], targets),
        "",
        (f"Governor write rate during the (c) runs with KV reads: median "
         f"{statistics.median(rates) / 1e6:.0f} MB/s, min {min(rates) / 1e6:.0f} MB/s, "
         f"max {max(rates) / 1e6:.0f} MB/s (sampled every 0.25 s; floor "
         f"{config_floor() / 1e6:.0f} MB/s)." if rates else
         "The governor reported no rate during the (c) runs."),
    ]
    return "\n".join(parts)


def config_floor() -> int:
    from isolane.config import QosConfig

    return QosConfig().write_bandwidth_min


def git_commit() -> str:
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, cwd=C.REPO_ROOT, check=False)
    return proc.stdout.strip() or "unknown"


if __name__ == "__main__":
    sys.exit(main())
