"""Child of ``bench_kv_scale.py build``: one build of the key directory's hash table from
``N`` rows of random 16-byte keys in a fresh process (as a reopen builds it), by
isolane's ``key_slots.place_rows`` or by the partitioned variant below; prints one JSON
line with the build's wall and CPU seconds.

    python benchmarks/_kv_table_build.py place_rows|partitioned N

``partitioned`` is the experiment issue 15's notes proposed for the 10M-block reopen:
group the rows by the top 16 bits of their home slot (a stable ``argsort`` of a
``uint16``: a radix sort), so that every step on the table (counts, picks, starts, the
final scatter) works on a window of the table that stays in the CPU cache, then run the
same build on the grouped rows and number them back. It builds the same table (checked
against ``place_rows`` on the same rows when ``--check`` is given).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import numpy as np
import numpy.typing as npt

from isolane.kvpool.log.key_slots import SlotHash, place_rows, probe_many, table_size


def partitioned(hashes: Any, k0: Any, k1: Any, klen: Any, size: int
                ) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int64]]:
    n = len(hashes)
    home = np.empty(n, np.int32)
    np.bitwise_and(hashes, np.uint64(size - 1), out=home, casting="unsafe")
    shift = max(0, size.bit_length() - 1 - 16)
    order = np.argsort((home >> shift).astype(np.uint16), kind="stable")
    # Rows of one home slot keep their log order in ``order``: the newest is still the
    # highest index, so place_rows' winner rule holds on the grouped rows.
    table, gone_g = place_rows(hashes[order], k0[order], k1[order], klen[order], size)
    if not len(gone_g):
        live = table >= 0
        table[live] = order[table[live]]
        return table, gone_g
    keep_g = np.ones(n, bool)
    keep_g[gone_g] = False
    kept_rows = order[keep_g]  # grouped kept row j -> its row in log order
    gone = np.sort(order[gone_g]).astype(np.int64)
    keep = np.ones(n, bool)
    keep[gone] = False
    number = np.cumsum(keep, dtype=np.int64) - 1
    live = table >= 0
    table[live] = number[kept_rows[table[live]]]
    return table, gone


def rows(n: int, seed: int = 15) -> tuple[Any, Any, Any, Any, int]:
    rng = np.random.default_rng(seed)
    k0 = rng.integers(0, 2**63, n, dtype=np.int64).astype(np.uint64)
    k1 = rng.integers(0, 2**63, n, dtype=np.int64).astype(np.uint64)
    k0[n - n // 20:], k1[n - n // 20:] = k0[:n // 20], k1[:n // 20]  # 5 % newer copies
    klen = np.full(n, 16, np.uint16)
    return SlotHash(0x9E3779B97F4A7C15, 7).many(k0, k1), k0, k1, klen, table_size(n)


def main() -> int:
    kind, n = sys.argv[1], int(sys.argv[2])
    hashes, k0, k1, klen, size = rows(n)
    build = place_rows if kind == "place_rows" else partitioned
    if "--check" in sys.argv:
        a, b = place_rows(hashes, k0, k1, klen, size), partitioned(hashes, k0, k1, klen, size)
        same = bool(np.array_equal(a[1], b[1]))
        kept = np.setdiff1d(np.arange(n), a[1])
        for table, _ in (a, b):
            found, _ = probe_many(table, hashes[kept], k0[kept], k1[kept], klen[kept],
                                  k0[kept], k1[kept], klen[kept])
            same = same and found.tolist() == list(range(len(kept)))
        print(json.dumps({"same": same}))
        return 0 if same else 1
    w, c = time.perf_counter(), time.process_time()
    build(hashes, k0, k1, klen, size)
    print(json.dumps({"kind": kind, "rows": n, "wall_s": time.perf_counter() - w,
                      "cpu_s": time.process_time() - c}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
