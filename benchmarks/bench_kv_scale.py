#!/usr/bin/env python
"""KV pool at scale: put and lookup rates, the p99 of a single ``get_blocks``, the key
directory's RSS per block and the reopen time, for pools of millions of blocks; LMDB on
the same blocks beside it.

    python benchmarks/bench_kv_scale.py run --store isolane --blocks 1000000 \\
        --block-bytes 4096 --json .bench/scale-1m.json
    python benchmarks/bench_kv_scale.py run --store lmdb --blocks 1000000 \\
        --block-bytes 4096 --json .bench/scale-1m.json
    python benchmarks/bench_kv_scale.py report --json .bench/scale-1m.json \\
        .bench/scale-10m.json --out docs/BENCHMARKS.md
    python benchmarks/bench_kv_scale.py --quick    # smoke test: both stores, 20,000 blocks

Each ``run`` (one store, one size: short enough for one exclusive measurement run)
appends its row to the JSON file; ``report`` writes the section from all rows
(``--section``/``--title``: a partial run's rows into a section of their own).

- **isolane**: a ``KVPool`` on one device, memory tier 0 bytes (every get reads the
  segment files), ``put_blocks`` in batches of 4096 blocks (16-byte random keys, as
  block keys are; values are views into one random buffer): blocks/s of the calls, the
  writes going into the page cache. Then ``lookup_blocks`` of batches of 4096 stored keys
  (lookups/s), then ``get_blocks([key])`` of 2000 random stored keys one at a time,
  warm page cache (p50/p99: the cost of one small get at this pool size). Then every
  segment is sealed (``rotate``) and the pool closed.
- **LMDB** (py-lmdb): the same keys and values, one write transaction per 4096 puts,
  ``txn.get`` without copying for lookups (buffers=True), and ``bytes(txn.get(key))``
  for the single gets.
- **Reopen**, each in a fresh process (``_kv_scale_child.py``): RSS delta of the open
  (``VmRSS`` after minus before, numpy and xxhash imported before), seconds of the open
  and until its first get. Cold: ``sync; echo 3 > /proc/sys/vm/drop_caches`` before the
  child (needs root; else the store's files are dropped from the page cache with
  ``posix_fadvise``). Warm: right after, files cached. Medians of ``--repeats``.
- Cold single gets (``cold_single_gets``): after the warm ones, the page cache dropped
  and every segment file's metadata read back, single gets beside raw ``os.pread`` of
  blocks and ``locate_many`` alone: the p99 at 1M against 10M blocks, both cold.
- ``--profile``: cProfile of isolane's put and lookup phases and of one more cold
  reopen (top functions by own time), and the same-run bounds (``same_run_bounds``: a
  raw ``pwritev`` loop of the same values in the same batches, before the puts after
  ``sync`` and again after every phase; the bare read-lane hop; a single get's work
  without the hop), kept in the JSON and printed in the report.
- Free page reporting: this VM hands memory freed in it back to its host at once
  (``page_reporting.min_free_ms`` = 0, ``max_waiting_mib`` = 1024), and a page-cache
  write into such memory takes a host page fault (~12 µs a 4 KiB page). The raw loops
  and the put passes run with freed memory kept in the VM (``_common.free_pages_kept``:
  60 s, up to 16 GiB; root only, put back after); one pass of the first 2 GiB before
  them runs at the VM's own setting and is reported beside them.
- ``build``: the reopen's table build (``key_slots.place_rows``) against a partitioned
  variant (``_kv_table_build.py``: rows grouped by the top bits of their home slot
  first), each in a fresh process on the same 10M rows.
- ``run --no-reopen`` keeps the store and leaves out the reopen rows; ``reopen`` adds
  them in a second invocation (a 10M-block pool is too big to build and reopen in one
  exclusive run of a few minutes) and removes the store.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C
import _quick
import numpy as np
from _kv_bytes import BYTE_BLOCKS, fix_layout

C.ensure_repo_importable()

SECTION = "kv-scale"
MiB = 1 << 20
BATCH = 4096
SINGLE_GETS = 2000
IOV_MAX = 1024
LOOKUPS = 400_000
RAW_REPEATS = 3  # the raw pwritev bound before the puts: median of this many
HEAD_REPEATS = 3  # the first 2 GiB of puts: median of this many (the last one the pool's)
CHILD = Path(__file__).resolve().parent / "_kv_scale_child.py"
PAGE_CACHE_BYTES = 2 << 30  # puts/s is also given for the first 2 GiB: under the
# kernel's dirty_background_ratio here (10 % of 23.5 GiB), so they land in the page cache
QUICK = {"blocks": 20_000, "block_bytes": 512, "segment_mib": 2}  # several sealed segments
ISSUE_ROWS = ((1_000_000, 4096), (10_000_000, 4096), (1_000_000, 65536))
TARGETS = {"put": 200_000, "lookup": 300_000, "rss": 64.0, "cold": 0.2}
GET_P50_TARGET_US = 100  # issue 15: per-call fixed overhead of a single get


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


def _profiled(enabled: bool, fn: Any) -> tuple[Any, list[str]]:
    if not enabled:
        return fn(), []
    prof = cProfile.Profile()
    result = prof.runcall(fn)
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(12)
    lines = [ln.rstrip() for ln in out.getvalue().splitlines()
             if ln.strip() and ("{" in ln or "/" in ln or "ncalls" in ln)]
    return result, [ln.replace(str(C.REPO_ROOT) + "/", "") for ln in lines]


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
    head_bytes = (head - head % BATCH or min(n, BATCH)) * (blocks.block_bytes + 64)
    # The raw loop once without held_memory first: what this VM's memory costs cold.
    raw_cold = None
    if args.profile:
        os.sync()
        raw_cold = pwritev_seconds(root / "raw-cold.bin", blocks,
                                   head_bytes // (blocks.block_bytes + 64))
    # One pass of the first 2 GiB at this VM's own free page reporting, before the
    # passes that keep freed pages in the VM (``C.free_pages_kept``): what the puts
    # cost where the host takes freed memory back at once. Only where the knobs can be
    # raised (root): elsewhere it would be one more pass like the others.
    head_vm_s = None
    if (head >= BATCH and C.free_page_reporting() is not None
            and os.access(C.FREE_PAGE_REPORTING / "min_free_ms", os.W_OK)):
        head_vm_s = put_head(config, scheduler, device, blocks, head - head % BATCH,
                             HEAD_REPEATS, segment_bytes)
    with C.free_pages_kept() as kept:
        raw_first = [raw_pwritev(root, blocks, head - head % BATCH or min(n, BATCH))
                     for _ in range(RAW_REPEATS)] if args.profile else None
        # The put profile in the same state as the raw loop and the puts (after sync,
        # before the pool's own dirty pages): where a put's time goes.
        put_prof = profile_appends(root / "profiled", blocks) if args.profile else []
        # The first 2 GiB into fresh pools of their own first (each after sync, then
        # removed): the put rate of the first 2 GiB is the median of these and the real
        # pool's (one pass moved 1.5x between exclusive runs of the same code).
        head_runs = [put_head(config, scheduler, device, blocks, head - head % BATCH, r,
                              segment_bytes) for r in range(HEAD_REPEATS - 1)] \
            if head >= BATCH else []
        os.sync()  # the puts start from the page cache state the raw loop started from
        held_memory(root, head_bytes)
        log(f"isolane: putting {n:,} blocks of {blocks.block_bytes} B")
        put_s = head_s = head_write_s = 0.0
        with WriteTimer() as writes:  # the write inside each put, timed around the real one
            for a in range(0, n, BATCH):
                keys = blocks.keys(a, min(n, a + BATCH))
                values = blocks.values(a, min(n, a + BATCH))
                t = time.perf_counter()
                stored = pool.put_blocks(keys, values)
                put_s += time.perf_counter() - t
                if a + BATCH <= head:
                    head_s, head_n, head_write_s = put_s, a + BATCH, writes.seconds
                if stored != len(keys):
                    raise RuntimeError(f"put_blocks stored {stored} of {len(keys)}")
    rng = np.random.default_rng(7)
    probe_ids = rng.integers(0, n, min(args.lookups, 100 * n))

    def lookup_all() -> float:
        spent = 0.0
        for a in range(0, len(probe_ids), BATCH):
            keys = [blocks.key(int(i)) for i in probe_ids[a:a + BATCH]]
            t = time.perf_counter()
            found = pool.lookup_blocks(keys)
            spent += time.perf_counter() - t
            if found != len(keys):
                raise RuntimeError(f"lookup_blocks found {found} of {len(keys)}")
        return spent

    lookup_s = lookup_all()
    lookup_prof = _profiled(True, lookup_all)[1] if args.profile else []
    singles = []
    for j, i in enumerate(rng.integers(0, n, SINGLE_GETS).tolist()):
        key = blocks.key(i)
        t = time.perf_counter()
        got = pool.get_blocks([key])[0]
        singles.append(time.perf_counter() - t)
        if got is None or (j % 64 == 0 and bytes(got) != bytes(blocks.value(i))):
            raise RuntimeError(f"get_blocks returned wrong bytes for block {i}")
    bounds = same_run_bounds(pool, blocks, root, head_n or min(n, BATCH)) \
        if args.profile else {}
    cold = cold_single_gets(pool, blocks, namespace_dir(device, "scale") / "segments")
    bounds["put_write_s"] = head_write_s  # of the measured pool's first 2 GiB
    if raw_cold is not None:
        bounds["raw_cold_s"] = raw_cold
    if raw_first is not None:  # the median of the repeats
        bounds["raw_first_runs_s"] = [t for t, _ in raw_first]
        bounds["raw_first_s"] = statistics.median(bounds["raw_first_runs_s"])
        bounds["raw_first_n"] = raw_first[0][1]
    pool.logs[0].rotate()
    folder = namespace_dir(device, "scale") / "segments"
    pool.close()
    reopen = reopen_rows(args, "isolane", folder, segment_bytes, blocks.key(n // 2)) \
        if args.reopen else {}
    return {"put_s": put_s, "head_s": head_s, "head_n": head_n, "bounds": bounds,
            "head_runs_s": [*head_runs, head_s], "head_vm_s": head_vm_s,
            "free_pages": kept,
            "lookup_s": lookup_s, "lookups": len(probe_ids),
            "single_get_s": singles, "cold": cold, "disk_bytes": tree_bytes(folder),
            "hint_bytes": sum(f.stat().st_size for f in folder.glob("*.hint")),
            "profile": {"put": put_prof, "lookup": lookup_prof}, **reopen}


def cold_single_gets(pool: Any, blocks: Blocks, folder: Path) -> dict[str, Any]:
    """Single gets against a cold page cache, whatever the pool's size: the page cache
    is dropped (``evict_cache``), then one 4 KiB read at the start of every segment file
    brings back what the file system needs to find a file's blocks (inode, extents), so
    that 1M- and 10M-block pools are compared with their data cold and their metadata
    warm. Then ``SINGLE_GETS`` times, each on a fresh random key: ``get_blocks([key])``;
    ``os.pread`` of one block at a random record of a random segment (weighted by size;
    the device's own cold read beside it, the same bytes); ``locate_many([key])`` of
    another random key (the index alone, no read)."""
    from isolane.kvpool.log.records import SEGMENT_HEADER_BYTES, record_geometry

    seg = pool.logs[0]
    infos = seg.segments()
    fds = [os.open(i.path, os.O_RDONLY) for i in infos]
    try:
        how = evict_cache(folder)
        for fd in fds:
            os.pread(fd, 4096, 0)
        rbytes = record_geometry(16, blocks.block_bytes)[1]
        sizes = np.array([i.file_bytes for i in infos], np.float64)
        rng = np.random.default_rng(13)
        at_seg = rng.choice(len(fds), SINGLE_GETS, p=sizes / sizes.sum()).tolist()
        times: dict[str, list[float]] = {"get_s": [], "raw_s": [], "locate_s": []}
        for j, (i, other) in enumerate(zip(rng.integers(0, blocks.n, SINGLE_GETS).tolist(),
                                           rng.integers(0, blocks.n, SINGLE_GETS).tolist(),
                                           strict=True)):
            key = blocks.key(i)
            t = time.perf_counter()
            got = pool.get_blocks([key])[0]
            times["get_s"].append(time.perf_counter() - t)
            if got is None or (j % 64 == 0 and bytes(got) != bytes(blocks.value(i))):
                raise RuntimeError(f"cold get_blocks returned wrong bytes for block {i}")
            records = max(1, (int(sizes[at_seg[j]]) - SEGMENT_HEADER_BYTES) // rbytes)
            off = SEGMENT_HEADER_BYTES + rbytes * int(rng.integers(0, records))
            t = time.perf_counter()
            os.pread(fds[at_seg[j]], blocks.block_bytes, off)
            times["raw_s"].append(time.perf_counter() - t)
            t = time.perf_counter()
            loc = seg.locate_many([blocks.key(other)])[0]
            times["locate_s"].append(time.perf_counter() - t)
            if loc is None:
                raise RuntimeError(f"locate_many lost block {other}")
    finally:
        for fd in fds:
            os.close(fd)
    return {**times, "how": how, "segments": len(fds)}


class WriteTimer:
    """While entered, ``SegmentLog._write_frame`` (a put batch's ``pwritev`` into the
    live segment, and a rotation when one is due) is timed around the real one:
    ``seconds`` sums its calls on any thread."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._lock = threading.Lock()
        self._patch: contextlib.ExitStack | None = None

    def _note(self, _index: int, start_ns: int, end_ns: int) -> None:
        with self._lock:
            self.seconds += (end_ns - start_ns) / 1e9

    def __enter__(self) -> WriteTimer:
        from isolane.kvpool.log.segment_log import SegmentLog

        self._patch = contextlib.ExitStack()
        self._patch.enter_context(C.timed_calls([(SegmentLog, "_write_frame")], self._note))
        return self

    def __exit__(self, *exc: object) -> None:
        if self._patch is not None:
            self._patch.close()


def put_head(config: Any, scheduler: Any, device: Path, blocks: Blocks, n: int,
             r: int, segment_bytes: int) -> float:
    """Seconds of ``put_blocks`` of the first ``n`` blocks into a fresh pool (namespace
    ``head<r>`` beside the measured one), after ``os.sync()``; the pool is closed and
    its files removed (and synced) right after."""
    from isolane.kvpool.namespace_files import namespace_dir
    from isolane.kvpool.pool import KVPool

    pool = KVPool(config, namespace=f"head{r}", memory_budget=0,
                  segment_bytes=segment_bytes, scheduler=scheduler, **BYTE_BLOCKS)
    fix_layout(pool, blocks.block_bytes)
    os.sync()
    held_memory(device.parent, n * (blocks.block_bytes + 64))
    spent = 0.0
    try:
        for a in range(0, n, BATCH):
            keys, values = blocks.keys(a, a + BATCH), blocks.values(a, a + BATCH)
            t = time.perf_counter()
            pool.put_blocks(keys, values)
            spent += time.perf_counter() - t
    finally:
        pool.close()
        shutil.rmtree(namespace_dir(device, f"head{r}"), ignore_errors=True)
        os.sync()
    log(f"isolane: first {n:,} blocks into a fresh pool: {n / spent:,.0f} blocks/s")
    return spent


def held_memory(root: Path, nbytes: int) -> None:
    """Write ``nbytes`` into a file under ``root`` and delete it (its dirty pages are
    dropped, never written back). Run right before a timed pass of
    puts, so that the pass writes into memory this VM holds: it hands memory freed a
    while ago back to its host, and touching such memory again costs a host page fault
    (the first raw loop of a process ran ~10x slower than the next ones, session 11).
    That holds only while freed pages stay in the VM (``C.free_pages_kept``): with the
    VM's own ``min_free_ms`` of 0 they go back to the host at once, and the last ~15 %
    of a pass's batches still ran at the host-fault rate (session 12)."""
    chunk = memoryview(np.ones(16 * MiB, np.uint8).data)
    path = root / "held-memory.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        offset = 0
        while offset < nbytes:
            offset += os.pwrite(fd, chunk, offset)
    finally:
        os.close(fd)
        path.unlink()


def raw_pwritev(root: Path, blocks: Blocks, n: int) -> tuple[float, int]:
    """Seconds of ``os.pwritev`` of the first ``n`` values into a fresh file beside the
    pool, in the puts' batches of 4096 (each ``IOV_MAX`` = 1024 buffers a call, 4 calls
    a batch: no per-block syscall), after ``os.sync()`` (no dirty pages of earlier
    phases in the way) and ``held_memory``; the file is removed (and synced) right
    after."""
    os.sync()
    held_memory(root, n * (blocks.block_bytes + 64))
    return pwritev_seconds(root / "raw-first.bin", blocks, n), n


def pwritev_seconds(path: Path, blocks: Blocks, n: int) -> float:
    """Seconds of ``os.pwritev`` of the first ``n`` values into a fresh file ``path``,
    ``IOV_MAX`` buffers a call; the file is removed afterwards."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        offset, t = 0, time.perf_counter()
        for a in range(0, n, IOV_MAX):
            offset += os.pwritev(fd, blocks.values(a, min(n, a + IOV_MAX)), offset)
        return time.perf_counter() - t
    finally:
        os.close(fd)
        path.unlink()


def same_run_bounds(pool: Any, blocks: Blocks, root: Path, head_n: int) -> dict[str, Any]:
    """What bounds the put rate and a single get, measured right after isolane's own
    phases: ``os.pwritev`` of the same values (1024 a call: IOV_MAX; no framing, no index) into a
    fresh file in the same folder, as many blocks as the first-2-GiB put rate covered;
    the bare hop to the read lane's thread (``submit(no-op).result()``); the work of a
    single get done in the calling thread (locate, one pread, record check); and that
    work submitted to the lane and waited for (the hop and the work together)."""
    from isolane.kvpool.log.coalesce import coalesce_ranges
    from isolane.kvpool.log.reader import verify_members

    raw_s = pwritev_seconds(root / "raw-pwritev.bin", blocks, head_n)
    framing_s = framing_seconds(blocks, head_n)
    lane, seg = pool.disk._read_lane, pool.logs[0]

    def get_inline(key: bytes) -> int:
        loc = seg.locate_many([key])[0]
        piece = coalesce_ranges([loc])[0]
        return len(verify_members(seg.read_run(piece.segment_id, piece.start, piece.end),
                                  piece).values)

    rng = np.random.default_rng(11)
    times: dict[str, list[float]] = {"lane_hop_s": [], "inline_get_s": [], "lane_get_s": []}
    for i in rng.integers(0, blocks.n, SINGLE_GETS).tolist():
        key = blocks.key(i)
        for name, call, arg in (("lane_hop_s", lambda a: lane.submit(int, 1).result(), key),
                                ("inline_get_s", get_inline, key),
                                ("lane_get_s",
                                 lambda a: lane.submit(get_inline, a).result(), key)):
            t = time.perf_counter()
            found = call(arg)
            times[name].append(time.perf_counter() - t)
            if found != 1:
                raise RuntimeError(f"{name} of block {i} found {found} values")
    return {"raw_pwritev_s": raw_s, "raw_pwritev_n": head_n, "framing_s": framing_s,
            **times}


def framing_seconds(blocks: Blocks, n: int) -> float:
    """Seconds of ``framing.frame_puts`` (key checks, headers, the copy into one frame,
    one xxh3 a record; what ``append_blocks`` does before its write, without the write
    and the index) of the first ``n`` blocks in the puts' batches, into one reused,
    pre-touched frame as the log's own."""
    from isolane.kvpool.log.framing import frame_puts

    scratch = np.ones(BATCH * (blocks.block_bytes + 128) + MiB, np.uint8)
    spent = 0.0
    for a in range(0, n, BATCH):
        keys, values = blocks.keys(a, min(n, a + BATCH)), blocks.values(a, min(n, a + BATCH))
        t = time.perf_counter()
        frame_puts(keys, values, time.time_ns(), scratch)
        spent += time.perf_counter() - t
    return spent


def profile_appends(folder: Path, blocks: Blocks) -> list[str]:
    """cProfile of what a ``put_blocks`` runs on the put lane's thread: 200,000 blocks
    through ``SegmentLog.append_blocks`` in this thread, into a fresh log."""
    from isolane.kvpool.log.segment_log import SegmentLog

    n = min(blocks.n, 200_000)
    os.sync()
    with SegmentLog(folder, segment_bytes=256 * MiB) as seg:
        def run() -> None:
            for a in range(0, n, BATCH):
                seg.append_blocks(blocks.keys(a, min(n, a + BATCH)),
                                  blocks.values(a, min(n, a + BATCH)))
        prof = _profiled(True, run)[1]
    shutil.rmtree(folder, ignore_errors=True)
    return prof


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
    probe_ids = rng.integers(0, n, min(args.lookups, 100 * n))
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
    reopen = reopen_rows(args, "lmdb", folder, map_bytes, blocks.key(n // 2)) \
        if args.reopen else {}
    return {"put_s": put_s, "head_s": head_s, "head_n": head_n,
            "lookup_s": lookup_s, "lookups": len(probe_ids),
            "single_get_s": singles, "disk_bytes": tree_bytes(folder), "hint_bytes": 0,
            "profile": {}, **reopen}


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


def open_in_child(kind: str, folder: Path, size: int, probe: bytes,
                  profile: bool = False) -> dict[str, float]:
    out = subprocess.run([sys.executable, str(CHILD), kind, str(folder), str(size),
                          probe.hex(), *(["profile"] if profile else [])],
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
        for k, v in (("cold", cold["open_s"]), ("cold_first", cold["first_get_s"]),
                     ("warm", warm["open_s"]), ("rss", warm["rss_delta"]),
                     ("keys", warm["keys"])):
            rows.setdefault(k, []).append(v)
        log(f"{kind}: reopen cold {cold['open_s']:.3f} s, warm {warm['open_s']:.3f} s, "
            f"rss {warm['rss_delta'] / max(warm['keys'], 1):.1f} B/key")
    prof: list[str] = []
    if getattr(args, "profile", False) and kind == "isolane":
        evict_cache(folder)
        prof = open_in_child(kind, folder, size, probe, profile=True)["profile"]  # type: ignore[assignment]
    return {"reopen": {k: statistics.median(v) for k, v in rows.items()},
            "reopen_runs": rows, "cache_drop": how, "reopen_profile": prof}


def cmd_run(args: argparse.Namespace) -> int:
    root = args.dir.resolve() / f"{args.store}-{args.blocks}-{args.block_bytes}"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    blocks = Blocks(args.blocks, args.block_bytes)
    t0 = time.perf_counter()
    try:
        row = (run_isolane if args.store == "isolane" else run_lmdb)(args, blocks, root)
    finally:
        if not args.keep and args.reopen:
            shutil.rmtree(root, ignore_errors=True)
    row.update({"store": args.store, "blocks": args.blocks, "block_bytes": args.block_bytes,
                "ram_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
                "segment_mib": args.segment_mib, "repeats": args.repeats,
                "command": C.command_line(), "when": C.now_text(),
                "wall_s": time.perf_counter() - t0,
                "machine": C.machine_description(args.dir.resolve(),
                                                 {"numpy": np.__version__,
                                                  **_lmdb_version()})})
    _save_row(args, row)
    log(f"done in {row['wall_s']:.0f} s; appended to {args.json}"
        + ("" if args.reopen else f"; store kept in {root} for `reopen`"))
    return 0


def _save_row(args: argparse.Namespace, row: dict[str, Any]) -> None:
    rows = json.loads(args.json.read_text()) if args.json.exists() else []
    rows = [r for r in rows if (r["store"], r["blocks"], r["block_bytes"]) !=
            (args.store, args.blocks, args.block_bytes)] + [row]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=1))


def cmd_reopen(args: argparse.Namespace) -> int:
    """``reopen``: the reopen rows of a store a ``run --no-reopen`` kept, added to its
    row (a pool too big to build and reopen in one exclusive run); then the store is
    removed unless ``--keep``."""
    root = args.dir.resolve() / f"{args.store}-{args.blocks}-{args.block_bytes}"
    rows = json.loads(args.json.read_text())
    row = next((r for r in rows if (r["store"], r["blocks"], r["block_bytes"]) ==
                (args.store, args.blocks, args.block_bytes)), None)
    if row is None or not root.is_dir():
        raise SystemExit(f"no kept {args.store} store of {args.blocks} x {args.block_bytes} "
                         f"in {root} with a row in {args.json}: run `run --no-reopen` first")
    args.repeats = row["repeats"]
    probe = Blocks(args.blocks, 16).key(args.blocks // 2)  # the keys do not depend on size
    t0 = time.perf_counter()
    try:
        if args.store == "isolane":
            from isolane.kvpool.namespace_files import namespace_dir

            folder = namespace_dir(root / "isolane", "scale") / "segments"
            row.update(reopen_rows(args, "isolane", folder, row["segment_mib"] * MiB, probe))
        else:
            raise SystemExit("reopen: only --store isolane keeps its store")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    row["command"] += f" && {C.command_line()}"
    row["wall_s"] += time.perf_counter() - t0
    _save_row(args, row)
    log(f"reopen rows added to {args.json} in {time.perf_counter() - t0:.0f} s")
    return 0


BUILD_CHILD = Path(__file__).resolve().parent / "_kv_table_build.py"
BUILDS = ("place_rows", "partitioned")


def cmd_build(args: argparse.Namespace) -> int:
    """``build``: the reopen's table build (``key_slots.place_rows``) against the
    partitioned variant (``_kv_table_build.py``) on the same ``--blocks`` rows, each in
    a fresh process, alternating, ``--repeats`` times; one row in ``--json``."""
    t0 = time.perf_counter()
    check = subprocess.run([sys.executable, str(BUILD_CHILD), "partitioned",
                            str(min(args.blocks, 200_000)), "--check"],
                           capture_output=True, text=True)
    if check.returncode != 0:
        raise SystemExit(f"the partitioned build differs from place_rows: {check.stdout}"
                         f"{check.stderr}")
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in BUILDS}
    for _ in range(args.repeats):
        for kind in BUILDS:
            out = subprocess.run([sys.executable, str(BUILD_CHILD), kind, str(args.blocks)],
                                 capture_output=True, text=True, check=True)
            runs[kind].append(json.loads(out.stdout.strip().splitlines()[-1]))
            log(f"build {kind}: {runs[kind][-1]['wall_s']:.3f} s")
    args.store, args.block_bytes = "table-build", 0  # the row's key in --json
    row = {"store": "table-build", "blocks": args.blocks, "block_bytes": 0, "runs": runs,
           "command": C.command_line(), "when": C.now_text(),
           "wall_s": time.perf_counter() - t0, "machine": C.machine_description(
               args.json.resolve().parent, {"numpy": np.__version__})}
    _save_row(args, row)
    return 0


def build_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The ``build`` rows: place_rows against the partitioned variant."""
    out = []
    for r in rows:
        med = {k: {m: statistics.median(x[m] for x in r["runs"][k]) for m in ("wall_s",
                                                                            "cpu_s")}
               for k in BUILDS}
        a, b = med["place_rows"], med["partitioned"]
        out += [f"Table build of {r['blocks']:,} rows (random 16-byte keys, 5 % of them "
                "newer copies of older keys) in a fresh process, as a reopen builds it, "
                f"medians of {len(r['runs']['place_rows'])} alternating runs "
                "(`bench_kv_scale.py build`): isolane's `place_rows` "
                f"{a['wall_s']:.3f} s ({a['cpu_s']:.3f} s CPU); the partitioned variant "
                "(`_kv_table_build.py`: rows grouped by the top 16 bits of their home "
                "slot with a stable radix `argsort` first, so each step on the table "
                "works on a window that stays in the CPU cache, then the same build) "
                f"{b['wall_s']:.3f} s ({b['cpu_s']:.3f} s CPU), "
                f"{b['wall_s'] / a['wall_s']:.2f}x. "
                + ("Grouping the rows costs more than the cache misses it saves: the "
                   "reopen keeps `place_rows`." if b["wall_s"] >= a["wall_s"] else
                   "The partitioned build is faster."), "",
                f"- `{r['command']}` ({r['when']}, {r['wall_s']:.0f} s)", ""]
    return out


def _lmdb_version() -> dict[str, str]:
    try:
        import lmdb
    except ImportError:
        return {}
    return {"py-lmdb": lmdb.__version__, "LMDB": ".".join(map(str, lmdb.version()))}


def head_rate(r: dict[str, Any]) -> float:
    """Blocks/s of the first 2 GiB of puts: the median of the repeats when there are
    (``put_head``), else the one pass; all the blocks' rate for a smaller pool."""
    if not r.get("head_s"):
        return float(r["blocks"] / r["put_s"])
    return float(r["head_n"] / statistics.median(r.get("head_runs_s") or [r["head_s"]]))


def _head_rate(r: dict[str, Any]) -> str:
    if not r.get("head_s"):
        return "-"
    runs = r.get("head_runs_s") or []
    each = ", ".join(f"{r['head_n'] / s / 1e3:.0f}k" for s in runs)
    return f"{head_rate(r):,.0f}" + (f" (runs {each})" if len(runs) > 1 else "")


def _size(nbytes: int) -> str:
    return f"{nbytes // 1024} KiB" if nbytes >= 1024 else f"{nbytes} B"


def cmd_report(args: argparse.Namespace) -> int:
    rows: list[dict[str, Any]] = []
    for path in args.json:
        rows += json.loads(path.read_text())
    builds = [r for r in rows if r["store"] == "table-build"]
    rows = [r for r in rows if r["store"] != "table-build"]
    rows.sort(key=lambda r: (r["blocks"], r["block_bytes"], r["store"] != "isolane"))
    missing = [f"{r['store']} {r['blocks']} x {r['block_bytes']}" for r in rows
               if "reopen" not in r]
    if missing:
        raise SystemExit(f"rows without reopen rows: {', '.join(missing)}; run `reopen` first")
    table = []
    for r in rows:
        m = r["reopen"]
        per_m = 1e6 / r["blocks"]
        singles = [s * 1e6 for s in r["single_get_s"]]
        table.append([
            "isolane KVPool" if r["store"] == "isolane" else "LMDB",
            f"{r['blocks']:,}", _size(r["block_bytes"]), f"{r['disk_bytes'] / 1e9:.2f}",
            f"{r['blocks'] / r['put_s']:,.0f}", _head_rate(r),
            f"{r['lookups'] / r['lookup_s']:,.0f}",
            f"{percentile(singles, 50):.0f} / {percentile(singles, 99):.0f}",
            f"{m['rss'] / r['blocks']:.1f}", f"{m['cold'] * per_m:.3f}",
            f"{m['cold_first'] * per_m:.3f}", f"{m['warm'] * per_m:.3f}"])
    lines = [
        "## KV pool at scale: index RSS, reopen, batch puts and lookups (issue 15)", "",
        "Generated by `benchmarks/bench_kv_scale.py report` from the rows its `run` "
        "invocations wrote (one store and size each, every one an exclusive run). "
        "16-byte random keys; isolane: `KVPool` with a 0-byte memory tier, "
        "`put_blocks`/`lookup_blocks` in batches of 4096, segments of "
        f"{rows[0]['segment_mib'] if rows else '?'} MiB, all sealed before the reopen "
        "(the reopen loads hint files only); LMDB: one write transaction per 4096 puts. "
        "Puts go into the page cache. A single get is one `get_blocks([key])` (isolane) or "
        "one read transaction (LMDB) of a random stored block, warm page cache, "
        f"{SINGLE_GETS} of them. Reopen: a fresh process, medians of "
        f"{rows[0]['repeats'] if rows else '?'}; cold = page cache dropped "
        f"({rows[0]['cache_drop'] if rows else '?'}).", "",
        C.markdown_table(["store", "blocks", "block", "disk GB", "puts/s (all)",
                          "puts/s (first 2 GiB)", "lookups/s",
                          "single get p50 / p99, µs", "index RSS, B/block",
                          "cold reopen, s per 1M", "cold reopen + first get, s per 1M",
                          "warm reopen, s per 1M"], table), "",
    ]
    iso = [r for r in rows if r["store"] == "isolane"]
    if iso:
        verdicts = []
        for r in iso:
            m = r["reopen"]
            per_m = 1e6 / r["blocks"]
            head = head_rate(r)
            checks = [("puts (first 2 GiB)", head, TARGETS["put"], ">="),
                      ("lookups", r["lookups"] / r["lookup_s"], TARGETS["lookup"], ">="),
                      ("index RSS B/block", m["rss"] / r["blocks"], TARGETS["rss"], "<="),
                      ("cold reopen s/1M", m["cold"] * per_m, TARGETS["cold"], "<=")]
            parts = []
            for name, got, want, op in checks:
                ok = got >= want if op == ">=" else got <= want
                parts.append(f"{name} {got:,.3g} ({op} {want:,}: "
                             f"{'met' if ok else 'not met'})")
            verdicts.append(f"- {r['blocks']:,} x {_size(r['block_bytes'])}: "
                            + "; ".join(parts))
        lines += ["Targets of issue 15 (isolane rows):", "", *verdicts, ""]
        if len(iso) >= 2 and iso[-1]["blocks"] > iso[0]["blocks"]:  # sizes, not repeats
            small, big = iso[0], iso[-1]
            p_small = percentile(small["single_get_s"], 99)
            p_big = percentile(big["single_get_s"], 99)
            ram = big.get("ram_bytes") or os.sysconf("SC_PAGE_SIZE") * os.sysconf(
                "SC_PHYS_PAGES")
            lines += [f"p99 of a single get at {big['blocks']:,} blocks is "
                      f"{p_big / p_small:.2f}x the p99 at {small['blocks']:,} "
                      f"({p_big * 1e6:.0f} vs {p_small * 1e6:.0f} µs)."
                      + (f" The {big['disk_bytes'] / 1e9:.0f} GB pool is larger than the "
                         f"machine's {ram / 2**30:.1f} GiB of RAM, so most of its random "
                         "gets read the device, while the "
                         f"{small['disk_bytes'] / 1e9:.1f} GB pool is served from the page "
                         "cache: the difference is the device's latency, not the index "
                         "(its lookups: "
                         f"{big['lookups'] / big['lookup_s'] / 1e6:.2f}M/s against "
                         f"{small['lookups'] / small['lookup_s'] / 1e6:.2f}M/s)."
                         if big["disk_bytes"] > ram >= small["disk_bytes"] else ""), ""]
    lines += cold_lines([r for r in iso if r.get("cold")])
    lines += build_lines(builds)
    have = {(r["blocks"], r["block_bytes"]) for r in iso}
    wanted = [(n, bb) for n, bb in ISSUE_ROWS if (n, bb) not in have]
    if wanted:
        lines += ["Rows of the issue's benchmark not in the data (disk the isolane pool "
                  "needs, records of block + 64 bytes):", "",
                  *(f"- {n:,} x {_size(bb)}: {n * (bb + 64) / 1e9:.0f} GB" for n, bb in wanted),
                  ""]
    for r in iso:
        if r.get("hint_bytes"):
            lines += [f"Hint files of {r['blocks']:,} x {_size(r['block_bytes'])}: "
                      f"{r['hint_bytes'] / 1e6:.1f} MB, {r['hint_bytes'] / r['blocks']:.1f} B "
                      "a block (what a cold reopen reads).", ""]
        lines += bound_lines(r)
        for phase, prof in r.get("profile", {}).items():
            if prof:
                what = (f"{min(r['blocks'], 200_000):,} `SegmentLog.append_blocks` of the "
                        "blocks (what `put_blocks` runs on the put lane's thread; after "
                        "`sync`, right before the pool's puts, into a log of its own)"
                        if phase == "put"
                        else "the lookup phase, run again")
                lines += [f"cProfile of {what}, {r['blocks']:,} x "
                          f"{_size(r['block_bytes'])} (top functions by own time):", "",
                          "```", *prof, "```", ""]
    lines += ["Commands:", ""]
    lines += [f"- `{r['command']}` ({r['when']}, {r['wall_s']:.0f} s)" for r in rows]
    if rows:
        lines += ["", "Machine: " + rows[-1]["machine"]]
    if getattr(args, "title", None):
        lines[0] = f"## {args.title}"
    C.print_report("\n".join(lines), args.out, getattr(args, "section", SECTION))
    return 0


COLD_GROWTH = 1.10  # p99 at the biggest pool within 10 % of the smallest: "does not grow"


def cold_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The cold single gets (``cold_single_gets``) of every isolane row, and whether
    their p99 grows from the smallest pool to the biggest."""
    if not rows:
        return []

    def us(r: dict[str, Any], k: str, q: float) -> float:
        return percentile([t * 1e6 for t in r["cold"][k]], q)

    table = [[f"{r['blocks']:,} x {_size(r['block_bytes'])}", f"{r['disk_bytes'] / 1e9:.1f}",
              str(r["cold"]["segments"]),
              *(f"{us(r, k, 50):.0f} / {us(r, k, 99):.0f}"
                for k in ("get_s", "raw_s", "locate_s"))] for r in rows]
    out = [f"Single gets with a cold page cache (`cold_single_gets`; {SINGLE_GETS} each, "
           f"after {rows[0]['cold']['how']} and one 4 KiB read at the start of every "
           "segment file, so data are cold and the file system's metadata warm at every "
           "size; each get on a fresh random key, beside it an `os.pread` of one block at "
           "a random record of the pool's segment files, the device's own cold read, and "
           "`locate_many` of another random key, the index alone):", "",
           C.markdown_table(["pool", "disk GB", "segments", "get_blocks p50 / p99, µs",
                             "os.pread of a block p50 / p99, µs",
                             "locate_many p50 / p99, µs"], table), ""]
    if len(rows) >= 2 and rows[-1]["blocks"] > rows[0]["blocks"]:  # sizes, not repeats
        small, big = rows[0], rows[-1]
        g, raw, loc = (us(big, k, 99) / us(small, k, 99)
                       for k in ("get_s", "raw_s", "locate_s"))
        over = [us(r, "get_s", 99) - us(r, "raw_s", 99) for r in (small, big)]
        verdict = (f"at most {100 * (COLD_GROWTH - 1):.0f} % higher: does not grow (met)"
                   if g <= COLD_GROWTH else
                   f"more than {100 * (COLD_GROWTH - 1):.0f} % higher (not met)")
        out += [f"Cold single-get p99 at {big['blocks']:,} blocks is {g:.2f}x the p99 at "
                f"{small['blocks']:,} ({us(big, 'get_s', 99):.0f} vs "
                f"{us(small, 'get_s', 99):.0f} µs): {verdict}. In the same runs the "
                f"device's own cold read of a block grew {raw:.2f}x at p99 and the index "
                f"alone (`locate_many`) {loc:.2f}x ({us(big, 'locate_s', 99):.0f} vs "
                f"{us(small, 'locate_s', 99):.0f} µs); a get's p99 over the raw read's "
                f"p99: {over[1]:.0f} µs at {big['blocks']:,} against {over[0]:.0f} µs at "
                f"{small['blocks']:,}."
                + (f" So the get's growth is the device's: its own cold read of one block "
                   f"at a random record grew more ({raw:.2f}x) than the get ({g:.2f}x), "
                   f"and the index did not grow (at most {100 * (COLD_GROWTH - 1):.0f} % "
                   "higher); the part of a get's p99 above the raw read's shrank."
                   if g > COLD_GROWTH and raw >= g and loc <= COLD_GROWTH
                   and over[1] <= over[0] else ""), ""]
    return out


def bound_lines(r: dict[str, Any]) -> list[str]:
    """The same-run bounds (``same_run_bounds``) and the reopen profile of one row."""
    b, out, what = r.get("bounds") or {}, [], f"{r['blocks']:,} x {_size(r['block_bytes'])}"
    out += free_page_lines(r)
    if b:
        raw = b["raw_pwritev_n"] / b["raw_pwritev_s"]
        head = head_rate(r)
        hop, inline = (percentile([s * 1e6 for s in b[k]], 50)
                       for k in ("lane_hop_s", "inline_get_s"))
        via = percentile([s * 1e6 for s in b.get("lane_get_s", [0.0])], 50)
        whole = percentile([s * 1e6 for s in r["single_get_s"]], 50)
        out += [f"Same-run bounds, {what}:", ""]
        if b.get("raw_first_s"):
            first = b["raw_first_n"] / b["raw_first_s"]
            out.append(
                f"- `os.pwritev` of the same values in the puts' batches of {BATCH} "
                f"({IOV_MAX} buffers a call, IOV_MAX: {BATCH // IOV_MAX} calls a batch, no "
                "framing or index) into one fresh file beside the pool, right before the "
                f"puts and after `sync` like them ({b['raw_first_n']:,} blocks): "
                f"{first:,.0f} blocks/s; isolane's puts (first 2 GiB) ran at "
                f"{100 * head / first:.0f} % of that. "
                + (f"This bound is under the put target ({TARGETS['put']:,}/s): the "
                   "kernel's copy into the page cache bounds the puts."
                   if first < TARGETS["put"] else
                   f"This bound is over the put target ({TARGETS['put']:,}/s): what isolane "
                   "adds (framing, checksums, index; the put profile below) is the gap."))
        runs = [b["raw_first_n"] / t for t in b.get("raw_first_runs_s", [])]
        if b.get("raw_cold_s") and runs:
            cold = b["raw_first_n"] / b["raw_cold_s"]
            out.append(
                f"- every timed pass of puts and of that loop starts right after "
                "`held_memory` (a file of the pass's size written and deleted), so it "
                "writes into memory this VM holds. The same loop once first without it, "
                f"in memory the VM had handed back to its host: {cold:,.0f} blocks/s, "
                f"{statistics.median(runs) / cold:.1f}x under the loop's median after it.")
        if len(runs) > 1:
            out.append(f"- the runs of that loop, in order: "
                       f"{', '.join(f'{v:,.0f}' for v in runs)} blocks/s (the slowest is "
                       f"{max(runs) / min(runs):.1f}x under the fastest, the same code on "
                       "the same bytes: the kernel's page-cache writes on this host vary "
                       "that much between runs).")
        if b.get("framing_s") and head:
            frame_us = b["framing_s"] / b["raw_pwritev_n"] * 1e6
            put_us, target_us = 1e6 / head, 1e6 / TARGETS["put"]
            write_us = [1e6 / v for v in runs] or [1e6 / raw]
            left = target_us - frame_us - statistics.median(write_us)
            text = (
                f"- per block: isolane's put (first 2 GiB, median) {put_us:.2f} µs; the "
                f"target takes {target_us:.2f} µs. Of that, `frame_puts` alone (key "
                "checks, headers, the copy into one frame, one xxh3 a record; no write, "
                f"no index; `framing_seconds`) {frame_us:.2f} µs, the raw `pwritev` "
                f"{statistics.median(write_us):.2f} µs (median of its runs; "
                f"{min(write_us):.2f}-{max(write_us):.2f}). "
                + ("Framing and the raw write alone already exceed the target."
                   if left < 0 else
                   f"Framing and the raw write leave {left:.2f} µs for the rest."))
            if b.get("put_write_s") and r.get("head_n"):
                inside = b["put_write_s"] / r["head_n"] * 1e6
                own = r["head_s"] / r["head_n"] * 1e6
                text += (
                    f" In the measured pool's own first 2 GiB ({own:.2f} µs a block) the "
                    f"write inside the puts (`SegmentLog._write_frame`, timed around "
                    f"the real one) took {inside:.2f} µs a block, "
                    f"{inside / statistics.median(write_us):.1f}x the raw loop's median "
                    f"write, and everything else {own - inside:.2f} µs"
                    + (" (within the target)" if own - inside <= target_us else "")
                    + ".")
            out.append(text)
        out += [f"- the same loop after every other phase (page cache then holding the "
                f"pool's dirty pages; {b['raw_pwritev_n']:,} blocks): {raw:,.0f} blocks/s "
                f"({100 * head / raw:.0f} % for isolane's puts).",
                f"- single get p50 {whole:.0f} µs (per-call overhead target "
                f"≤ {GET_P50_TARGET_US} µs: {'met' if whole <= GET_P50_TARGET_US else 'not met'})."
                " With the read lane free its read runs on the calling thread "
                "(`Lane.call_inline`: counted in the lane's in-flight bytes, latency window "
                "and host-plane histogram, at the lane's I/O priority), so it skips the hop "
                f"to a lane thread and back (`submit(no-op).result()`, p50 {hop:.0f} µs, "
                "measured right after the single gets like the rest of this list). "
                f"A get's work written out by hand in the calling thread (locate, coalesce, "
                f"one pread, record check; no tiers, no lane) is p50 {inline:.0f} µs, "
                f"and the whole get {whole / inline:.2f}x that. The same hand-written "
                f"work queued to the lane and waited for (what a get pays when every read "
                f"thread is busy): p50 {via:.0f} µs.", ""]
    if r.get("reopen_profile"):
        out += [f"cProfile of a cold reopen, {what} (fresh process, top functions by own "
                "time):", "", "```",
                *(ln.replace(str(C.REPO_ROOT) + "/", "") for ln in r["reopen_profile"]),
                "```", ""]
    return out


def free_page_lines(r: dict[str, Any]) -> list[str]:
    """How the run kept this VM's freed memory from going back to its host, and the
    put rate of a pass that did not (``C.free_pages_kept``, ``head_vm_s``)."""
    kept, vm_s = r.get("free_pages"), r.get("head_vm_s")
    if not kept:
        return []
    what = f"{r['blocks']:,} x {_size(r['block_bytes'])}"
    was, held = kept["was"], kept["kept"]
    text = (f"Free page reporting, {what}: this VM's guest kernel hands memory freed in "
            f"it back to its host after `page_reporting.min_free_ms` = {was['min_free_ms']:,} "
            f"ms, or at once past `max_waiting_mib` = {was['max_waiting_mib']:,} MiB "
            "waiting, and the next page-cache write into such memory takes a host page "
            "fault. The raw loops and the put passes above ran with them at "
            f"{held['min_free_ms']:,} ms and {held['max_waiting_mib']:,} MiB "
            "(`_common.free_pages_kept`, put back after), as on a host that does not take "
            "memory back.")
    if vm_s and r.get("head_n"):
        vm_rate = r["head_n"] / vm_s
        text += (f" One pass of the first 2 GiB before them, at the VM's own setting: "
                 f"{vm_rate:,.0f} blocks/s, {head_rate(r) / vm_rate:.2f}x under the "
                 "median above.")
    return [text, ""]


def cmd_quick(args: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    """``--quick``: ``run`` of each store at a small size (profiled), then ``report``."""
    root = _quick.enter(args, p, folders=(), files=())
    rows = root / "rows.json"
    for store in ("isolane", "lmdb"):
        run = argparse.Namespace(
            store=store, repeats=1, profile=store == "isolane", dir=root / "stores",
            keep=False, json=rows, lookups=5 * QUICK["blocks"], reopen=True, **QUICK)
        if cmd_run(run) != 0:
            return 1
    return cmd_report(argparse.Namespace(json=[rows], out=None))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _quick.add_argument(p)
    sub = p.add_subparsers(dest="cmd")
    r = sub.add_parser("run", help="measure one store at one size, append to --json")
    r.add_argument("--store", choices=("isolane", "lmdb"), default="isolane")
    r.add_argument("--blocks", type=int, default=1_000_000)
    r.add_argument("--block-bytes", type=int, default=4096)
    r.add_argument("--segment-mib", type=int, default=256)
    r.add_argument("--repeats", type=int, default=3)
    r.add_argument("--profile", action="store_true", help="cProfile the put/lookup phases")
    r.add_argument("--dir", type=Path, default=C.REPO_ROOT / ".bench" / "kv-scale")
    r.add_argument("--keep", action="store_true", help="keep the store's files")
    r.add_argument("--json", type=Path, required=True)
    r.add_argument("--lookups", type=int, default=LOOKUPS, help=argparse.SUPPRESS)
    r.add_argument("--no-reopen", dest="reopen", action="store_false",
                   help="keep the store and skip the reopen rows (then run `reopen`)")
    o = sub.add_parser("reopen", help="the reopen rows of a store `run --no-reopen` kept")
    o.add_argument("--store", choices=("isolane",), default="isolane")
    o.add_argument("--blocks", type=int, required=True)
    o.add_argument("--block-bytes", type=int, required=True)
    o.add_argument("--profile", action="store_true", help="cProfile one more cold reopen")
    o.add_argument("--dir", type=Path, default=C.REPO_ROOT / ".bench" / "kv-scale")
    o.add_argument("--keep", action="store_true", help="keep the store's files")
    o.add_argument("--json", type=Path, required=True)
    b = sub.add_parser("build", help="place_rows against the partitioned table build")
    b.add_argument("--blocks", type=int, default=10_000_000)
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--json", type=Path, required=True)
    g = sub.add_parser("report", help="write the report from the rows of --json files")
    g.add_argument("--json", type=Path, nargs="+", required=True)
    g.add_argument("--out", type=Path, help="markdown file whose section to (re)write")
    g.add_argument("--section", default=SECTION, help="section marker name in --out")
    g.add_argument("--title", help="heading of the report (a partial run's own section)")
    args = p.parse_args(argv)
    if args.quick:
        if args.cmd:
            p.error("--quick runs both stores and the report itself: give no command")
        return cmd_quick(args, p)
    if not args.cmd:
        p.error("give a command: run or report (or --quick)")
    return {"run": cmd_run, "reopen": cmd_reopen, "build": cmd_build,
            "report": cmd_report}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
