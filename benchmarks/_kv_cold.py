"""What a cold 64 KiB restore pays besides its data, for the KV benchmark (``bench_kv.py``).

- **Cold by page cache only against cold by every cache** (``--cold 3,1``): the same
  restores after ``echo 3 > drop_caches`` (page cache and slab: dentries, inodes, ext4's
  extent-status cache, so a read at a new file offset may first read extent-tree blocks)
  and after ``echo 1`` (page cache only, as an engine that keeps restoring sees its
  files), in the same rounds; per call the requests the disk completed
  (``/proc/diskstats``).
- **Per-call fixed overhead** (``measure_overhead``): one-block calls on a warm page
  cache against the bare read of the same stored bytes, and for cold calls the time from
  the call until isolane issues its first read (``SegmentLog.read_direct`` /
  ``read_scatter`` / ``read_run`` entered), timed by wrapping those methods around the
  real ones for the duration of the call.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import _common as C
import numpy as np
import xxhash

COLD_SUFFIX = {3: "", 1: "/pages"}  # drop_caches level -> suffix of the geometry's key
COLD_TEXT = {3: "`echo 3 > drop_caches` (page cache, dentries, inodes, extent caches)",
             1: "`echo 1 > drop_caches` (page cache only)"}
OVERHEAD_NS = (1, 16, 64, 256)
WARM_CALLS = 400
TARGET_OVERHEAD_US = 100.0


def cold_key(geometry: str, level: int) -> str:
    """The key of a geometry's restore rows made cold at ``drop_caches`` = ``level``."""
    return geometry + COLD_SUFFIX[level]


def split_key(key: str) -> tuple[str, int]:
    """(geometry name, drop_caches level) of a restore rows' geometry key."""
    for level, suffix in COLD_SUFFIX.items():
        if suffix and key.endswith(suffix):
            return key[:-len(suffix)], level
    return key, 3


def med(values: list[int] | list[float]) -> float:
    return float(np.median(values)) if values else float("nan")


def disk_text(row: Any) -> str:
    if not row.disk_reads:
        return "-"
    return f"{med(row.disk_reads):.0f} ({med(row.disk_kib):,.0f})"


# -- cold by page cache only against every cache ---------------------------------------------
COMPARED = (("limit", "sequential read: limit"),
            ("isolane:ranges_direct", "isolane's ranges, O_DIRECT (bound)"),
            ("isolane:get_into", "isolane get_into"),
            ("isolane:get_blocks", "isolane get_blocks + copy"),
            ("files:serial", "one file per block, serial"))


def cold_lines(res: Any, small_keys: list[tuple[str, str]]) -> list[str]:
    """The table and summary of the same restores cold at both ``drop_caches`` levels."""
    by_level = {split_key(k)[1]: k for k, _label in small_keys}
    if not {1, 3} <= by_level.keys():
        return []
    every, pages = by_level[3], by_level[1]
    ns = sorted({n for (g, _k, n) in res.restore if g == every})
    table, text = [], []
    for n in ns:
        got: dict[str, tuple[float, float]] = {}
        for key, label in COMPARED:
            a, b = res.restore.get((every, key, n)), res.restore.get((pages, key, n))
            if a is None or b is None or not a.median or not b.median:
                continue
            got[key] = (a.median, b.median)
            table.append([label, n, f"{a.median * 1e3:.1f}", f"{b.median * 1e3:.1f}",
                          f"{(a.median - b.median) * 1e3:+.1f}",
                          C.fmt_ratio(a.share, percent=True),
                          C.fmt_ratio(b.share, percent=True), disk_text(a), disk_text(b)])
        if {"limit", "isolane:get_into"} <= got.keys():
            (li3, li1), (gi3, gi1) = got["limit"], got["isolane:get_into"]
            line = (f"- **N={n}**: emptying the slab as well adds {(gi3 - gi1) * 1e3:+.1f} ms "
                    f"to get_into ({gi1 * 1e3:.1f} → {gi3 * 1e3:.1f} ms) and "
                    f"{(li3 - li1) * 1e3:+.1f} ms to the limit")
            if "isolane:ranges_direct" in got:
                d3, d1 = got["isolane:ranges_direct"]
                line += (f", {(d3 - d1) * 1e3:+.1f} ms to the O_DIRECT read of isolane's "
                         f"own ranges; get_into's time over that bound is "
                         f"{(gi3 - d3) * 1e3:.1f} ms cold by every cache, "
                         f"{(gi1 - d1) * 1e3:.1f} ms cold by page cache only")
            r3 = res.restore.get((every, "isolane:get_into", n))
            r1 = res.restore.get((pages, "isolane:get_into", n))
            lr3 = res.restore.get((every, "limit", n))
            if r3 is not None and r1 is not None and r3.disk_reads and r1.disk_reads:
                line += (f"; the disk completed {med(r3.disk_reads):.0f} requests a "
                         f"get_into against {med(r1.disk_reads):.0f}")
                if lr3 is not None and lr3.disk_reads:
                    line += f" (limit: {med(lr3.disk_reads):.0f} cold by every cache)"
            text.append(line + ".")
    return ["### Cold by page cache only against cold by every cache (same rounds)", "",
            "Each restore of the tables above ran twice a round: after `echo 3 > "
            "drop_caches` (the page cache and the slab: dentries, inodes and ext4's "
            "extent-status cache, which a read at a new offset of a segment file may have "
            "to fill from the extent tree on disk first) and after `echo 1` (the page "
            "cache only: a process that keeps restoring keeps its files' dentries, inodes "
            "and extents in memory). Medians; disk reads = requests completed during the "
            "call (KiB read), `/proc/diskstats`.", "",
            C.markdown_table(["system", "N", "ms, cold = 3", "ms, cold = 1",
                              "3 - 1 (ms)", "share of limit, 3", "share of limit, 1",
                              "disk reads, 3", "disk reads, 1"], table), "", *text, ""]


# -- per-call fixed overhead ------------------------------------------------------------------
class ReadTimeline:
    """Wraps ``SegmentLog``'s read methods (the real ones still run) to note, for every
    read entered after ``arm``, its thread, start and end (``perf_counter_ns``)."""

    METHODS = ("read_direct", "read_scatter", "read_run")

    def __init__(self) -> None:
        self.spans: list[tuple[int, int, int]] = []  # (thread ident, start, end)
        self.checks: list[tuple[int, int, int]] = []  # reader._copy_out: checks + copy
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def installed(self) -> Iterator[ReadTimeline]:
        from isolane.kvpool.log import reader
        from isolane.kvpool.log.segment_log import SegmentLog

        targets = [(SegmentLog, m) for m in self.METHODS] + [(reader, "_copy_out")]

        def note(index: int, start: int, end: int) -> None:
            with self._lock:
                (self.spans if index < len(self.METHODS) else self.checks).append(
                    (threading.get_ident(), start, end))

        with C.timed_calls(targets, note):
            yield self

    def arm(self) -> None:
        with self._lock:
            self.spans, self.checks = [], []

    def phases_us(self, called_ns: int, done_ns: int) -> dict[str, float] | None:
        """Of one call: µs to the first read, the reads' phase (first start to last
        end), the time after the last read, the reads' summed time, and how many."""
        with self._lock:
            spans, checks = list(self.spans), list(self.checks)
        if not spans:
            return None
        first = min(s for _t, s, _e in spans)
        last = max(e for _t, _s, e in spans)
        last_check = max([e for _t, _s, e in checks] or [last])
        return {"first_read_us": (first - called_ns) / 1e3,
                "checks_sum_us": sum(e - s for _t, s, e in checks) / 1e3,
                "checks_after_us": max(0, last_check - last) / 1e3,
                "tail_us": (done_ns - max(last, last_check)) / 1e3,
                "reads_us": (last - first) / 1e3,
                "after_reads_us": (done_ns - last) / 1e3,
                "read_sum_us": sum(e - s for _t, s, e in spans) / 1e3,
                "reads": float(len(spans)),
                "threads": float(len({t for t, _s, _e in spans})),
                "call_us": (done_ns - called_ns) / 1e3}


def series_us(call: Callable[[], object], calls: int) -> list[float]:
    out = []
    for _ in range(calls):
        t = time.perf_counter_ns()
        call()
        out.append((time.perf_counter_ns() - t) / 1e3)
    return out


def measure_overhead(store: Any, levels: list[int], rounds: int,
                     drop: Callable[[int], None]) -> dict[str, Any]:
    """One-block calls warm, against the bare read and check of the same bytes; then,
    cold at each ``drop_caches`` level, the time from a get_into call to its first read
    and to its end, at N in ``OVERHEAD_NS``, ``rounds`` prompts each."""
    pool, g, corpus = store.pool, store.geometry, store.corpus
    prompt = corpus.prompts - 1
    keys = store.prompt_keys(prompt)[:1]
    tokens = corpus.tokens(prompt)[:g.chunk_tokens]
    out1 = store._out(1)
    path, start, end, _ = store._stored_ranges(prompt, 1)[0]
    buf = bytearray(end - start)
    fd = os.open(path, os.O_RDONLY)
    try:
        for call in (lambda: pool.get_blocks(keys), lambda: pool.get_into(tokens, out1),
                     lambda: os.preadv(fd, [buf], start)):
            call()  # page cache and lazy set-up warm
        warm = {
            "get_blocks": series_us(lambda: pool.get_blocks(keys), WARM_CALLS),
            "get_into": series_us(lambda: pool.get_into(tokens, out1), WARM_CALLS),
            "block_keys": series_us(lambda: pool.block_keys(tokens), WARM_CALLS),
            "pread": series_us(lambda: os.preadv(fd, [buf], start), WARM_CALLS),
            "xxh3": series_us(lambda: xxhash.xxh3_64_intdigest(buf), WARM_CALLS),
        }
    finally:
        os.close(fd)
    cold: dict[str, dict[int, dict[str, list[float]]]] = {}
    probe = ReadTimeline()
    with probe.installed():
        for level in levels:
            per_n = cold.setdefault(str(level), {})
            for ni, n in enumerate(OVERHEAD_NS):
                got: dict[str, list[float]] = {"keys_us": []}
                for r in range(rounds):
                    p = (ni * rounds + r) % corpus.prompts
                    toks = corpus.tokens(p)[:n * g.chunk_tokens]
                    t = time.perf_counter_ns()
                    pool.block_keys(toks)
                    got["keys_us"].append((time.perf_counter_ns() - t) / 1e3)
                    dest = store._out(n)
                    gc.collect()
                    drop(level)
                    probe.arm()
                    t = time.perf_counter_ns()
                    filled = pool.get_into(toks, dest)
                    done = time.perf_counter_ns()
                    phases = probe.phases_us(t, done)
                    if filled != n * g.chunk_tokens or phases is None:
                        continue
                    for k, v in phases.items():
                        got.setdefault(k, []).append(v)
                per_n[n] = got
    return {"warm": warm, "cold": cold, "value_bytes": len(buf)}


def overhead_lines(res: Any) -> list[str]:
    o = getattr(res, "overhead", None)
    if not o:
        return []
    w = {k: med(v) for k, v in o["warm"].items()}
    p99 = {k: float(np.percentile(v, 99)) for k, v in o["warm"].items()}
    table = [[f"`{k}`" if k in ("get_blocks", "get_into") else k, f"{w[k]:.1f}",
              f"{p99[k]:.1f}"] for k in ("get_blocks", "get_into", "block_keys", "pread",
                                         "xxh3")]
    data = w["pread"] + w["xxh3"]
    rows = []
    for level, per_n in o["cold"].items():
        for n, got in per_n.items():
            if got.get("first_read_us"):
                rows.append([f"`echo {level}`", n, f"{med(got['keys_us']):.0f}",
                             f"{med(got['first_read_us']):.0f}",
                             f"{med(got['reads_us']) / 1e3:.2f}",
                             f"{med(got['read_sum_us']) / 1e3:.2f}",
                             f"{med(got['reads']):.0f} on {med(got['threads']):.0f}",
                             f"{med(got['after_reads_us']):.0f}",
                             f"{med(got['checks_sum_us']) / 1e3:.2f}",
                             f"{med(got['checks_after_us']):.0f}",
                             f"{med(got['tail_us']):.0f}",
                             f"{med(got['call_us']) / 1e3:.2f}", len(got["call_us"])])
    fixed = {k: w[k] - data for k in ("get_blocks", "get_into")}
    first_small = [med(got["first_read_us"]) for per_n in o["cold"].values()
                   for n, got in per_n.items() if int(n) <= 16 and got.get("first_read_us")]
    worst = max(first_small) if first_small else float("nan")
    verdict = (f"Fixed overhead of a warm one-block call (its time less the bare `preadv` "
               f"and xxh3 of the same {o['value_bytes']:,} stored bytes, "
               f"{data:.1f} µs): get_blocks {fixed['get_blocks']:.0f} µs, get_into "
               f"{fixed['get_into']:.0f} µs (p50); cold, a get_into of up to 16 blocks "
               f"issues its first read {worst:.0f} µs after the call (worst median of the "
               f"levels). Target ≤ {TARGET_OVERHEAD_US:.0f} µs: "
               + ("met" if max(*fixed.values(), worst) <= TARGET_OVERHEAD_US else
                  "**not met**") + ".")
    return ["### Per-call fixed overhead (same run)", "",
            f"Warm: one block (one 64 KiB block, memory tier 0 B, its page-cache pages "
            f"warm), {len(o['warm']['get_into'])} calls each, µs; `block_keys` = the one "
            "BLAKE2b a block's key costs, `pread` / `xxh3` = a bare `preadv` of the "
            "block's stored record range and its xxh3 (the byte work of any read).", "",
            C.markdown_table(["call", "p50 µs", "p99 µs"], table), "",
            "Cold: a timeline of get_into of N blocks of one prompt after `drop_caches` "
            "(the restore tables' conditions: the same pool, corpus and cache drop), from "
            "isolane's segment reads (`read_direct`, `read_scatter`, `read_run`: each "
            "read's thread, start and end). first read = µs from the call until the "
            "first read starts; reads = from its start to the end of the last read; "
            "their sum = the reads' own times added up (more than the phase when they "
            "overlap); after = from the last read's end to the call's return; checks = "
            "`reader._copy_out` (each O_DIRECT piece's record checks and its copy into the "
            "tensor): their times added up, how long the last ended after the last read, "
            "and from then (or the last read) to the call's return; keys = "
            "`block_keys` of the same tokens (warm, outside the call: part of the time "
            "to the first read). Medians.", "",
            C.markdown_table(["cold", "N", "keys µs", "call → first read µs",
                              "reads ms", "reads' sum ms", "reads on threads",
                              "after reads µs", "checks' sum ms", "checks after reads µs",
                              "after checks µs", "whole call ms", "calls"], rows), "",
            verdict, ""]
