#!/usr/bin/env python
"""KV pool at scale: put and lookup rates, a single ``get_blocks``'s latency, the key
directory's memory per block and the reopen time, for pools of millions of blocks; LMDB on
the same blocks beside it.

    python benchmarks/bench_kv_scale.py --quick    # smoke test: both stores, 20,000 blocks
    python benchmarks/bench_kv_scale.py run --store isolane --json .bench/scale.json
    python benchmarks/bench_kv_scale.py run --store lmdb --json .bench/scale.json
    python benchmarks/bench_kv_scale.py report --json .bench/scale.json --out docs/BENCHMARKS.md

A ``run`` (one store, one size, alone on the machine) replaces its row in the JSON file;
``report`` prints the isolane rows beside LMDB's of the same size and, with ``--out
docs/BENCHMARKS.md``, records them. Both stores get batches of 4096 blocks
(16-byte random keys): isolane a ``KVPool`` (memory tier 0 bytes) with ``put_blocks``,
``lookup_blocks`` and ``get_blocks([key])``; LMDB a write transaction per batch and
``txn.get``. Puts go to the page cache (the first 2 GiB are rated apart: past them the
kernel's dirty limits set the pace); single gets (2000) run on a warm page cache. The
reopen runs in fresh processes (``child``), cold (page cache dropped, else the files
dropped with ``posix_fadvise``) and warm; its memory is isolane's heap as ``tracemalloc``
counts it (in a third process: tracing slows the open) and LMDB's RSS (its pages are
mapped, not allocated). Medians of ``--repeats``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _common as C
import _quick
import _results
import numpy as np
from _kv_bytes import BYTE_BLOCKS, fix_layout

C.ensure_repo_importable()
from tests.support.page_cache import evict  # noqa: E402

BATCH, SINGLE_GETS, LOOKUPS = 4096, 2000, 400_000
PAGE_CACHE_BYTES = 2 << 30  # under the kernel's dirty_background_ratio here
QUICK = {"blocks": 20_000, "block_bytes": 512, "segment_mib": 2}  # several sealed segments
TARGETS = {"put": 200_000, "lookup": 300_000, "index": 64.0, "cold": 0.2}


class Blocks:
    """``n`` blocks: 16-byte random keys, values that are views into a random buffer."""

    def __init__(self, n: int, block_bytes: int) -> None:
        rng = np.random.default_rng(15)
        self.n, self.block_bytes = n, block_bytes
        self.raw_keys = rng.integers(0, 256, (n, 16), np.uint8).tobytes()
        self.data = memoryview(rng.integers(0, 256, max(8 << 20, 4 * block_bytes),
                                            np.uint8).tobytes())
        self.span = len(self.data) - block_bytes

    def key(self, i: int) -> bytes:
        return self.raw_keys[16 * i:16 * i + 16]

    def value(self, i: int) -> memoryview:
        off = (i * 4160) % self.span
        return self.data[off:off + self.block_bytes]


def measure_store(name: str, blocks: Blocks, put: Callable[[list[bytes], list[memoryview]], Any],
                  flush: Callable[[], Any], lookup: Callable[[list[bytes]], int],
                  get: Callable[[bytes], Any]) -> dict[str, Any]:
    """Put every block in batches (then ``flush``), look up random stored keys in
    batches, get single random blocks; the seconds of each, as a row keeps them."""
    n = blocks.n
    head, head_n, put_s, head_s = min(n, PAGE_CACHE_BYTES // (blocks.block_bytes + 64)), 0, 0., 0.
    for a in range(0, n, BATCH):
        ids = range(a, min(n, a + BATCH))
        keys, values = [blocks.key(i) for i in ids], [blocks.value(i) for i in ids]
        t = time.perf_counter()
        put(keys, values)
        put_s += time.perf_counter() - t
        if a + BATCH <= head:
            head_s, head_n = put_s, a + BATCH
    flush()
    rng = np.random.default_rng(7)
    probe_ids = rng.integers(0, n, min(LOOKUPS, 5 * n))
    lookup_s = 0.0
    for a in range(0, len(probe_ids), BATCH):
        keys = [blocks.key(int(i)) for i in probe_ids[a:a + BATCH]]
        t = time.perf_counter()
        found = lookup(keys)
        lookup_s += time.perf_counter() - t
        if found != len(keys):
            raise RuntimeError(f"{name} found {found} of {len(keys)} stored keys")
    singles = []
    for j, i in enumerate(rng.integers(0, n, SINGLE_GETS).tolist()):
        t = time.perf_counter()
        got = get(blocks.key(i))
        singles.append(time.perf_counter() - t)
        if got is None or (j % 64 == 0 and bytes(got) != bytes(blocks.value(i))):
            raise RuntimeError(f"{name} returned wrong bytes for block {i}")
    return {"put_s": put_s, "head_s": head_s, "head_n": head_n, "lookup_s": lookup_s,
            "lookups": len(probe_ids), "single_get_s": singles}


def run_isolane(args: argparse.Namespace, blocks: Blocks, root: Path) -> dict[str, Any]:
    from isolane.config import config_from_dict
    from isolane.kvpool.namespace_files import namespace_dir
    from isolane.kvpool.pool import KVPool
    from isolane.lanes.scheduler import LaneScheduler

    device = root / "isolane"
    config = config_from_dict({"device_groups": {"kv": {"role": "read",
                                                        "devices": [str(device)]}}})
    scheduler = LaneScheduler(config)
    segment_bytes = args.segment_mib << 20
    pool = KVPool(config, namespace="scale", memory_budget=0, segment_bytes=segment_bytes,
                  scheduler=scheduler, **BYTE_BLOCKS)
    fix_layout(pool, blocks.block_bytes)
    os.sync()

    def put(keys: list[bytes], values: list[memoryview]) -> None:
        if (stored := pool.put_blocks(keys, values)) != len(keys):
            raise RuntimeError(f"put_blocks stored {stored} of {len(keys)}")

    row = measure_store("isolane", blocks, put, lambda: None, pool.lookup_blocks,
                        lambda key: pool.get_blocks([key])[0])
    pool.logs[0].rotate()
    folder = namespace_dir(device, "scale") / "segments"
    pool.close()
    scheduler.close()
    return {**row, **reopen_rows(args, "isolane", folder, segment_bytes, blocks.key(blocks.n // 2)),
            "disk_bytes": tree_bytes(folder)}


def run_lmdb(args: argparse.Namespace, blocks: Blocks, root: Path) -> dict[str, Any]:
    import lmdb

    folder = root / "lmdb"
    folder.mkdir(parents=True, exist_ok=True)
    pages = -(-(blocks.block_bytes + 64) // 4096)
    map_bytes = int(blocks.n * (pages * 4096 + 64) * 1.6) + (1 << 30)
    env = lmdb.open(str(folder), map_size=map_bytes, max_readers=64)

    def put(keys: list[bytes], values: list[memoryview]) -> None:
        with env.begin(write=True) as txn:
            for k, v in zip(keys, values, strict=True):
                txn.put(k, v)

    def lookup(keys: list[bytes]) -> int:
        with env.begin(buffers=True) as txn:
            return sum(txn.get(k) is not None for k in keys)

    def get(key: bytes) -> Any:
        with env.begin() as txn:
            return txn.get(key)

    row = measure_store("lmdb", blocks, put, lambda: env.sync(True), lookup, get)
    env.close()
    return {**row, **reopen_rows(args, "lmdb", folder, map_bytes, blocks.key(blocks.n // 2)),
            "disk_bytes": tree_bytes(folder)}


def tree_bytes(folder: Path) -> int:
    return sum(f.stat().st_blocks * 512 for f in folder.rglob("*") if f.is_file())


def evict_cache(folder: Path) -> str:
    if C.drop_page_cache():
        return "drop_caches"
    for path in (p for p in folder.rglob("*") if p.is_file()):
        evict(path)
    return "posix_fadvise(DONTNEED) of the store's files"


def open_store(kind: str, folder: str, size: int, probe: bytes,
               trace_heap: bool = False) -> dict[str, Any]:
    """``child``, in a fresh process: the seconds to open a store, and the memory the open
    added. isolane opens a ``SegmentLog`` (the pool's disk
    tier: its key directory is the index); ``trace_heap`` counts its heap (numpy's arrays
    included), as RSS moves by more than a small index does."""
    import gc
    import tracemalloc

    import lmdb
    import xxhash  # noqa: F401  (imported by the index: not part of its cost)

    from isolane.kvpool.log.segment_log import SegmentLog

    def held_bytes() -> int:
        return tracemalloc.get_traced_memory()[0] if trace_heap else C.current_rss_bytes()

    gc.collect()
    if trace_heap:
        tracemalloc.start()
    before = held_bytes()
    t0 = time.perf_counter()
    if kind == "isolane":
        log = SegmentLog(folder, segment_bytes=size)
        opened = time.perf_counter()
        value: Any = log.get(probe)
        held = held_bytes()  # while the index is held: close() frees it
        log.close()
    else:
        env = lmdb.open(folder, map_size=size, readonly=True, lock=False)
        opened = time.perf_counter()
        with env.begin() as txn:
            value = txn.get(probe)
            held = held_bytes()
        env.close()
    return {"open_s": opened - t0, "index_bytes": held - before, "found": value is not None}


def open_in_child(kind: str, folder: Path, size: int, probe: bytes,
                  trace_heap: bool = False) -> dict[str, float]:
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "child", kind,
                          str(folder), str(size), probe.hex(),
                          *(["--trace-heap"] if trace_heap else [])],
                         capture_output=True, text=True, check=True)
    row: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    if not row["found"]:
        raise RuntimeError(f"the reopened {kind} store lost the probe key")
    return row


def reopen_rows(args: argparse.Namespace, kind: str, folder: Path, size: int,
                probe: bytes) -> dict[str, Any]:
    rows: dict[str, list[float]] = {}
    how = ""
    for _ in range(args.repeats):
        how = evict_cache(folder)
        cold = open_in_child(kind, folder, size, probe)
        warm = open_in_child(kind, folder, size, probe)
        # a traced open is slower: its own process, apart from the timed ones
        memory = open_in_child(kind, folder, size, probe, trace_heap=True) \
            if kind == "isolane" else warm
        for k, v in (("cold", cold["open_s"]), ("warm", warm["open_s"]),
                     ("index_bytes", memory["index_bytes"])):
            rows.setdefault(k, []).append(v)
    return {"reopen": {k: statistics.median(v) for k, v in rows.items()}, "cache_drop": how}


def cmd_run(args: argparse.Namespace) -> int:
    root = args.dir.resolve() / f"{args.store}-{args.blocks}-{args.block_bytes}"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    t0 = time.perf_counter()
    try:
        row = (run_isolane if args.store == "isolane" else run_lmdb)(
            args, Blocks(args.blocks, args.block_bytes), root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    import lmdb

    row.update(store=args.store, blocks=args.blocks, block_bytes=args.block_bytes,
               segment_mib=args.segment_mib, repeats=args.repeats, command=C.command_line(),
               when=C.now_text(), wall_s=time.perf_counter() - t0,
               machine=C.machine_description(args.dir.resolve(), {
                   "numpy": np.__version__, "py-lmdb": lmdb.__version__,
                   "LMDB": ".".join(map(str, lmdb.version()))}))
    rows = json.loads(args.json.read_text()) if args.json.exists() else []
    rows = [r for r in rows if (r["store"], r["blocks"], r["block_bytes"]) !=
            (args.store, args.blocks, args.block_bytes)] + [row]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=1))
    return 0


def size_text(nbytes: int) -> str:
    return f"{nbytes // 1024} KiB" if nbytes >= 1024 else f"{nbytes} B"


def measures(r: dict[str, Any]) -> dict[str, float]:
    """Per second, per block and per 1M blocks; puts: the first 2 GiB (all for a small pool)."""
    per_m = 1e6 / r["blocks"]
    p50, p99 = np.percentile(np.array(r["single_get_s"]) * 1e6, [50, 99])
    return {"puts": r["head_n"] / r["head_s"] if r.get("head_s") else r["blocks"] / r["put_s"],
            "lookups": r["lookups"] / r["lookup_s"], "p50": float(p50), "p99": float(p99),
            "index": r["reopen"]["index_bytes"] / r["blocks"], "cold": r["reopen"]["cold"] * per_m}


def headline_rows(rows: list[dict[str, Any]]) -> list[_results.Result]:
    """Each isolane size's puts, lookups, single get, index memory and cold reopen, beside
    LMDB's of the same size where it ran (each ``run`` is its own exclusive run)."""
    out: list[_results.Result] = []
    lmdb = {(r["blocks"], r["block_bytes"]): measures(r) for r in rows if r["store"] == "lmdb"}
    for r in (r for r in rows if r["store"] == "isolane"):
        m, peer = measures(r), lmdb.get((r["blocks"], r["block_bytes"]))
        size = f"{r['blocks']:,} blocks of {size_text(r['block_bytes'])}"
        where = {"machine": r["machine"], "date": r["when"], "command": r["command"]}
        for key, measure, unit, digits, more_is_better, target in (
                ("puts", "puts into the page cache (first 2 GiB)", "blocks/s", 0, True,
                 ("≥ 200,000 blocks/s", TARGETS["put"])),
                ("lookups", "lookups", "keys/s", 0, True, ("≥ 300,000 keys/s", TARGETS["lookup"])),
                ("p50", "single get, warm page cache (p50)", "µs", 0, False, None),
                ("p99", "single get, warm page cache (p99)", "µs", 0, False, None),
                ("index", "index memory", "B/block", 1, False,
                 ("≤ 64 B/block", TARGETS["index"])),
                ("cold", "cold reopen", "s per 1M blocks", 3, False,
                 ("≤ 0.2 s per 1M", TARGETS["cold"]))):
            value, other = m[key], peer[key] if peer else None
            ratio = None if not other or not value else (
                value / other if more_is_better else other / value)
            out.append(_results.Result(
                area="KV pool", measure=f"{measure}, {size}", value=round(value, digits),
                unit=unit, peer="LMDB, same blocks" if other is not None else None,
                peer_value=None if other is None else round(other, digits),
                ratio=None if ratio is None else round(ratio, 2),
                target=target[0] if target else None,
                met=None if target is None else (value >= target[1] if more_is_better
                                                 else value <= target[1]), **where))
    return out


def cmd_report(args: argparse.Namespace) -> int:
    rows: list[dict[str, Any]] = []
    for path in args.json:
        rows += json.loads(path.read_text())
    rows.sort(key=lambda r: (r["blocks"], r["block_bytes"], r["store"] != "isolane"))
    first = rows[0] if rows else {"segment_mib": "?", "repeats": "?", "cache_drop": "?"}
    lines = [
        "## KV pool at scale: index memory, reopen, batch puts and lookups "
        "(`benchmarks/bench_kv_scale.py`)", "",
        f"16-byte random keys, batches of {BATCH}, isolane segments of {first['segment_mib']} "
        f"MiB; {SINGLE_GETS} single gets, warm page cache; reopen in a fresh process, medians "
        f"of {first['repeats']}, cold = {first['cache_drop']} (method: the script's "
        "docstring). Runs:", ""]
    lines += [f"- {r['store']}: `{r['command']}` ({r['when']}, {r['wall_s']:.0f} s)"
              for r in rows]
    if rows:
        lines += ["", "Machine: " + rows[-1]["machine"]]
    C.publish("kv_scale", "\n".join(lines), headline_rows(rows), args.out)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _quick.add_argument(p)
    sub = p.add_subparsers(dest="cmd")
    r = sub.add_parser("run", help="measure one store at one size, write its row to --json")
    r.add_argument("--store", choices=("isolane", "lmdb"), default="isolane")
    r.add_argument("--blocks", type=int, default=1_000_000)
    r.add_argument("--block-bytes", type=int, default=4096)
    r.add_argument("--segment-mib", type=int, default=256)
    r.add_argument("--repeats", type=int, default=3)
    r.add_argument("--dir", type=Path, default=C.REPO_ROOT / ".bench" / "kv-scale")
    r.add_argument("--json", type=Path, required=True)
    g = sub.add_parser("report", help="print the table from the rows of --json files")
    g.add_argument("--json", type=Path, nargs="+", required=True)
    g.add_argument("--out", type=Path, help="docs/BENCHMARKS.md records the rows in "
                   "benchmarks/results/kv_scale.json; another file gets the report")
    c = sub.add_parser("child")  # a reopen's own process (open_in_child)
    for name in ("kind", "folder", "size", "probe"):
        c.add_argument(name)
    c.add_argument("--trace-heap", action="store_true")
    args = p.parse_args(argv)
    if args.cmd == "child":
        print(json.dumps(open_store(args.kind, args.folder, int(args.size),
                                    bytes.fromhex(args.probe), args.trace_heap)))
        return 0
    if args.quick:  # a run of each store at a small size, then the report
        if args.cmd:
            p.error("--quick runs both stores and the report itself: give no command")
        root = _quick.enter(args, p, folders=(), files=())
        for store in ("isolane", "lmdb"):
            cmd_run(argparse.Namespace(store=store, repeats=1, dir=root / "stores",
                                       json=root / "rows.json", **QUICK))
        return cmd_report(argparse.Namespace(json=[root / "rows.json"], out=None))
    if not args.cmd:
        p.error("give a command: run or report (or --quick)")
    return {"run": cmd_run, "report": cmd_report}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
