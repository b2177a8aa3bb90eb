#!/usr/bin/env python
"""KV pool: prompt restore, small random reads and restart; isolane against one file per
block, LMDB, LMCache's disk backend, Redis and the disk's own sequential read.

    python benchmarks/bench_kv.py --quick                         # smoke test, ~30 s
    python benchmarks/bench_kv.py --out docs/BENCHMARKS.md        # full run, ~15 min

Block geometry of Llama-3-8B (128 KiB of KV per token, bf16): a 256-token block across
all 32 layers is 32 MiB; a 16-token block of one layer is 64 KiB. Every store holds the
same corpus (prompts of 256 blocks; at least ``--corpus-gb`` of 32 MiB blocks and
``--corpus-small-gb`` of 64 KiB blocks), far larger than isolane's memory tier, which is
0 bytes for the restore and cold runs.

- **Prompt restore** of the first N in {16, 64, 256} blocks of a prompt, after
  ``sync; echo 3 > /proc/sys/vm/drop_caches``: seconds from the call until the bytes are
  in the caller's (preallocated, pre-touched) tensor. isolane ``get_blocks`` (+ copy)
  and ``get_into``; one file per block, serial and on 8 threads; LMDB; LMCache 0.5.6
  ``LocalDiskBackend`` (child process in ``.bench/lmcache-venv``); and, in the same
  round, a sequential read of as many bytes from one file (buffered, and O_DIRECT with 8
  requests in flight; the faster is the limit).
  64 KiB blocks: all stores exist at once and take turns within each round. 32 MiB
  blocks (8.6 GB for N = 256): one store at a time (built, measured, deleted) to stay
  within ~20 GB of disk; the limit is measured in every round of every phase, and
  ratios between stores are ratios of their shares of the limit of their own rounds,
  which cancels the disk's drift between phases.
- **Small random reads** of 64 KiB blocks, ids drawn from Zipf(1.0) over the corpus:
  p50/p99/p999 per call at 1, 8 and 32 threads, cold (page cache dropped, isolane
  reopened with an empty memory tier) and warm (isolane's memory tier holds the whole
  corpus; LMDB's pages cached); vs LMDB and Redis (``redis-server`` on loopback,
  persistence off, started and stopped here).
- **Restart**: reopen isolane pools grown to ``--restart-gb`` (32 MiB blocks) and
  ``--restart-small-gb`` (64 KiB blocks): seconds cold (page cache dropped) and warm; LMDB
  reopen; whether LMCache finds its blocks after a restart.

Every restore is compared with the stored bytes outside the timing (all blocks in the
first round, 4 spread blocks after); every 16th random read too.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C
import _kv_data as D
import _kv_latency as L
import _kv_systems as K
import _quick
import _results
import numpy as np
from _kv_report import TARGETS, THREADS, Results, Row, isolane_revision, raw, render, share_ratio

C.ensure_repo_importable()

SECTION = "kv"
RESTORE_NS = (16, 64, 256)
QUICK_NS_LARGE = (2, 4)
STORE_KEYS = ("isolane", "files", "lmdb", "lmcache")
MEMORY_MARGIN = 1 << 30
_T0 = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f}s] {message}", file=sys.stderr, flush=True)


def drop(res: Results) -> None:
    res.cache_dropped &= C.drop_page_cache()


def timed(res: Results, row: Row, call: Callable[[], float]) -> float:
    """``call()`` (a restore, which times itself), with the reads and sectors the scratch
    folder's disk completed meanwhile (``/proc/diskstats``) added to ``row``."""
    before = C.disk_read_counts(res.scratch) if res.scratch else None
    seconds = call()
    after = C.disk_read_counts(res.scratch) if before is not None else None
    if before is not None and after is not None:
        row.disk_reads.append(after[0] - before[0])
        row.disk_kib.append((after[1] - before[1]) // 2)
    return seconds


# -- prompt restore rounds ------------------------------------------------------------------
def restore_rounds(geometry: D.Geometry, corpus: D.Corpus, limit: K.SequentialLimit,
                   restorers: list[K.Restorer], ns: Sequence[int], args: argparse.Namespace,
                   res: Results, *, phase: int = 0) -> None:
    """``args.repeats`` rounds; in each, per N: the limit (both ways), then every restorer
    (order rotated round by round), each after dropping the page cache."""
    warm_up(geometry, corpus, restorers, max(ns), res)
    for rnd in range(args.repeats):
        for ni, n in enumerate(ns):
            prompt = (phase + rnd * len(ns) + ni) % corpus.prompts
            one_round(geometry, limit, restorers, n, prompt, rnd, res)


def one_round(geometry: D.Geometry, limit: K.SequentialLimit, restorers: list[K.Restorer],
              n: int, prompt: int, rnd: int, res: Results) -> None:
    """The limit (both ways), then every restorer (order rotated round by round), each
    after dropping the page cache."""
    b = geometry.block_bytes
    gkey = geometry.name
    limits = []
    for lr in limit.restorers(b):
        drop(res)
        row = res.row(gkey, lr, n, b)
        seconds = timed(res, row, lambda lr=lr: lr.restore(prompt, n, None))
        row.seconds.add(seconds)
        limits.append((seconds, row))
    best, fastest = min(limits, key=lambda t: t[0])
    lim_row = res.limit_row(gkey, n, b)
    lim_row.seconds.add(best)
    lim_row.shares.append(1.0)
    lim_row.disk_reads += fastest.disk_reads[-1:]
    lim_row.disk_kib += fastest.disk_kib[-1:]
    order = restorers[rnd % len(restorers):] + restorers[:rnd % len(restorers)] \
        if restorers else []
    for r in order:
        row = res.row(gkey, r, n, b)
        if row.skipped:
            continue
        need = r.extra_bytes(n) + MEMORY_MARGIN
        if K.mem_available_bytes() < need:
            row.skipped = (f"needs ~{need / C.GB:.1f} GB of free memory, "
                           f"{K.mem_available_bytes() / C.GB:.1f} GB available")
            continue
        sample = None if rnd == 0 else 4
        r.before_cold()
        drop(res)
        try:
            seconds = timed(res, row, lambda r=r, s=sample: r.restore(prompt, n, s))
            problem = r.check(prompt, n, sample)
        except Exception as exc:  # record it in the row, measure the rest
            traceback.print_exc()
            row.errors.append(f"{type(exc).__name__}: {exc}"[:300])
            continue
        finally:
            gc.collect()
        row.seconds.add(seconds)
        row.shares.append(best / seconds)
        if problem:
            row.problems.append(problem)
    done = [(r.key, res.restore[(gkey, r.key, n)].seconds.values) for r in order]
    summary = ", ".join(f"{key} {n * b / vals[-1] / C.GB:.2f}" for key, vals in done
                        if vals)
    log(f"  {gkey} N={n} round {rnd + 1}: limit {n * b / best / C.GB:.2f} "
        f"GB/s; {summary} GB/s")


def warm_up(geometry: D.Geometry, corpus: D.Corpus, restorers: list[K.Restorer], n: int,
            res: Results) -> None:
    """One untimed restore of ``n`` blocks per restorer (page cache not dropped): lazy
    imports, thread pools and staging pools are set up before the first timed round, as
    in a long-running server. A mismatch here is recorded like any other."""
    prompt = corpus.prompts - 1
    for r in restorers:
        if K.mem_available_bytes() < r.extra_bytes(n) + MEMORY_MARGIN:
            continue
        try:
            r.restore(prompt, n, 4)
            problem = r.check(prompt, n, 4)
        except Exception as exc:  # recorded; the rounds will show it again
            traceback.print_exc()
            problem = f"warm-up failed: {type(exc).__name__}: {exc}"[:300]
        finally:
            gc.collect()
        if problem:
            res.row(geometry.name, r, n, geometry.block_bytes).problems.append(problem)


# -- building stores --------------------------------------------------------------------------
@dataclass
class Workspace:
    geometry: D.Geometry
    corpus: D.Corpus
    base: D.Bytes
    base_file: Path
    folder: Path
    ns: tuple[int, ...]


def open_store(key: str, ws: Workspace, dest: K.Dest | None, args: argparse.Namespace,
               res: Results) -> K.Store | None:
    """Create and fill one store; None (reason recorded) when it cannot run here."""
    g, corpus = ws.geometry, ws.corpus
    b = g.block_bytes
    store: K.Store
    try:
        if key == "isolane":
            store = K.IsolaneStore(ws.folder / "isolane", corpus, ws.base, dest)
        elif key == "files":
            assert dest is not None
            store = K.FilesStore(ws.folder / "files", corpus, ws.base, dest)
        elif key == "lmdb":
            store = K.LmdbStore(ws.folder / "lmdb", corpus, ws.base, dest,
                                map_bytes=int(corpus.nbytes * 1.25) + (256 << 20))
        elif key == "lmcache":
            max_n = max(ws.ns)
            while max_n and 2 * max_n * b + MEMORY_MARGIN > K.mem_available_bytes():
                max_n //= 2
            if max_n < max(ws.ns):
                res.skipped.append(f"LMCache ({g.name}): N > {max_n} skipped, its staging "
                                   "pool and tensor would not fit in free memory")
            store = K.LmcacheStore(
                K.python_of_venv(args.lmcache_venv), ws.folder / "lmcache", corpus,
                ws.base_file, dest_bytes=max(max_n, 1) * b,
                pool_bytes=max(max_n, 1) * b + (64 << 20), threads=args.lmcache_threads,
                log_path=args.dir / "lmcache-child.log")
            res.versions["LMCache"] = store.versions.get("lmcache", "?")
            res.versions["LMCache venv: torch"] = store.versions.get("torch", "?")
            res.versions["LMCache venv: numpy"] = store.versions.get("numpy", "?")
        else:
            raise ValueError(key)
    except Exception as exc:  # the row says why; the others still run
        traceback.print_exc()
        why = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        res.builds[(g.name, key)] = {"error": why}
        res.skipped.append(f"{key} ({g.name}) not measured: {why}")
        return None
    log(f"{g.name}: building {key} ({C.fmt_gb(corpus.nbytes)})")
    try:
        seconds = store.build(corpus, range(corpus.prompts))
    except Exception as exc:  # the row says why; the others still run
        traceback.print_exc()
        why = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        res.builds[(g.name, key)] = {"error": why}
        res.skipped.append(f"{key} ({g.name}) not measured: build failed: {why}")
        store.remove()
        return None
    res.builds[(g.name, key)] = {"seconds": seconds, "nbytes": corpus.nbytes}
    log(f"  {key}: {seconds:.1f} s, {corpus.nbytes / seconds / C.GB:.2f} GB/s until durable")
    return store


def restorers_of(store: K.Store, args: argparse.Namespace) -> list[K.Restorer]:
    return [r for r in store.restorers() if r.key.split(":")[0] in args.stores
            or r.key in args.stores]


# -- the 64 KiB geometry: all stores at once ------------------------------------------------
def run_small(args: argparse.Namespace, res: Results) -> None:
    g = D.LLAMA3_8B_LAYER
    ns = RESTORE_NS
    corpus = D.plan_corpus(g, int(args.corpus_small_gb * C.GB), max(ns))
    ws = make_workspace(g, corpus, ns, args)
    res.corpora[g.name] = corpus
    limit = K.SequentialLimit(ws.folder / "limit.bin", max(ns) * g.block_bytes, ws.base)
    res.builds[(g.name, "limit")] = {"seconds": limit.build(), "nbytes": limit.capacity}
    dest = K.Dest(max(ns) * g.block_bytes)
    stores: dict[str, K.Store] = {}
    try:
        for key in STORE_KEYS:
            if key in args.stores:
                store = open_store(key, ws, dest, args, res)
                if store is not None:
                    stores[key] = store
        restorers = [r for s in stores.values() for r in restorers_of(s, args)]
        log(f"{g.name}: prompt restore, {args.repeats} round(s)")
        restore_rounds(g, corpus, limit, restorers, ns, args, res)
        iso = stores.get("isolane")
        if not args.no_latency:
            run_latency(ws, stores, args, res)
        lmcache = stores.get("lmcache")
        if isinstance(lmcache, K.LmcacheStore):
            lmcache_restart(lmcache, g, res)
        for key in [k for k in stores if k != "isolane"]:
            stores.pop(key).remove()
        dest.release()
        if isinstance(iso, K.IsolaneStore) and not args.no_restart:
            restart_isolane(iso, ws, args.restart_small_gb, args, res)
    finally:
        for store in stores.values():
            store.remove()
        limit.remove()
        C.remove_path(ws.folder)


def make_workspace(g: D.Geometry, corpus: D.Corpus, ns: tuple[int, ...],
                   args: argparse.Namespace) -> Workspace:
    folder = args.dir / f"kv-{g.name}"
    C.remove_path(folder)
    folder.mkdir(parents=True)
    base_file = folder / "base.bin"
    base = D.make_base(g.block_bytes, base_file)
    log(f"{g.name}: corpus of {corpus.prompts} prompt(s) x {corpus.blocks_per_prompt} blocks "
        f"= {corpus.blocks} blocks, {C.fmt_gb(corpus.nbytes)}")
    return Workspace(g, corpus, base, base_file, folder, ns)


# -- the 32 MiB geometry: one store at a time -------------------------------------------------
def run_large(args: argparse.Namespace, res: Results) -> None:
    g = D.LLAMA3_8B_BLOCK
    ns = QUICK_NS_LARGE if args.quick else RESTORE_NS
    corpus = D.plan_corpus(g, int(args.corpus_gb * C.GB), max(ns))
    ws = make_workspace(g, corpus, ns, args)
    res.corpora[g.name] = corpus
    limit = K.SequentialLimit(ws.folder / "limit.bin", max(ns) * g.block_bytes, ws.base)
    log(f"{g.name}: writing the limit file ({C.fmt_gb(limit.capacity)})")
    res.builds[(g.name, "limit")] = {"seconds": limit.build(), "nbytes": limit.capacity}
    try:
        for phase, key in enumerate(k for k in STORE_KEYS if k in args.stores):
            parent_side = key != "lmcache"
            dest = K.Dest(max(ns) * g.block_bytes) if parent_side else None
            store = open_store(key, ws, dest, args, res)
            try:
                if store is None:
                    continue
                log(f"{g.name}: prompt restore from {key}, {args.repeats} round(s)")
                restore_rounds(g, corpus, limit, restorers_of(store, args), ns, args, res,
                               phase=phase)
                if isinstance(store, K.LmdbStore):
                    lmdb_restart(store, g, corpus, res)
                if isinstance(store, K.LmcacheStore):
                    lmcache_restart(store, g, res)
                if dest is not None:
                    dest.release()
                    dest = None
                if isinstance(store, K.IsolaneStore) and not args.no_restart:
                    restart_isolane(store, ws, args.restart_gb, args, res)
            finally:
                if store is not None:
                    store.remove()
                if dest is not None:
                    dest.release()
                gc.collect()
    finally:
        limit.remove()
        C.remove_path(ws.folder)


# -- small random reads ---------------------------------------------------------------------
def run_latency(ws: Workspace, stores: dict[str, K.Store], args: argparse.Namespace,
                res: Results) -> None:
    g, corpus, base = ws.geometry, ws.corpus, ws.base
    b = g.block_bytes
    readers: dict[str, Callable[[], L.Reader]] = {}
    prepare: dict[str, Callable[[str], None]] = {}
    server: L.RedisServer | None = None
    iso = stores.get("isolane")
    if isinstance(iso, K.IsolaneStore):
        add_isolane_readers(iso, corpus, readers, prepare, res)
    lm = stores.get("lmdb")
    if isinstance(lm, K.LmdbStore):
        lmdb_store = lm

        def lmdb_prepare(state: str) -> None:
            if state == "cold":
                lmdb_store.reopen()  # unmap: mapped pages would survive the drop
            else:
                with lmdb_store.env.begin(buffers=True) as txn:
                    for j in range(corpus.blocks):
                        bytes(txn.get(lmdb_store.key_of(j))[::4096])  # touch every page

        readers["lmdb"] = lambda: lmdb_store.get
        prepare["lmdb"] = lmdb_prepare
        res.latency_notes["lmdb"] = ("a read transaction + `get` per call, the value (a view "
                                     "into the map) copied out; warm = every page cached")
    if "redis" in args.stores:
        try:
            server = L.RedisServer(ws.folder / "redis")
            server.start()
            client = L.redis_client(server.port)
            seconds = L.load_redis(client, base, list(range(corpus.blocks)), b)
            res.builds[(g.name, "redis")] = {"seconds": seconds, "nbytes": corpus.nbytes,
                                             "note": "in memory, no persistence"}
            res.versions["redis-server"] = server.version

            def redis_reader() -> L.Reader:
                def read(block_id: int, out: memoryview) -> None:
                    out[:] = client.get(L.redis_key(block_id))
                return read

            readers["redis"] = redis_reader
            prepare["redis"] = lambda state: None
            res.latency_notes["redis"] = (
                f"redis-server {server.version} on 127.0.0.1 (`--save '' --appendonly no`), "
                "redis-py `GET` over a pool of 64 connections; all data in RAM, so cold = "
                "warm")
        except Exception as exc:  # the row says why
            traceback.print_exc()
            res.skipped.append(f"redis not measured: {type(exc).__name__}: {exc}")
            if server is not None:
                server.stop()
                server = None
    try:
        total = args.latency_calls
        for rnd in range(args.repeats):
            for state in ("cold", "warm"):
                for threads in THREADS:
                    ids = D.zipf_ids(corpus.blocks, total // threads * threads,
                                     seed=1000 * rnd + threads)
                    names = list(readers)
                    names = names[rnd % len(names):] + names[:rnd % len(names)]
                    for name in names:
                        prepare[name](state)
                        if state == "cold":
                            drop(res)
                        run = L.measure(readers[name], ids, threads, base, b,
                                        read_bytes=K.process_read_bytes)
                        res.latency.setdefault((name, state, threads), []).append(run)
                        log(f"  {name} {state} x{threads}: p50 {run.p50_us:.0f} p99 "
                            f"{run.p99_us:.0f} p999 {run.p999_us:.0f} us"
                            + (f" ERROR {run.error}" if run.error else ""))
    finally:
        if server is not None:
            server.stop()
        if isinstance(iso, K.IsolaneStore):
            iso.open(0)


def add_isolane_readers(iso: K.IsolaneStore, corpus: D.Corpus,
                        readers: dict[str, Callable[[], L.Reader]],
                        prepare: dict[str, Callable[[str], None]], res: Results) -> None:
    """Two readers over one pool (one open at a time: the folder is locked): "isolane"
    with a memory tier that holds the whole corpus, "isolane, tier 0" without one (every
    call takes the disk path: read lane, pread, checksum)."""
    keys = [k for p in range(corpus.prompts) for k in iso.prompt_keys(p)]
    budget = corpus.nbytes + (64 << 20)
    state = {"budget": -1, "warm": False}

    def reopen(memory_budget: int) -> None:
        iso.open(memory_budget)
        state["budget"], state["warm"] = memory_budget, False

    def reader() -> L.Reader:
        def read(block_id: int, out: memoryview) -> None:
            out[:] = iso.pool.get_blocks([keys[block_id]])[0]
        return read

    def prepare_for(memory_budget: int) -> Callable[[str], None]:
        def prep(temperature: str) -> None:
            if temperature == "cold" or state["budget"] != memory_budget:
                reopen(memory_budget)  # an empty memory tier
            if temperature == "warm" and not state["warm"]:
                for i in range(0, len(keys), 256):  # into the tier, or the page cache
                    iso.pool.get_blocks(keys[i:i + 256])
                state["warm"] = True
        return prep

    readers["isolane"], prepare["isolane"] = reader, prepare_for(budget)
    readers["isolane, tier 0"], prepare["isolane, tier 0"] = reader, prepare_for(0)
    res.latency_notes["isolane"] = (
        f"`get_blocks([key])` + copy; memory tier {budget / 2**30:.2f} GiB (holds the "
        "whole corpus): warm = every block in the memory tier (in-process, no I/O); cold = "
        "pool reopened (tier empty) and page cache dropped, the run's own reads then fill "
        "the tier (Zipf repeats hit it)")
    res.latency_notes["isolane, tier 0"] = (
        "the same pool with a 0-byte memory tier: every call takes the disk path (read "
        "lane thread, pread, checksum); warm = every block in the page cache")


# -- restart --------------------------------------------------------------------------------
def restart_isolane(store: K.IsolaneStore, ws: Workspace, target_gb: float,
                    args: argparse.Namespace, res: Results) -> None:
    g = ws.geometry
    store.open(0)
    # Grow with prompts of at most 256 MiB so the pool lands just past the target. Their
    # token ids and block ids start where the corpus's end (no key or content repeats).
    per = max(1, min(ws.corpus.blocks_per_prompt, (256 << 20) // g.block_bytes))
    start_prompt = -(-ws.corpus.blocks // per)
    extra = max(0, -(-(int(target_gb * C.GB) - ws.corpus.nbytes) // (per * g.block_bytes)))
    grown = ws.corpus
    free = shutil.disk_usage(ws.folder).free
    if extra and free < extra * per * g.block_bytes + (5 << 30):
        res.skipped.append(f"isolane restart ({g.name}): not grown to {target_gb} GB, only "
                           f"{free / C.GB:.1f} GB free on the scratch disk")
        extra = 0
    if extra:
        grown = D.Corpus(g, start_prompt + extra, per)
        log(f"{g.name}: growing the isolane pool by {C.fmt_gb(extra * per * g.block_bytes)}")
        seconds = store.build(grown, range(start_prompt, grown.prompts))
        log(f"  {seconds:.1f} s, {extra * per * g.block_bytes / seconds / C.GB:.2f} GB/s")
    store.corpus = grown
    store.keys.clear()
    stats = store.stats()
    disk = stats.get("disk", [{}])
    blocks = sum(d.get("blocks", 0) for d in disk)
    nbytes = sum(d.get("bytes", 0) for d in disk)
    segments = sum(1 for p in store.folder.rglob("seg-*.sealed")) + \
        sum(1 for p in store.folder.rglob("seg-*.live"))
    cold, warm, first = C.Samples(), C.Samples(), C.Samples()
    problem = None if blocks == grown.blocks else (
        f"the pool holds {blocks} blocks, {grown.blocks} were stored")
    probe = [grown.block_id(grown.prompts - 1, grown.blocks_per_prompt - 1)]
    for _ in range(args.repeats):
        store.close()
        drop(res)
        cold.add(store.open(0))
        store.keys.clear()
        keys = store.prompt_keys(grown.prompts - 1)[-1:]
        t0 = time.perf_counter()
        got = store.pool.get_blocks(keys)[0]
        first.add(time.perf_counter() - t0)
        if got is None or not np.array_equal(np.frombuffer(got, np.uint8),
                                             D.block_view(ws.base, probe[0], g.block_bytes)):
            problem = "the last block stored was not found or differs after reopening"
        store.close()
        warm.add(store.open(0))
    res.restart.append({
        "system": "isolane KVPool", "geometry": g.name, "nbytes": nbytes, "blocks": blocks,
        "segments": segments, "cold": cold.values, "warm": warm.values,
        "first_get": first.values, "check": problem or "ok: last block read back",
        "note": "constructor until open (hint files loaded, live segment scanned)"})
    log(f"  reopen {C.fmt_gb(nbytes)} ({blocks} blocks): cold {cold.median:.3f} s, warm "
        f"{warm.median:.3f} s")


def lmdb_restart(store: K.LmdbStore, g: D.Geometry, corpus: D.Corpus, res: Results) -> None:
    cold, first = C.Samples(), C.Samples()
    out = K.Dest(g.block_bytes)
    problem = None
    for _ in range(3):
        store.reopen()  # unmap first: pages still mapped would survive the drop
        drop(res)
        cold.add(store.reopen())
        t0 = time.perf_counter()
        store.get(corpus.blocks - 1, out.view)
        first.add(time.perf_counter() - t0)
        if not np.array_equal(out.array, D.block_view(store.base, corpus.blocks - 1,
                                                      g.block_bytes)):
            problem = "the last block differs after reopening"
    out.release()
    res.restart.append({
        "system": "LMDB", "geometry": g.name, "nbytes": corpus.nbytes, "blocks": corpus.blocks,
        "segments": 1, "cold": cold.values, "warm": [], "first_get": first.values,
        "check": problem or "ok: last block read back", "note": "`lmdb.open` (mmap, no scan)"})


def lmcache_restart(store: K.LmcacheStore, g: D.Geometry, res: Results) -> None:
    try:
        answer = store.reopen()
    except K.ChildError as exc:
        res.skipped.append(f"LMCache restart ({g.name}) not measured: {exc}")
        return
    res.restart.append({
        "system": "LMCache LocalDiskBackend", "geometry": g.name,
        "nbytes": store.corpus.nbytes, "blocks": store.corpus.blocks, "segments": answer["files"],
        "cold": [answer["seconds"]], "warm": [], "first_get": [],
        "check": f"found {answer['found']} of {store.corpus.blocks} blocks after reopening",
        "note": "a new LocalDiskBackend on the same folder: its index lives in memory only, "
                "so the files stay on disk but the cache is empty"})


# -- the recorded rows ---------------------------------------------------------------------
def headline_rows(res: Results, where: dict[str, str]) -> list[_results.Result]:
    """The page's rows: prompt restores (get_into) against serial per-block files, LMCache
    and the same run's sequential read; random reads against LMDB; the reopen."""
    rows: list[_results.Result] = []

    def add(measure: str, row: Row | None, peer: str, peer_row: Row | None, ratio: float | None,
            target: float | None, *, share: bool = False) -> None:
        if row is None or row.median is None or peer_row is None or peer_row.median is None \
                or ratio is None:
            return
        value = ratio * 100 if share else ratio
        rows.append(_results.Result(
            area="KV pool", measure=measure, value=round(row.median * 1e3, 1), unit="ms",
            peer=peer, peer_value=round(peer_row.median * 1e3, 1),
            ratio=round(value, 0 if share else 2), ratio_unit="%" if share else "x",
            target=None if target is None else (f"≥ {target * 100:.0f} %" if share
                                                else f"≥ {target:g}x"),
            met=None if target is None else value >= (target * 100 if share else target),
            **where))

    for g, label in ((D.LLAMA3_8B_LAYER, "64 KiB"), (D.LLAMA3_8B_BLOCK, "32 MiB")):
        ns = sorted({n for (name, _k, n) in res.restore if name == g.name})
        for n in ns:
            into = res.restore.get((g.name, "isolane:get_into", n))
            what = f"prompt restore, {n} blocks of {label}, get_into, cold"
            if g is D.LLAMA3_8B_LAYER:  # 32 MiB blocks are big sequential reads already
                add(what, into, "one file per block, serial reads",
                    res.restore.get((g.name, "files:serial", n)),
                    share_ratio(res, g.name, "isolane:get_into", "files:serial", n),
                    TARGETS["vs_serial_64k"])
            add(what, into, "LMCache LocalDiskBackend", res.restore.get((g.name, "lmcache", n)),
                share_ratio(res, g.name, "isolane:get_into", "lmcache", n), TARGETS["vs_lmcache"])
            add(f"prompt restore, {n} blocks of {label}, share of the read limit", into,
                "sequential read of the same bytes", res.restore.get((g.name, "limit", n)),
                into.share if into else None, TARGETS["vs_limit"], share=True)
    for state in ("warm", "cold"):
        iso, lmdb = res.latency.get(("isolane", state, 1)), res.latency.get(("lmdb", state, 1))
        if iso and lmdb and not any(r.error for r in [*iso, *lmdb]):
            p99, peer = (float(np.median([r.p99_us for r in runs])) for runs in (iso, lmdb))
            target = TARGETS["warm_p99_us"] if state == "warm" else None
            rows.append(_results.Result(
                area="KV pool", measure=f"random 64 KiB reads (Zipf), {state}, 1 thread, p99",
                value=round(p99), unit="µs", peer="LMDB", peer_value=round(peer),
                ratio=round(peer / p99, 2), target=f"≤ {target:g} µs" if target else None,
                met=p99 <= target if target else None, **where))
    for r in res.restart:
        if r["system"].startswith("isolane") and r["cold"]:
            rows.append(_results.Result(
                area="KV pool", measure=f"reopen a full store ({C.fmt_gb(r['nbytes'])} of "
                f"{r['geometry']} blocks), cold", value=round(float(np.median(r["cold"])), 3),
                unit="s", **where))
    return rows


# -- command line -----------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _quick.add_argument(p)
    p.add_argument("--corpus-gb", type=float, default=4.0,
                   help="minimum corpus of 32 MiB blocks (whole 256-block prompts: 8.6 GB "
                        "at least for N = 256)")
    p.add_argument("--corpus-small-gb", type=float, default=1.0,
                   help="corpus of 64 KiB blocks")
    p.add_argument("--restart-gb", type=float, default=10.0,
                   help="isolane pool of 32 MiB blocks to reopen")
    p.add_argument("--restart-small-gb", type=float, default=10.0,
                   help="isolane pool of 64 KiB blocks to reopen")
    p.add_argument("--repeats", type=int, default=3, help="rounds per measurement (median)")
    p.add_argument("--latency-calls", type=int, default=6000,
                   help="calls per random-read run (split over the threads)")
    p.add_argument("--geometries", default="64KiB,32MiB", help="comma list: 64KiB, 32MiB")
    p.add_argument("--stores", default="isolane,files,lmdb,lmcache,redis",
                   help="comma list: isolane, files, lmdb, lmcache, redis")
    p.add_argument("--lmcache-venv", type=Path, default=C.REPO_ROOT / ".bench" / "lmcache-venv",
                   help="virtual env with torch==2.13.0 lmcache==0.5.6")
    p.add_argument("--lmcache-threads", type=int, default=4,
                   help="LMCache disk_io_threads (its default is 4)")
    p.add_argument("--no-latency", action="store_true", help="skip the random reads")
    p.add_argument("--no-restart", action="store_true", help="skip the restart case")
    p.add_argument("--dir", type=Path, default=C.REPO_ROOT / ".bench",
                   help="scratch folder (deleted after use)")
    p.add_argument("--out", type=Path, help="docs/BENCHMARKS.md records the headline rows "
                   "in benchmarks/results/kv.json; another file gets the report")
    p.add_argument("--json", type=Path, help="also write the raw measurements here")
    args = p.parse_args(argv)
    if args.quick:  # N of 32 MiB blocks {2, 4}, 1 round, few calls, small restart pools
        _quick.enter(args, p)
        args.corpus_gb = min(args.corpus_gb, 0.1)
        args.corpus_small_gb = min(args.corpus_small_gb, 0.05)
        args.restart_gb = min(args.restart_gb, 0.2)
        args.restart_small_gb = min(args.restart_small_gb, 0.1)
        args.repeats = 1
        args.latency_calls = min(args.latency_calls, 400)
    args.dir = args.dir.resolve()
    args.stores = {s.strip() for s in args.stores.split(",") if s.strip()}
    args.geometries = [s.strip() for s in args.geometries.split(",") if s.strip()]
    unknown = (args.stores - {*STORE_KEYS, "redis"}) | (set(args.geometries) - set(D.GEOMETRIES))
    if unknown or args.repeats < 1:
        p.error(f"unknown store or geometry {sorted(unknown)}, or --repeats < 1")
    return args


def isolane_missing() -> str | None:
    try:
        from isolane.kvpool.pool import KVPool  # noqa: F401
    except Exception as exc:  # any import failure means: skip the isolane rows
        return f"{type(exc).__name__}: {exc}"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    res = Results(revision=isolane_revision())  # what is imported below, not at the end
    res.scratch = args.dir
    if args.quick and (why := isolane_missing()):
        log(f"--quick: cannot import isolane.kvpool.pool.KVPool ({why})")
        return 1
    if "isolane" in args.stores and (why := isolane_missing()):
        args.stores.discard("isolane")
        res.skipped.append(f"isolane rows skipped: `from isolane.kvpool.pool import KVPool` "
                           f"failed ({why})")
    try:
        import hiredis

        res.versions["hiredis"] = hiredis.__version__  # redis-py's parser when installed
    except ImportError:
        pass
    for name, module in (("lmdb", "lmdb"), ("redis-py", "redis")):
        try:
            res.versions[name] = __import__(module).__version__
        except ImportError as exc:
            res.skipped.append(f"{name} missing ({exc}): `pip install lmdb redis`")
            args.stores.discard("lmdb" if module == "lmdb" else "redis")
    if "64KiB" in args.geometries:
        run_small(args, res)
    if "32MiB" in args.geometries:
        run_large(args, res)
    machine = C.machine_description(args.dir, dict(res.versions))
    rows = headline_rows(res, {"machine": machine, "date": C.now_text(),
                               "command": C.command_line()})
    C.print_report(render(res, args) + "\n" + _results.rows_markdown(rows), args.out, SECTION)
    if args.out and _results.is_page(args.out):
        _results.write_results(SECTION, rows)
    if args.json:
        args.json.write_text(json.dumps(raw(res), indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
