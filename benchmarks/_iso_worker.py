"""One process of ``bench_isolation.py``: KV reader, checkpoint saver, or both.

    python benchmarks/_iso_worker.py ROLE RUN_DIR NAME SPEC_JSON

ROLE ``reader`` (8 threads of ``KVPool.get_blocks([key])``, Zipf keys, no memory
tier, O_DIRECT), ``saver`` (a save loop of a fp32 state dict, full writes; under
torchrun every rank saves its part of one distributed snapshot), or ``both`` (the two
in one process sharing one scheduler). SPEC_JSON: the config dict, the state bytes,
the corpus blocks, the seconds and the seed. The process writes ``NAME.ready`` (per
rank under torchrun) once set up, waits for ``start`` (a CLOCK_MONOTONIC time, shared
by all processes) and writes ``NAME.json`` (per rank) with its results.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

BLOCK = 64 << 10


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


def run_saver(store: Any, spec: dict[str, Any], start: float, stop_at: float,
              rank: int) -> dict[str, Any]:
    import torch

    world = int(os.environ.get("WORLD_SIZE", "1"))
    per = 64 << 20
    count = max(1, spec["state_bytes"] // world // per)
    state = {f"r{rank}.layer{i}": torch.empty(per // 4).fill_(float(i + rank))
             for i in range(count)}
    nbytes = count * per * world  # what one (distributed) save commits
    saved = 0
    n = 0
    rates: list[float] = []
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
        done = time.monotonic()
        if start <= done <= stop_at:
            saved += nbytes
        gov = store.scheduler.stats()["governor"]
        if gov.get("write_rate_bytes_per_s") is not None:
            rates.append(float(gov["write_rate_bytes_per_s"]))
        if n and rank == 0:
            store.delete(f"loop-{n - 1}")
        n += 1
    return {"saved_bytes": saved, "seconds": stop_at - start, "saves": n, "rates": rates}


def main() -> int:
    role, run_dir_s, name, spec_json = sys.argv[1:5]
    run_dir = Path(run_dir_s)
    spec = json.loads(spec_json)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from isolane.config import config_from_dict
    from isolane.kvpool.pool import KVPool
    from isolane.lanes.scheduler import LaneScheduler
    from isolane.snapshot.store import SnapshotStore

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _kv_bytes import BYTE_BLOCKS

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
            out.update(run_saver(store, spec, start, stop_at, rank))
        except BaseException as exc:
            errors.append(exc)

    def meter() -> None:  # the write lane's bytes inside the measured run, and what
        lane = scheduler.lanes["write"]  # the governor did: its host write rate every 0.1 s
        bucket = lane.bucket  # its bytes are counted per paced slice (1-4 MiB), the
        # lane's per finished job (a 64 MiB chunk: 6 % of a 5 s run at 0.2 GB/s)

        def moved() -> int:
            return bucket.consumed_bytes if bucket is not None else lane.counters.bytes

        time.sleep(max(0.0, start - time.monotonic()))
        before, jobs_before = moved(), lane.counters.bytes
        cpu0 = time.process_time()  # every thread of this process
        series: list[float | None] = []
        gov: dict[str, Any] = {}
        while time.monotonic() < stop_at:
            gov = scheduler.stats()["governor"]
            host = gov.get("host") or {}
            rate = (host["write_rate_bytes_per_s"] if host.get("joined")
                    else gov.get("write_rate_bytes_per_s"))
            series.append(None if rate is None else float(rate))
            time.sleep(max(0.0, min(0.1, stop_at - time.monotonic())))
        out["written_bytes"] = moved() - before
        out["written_job_bytes"] = lane.counters.bytes - jobs_before
        out["meter"] = "bucket" if bucket is not None else "jobs"
        out["cpu_s"] = time.process_time() - cpu0
        out["rate_series"] = series
        warm = (gov.get("host") or {}).get("warm_start_bytes_per_s")
        out["warm_start"] = warm if isinstance(warm, int | float) else None
        out["decisions"] = [d for d in ((gov.get("host") or {}).get("decisions")
                                        or gov.get("decisions") or []) if isinstance(d, dict)]

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


if __name__ == "__main__":
    sys.exit(main())
