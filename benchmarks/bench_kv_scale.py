#!/usr/bin/env python
"""KV pool at scale: the key directory's RSS per block and the reopen time of a pool
of ``--blocks`` blocks of ``--block-kib`` KiB, against a baseline checkout of isolane
opening the same files (the segment and hint formats are shared).

    python benchmarks/bench_kv_scale.py --blocks 1000000 --baseline /path/to/old/checkout \\
        --out docs/BENCHMARKS.md

The pool is built once with ``SegmentLog.append_many`` in batches of 4096 (16-byte random
keys, as the pool's block keys are), then every segment is sealed (``rotate``), so a
reopen loads hint files only. Each open runs in a fresh process
(``_kv_scale_child.py``): RSS delta of the open (``VmRSS`` after minus before, with
numpy and xxhash imported before), seconds of ``SegmentLog(...)`` and until its first
``get``. Cold: ``sync; echo 3 > /proc/sys/vm/drop_caches`` before the child starts (needs
root; else the page cache of the pool's files is dropped with ``posix_fadvise``). Warm:
the same right after, files cached. Medians of ``--repeats``; the ratios are of the same
run.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C
import numpy as np

C.ensure_repo_importable()

SECTION = "kv-scale"
MiB = 1 << 20
BATCH = 4096
CHILD = Path(__file__).resolve().parent / "_kv_scale_child.py"


def log(message: str) -> None:
    print(f"[kv-scale] {message}", file=sys.stderr, flush=True)


def build(folder: Path, blocks: int, block_bytes: int, segment_bytes: int) -> tuple[float, bytes]:
    """Fill a fresh pool; returns (blocks/s of the puts, a key to probe)."""
    from isolane.kvpool.segments import SegmentLog

    rng = np.random.default_rng(15)
    keys = rng.integers(0, 256, (blocks, 16), np.uint8).tobytes()
    data = memoryview(rng.integers(0, 256, 8 * MiB, np.uint8).tobytes())
    span = len(data) - block_bytes
    t0 = time.perf_counter()
    with SegmentLog(folder, segment_bytes=segment_bytes) as seg:
        for first in range(0, blocks, BATCH):
            items = [(keys[16 * i:16 * i + 16],
                      data[(i * 4160) % span:(i * 4160) % span + block_bytes])
                     for i in range(first, min(blocks, first + BATCH))]
            seg.append_many(items)
        seconds = time.perf_counter() - t0
        seg.rotate()
    return blocks / seconds, keys[16 * (blocks // 2):16 * (blocks // 2) + 16]


def evict_cache(folder: Path) -> str:
    if C.drop_page_cache():
        return "drop_caches"
    for path in folder.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "posix_fadvise(DONTNEED) of the pool's files"


def open_in_child(tree: Path, folder: Path, segment_bytes: int, probe: bytes) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, str(CHILD), str(folder), str(segment_bytes),
                          probe.hex()], env=env, capture_output=True, text=True, check=True)
    row: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    if not row["found"]:
        raise RuntimeError(f"the reopened pool ({tree}) lost the probe key")
    return row


def git_rev(tree: Path) -> str:
    proc = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=False)
    return proc.stdout.strip() or "?"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=1_000_000)
    p.add_argument("--block-kib", type=int, default=4)
    p.add_argument("--segment-mib", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--baseline", type=Path, help="another isolane checkout to compare with")
    p.add_argument("--baseline-name", help="how to name the baseline (default: its commit)")
    p.add_argument("--dir", type=Path, default=C.REPO_ROOT / ".bench" / "kv-scale")
    p.add_argument("--keep", action="store_true", help="keep the pool's files")
    p.add_argument("--out", type=Path, help="markdown file whose section to (re)write")
    args = p.parse_args(argv)
    folder = args.dir.resolve() / "pool"
    shutil.rmtree(folder, ignore_errors=True)
    folder.parent.mkdir(parents=True, exist_ok=True)
    segment_bytes = args.segment_mib * MiB
    trees = {"isolane (this tree)": C.REPO_ROOT}
    if args.baseline:
        name = args.baseline_name or git_rev(args.baseline)
        trees[f"baseline `{name}`"] = args.baseline.resolve()
    try:
        log(f"building {args.blocks} blocks of {args.block_kib} KiB in {folder}")
        put_rate, probe = build(folder, args.blocks, args.block_kib * 1024, segment_bytes)
        disk = sum(f.stat().st_size for f in folder.iterdir())
        hints = sum(f.stat().st_size for f in folder.glob("*.hint"))
        rows: dict[str, dict[str, list[float]]] = {}
        how = ""
        for _ in range(args.repeats):
            for name, tree in trees.items():
                r = rows.setdefault(name, {})
                how = evict_cache(folder)
                cold = open_in_child(tree, folder, segment_bytes, probe)
                warm = open_in_child(tree, folder, segment_bytes, probe)
                for k, v in (("cold", cold["open_s"]), ("cold_first", cold["first_get_s"]),
                             ("warm", warm["open_s"]), ("rss", warm["rss_delta"]),
                             ("keys", warm["keys"])):
                    r.setdefault(k, []).append(v)
                log(f"{name}: cold {cold['open_s']:.3f} s, warm {warm['open_s']:.3f} s, "
                    f"rss {warm['rss_delta'] / args.blocks:.1f} B/block")
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    med = {n: {k: statistics.median(v) for k, v in r.items()} for n, r in rows.items()}
    per_m = 1e6 / args.blocks
    table = []
    for name, m in med.items():
        table.append([name, f"{m['rss'] / args.blocks:.1f}",
                      f"{m['cold'] * per_m:.3f}", f"{m['cold_first'] * per_m:.3f}",
                      f"{m['warm'] * per_m:.3f}", int(m["keys"])])
    lines = [
        "## KV pool at scale: index RSS and reopen (issue 15)", "",
        f"{args.blocks:,} blocks of {args.block_kib} KiB (16-byte random keys) in "
        f"{args.segment_mib} MiB segments, all sealed: {disk / 1e9:.2f} GB of segments, "
        f"{hints / 1e6:.1f} MB of hint files. Built with `append_many` in batches of "
        f"{BATCH} at {put_rate:,.0f} blocks/s (this tree; vectorised batch paths are issue "
        "15 item 3, not built yet). Each open in a fresh process; cold = page cache dropped "
        f"({how}) before it; medians of {args.repeats} runs.", "",
        C.markdown_table(["code", "index RSS, bytes/block", "cold reopen, s per 1M blocks",
                          "cold reopen + first get, s per 1M", "warm reopen, s per 1M",
                          "keys after reopen"], table), "",
    ]
    if len(med) == 2:
        new, old = med.values()
        lines += [f"Same run: the compact key directory uses {old['rss'] / new['rss']:.1f}x "
                  f"less RSS per block and reopens {old['cold'] / new['cold']:.1f}x faster "
                  f"cold ({old['warm'] / new['warm']:.1f}x warm) than the baseline.", ""]
    lines += [f"Command: `{C.command_line()}` ({C.now_text()}).", "",
              "Machine: " + C.machine_description(folder.parent, {"numpy": np.__version__})]
    report = "\n".join(lines)
    print(report)
    if args.out:
        C.replace_section(args.out, SECTION, report)
        log(f"wrote section '{SECTION}' of {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
