"""Probe: does ``KVPool.get_blocks`` finish when a get needs more read ranges than the read
lane's in-flight byte budget admits at once?

    python benchmarks/_kv_deadlock_probe.py FOLDER [--budget-mib 1] [--blocks 16]

Builds a pool whose read group has a small ``inflight_bytes`` and whose blocks each sit
in their own segment (so every block is one read range larger than the budget), then
calls ``get_blocks`` on all of them once and prints ``_common``'s result line. The
benchmark runs it in a child process with a timeout: a child that never answers is the
hang (as it was once: ``_read_range``, now on ``tiers/disk.DiskTier``, held the tier's
lock while ``Lane.submit_sized`` waited for budget, and the finished reads'
done-callbacks, ``_drop_inflight``, needed that lock on the lane's worker threads, so no
queued read ever ran and no budget returned).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C
from _kv_bytes import BYTE_BLOCKS, fix_layout

C.ensure_repo_importable()

MiB = 1 << 20


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("folder", type=Path)
    p.add_argument("--budget-mib", type=int, default=1)
    p.add_argument("--blocks", type=int, default=16)
    p.add_argument("--block-kib", type=int, default=1024)
    args = p.parse_args()
    from isolane.config import config_from_dict
    from isolane.kvpool.pool import KVPool
    from isolane.lanes.scheduler import LaneScheduler

    shutil.rmtree(args.folder, ignore_errors=True)
    config = config_from_dict({"device_groups": {"kv": {
        "role": "read", "devices": [str(args.folder)],
        "inflight_bytes": args.budget_mib * MiB}}})
    scheduler = LaneScheduler(config)
    pool = KVPool(config, namespace="probe", memory_budget=0, segment_bytes=1 << 20,
                  scheduler=scheduler, **BYTE_BLOCKS)
    value = os.urandom(args.block_kib << 10)
    fix_layout(pool, len(value))
    keys = [b"probe-%010d" % i for i in range(args.blocks)]
    for key in keys:  # one batch each: every block rotates into a segment of its own
        pool.put_blocks([key], [value])
    start = time.perf_counter()
    blocks = pool.get_blocks(keys)
    seconds = time.perf_counter() - start
    ok = all(b is not None and bytes(b) == value for b in blocks)
    pool.close()
    scheduler.close()
    shutil.rmtree(args.folder, ignore_errors=True)
    C.emit_result({"seconds": seconds, "ok": ok, "blocks": args.blocks,
                   "budget_bytes": args.budget_mib * MiB})
    return 0


if __name__ == "__main__":
    sys.exit(main())
