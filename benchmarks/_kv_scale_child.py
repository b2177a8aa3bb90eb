"""Child of bench_kv_scale.py: open a store in a fresh process and report, as one JSON
line, the seconds to open it, to open it and answer a first get, and the RSS it added.

    python benchmarks/_kv_scale_child.py isolane FOLDER SEGMENT_BYTES PROBE_KEY_HEX
    python benchmarks/_kv_scale_child.py lmdb FOLDER MAP_BYTES PROBE_KEY_HEX

``isolane`` opens a ``SegmentLog`` (the KV pool's disk tier: its key directory is the
index whose RSS is measured); the isolane imported is the one first on ``sys.path``
(PYTHONPATH), so the parent can point it at a baseline checkout. ``lmdb`` opens the
LMDB environment and reads the probe (LMDB maps its file: its index costs page cache,
not heap, so its RSS delta is the pages the first get touched).
"""

from __future__ import annotations

import gc
import json
import sys
import time
from pathlib import Path


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def main() -> int:
    kind, folder, size, probe = sys.argv[1], sys.argv[2], int(sys.argv[3]), bytes.fromhex(
        sys.argv[4])
    import numpy  # noqa: F401  (imported by the index: not part of its cost)
    import xxhash  # noqa: F401

    if kind == "isolane":
        from isolane.kvpool.log.segment_log import SegmentLog

        gc.collect()
        before = rss_bytes()
        t0 = time.perf_counter()
        log = SegmentLog(folder, segment_bytes=size)
        opened = time.perf_counter()
        value = log.get(probe)
        first = time.perf_counter()
        gc.collect()
        after = rss_bytes()
        keys = len(log)
        log.close()
    else:
        import lmdb

        gc.collect()
        before = rss_bytes()
        t0 = time.perf_counter()
        env = lmdb.open(folder, map_size=size, readonly=True, lock=False)
        opened = time.perf_counter()
        with env.begin() as txn:
            value = txn.get(probe)
            first = time.perf_counter()
            keys = env.stat()["entries"]
        gc.collect()
        after = rss_bytes()
        env.close()
    print(json.dumps({"open_s": opened - t0, "first_get_s": first - t0, "keys": keys,
                      "rss_delta": after - before, "found": value is not None}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
