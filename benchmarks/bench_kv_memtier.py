#!/usr/bin/env python
"""KV pool memory tier at 1M+ entries: bytes of RSS per entry beyond the values, per
eviction policy.

    python benchmarks/bench_kv_memtier.py --entries 1000000 --out docs/BENCHMARKS.md
    python benchmarks/bench_kv_memtier.py --quick    # smoke test: 20,000 entries

Each policy runs in a fresh process: a ``MemoryTier`` whose budget holds ``--entries``
values of ``--value-bytes``; as many puts of distinct 16-byte random keys fill it, as many
more push the first ones out (S3-FIFO's ghost queue fills too). The RSS delta minus the
resident value bytes, per resident entry, is the tier's own cost.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
from pathlib import Path

import _common as C
import _quick
import _results

C.ensure_repo_importable()

POLICIES = ("s3fifo", "lru")
QUICK_ENTRIES = 20_000


def child(policy: str, entries: int, value_bytes: int) -> dict[str, float]:
    import numpy as np

    from isolane.kvpool.tiers.memory import MemoryTier

    rng = np.random.default_rng(3)
    raw = rng.integers(0, 256, (2 * entries, 16), np.uint8).tobytes()
    keys = [raw[16 * i:16 * i + 16] for i in range(2 * entries)]
    value = memoryview(rng.integers(0, 256, value_bytes, np.uint8).tobytes())
    gc.collect()
    before = C.current_rss_bytes()
    tier = MemoryTier(entries * value_bytes, policy)
    overhead = {}
    for phase, batch in (("fill", keys[:entries]), ("churn", keys[entries:])):
        for k in batch:
            tier.put(k, value)
        gc.collect()
        overhead[phase] = (C.current_rss_bytes() - before - len(tier) * value_bytes) / len(tier)
    return {"policy": policy, "per_entry_full": overhead["fill"],
            "per_entry_churned": overhead["churn"], "resident": len(tier),
            "entries_kept": tier.entries}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--entries", type=int, default=1_000_000)
    p.add_argument("--value-bytes", type=int, default=4096)
    p.add_argument("--out", type=Path, help="markdown file whose section to (re)write")
    p.add_argument("--child", help=argparse.SUPPRESS)
    _quick.add_argument(p)
    args = p.parse_args(argv)
    if args.quick:
        _quick.enter(args, p, folders=(), files=())
        args.entries = min(args.entries, QUICK_ENTRIES)
    if args.child:
        print(json.dumps(child(args.child, args.entries, args.value_bytes)))
        return 0
    rows = []
    for policy in POLICIES:
        out = subprocess.run([sys.executable, __file__, "--child", policy, "--entries",
                              str(args.entries), "--value-bytes", str(args.value_bytes)],
                             capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    v, facts = args.value_bytes, C.run_facts(Path("/tmp"), {})
    table = [[r["policy"], f"{r['resident']:,}", f"{r['entries_kept']:,}",
              f"{r['per_entry_full']:.0f}", f"{r['per_entry_churned']:.0f}",
              f"{100 * r['per_entry_churned'] / v:.1f} %"] for r in rows]
    body = "\n".join([
        *C.report_head("KV memory tier at 1M+ entries (`benchmarks/bench_kv_memtier.py`)",
                       facts),
        f"`MemoryTier` holding {args.entries:,} values of {v:,} bytes (16-byte keys); "
        "overhead = RSS delta minus the resident value bytes, per resident entry "
        "(S3-FIFO's ghost keys are in \"entries kept\").", "",
        C.markdown_table(["policy", "entries resident", "entries kept (with ghosts)",
                          "overhead B/entry (filled)", "overhead B/entry (after churn)",
                          f"overhead vs a {v:,}-byte value"], table)])
    C.publish("kv_memtier", body, [_results.Result(
        area="KV pool", measure=f"memory tier overhead a {v:,}-byte entry, "
        f"{args.entries:,} entries, {r['policy']}"
        + (" (ghosts included)" if r["entries_kept"] > r["resident"] else ""),
        value=round(r["per_entry_churned"]), unit="B", peer="the value itself",
        peer_value=v, **facts) for r in rows], args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
