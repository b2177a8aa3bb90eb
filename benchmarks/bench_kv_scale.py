#!/usr/bin/env python
"""KV pool at scale: put and lookup rates, the latency of a single ``get_blocks``, the key
directory's memory per block and the reopen time, for pools of millions of blocks; LMDB on
the same blocks beside it.

    python benchmarks/bench_kv_scale.py --quick    # smoke test: both stores, 20,000 blocks
    python benchmarks/bench_kv_scale.py run --store isolane --json .bench/scale.json
    python benchmarks/bench_kv_scale.py run --store lmdb --json .bench/scale.json
    python benchmarks/bench_kv_scale.py report --json .bench/scale.json --out docs/BENCHMARKS.md

Each ``run`` (one store, one size: one exclusive measurement) replaces its row in the
JSON file; ``report`` prints the table from every row and, with ``--out
docs/BENCHMARKS.md``, records the isolane rows beside LMDB's of the same size in
``benchmarks/results/kv_scale.json``.

- **isolane**: a ``KVPool`` on one device, memory tier 0 bytes, ``put_blocks`` in
  batches of 4096 blocks (16-byte random keys), the writes going into the page cache
  (the rate of the first 2 GiB is given apart: past it the kernel's dirty limits set
  the pace); ``lookup_blocks`` of batches of stored keys; ``get_blocks([key])`` of 2000
  random stored keys one at a time, warm page cache. Then every segment is sealed and
  the pool closed.
- **LMDB** (py-lmdb): the same keys and values, one write transaction per 4096 puts,
  ``txn.get`` for lookups (buffers=True) and single gets.
- **Reopen**, each in a fresh process (``child``): seconds of the open and until its
  first get, cold (page cache dropped, or the files dropped with ``posix_fadvise`` when
  not root) and warm; the memory the open holds: isolane's heap as ``tracemalloc``
  counts it (in a third process: tracing slows the open), LMDB's RSS (its pages are
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
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C
import _quick
import _results
import numpy as np
from _kv_bytes import BYTE_BLOCKS, fix_layout

C.ensure_repo_importable()

SECTION = "kv_scale"
MiB = 1 << 20
BATCH = 4096
SINGLE_GETS = 2000
LOOKUPS = 400_000
PAGE_CACHE_BYTES = 2 << 30  # under the kernel's dirty_background_ratio here
QUICK = {"blocks": 20_000, "block_bytes": 512, "segment_mib": 2}  # several sealed segments
TARGETS = {"put": 200_000, "lookup": 300_000, "index": 64.0, "cold": 0.2}


def log(message: str) -> None:
    print(f"[kv-scale] {message}", file=sys.stderr, flush=True)


class Blocks:
    """``n`` blocks: 16-byte random keys, values that are views into a random buffer."""

    def __init__(self, n: int, block_bytes: int) -> None:
        rng = np.random.default_rng(15)
        self.n, self.block_bytes = n, block_bytes
        self.raw_keys = rng.integers(0, 256, (n, 16), np.uint8).tobytes()
        self.data = memoryview(rng.integers(0, 256, max(8 * MiB, 4 * block_bytes),
                                            np.uint8).tobytes())
        self.span = len(self.data) - block_bytes

    def key(self, i: int) -> bytes:
        return self.raw_keys[16 * i:16 * i + 16]

    def keys(self, start: int, stop: int) -> list[bytes]:
        raw = self.raw_keys
        return [raw[16 * i:16 * i + 16] for i in range(start, stop)]

    def value(self, i: int) -> memoryview:
        off = (i * 4160) % self.span
        return self.data[off:off + self.block_bytes]

    def values(self, start: int, stop: int) -> list[memoryview]:
        return [self.value(i) for i in range(start, stop)]


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values), q))


def run_isolane(args: argparse.Namespace, blocks: Blocks, root: Path) -> dict[str, Any]:
    from isolane.config import config_from_dict
    from isolane.kvpool.namespace_files import namespace_dir
    from isolane.kvpool.pool import KVPool
    from isolane.lanes.scheduler import LaneScheduler

    device = root / "isolane"
    config = config_from_dict({"device_groups": {"kv": {"role": "read",
                                                        "devices": [str(device)]}}})
    scheduler = LaneScheduler(config)
    segment_bytes = args.segment_mib * MiB
    pool = KVPool(config, namespace="scale", memory_budget=0, segment_bytes=segment_bytes,
                  scheduler=scheduler, **BYTE_BLOCKS)
    fix_layout(pool, blocks.block_bytes)
    n = blocks.n
    head, head_n = min(n, PAGE_CACHE_BYTES // (blocks.block_bytes + 64)), 0
    os.sync()
    log(f"isolane: putting {n:,} blocks of {blocks.block_bytes} B")
    put_s = head_s = 0.0
    for a in range(0, n, BATCH):
        keys, values = blocks.keys(a, min(n, a + BATCH)), blocks.values(a, min(n, a + BATCH))
        t = time.perf_counter()
        stored = pool.put_blocks(keys, values)
        put_s += time.perf_counter() - t
        if a + BATCH <= head:
            head_s, head_n = put_s, a + BATCH
        if stored != len(keys):
            raise RuntimeError(f"put_blocks stored {stored} of {len(keys)}")
    rng = np.random.default_rng(7)
    probe_ids = rng.integers(0, n, min(LOOKUPS, 5 * n))
    lookup_s = 0.0
    for a in range(0, len(probe_ids), BATCH):
        keys = [blocks.key(int(i)) for i in probe_ids[a:a + BATCH]]
        t = time.perf_counter()
        found = pool.lookup_blocks(keys)
        lookup_s += time.perf_counter() - t
        if found != len(keys):
            raise RuntimeError(f"lookup_blocks found {found} of {len(keys)}")
    singles = []
    for j, i in enumerate(rng.integers(0, n, SINGLE_GETS).tolist()):
        key = blocks.key(i)
        t = time.perf_counter()
        got = pool.get_blocks([key])[0]
        singles.append(time.perf_counter() - t)
        if got is None or (j % 64 == 0 and bytes(got) != bytes(blocks.value(i))):
            raise RuntimeError(f"get_blocks returned wrong bytes for block {i}")
    pool.logs[0].rotate()
    folder = namespace_dir(device, "scale") / "segments"
    pool.close()
    scheduler.close()
    reopen = reopen_rows(args, "isolane", folder, segment_bytes, blocks.key(n // 2))
    return {"put_s": put_s, "head_s": head_s, "head_n": head_n, "lookup_s": lookup_s,
            "lookups": len(probe_ids), "single_get_s": singles,
            "disk_bytes": tree_bytes(folder), **reopen}


def run_lmdb(args: argparse.Namespace, blocks: Blocks, root: Path) -> dict[str, Any]:
    import lmdb

    folder = root / "lmdb"
    folder.mkdir(parents=True, exist_ok=True)
    n = blocks.n
    pages = -(-(blocks.block_bytes + 64) // 4096)
    map_bytes = int(n * (pages * 4096 + 64) * 1.6) + (1 << 30)
    env = lmdb.open(str(folder), map_size=map_bytes, max_readers=64)
    log(f"lmdb: putting {n:,} blocks of {blocks.block_bytes} B (map {map_bytes / 1e9:.1f} GB)")
    put_s = head_s = 0.0
    head, head_n = min(n, PAGE_CACHE_BYTES // (blocks.block_bytes + 64)), 0
    for a in range(0, n, BATCH):
        keys, values = blocks.keys(a, min(n, a + BATCH)), blocks.values(a, min(n, a + BATCH))
        t = time.perf_counter()
        with env.begin(write=True) as txn:
            for k, v in zip(keys, values, strict=True):
                txn.put(k, v)
        put_s += time.perf_counter() - t
        if a + BATCH <= head:
            head_s, head_n = put_s, a + BATCH
    env.sync(True)
    rng = np.random.default_rng(7)
    probe_ids = rng.integers(0, n, min(LOOKUPS, 5 * n))
    lookup_s = 0.0
    for a in range(0, len(probe_ids), BATCH):
        keys = [blocks.key(int(i)) for i in probe_ids[a:a + BATCH]]
        t = time.perf_counter()
        with env.begin(buffers=True) as txn:
            found = sum(txn.get(k) is not None for k in keys)
        lookup_s += time.perf_counter() - t
        if found != len(keys):
            raise RuntimeError(f"lmdb found {found} of {len(keys)}")
    singles = []
    for i in rng.integers(0, n, SINGLE_GETS).tolist():
        key = blocks.key(i)
        t = time.perf_counter()
        with env.begin() as txn:
            got = txn.get(key)
        singles.append(time.perf_counter() - t)
        if got is None:
            raise RuntimeError(f"lmdb lost block {i}")
    env.close()
    reopen = reopen_rows(args, "lmdb", folder, map_bytes, blocks.key(n // 2))
    return {"put_s": put_s, "head_s": head_s, "head_n": head_n,
            "lookup_s": lookup_s, "lookups": len(probe_ids),
            "single_get_s": singles, "disk_bytes": tree_bytes(folder), **reopen}


def tree_bytes(folder: Path) -> int:
    return sum(f.stat().st_blocks * 512 for f in folder.rglob("*") if f.is_file())


def evict_cache(folder: Path) -> str:
    if C.drop_page_cache():
        return "drop_caches"
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return "posix_fadvise(DONTNEED) of the store's files"


def open_store(kind: str, folder: str, size: int, probe: bytes,
               trace_heap: bool = False) -> dict[str, Any]:
    """``child``, in a fresh process: open a store and report, as one JSON line, the
    seconds to open it, to open it and answer a first get, and the memory the open added.
    isolane opens a ``SegmentLog`` (the KV pool's disk tier: its key directory is the
    index measured). Its index lives on the heap, so ``trace_heap`` counts it with
    ``tracemalloc`` (numpy's arrays included): RSS moves by more than a small index
    does. LMDB maps its file, so its memory is the RSS its get added (mapped pages)."""
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
        first = time.perf_counter()
        keys = len(log)
        held = held_bytes()  # while the index is held: close() frees it
        log.close()
    else:
        env = lmdb.open(folder, map_size=size, readonly=True, lock=False)
        opened = time.perf_counter()
        with env.begin() as txn:
            value = txn.get(probe)
            first = time.perf_counter()
            keys = env.stat()["entries"]
            held = held_bytes()
        env.close()
    return {"open_s": opened - t0, "first_get_s": first - t0, "keys": keys,
            "index_bytes": held - before, "found": value is not None}


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
        for k, v in (("cold", cold["open_s"]), ("cold_first", cold["first_get_s"]),
                     ("warm", warm["open_s"]), ("index_bytes", memory["index_bytes"]),
                     ("keys", warm["keys"])):
            rows.setdefault(k, []).append(v)
        log(f"{kind}: reopen cold {cold['open_s']:.3f} s, warm {warm['open_s']:.3f} s, "
            f"index {memory['index_bytes'] / max(warm['keys'], 1):.1f} B/key")
    return {"reopen": {k: statistics.median(v) for k, v in rows.items()},
            "cache_drop": how}


def cmd_run(args: argparse.Namespace) -> int:
    root = args.dir.resolve() / f"{args.store}-{args.blocks}-{args.block_bytes}"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    blocks = Blocks(args.blocks, args.block_bytes)
    t0 = time.perf_counter()
    try:
        row = (run_isolane if args.store == "isolane" else run_lmdb)(args, blocks, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    row.update({"store": args.store, "blocks": args.blocks, "block_bytes": args.block_bytes,
                "segment_mib": args.segment_mib, "repeats": args.repeats,
                "command": C.command_line(), "when": C.now_text(),
                "wall_s": time.perf_counter() - t0,
                "machine": C.machine_description(args.dir.resolve(),
                                                 {"numpy": np.__version__,
                                                  **_lmdb_version()})})
    _save_row(args, row)
    log(f"done in {row['wall_s']:.0f} s; written to {args.json}")
    return 0


def _save_row(args: argparse.Namespace, row: dict[str, Any]) -> None:
    rows = json.loads(args.json.read_text()) if args.json.exists() else []
    rows = [r for r in rows if (r["store"], r["blocks"], r["block_bytes"]) !=
            (args.store, args.blocks, args.block_bytes)] + [row]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=1))


def _lmdb_version() -> dict[str, str]:
    try:
        import lmdb
    except ImportError:
        return {}
    return {"py-lmdb": lmdb.__version__, "LMDB": ".".join(map(str, lmdb.version()))}


def _size(nbytes: int) -> str:
    return f"{nbytes // 1024} KiB" if nbytes >= 1024 else f"{nbytes} B"


def head_rate(r: dict[str, Any]) -> float:
    """Blocks/s of the first 2 GiB of puts (all of them for a smaller pool)."""
    return float(r["head_n"] / r["head_s"]) if r.get("head_s") else float(r["blocks"] / r["put_s"])


def measures(r: dict[str, Any]) -> dict[str, float]:
    per_m = 1e6 / r["blocks"]
    singles = [s * 1e6 for s in r["single_get_s"]]
    return {"puts": head_rate(r), "lookups": r["lookups"] / r["lookup_s"],
            "p50": percentile(singles, 50), "p99": percentile(singles, 99),
            "index": r["reopen"]["index_bytes"] / r["blocks"], "cold": r["reopen"]["cold"] * per_m,
            "cold_first": r["reopen"]["cold_first"] * per_m,
            "warm": r["reopen"]["warm"] * per_m}


def headline_rows(rows: list[dict[str, Any]]) -> list[_results.Result]:
    """Each isolane size's puts, lookups, single get, index memory and cold reopen, beside
    LMDB's of the same size where it ran (each ``run`` is its own exclusive run)."""
    out: list[_results.Result] = []
    lmdb = {(r["blocks"], r["block_bytes"]): measures(r) for r in rows if r["store"] == "lmdb"}
    for r in (r for r in rows if r["store"] == "isolane"):
        m, peer = measures(r), lmdb.get((r["blocks"], r["block_bytes"]))
        size = f"{r['blocks']:,} blocks of {_size(r['block_bytes'])}"
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
    table = []
    for r in rows:
        m = measures(r)
        table.append([
            "isolane KVPool" if r["store"] == "isolane" else "LMDB",
            f"{r['blocks']:,}", _size(r["block_bytes"]), f"{r['disk_bytes'] / 1e9:.2f}",
            f"{r['blocks'] / r['put_s']:,.0f}", f"{m['puts']:,.0f}", f"{m['lookups']:,.0f}",
            f"{m['p50']:.0f} / {m['p99']:.0f}", f"{m['index']:.1f}", f"{m['cold']:.3f}",
            f"{m['cold_first']:.3f}", f"{m['warm']:.3f}"])
    lines = [
        "## KV pool at scale: index memory, reopen, batch puts and lookups "
        "(`benchmarks/bench_kv_scale.py`)", "",
        "16-byte random keys; isolane: `KVPool` with a 0-byte memory tier, batches of "
        f"{BATCH}, segments of {rows[0]['segment_mib'] if rows else '?'} MiB, all sealed "
        "before the reopen; LMDB: one write transaction per 4096 puts. A single get is one "
        "`get_blocks([key])` (isolane) or one read transaction (LMDB) of a random stored "
        f"block, warm page cache, {SINGLE_GETS} of them. Reopen: a fresh process, medians "
        f"of {rows[0]['repeats'] if rows else '?'}; cold = "
        f"{rows[0]['cache_drop'] if rows else '?'}.", "",
        C.markdown_table(["store", "blocks", "block", "disk GB", "puts/s (all)",
                          "puts/s (first 2 GiB)", "lookups/s", "single get p50 / p99, µs",
                          "index memory, B/block", "cold reopen, s per 1M",
                          "cold reopen + first get, s per 1M", "warm reopen, s per 1M"],
                         table), "", "Commands:", ""]
    lines += [f"- `{r['command']}` ({r['when']}, {r['wall_s']:.0f} s)" for r in rows]
    if rows:
        lines += ["", "Machine: " + rows[-1]["machine"]]
    recorded = headline_rows(rows)
    C.print_report("\n".join(lines) + "\n\n" + _results.rows_markdown(recorded), args.out,
                   SECTION)
    if args.out and _results.is_page(args.out):
        _results.write_results(SECTION, recorded)
    return 0


def cmd_quick(args: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    """``--quick``: ``run`` of each store at a small size, then ``report``."""
    root = _quick.enter(args, p, folders=(), files=())
    rows = root / "rows.json"
    for store in ("isolane", "lmdb"):
        run = argparse.Namespace(
            store=store, repeats=1, dir=root / "stores", json=rows, **QUICK)
        if cmd_run(run) != 0:
            return 1
    return cmd_report(argparse.Namespace(json=[rows], out=None))


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
        row = open_store(args.kind, args.folder, int(args.size), bytes.fromhex(args.probe),
                         args.trace_heap)
        print(json.dumps(row))
        return 0
    if args.quick:
        if args.cmd:
            p.error("--quick runs both stores and the report itself: give no command")
        return cmd_quick(args, p)
    if not args.cmd:
        p.error("give a command: run or report (or --quick)")
    return {"run": cmd_run, "report": cmd_report}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
