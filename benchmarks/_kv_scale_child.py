"""Child of bench_kv_scale.py: open a segment log in a fresh process and report, as one
JSON line, the seconds to open it, the RSS it added, and the first get.

    python benchmarks/_kv_scale_child.py FOLDER SEGMENT_BYTES PROBE_KEY_HEX

The isolane imported is the one first on ``sys.path`` (PYTHONPATH): the parent points
it at this tree or at a baseline checkout.
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
    folder, segment_bytes, probe = sys.argv[1], int(sys.argv[2]), bytes.fromhex(sys.argv[3])
    import numpy  # noqa: F401  (imported by the new index: not part of its cost)
    import xxhash  # noqa: F401

    from isolane.kvpool.segments import SegmentLog

    gc.collect()
    before = rss_bytes()
    t0 = time.perf_counter()
    log = SegmentLog(folder, segment_bytes=segment_bytes)
    opened = time.perf_counter()
    value = log.get(probe)
    first = time.perf_counter()
    gc.collect()
    after = rss_bytes()
    keys = len(log)
    log.close()
    print(json.dumps({"open_s": opened - t0, "first_get_s": first - t0, "keys": keys,
                      "rss_delta": after - before, "found": value is not None}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
