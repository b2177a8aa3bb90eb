#!/usr/bin/env python
"""KV pool: cold prompt restores, small random reads and a reopen; isolane against one
file per block, LMCache's disk backend, LMDB and the disk's own sequential read.

    python benchmarks/bench_kv.py --quick                         # smoke test
    python benchmarks/bench_kv.py --out docs/BENCHMARKS.md        # full run, ~15 min

Llama-3-8B blocks of bf16 KV, 64 KiB (16 tokens, one layer) and 32 MiB (256 tokens, 32
layers), in prompts of 256 blocks; every store holds the same corpus.

- **Prompt restore** of a prompt's first N in {16, 64, 256} blocks, page cache dropped,
  into the caller's pre-touched tensor: isolane ``get_into`` (memory tier 0 bytes), one
  file per block read serially, LMCache 0.5 ``LocalDiskBackend`` (``batched_get_blocking``
  and a copy), and in the same round the limit: a sequential read of as many bytes
  (buffered or O_DIRECT with 8 requests in flight, the faster). 64 KiB blocks: the stores
  take turns in each round; 32 MiB blocks: one store at a time, compared by their shares
  of their own rounds' limit (which cancels the disk's drift).
- **Small random reads** of 64 KiB blocks, Zipf(1.0), one thread, cold (an empty memory
  tier) and warm (it holds the corpus); vs LMDB.
- **Reopen** of an isolane pool grown to ``--restart-gb``, cold; how many blocks
  a new LMCache ``LocalDiskBackend`` on the same folder finds.

Restores are compared with the stored bytes outside the timing (every block in the first
round, 4 spread blocks after); every 16th random read too.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import math
import mmap
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from statistics import median
from typing import Any, cast

import _common as C
import _quick
import _results
import numpy as np
import numpy.typing as npt
import torch

C.ensure_repo_importable()
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

O_DIRECT, PAGE, MiB = getattr(os, "O_DIRECT", 0), 4096, 1 << 20
LIMIT_DIRECT_THREADS = 8
LMCACHE_THREADS = 4  # its own default disk_io_threads
ISOLANE_PUT_BATCH_BYTES = 256 << 20
RESTORE_NS, QUICK_NS_LARGE = (16, 64, 256), (2, 4)
MEMORY_MARGIN = 1 << 30
CHECK_EVERY = 16
KV_HEADS, HEAD_DIM, TOKEN_DIM = 8, 128, 2
TARGETS = {"vs_serial_64k": 3.0, "vs_lmcache": 1.5, "vs_limit": 0.85, "warm_p99_us": 100.0}
# Block j is cut out of one random base buffer at an offset on an 8-byte grid below
# SPREAD: distinct for every j below SPREAD / 8, so a swapped block fails the comparison.
SPREAD = 16 * MiB
STRIDE = 104729  # odd: j -> j * STRIDE mod (SPREAD / 8) is a bijection
SEED = 20261129
Bytes = npt.NDArray[np.uint8]


@dataclass(frozen=True)
class Geometry:
    """A KV block: [layers, K/V, tokens, kv_heads, head_dim] of bf16."""

    name: str
    label: str
    chunk_tokens: int
    layers: int

    @property
    def block_bytes(self) -> int:
        return self.layers * 2 * self.chunk_tokens * KV_HEADS * HEAD_DIM * 2

    def kv_shape(self, tokens: int) -> tuple[int, ...]:
        return (self.layers, 2, tokens, KV_HEADS, HEAD_DIM)


LAYER = Geometry("64KiB", "Llama-3-8B, 16-token block, one layer (64 KiB)", 16, 1)
BLOCK = Geometry("32MiB", "Llama-3-8B, 256-token block, all 32 layers (32 MiB)", 256, 32)


def aligned_buffer(nbytes: int) -> tuple[mmap.mmap, Bytes]:
    """Page-aligned (O_DIRECT-able) memory, every page touched (no first-touch faults)."""
    m = mmap.mmap(-1, max(nbytes, 1))
    arr = np.frombuffer(m, dtype=np.uint8)[:nbytes]
    arr.fill(0)
    return m, arr


def read_fully(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise OSError(f"short read: {done} of {len(view)} bytes at offset {offset}")
        done += n


def zipf_ids(n_blocks: int, count: int, seed: int) -> list[int]:
    """Zipf(1.0) over ``n_blocks`` ranks, mapped to ids by a fixed permutation (so hot
    blocks are spread over the corpus)."""
    rng = np.random.default_rng(seed)
    cdf = np.cumsum(1.0 / np.arange(1, n_blocks + 1, dtype=np.float64))
    ranks = np.minimum(np.searchsorted(cdf / cdf[-1], rng.random(count), side="right"),
                       n_blocks - 1)
    return [int(x) for x in np.random.default_rng(SEED).permutation(n_blocks)[ranks]]


class Workspace:
    """One geometry's corpus (``prompts`` of ``per`` blocks, cut from one random buffer),
    its scratch folder, the caller's destination (page-aligned, pre-touched) and the file
    the sequential-read limit reads."""

    def __init__(self, g: Geometry, corpus_gb: float, ns: Sequence[int], root: Path) -> None:
        self.g, self.per = g, max(ns)
        self.prompts = max(1, math.ceil(corpus_gb * C.GB / (self.per * g.block_bytes)))
        self.folder, size = root / f"kv-{g.name}", self.per * g.block_bytes
        C.remove_path(self.folder)
        self.folder.mkdir(parents=True)
        self.base = np.random.default_rng(SEED).integers(0, 256, g.block_bytes + SPREAD,
                                                          dtype=np.uint8)
        self._mmap, self.array = aligned_buffer(size)
        self.view, self.tensor = memoryview(self._mmap), torch.from_numpy(self.array)
        self.threads = ThreadPoolExecutor(LIMIT_DIRECT_THREADS)
        with open(self.folder / "limit.bin", "wb") as f:
            for done in range(0, size, SPREAD):
                f.write(memoryview(self.base[done // SPREAD % 7 * 8:][:min(SPREAD, size - done)]))
        os.sync()

    def read_limit(self, nbytes: int, direct: bool) -> float:
        """Seconds to read the limit file's first ``nbytes`` into a reused ring (the first
        256 MiB of the destination): buffered, a ring at a time; or O_DIRECT, in chunks of
        up to 8 MiB, ``LIMIT_DIRECT_THREADS`` in flight."""
        ring = self.view[:256 << 20]
        chunk = min(8 << 20, max(128 << 10, nbytes // 8 // PAGE * PAGE)) if direct else len(ring)

        def one(index: int) -> None:
            off = index * chunk
            length = -(-min(chunk, nbytes - off) // PAGE) * PAGE if direct else \
                min(chunk, nbytes - off)
            read_fully(fd, ring[index % (len(ring) // chunk) * chunk:][:length], off)

        start = time.perf_counter()
        fd = os.open(self.folder / "limit.bin", os.O_RDONLY | (O_DIRECT if direct else 0))
        try:
            list((self.threads.map if direct else map)(one, range(-(-nbytes // chunk))))
        finally:
            os.close(fd)
        return time.perf_counter() - start

    def nbytes(self, prompts: int = 0) -> int:
        return (prompts or self.prompts) * self.per * self.g.block_bytes

    def ids(self, prompt: int, n: int = 0) -> list[int]:
        return [prompt * self.per + i for i in range(n or self.per)]

    def tokens(self, prompt: int) -> npt.NDArray[np.int64]:
        """A prompt's token ids: distinct from every other prompt's from the first one."""
        per = self.per * self.g.chunk_tokens
        return np.arange(prompt * per, (prompt + 1) * per, dtype=np.int64)

    def block(self, block_id: int) -> Bytes:
        off = (block_id * STRIDE) % (SPREAD // 8) * 8
        return self.base[off:off + self.g.block_bytes]

    def close(self) -> None:
        self.threads.shutdown(wait=True)
        self.view.release()
        del self.tensor, self.array
        self._mmap.close()
        C.remove_path(self.folder)


class Store:
    """A store under test: ``build`` stores prompts until durable, ``restore`` reads a
    prompt's first ``n`` blocks into the workspace, ``restored`` is block ``pos`` of it."""

    key = label = ""

    def __init__(self, ws: Workspace) -> None:
        self.ws, self.folder = ws, ws.folder / self.key
        self.folder.mkdir(parents=True, exist_ok=True)

    def restored(self, pos: int, n: int) -> Bytes:
        b = self.ws.g.block_bytes
        return self.ws.array[pos * b:(pos + 1) * b]

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


class IsolaneStore(Store):
    key, label = "isolane", "isolane get_into(tokens, out)"

    def __init__(self, ws: Workspace) -> None:
        from isolane.config import config_from_dict
        from isolane.lanes.scheduler import LaneScheduler

        super().__init__(ws)
        self.config = config_from_dict(
            {"device_groups": {"kv": {"role": "read", "devices": [str(self.folder)]}}})
        self.scheduler = LaneScheduler(self.config)
        self.pool: Any = None
        self.open(0)

    def open(self, memory_budget: int) -> float:
        """(Re)open the pool; the seconds the constructor took."""
        from isolane.kvpool.pool import KVPool

        self.close()
        seconds, self.pool = C.timed(lambda: KVPool(
            self.config, namespace=f"bench-{self.ws.g.name}", chunk_tokens=self.ws.g.chunk_tokens,
            token_dim=TOKEN_DIM, memory_budget=memory_budget, scheduler=self.scheduler))
        return seconds

    def keys(self, prompt: int) -> list[bytes]:
        return list(self.pool.block_keys(self.ws.tokens(prompt)))

    def build(self, prompts: Sequence[int]) -> None:
        g, ws = self.ws.g, self.ws
        batch = max(1, ISOLANE_PUT_BATCH_BYTES // g.block_bytes)
        for p in prompts:
            if self.pool.layout is None:  # the first put of a KV tensor fixes the layout
                first = torch.from_numpy(ws.block(ws.ids(p)[0])).view(torch.bfloat16)
                self.pool.put(ws.tokens(p)[:g.chunk_tokens],
                              first.view(g.kv_shape(g.chunk_tokens)))
            keys, ids = self.keys(p), ws.ids(p)
            for i in range(0, len(keys), batch):
                self.pool.put_blocks(keys[i:i + batch], [ws.block(j) for j in ids[i:i + batch]])
        os.sync()

    def _out(self, n: int) -> torch.Tensor:
        g = self.ws.g
        return self.ws.tensor[:n * g.block_bytes].view(torch.bfloat16).view(
            g.kv_shape(n * g.chunk_tokens))

    def restore(self, prompt: int, n: int) -> None:
        tokens = n * self.ws.g.chunk_tokens
        if (got := self.pool.get_into(self.ws.tokens(prompt)[:tokens], self._out(n))) != tokens:
            raise RuntimeError(f"get_into restored {got} of {tokens} tokens")

    def restored(self, pos: int, n: int) -> Bytes:
        """Block ``pos`` is the out tensor's tokens of chunk ``pos``."""
        chunk = self.ws.g.chunk_tokens
        got = self._out(n).narrow(TOKEN_DIM, pos * chunk, chunk).contiguous()
        return got.view(torch.uint8).numpy().reshape(-1)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def remove(self) -> None:
        self.close()
        self.scheduler.close()
        super().remove()


class FilesStore(Store):
    key, label = "files", "one file per block, serial reads"

    def build(self, prompts: Sequence[int]) -> None:
        for j in (j for p in prompts for j in self.ws.ids(p)):
            (self.folder / f"{j:010d}.kv").write_bytes(self.ws.block(j))
        os.sync()

    def restore(self, prompt: int, n: int) -> None:
        b = self.ws.g.block_bytes
        for pos, j in enumerate(self.ws.ids(prompt, n)):
            fd = os.open(self.folder / f"{j:010d}.kv", os.O_RDONLY)
            try:
                read_fully(fd, self.ws.view[pos * b:(pos + 1) * b], 0)
            finally:
                os.close(fd)


class LMCacheStore(Store):
    """LMCache's ``LocalDiskBackend`` behind its ``LocalCPUBackend``, as its storage
    manager builds them: puts with ``submit_put_task``, restores with
    ``batched_get_blocking`` and a copy of every memory object into the caller's tensor."""

    key, label = "lmcache", "LMCache LocalDiskBackend"

    def __init__(self, ws: Workspace, max_n: int) -> None:
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.memory_allocators.mixed_memory_allocator import MixedMemoryAllocator
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

        super().__init__(ws)
        g = ws.g
        self.key_of = lambda j: CacheEngineKey("isolane-bench", 1, 0, j, torch.bfloat16)
        self.shape = torch.Size((2, g.layers, g.chunk_tokens, KV_HEADS * HEAD_DIM))
        pool_bytes = max_n * g.block_bytes + (64 << 20)
        self.config = LMCacheEngineConfig.from_defaults(
            chunk_size=g.chunk_tokens, local_cpu=False, max_local_cpu_size=pool_bytes / 2**30,
            local_disk=str(self.folder), max_local_disk_size=ws.nbytes() * 1.5 / 2**30 + 1,
            lmcache_instance_id="isolane-bench", extra_config={"disk_io_threads": LMCACHE_THREADS})
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.cpu = LocalCPUBackend(self.config, memory_allocator=MixedMemoryAllocator(
            pool_bytes, config=self.config))
        self.backend = self._backend()

    def _backend(self) -> Any:
        from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

        return LocalDiskBackend(self.config, self.loop, self.cpu, dst_device="cpu")

    def build(self, prompts: Sequence[int]) -> None:
        from lmcache.v1.memory_management import MemoryFormat

        ids = [j for p in prompts for j in self.ws.ids(p)]
        done = threading.Semaphore(0)
        for j in ids:
            obj = self.cpu.allocate(self.shape, torch.bfloat16, MemoryFormat.KV_2LTD)
            if obj is None:
                raise RuntimeError("LMCache's CPU staging pool ran out during the build")
            np.frombuffer(obj.byte_array, dtype=np.uint8)[:] = self.ws.block(j)
            self.backend.submit_put_task(self.key_of(j), obj,
                                         on_complete_callback=lambda _k: done.release())
            obj.ref_count_down()
        for _ in ids:
            done.acquire()
        os.sync()

    def restore(self, prompt: int, n: int) -> None:
        b = self.ws.g.block_bytes
        keys = [self.key_of(j) for j in self.ws.ids(prompt, n)]
        for pos, obj in enumerate(self.backend.batched_get_blocking(keys)):
            if obj is None:
                raise RuntimeError(f"LMCache missed block {pos} of {n}")
            self.ws.tensor[pos * b:(pos + 1) * b].copy_(obj.tensor.view(-1).view(torch.uint8))
            obj.ref_count_down()

    def found_after_reopen(self) -> int:
        """Blocks a new backend on the same folder finds (its index is in memory only)."""
        fresh = self._backend()
        try:
            return sum(fresh.contains(self.key_of(j)) for j in range(self.ws.prompts * self.ws.per))
        finally:
            fresh.close()

    def remove(self) -> None:
        self.backend.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        super().remove()


@dataclass
class Row:
    """One store at one N of one geometry, over the rounds."""

    label: str
    nbytes: int
    seconds: list[float] = field(default_factory=list)
    shares: list[float] = field(default_factory=list)  # limit seconds / seconds, same round


@dataclass
class Results:
    restore: dict[tuple[str, str, int], Row] = field(default_factory=dict)
    latency: dict[tuple[str, str], list[float]] = field(default_factory=dict)  # p99 µs
    restart: dict[str, Any] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    cache_dropped: bool = True

    def row(self, geometry: str, key: str, label: str, n: int, nbytes: int) -> Row:
        return self.restore.setdefault((geometry, key, n), Row(label, nbytes))

    def drop(self) -> None:
        self.cache_dropped &= C.drop_page_cache()

    def share_ratio(self, geometry: str, a: str, b: str, n: int) -> float | None:
        ra, rb = self.restore.get((geometry, a, n)), self.restore.get((geometry, b, n))
        return C.ratio(median(ra.shares), median(rb.shares)) if ra and rb else None


def check_restore(store: Store, prompt: int, n: int, sample: int | None) -> None:
    """Raise when the restore differs from the prompt's first ``n`` blocks (``sample``:
    the first, the last and evenly spread ones only)."""
    positions: Sequence[int] = range(n)
    if sample is not None and n > sample:
        positions = sorted({round(k * (n - 1) / (sample - 1)) for k in range(sample)})
    ids = store.ws.ids(prompt, n)
    for pos in positions:
        if not np.array_equal(store.restored(pos, n), store.ws.block(ids[pos])):
            raise RuntimeError(f"{store.label}: block {pos} of a {n}-block restore differs "
                               "from what was stored")


def restore_rounds(ws: Workspace, stores: list[Store], ns: Sequence[int], repeats: int,
                   res: Results, phase: int = 0) -> None:
    """One untimed warm-up restore per store (lazy imports, thread pools, as in a server
    that runs long), then ``repeats`` rounds: per N the limit both ways, then every store
    (order rotated round by round), each after dropping the page cache."""
    g = ws.g
    for store in stores:
        store.restore(ws.prompts - 1, max(ns))
    for rnd in range(repeats):
        for ni, n in enumerate(ns):
            prompt, nbytes = (phase + rnd * len(ns) + ni) % ws.prompts, n * g.block_bytes
            limits = []
            for direct in (False, True):
                res.drop()
                limits.append(ws.read_limit(nbytes, direct))
            best = min(limits)
            lim = res.row(g.name, "limit", "sequential read", n, nbytes)
            lim.seconds.append(best)
            lim.shares.append(1.0)
            for store in stores[rnd % len(stores):] + stores[:rnd % len(stores)]:
                row = res.row(g.name, store.key, store.label, n, nbytes)
                res.drop()
                seconds, _ = C.timed(partial(store.restore, prompt, n))
                gc.collect()
                row.seconds.append(seconds)
                row.shares.append(best / seconds)
                check_restore(store, prompt, n, None if rnd else 4)


def built(store: Store) -> Store:
    """``store`` holding the workspace's prompts (removed if that fails)."""
    try:
        store.build(range(store.ws.prompts))
    except BaseException:
        store.remove()
        raise
    return store


def run_small(args: argparse.Namespace, res: Results) -> None:
    """64 KiB blocks: every store at once; then the random reads and the reopen."""
    ws = Workspace(LAYER, args.corpus_small_gb, RESTORE_NS, args.dir)
    stores: list[Store] = []
    try:
        for make in (IsolaneStore, FilesStore, lambda w: LMCacheStore(w, max(RESTORE_NS))):
            stores.append(built(make(ws)))
        restore_rounds(ws, stores, RESTORE_NS, args.repeats, res)
        iso, lm = cast(IsolaneStore, stores[0]), cast(LMCacheStore, stores[2])
        run_latency(iso, args, res)
        res.restart.update(lmcache_found=lm.found_after_reopen(),
                           lmcache_blocks=ws.prompts * ws.per)
        while len(stores) > 1:  # room on the disk for the reopen's pool
            stores.pop().remove()
        reopen_isolane(iso, args, res)
    finally:
        for store in stores:
            store.remove()
        ws.close()


def run_large(args: argparse.Namespace, res: Results) -> None:
    """32 MiB blocks: one store at a time (built, measured, deleted)."""
    ns = QUICK_NS_LARGE if args.quick else RESTORE_NS
    ws = Workspace(BLOCK, args.corpus_gb, ns, args.dir)
    try:
        for phase, key in enumerate(("isolane", "lmcache")):
            max_n, free = max(ns), C.proc_number("/proc/meminfo", "MemAvailable") * 1024
            while key == "lmcache" and max_n and max_n * BLOCK.block_bytes + MEMORY_MARGIN > free:
                max_n //= 2  # its staging pool, beside the caller's tensor
            if max_n < max(ns):
                res.skipped.append(f"{key} (32MiB): N > {max_n} left out, it would not fit "
                                   "in free memory")
            if max_n < min(ns):
                continue
            store = built(IsolaneStore(ws) if key == "isolane" else LMCacheStore(ws, max_n))
            try:
                restore_rounds(ws, [store], [n for n in ns if n <= max_n], args.repeats, res,
                               phase)
            finally:
                store.remove()
                gc.collect()
    finally:
        ws.close()


def p99_us(read: Callable[[int, memoryview], None], ids: list[int], ws: Workspace) -> float:
    """One thread reading ``ids`` one call at a time into a pre-touched buffer: the p99 in
    µs; every 16th block is compared after the clock stopped."""
    _m, buf = aligned_buffer(ws.g.block_bytes)
    out, ns = memoryview(buf), np.zeros(len(ids), dtype=np.int64)
    for i, block_id in enumerate(ids):
        t0 = time.perf_counter_ns()
        read(block_id, out)
        ns[i] = time.perf_counter_ns() - t0
        if i % CHECK_EVERY == 0 and not np.array_equal(buf, ws.block(block_id)):
            raise RuntimeError(f"random read of block {block_id} came back different")
    return float(np.percentile(ns / 1000.0, 99, method="higher"))


def run_latency(iso: IsolaneStore, args: argparse.Namespace, res: Results) -> None:
    import lmdb

    ws, blocks = iso.ws, iso.ws.prompts * iso.ws.per
    keys = [k for p in range(ws.prompts) for k in iso.keys(p)]
    folder, map_size = ws.folder / "lmdb", int(ws.nbytes() * 1.25) + (256 << 20)
    env = lmdb.open(str(folder), map_size=map_size)
    with env.begin(write=True) as txn:
        for j in range(blocks):
            txn.put(b"%010d" % j, memoryview(ws.block(j)), append=True)
    env.sync(True)

    def read_isolane(j: int, out: memoryview) -> None:
        out[:] = iso.pool.get_blocks([keys[j]])[0]

    def read_lmdb(j: int, out: memoryview) -> None:
        with env.begin(buffers=True) as txn:
            out[:] = txn.get(b"%010d" % j)

    def prepare(name: str, state: str) -> None:
        nonlocal env
        if name == "isolane":  # cold: an empty memory tier; warm: one holding the corpus
            iso.open(0 if state == "cold" else ws.nbytes() + (64 << 20))
            for i in range(0, len(keys), 256) if state == "warm" else ():
                iso.pool.get_blocks(keys[i:i + 256])
        elif state == "cold":  # unmapped first: mapped pages would survive the drop
            env.close()
            env = lmdb.open(str(folder), map_size=map_size)
        else:
            with env.begin(buffers=True) as txn:
                for j in range(blocks):
                    bytes(txn.get(b"%010d" % j)[::PAGE])  # every page touched
        if state == "cold":
            res.drop()

    try:
        for rnd in range(args.repeats):
            for state in ("cold", "warm"):
                ids = zipf_ids(blocks, args.latency_calls, seed=1000 * rnd)
                readers = [("isolane", read_isolane), ("lmdb", read_lmdb)]
                for name, read in readers[::-1] if rnd % 2 else readers:
                    prepare(name, state)
                    res.latency.setdefault((name, state), []).append(p99_us(read, ids, ws))
    finally:
        env.close()
        iso.open(0)


def reopen_isolane(iso: IsolaneStore, args: argparse.Namespace, res: Results) -> None:
    """Grow the pool to ``--restart-gb`` with prompts whose tokens and blocks follow the
    corpus's, then reopen it cold; the last block stored must read back."""
    ws, prompt_bytes = iso.ws, iso.ws.nbytes(1)
    extra = max(0, -(-(int(args.restart_gb * C.GB) - ws.nbytes()) // prompt_bytes))
    if extra and shutil.disk_usage(ws.folder).free < extra * prompt_bytes + (5 << 30):
        res.skipped.append(f"isolane reopen: not grown to {args.restart_gb} GB (disk space)")
        extra = 0
    last = ws.prompts + extra - 1
    iso.build(range(ws.prompts, last + 1))
    cold: list[float] = []
    for _ in range(args.repeats):
        iso.close()
        res.drop()
        cold.append(iso.open(0))
        got = iso.pool.get_blocks(iso.keys(last)[-1:])[0]
        if got is None or not np.array_equal(np.frombuffer(got, np.uint8),
                                             ws.block(ws.ids(last)[-1])):
            raise RuntimeError("the last block stored was not found or differs after reopening")
    res.restart.update(geometry=ws.g.name, nbytes=ws.nbytes(last + 1), cold=cold)


def render(res: Results, args: argparse.Namespace, facts: dict[str, str]) -> str:
    out = C.report_head("KV pool: prompt restore, random reads, reopen "
                        "(`benchmarks/bench_kv.py`)", facts)
    out += [f"Medians of {args.repeats} round(s); share of limit = the same round's "
            "sequential read of as many bytes (the faster of buffered and O_DIRECT, "
            f"{LIMIT_DIRECT_THREADS} in flight) / the restore's time; every restore and "
            "every 16th random read compared with the stored bytes.", ""]
    if not res.cache_dropped:
        out += ["> WARNING: dropping the page cache was refused (not root): the 'cold' "
                "numbers are not cold.", ""]
    out += [f"> {line}" for line in [*res.skipped, (
        f"the isolane pool reopened with its last block read back; a new LMCache "
        f"LocalDiskBackend on its folder finds {res.restart['lmcache_found']} of its "
        f"{res.restart['lmcache_blocks']} blocks.")]]
    return "\n".join(out)


def headline_rows(res: Results, where: dict[str, str]) -> list[_results.Result]:
    """Prompt restores (get_into) against serial per-block files, LMCache and the same
    run's sequential read; random reads against LMDB; the reopen."""
    rows: list[_results.Result] = []

    def add(measure: str, row: Row | None, peer: str, peer_row: Row | None,
            ratio: float | None, target: float, share: bool = False) -> None:
        if row is None or peer_row is None or ratio is None:
            return
        scale = 100 if share else 1
        rows.append(_results.Result(
            area="KV pool", measure=measure, value=round(median(row.seconds) * 1e3, 1),
            unit="ms", peer=peer, peer_value=round(median(peer_row.seconds) * 1e3, 1),
            ratio=round(ratio * scale, 0 if share else 2), ratio_unit="%" if share else "x",
            target=f"≥ {target * 100:.0f} %" if share else f"≥ {target:g}x",
            met=ratio >= target, **where))

    for g, label in ((LAYER, "64 KiB"), (BLOCK, "32 MiB")):
        for n in sorted({n for (name, _k, n) in res.restore if name == g.name}):
            into = res.restore.get((g.name, "isolane", n))
            what = f"prompt restore, {n} blocks of {label}, get_into, cold"
            if g is LAYER:  # 32 MiB blocks are big sequential reads already
                add(what, into, "one file per block, serial reads",
                    res.restore.get((g.name, "files", n)),
                    res.share_ratio(g.name, "isolane", "files", n), TARGETS["vs_serial_64k"])
            add(what, into, "LMCache LocalDiskBackend", res.restore.get((g.name, "lmcache", n)),
                res.share_ratio(g.name, "isolane", "lmcache", n), TARGETS["vs_lmcache"])
            add(f"prompt restore, {n} blocks of {label}, share of the read limit", into,
                "sequential read of the same bytes", res.restore.get((g.name, "limit", n)),
                median(into.shares) if into else None, TARGETS["vs_limit"], share=True)
    for state in ("warm", "cold"):
        iso, lm = res.latency.get(("isolane", state)), res.latency.get(("lmdb", state))
        if iso and lm:
            p99, peer = median(iso), median(lm)
            target = TARGETS["warm_p99_us"] if state == "warm" else None
            rows.append(_results.Result(
                area="KV pool", measure=f"random 64 KiB reads (Zipf), {state}, 1 thread, p99",
                value=round(p99), unit="µs", peer="LMDB", peer_value=round(peer),
                ratio=round(peer / p99, 2), target=f"≤ {target:g} µs" if target else None,
                met=p99 <= target if target else None, **where))
    r, found = res.restart, res.restart["lmcache_found"]
    rows.append(_results.Result(
        area="KV pool", measure=f"reopen a full store ({C.fmt_gb(r['nbytes'])} of "
        f"{r['geometry']} blocks), cold", value=round(median(r["cold"]), 3), unit="s",
        peer="LMCache LocalDiskBackend: finds " + ("none" if found == 0 else
        f"{found} of {r['lmcache_blocks']}") + " of its blocks after a reopen", **where))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _quick.add_argument(p)
    p.add_argument("--corpus-gb", type=float, default=4.0,
                   help="corpus of 32 MiB blocks (whole 256-block prompts: 8.6 GB at least)")
    p.add_argument("--corpus-small-gb", type=float, default=1.0, help="of 64 KiB blocks")
    p.add_argument("--restart-gb", type=float, default=10.0,
                   help="isolane pool of 64 KiB blocks to reopen")
    p.add_argument("--repeats", type=int, default=3, help="rounds per measurement (median)")
    p.add_argument("--latency-calls", type=int, default=6000, help="calls per random-read run")
    p.add_argument("--dir", type=Path, default=C.REPO_ROOT / ".bench",
                   help="scratch folder (deleted after use)")
    p.add_argument("--out", type=Path, help="docs/BENCHMARKS.md records the headline rows "
                   "in benchmarks/results/kv.json; another file gets the report")
    args = p.parse_args(argv)
    if args.quick:  # N of 32 MiB blocks {2, 4}, 1 round, few calls, a small reopen
        _quick.enter(args, p, files=())
        args.corpus_gb, args.corpus_small_gb, args.restart_gb = 0.1, 0.05, 0.1
        args.repeats, args.latency_calls = 1, 400
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    import lmcache
    import lmdb

    args.dir = args.dir.resolve()
    args.dir.mkdir(parents=True, exist_ok=True)
    res = Results()
    run_small(args, res)
    run_large(args, res)
    facts = C.run_facts(args.dir, {"torch": torch.__version__, "numpy": np.__version__,
                                   "LMCache": lmcache.__version__, "lmdb": lmdb.__version__})
    C.publish("kv", render(res, args, facts), headline_rows(res, facts), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
