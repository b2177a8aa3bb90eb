#!/usr/bin/env python
"""KV pool: cold prompt restores, small random reads and a reopen; isolane against one
file per block, LMCache's disk backend, LMDB and the disk's own sequential read.

    python benchmarks/bench_kv.py --quick                         # smoke test
    python benchmarks/bench_kv.py --out docs/BENCHMARKS.md        # full run, ~15 min

Block geometry of Llama-3-8B (128 KiB of KV per token, bf16): a 256-token block across
all 32 layers is 32 MiB; a 16-token block of one layer is 64 KiB. Every store holds the
same corpus (prompts of 256 blocks; ``--corpus-gb`` of 32 MiB blocks, ``--corpus-small-gb``
of 64 KiB blocks); isolane's memory tier is 0 bytes for the restores.

- **Prompt restore** of the first N in {16, 64, 256} blocks of a prompt after
  ``sync; echo 3 > /proc/sys/vm/drop_caches``: from the call until the bytes are in the
  caller's preallocated, pre-touched tensor. isolane ``get_into``; one file per block,
  read serially; LMCache 0.5 ``LocalDiskBackend`` (``batched_get_blocking``, then a copy
  into the tensor); and in the same round the limit: a sequential read of as many bytes
  from one file (buffered, and O_DIRECT with 8 requests in flight; the faster counts).
  64 KiB blocks: the stores exist at once and take turns within each round. 32 MiB
  blocks (8.6 GB for N = 256): one store at a time, so ratios between stores are ratios
  of their shares of the limit of their own rounds (which cancels the disk's drift).
- **Small random reads** of 64 KiB blocks, ids drawn from Zipf(1.0) over the corpus, one
  thread: cold (page cache dropped, isolane reopened with an empty memory tier) and warm
  (isolane's memory tier holds the corpus; LMDB's pages cached); vs LMDB.
- **Reopen** of an isolane pool of 64 KiB blocks grown to ``--restart-gb``, cold and
  warm; how many blocks a new LMCache ``LocalDiskBackend`` on the same folder finds.

Every restore is compared with the stored bytes outside the timing (all blocks in the
first round, 4 spread blocks after); every 16th random read too.
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
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _common as C
import _quick
import _results
import numpy as np
import numpy.typing as npt
import torch

C.ensure_repo_importable()
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

SECTION = "kv"
O_DIRECT = getattr(os, "O_DIRECT", 0)
PAGE = 4096
MiB = 1 << 20
LIMIT_DIRECT_THREADS = 8
LMCACHE_THREADS = 4  # its own default disk_io_threads
ISOLANE_PUT_BATCH_BYTES = 256 << 20
RESTORE_NS = (16, 64, 256)
QUICK_NS_LARGE = (2, 4)
MEMORY_MARGIN = 1 << 30
CHECK_EVERY = 16
TARGETS = {"vs_serial_64k": 3.0, "vs_lmcache": 1.5, "vs_limit": 0.85, "warm_p99_us": 100.0}
# Block ``j`` is ``block_bytes`` cut out of one random base buffer at an offset on an
# 8-byte grid below SPREAD: distinct for every j below SPREAD / 8, so a swapped or
# misplaced block fails the comparison.
SPREAD = 16 * MiB
STRIDE = 104729  # odd: j -> j * STRIDE mod (SPREAD / 8) is a bijection
SEED = 20261129
Bytes = npt.NDArray[np.uint8]
_T0 = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f}s] {message}", file=sys.stderr, flush=True)


# -- the data ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Geometry:
    """A KV block: [layers, K/V, tokens, kv_heads, head_dim] of bf16, tokens at dim 2."""

    name: str
    label: str
    chunk_tokens: int
    layers: int
    kv_heads: int = 8
    head_dim: int = 128
    token_dim: int = 2

    @property
    def block_bytes(self) -> int:
        return self.layers * 2 * self.chunk_tokens * self.kv_heads * self.head_dim * 2

    def kv_shape(self, tokens: int) -> tuple[int, ...]:
        return (self.layers, 2, tokens, self.kv_heads, self.head_dim)


LAYER = Geometry("64KiB", "Llama-3-8B, 16-token block, one layer (64 KiB)", 16, 1)
BLOCK = Geometry("32MiB", "Llama-3-8B, 256-token block, all 32 layers (32 MiB)", 256, 32)


@dataclass(frozen=True)
class Corpus:
    geometry: Geometry
    prompts: int
    blocks_per_prompt: int

    @property
    def blocks(self) -> int:
        return self.prompts * self.blocks_per_prompt

    @property
    def nbytes(self) -> int:
        return self.blocks * self.geometry.block_bytes

    def block_id(self, prompt: int, index: int) -> int:
        return prompt * self.blocks_per_prompt + index

    def prompt_ids(self, prompt: int, n: int | None = None) -> list[int]:
        return [self.block_id(prompt, i) for i in range(n or self.blocks_per_prompt)]

    def tokens(self, prompt: int) -> npt.NDArray[np.int64]:
        """Token ids of a prompt: distinct from every other prompt's from the first one."""
        per = self.blocks_per_prompt * self.geometry.chunk_tokens
        return np.arange(prompt * per, (prompt + 1) * per, dtype=np.int64)


def plan_corpus(geometry: Geometry, min_bytes: int, blocks_per_prompt: int) -> Corpus:
    prompt_bytes = blocks_per_prompt * geometry.block_bytes
    return Corpus(geometry, max(1, math.ceil(min_bytes / prompt_bytes)), blocks_per_prompt)


def block_view(base: Bytes, block_id: int, block_bytes: int) -> Bytes:
    off = (block_id * STRIDE) % (SPREAD // 8) * 8
    return base[off:off + block_bytes]


def aligned_buffer(nbytes: int) -> tuple[mmap.mmap, Bytes]:
    """Page-aligned (O_DIRECT-able) memory, every page touched (no first-touch faults)."""
    m = mmap.mmap(-1, max(nbytes, 1))
    arr = np.frombuffer(m, dtype=np.uint8)[:nbytes]
    arr.fill(0)
    return m, arr


def check_blocks(dest: Bytes, base: Bytes, ids: list[int], block_bytes: int,
                 sample: int | None) -> str | None:
    """None when ``dest`` holds blocks ``ids`` back to back (``sample``: the first, the
    last and evenly spread ones only), else what differs."""
    positions: Sequence[int] = range(len(ids))
    if sample is not None and len(ids) > sample:
        step = (len(ids) - 1) / max(sample - 1, 1)
        positions = sorted({round(k * step) for k in range(sample)})
    for pos in positions:
        got = dest[pos * block_bytes:(pos + 1) * block_bytes]
        if not np.array_equal(got, block_view(base, ids[pos], block_bytes)):
            return f"block {pos} (id {ids[pos]}) differs from what was stored"
    return None


def zipf_ids(n_blocks: int, count: int, seed: int) -> list[int]:
    """Zipf(1.0) over ``n_blocks`` ranks, mapped to ids by a fixed permutation (so hot
    blocks are spread over the corpus)."""
    rng = np.random.default_rng(seed)
    cdf = np.cumsum(1.0 / np.arange(1, n_blocks + 1, dtype=np.float64))
    ranks = np.minimum(np.searchsorted(cdf / cdf[-1], rng.random(count), side="right"),
                       n_blocks - 1)
    return [int(x) for x in np.random.default_rng(SEED).permutation(n_blocks)[ranks]]


def mem_available() -> int:
    return C.proc_number("/proc/meminfo", "MemAvailable") * 1024


def read_fully(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise OSError(f"short read: {done} of {len(view)} bytes at offset {offset}")
        done += n


# -- the stores -------------------------------------------------------------------------------
class Dest:
    """The caller's destination: ``capacity`` bytes, page-aligned, every page touched."""

    def __init__(self, capacity: int) -> None:
        self._mmap, self.array = aligned_buffer(capacity)
        self.view = memoryview(self._mmap)
        self.tensor = torch.from_numpy(self.array)

    def release(self) -> None:
        self.view.release()
        del self.tensor, self.array
        self._mmap.close()


@dataclass
class Workspace:
    corpus: Corpus
    base: Bytes
    folder: Path
    dest: Dest

    def check(self, prompt: int, n: int, sample: int | None) -> str | None:
        return check_blocks(self.dest.array, self.base, self.corpus.prompt_ids(prompt, n),
                            self.corpus.geometry.block_bytes, sample)


class IsolaneStore:
    key, label = "isolane", "isolane get_into(tokens, out)"

    def __init__(self, ws: Workspace) -> None:
        from isolane.config import config_from_dict
        from isolane.lanes.scheduler import LaneScheduler

        self.ws, self.folder, self.corpus = ws, ws.folder / "isolane", ws.corpus
        self.config = config_from_dict(
            {"device_groups": {"kv": {"role": "read", "devices": [str(self.folder)]}}})
        self.scheduler = LaneScheduler(self.config)
        self.pool: Any = None
        self.open(0)

    def open(self, memory_budget: int) -> float:
        """(Re)open the pool; the seconds the constructor took."""
        from isolane.kvpool.pool import KVPool

        g = self.corpus.geometry
        self.close()
        start = time.perf_counter()
        self.pool = KVPool(self.config, namespace=f"bench-{g.name}", chunk_tokens=g.chunk_tokens,
                           token_dim=g.token_dim, memory_budget=memory_budget,
                           scheduler=self.scheduler)
        return time.perf_counter() - start

    def keys(self, prompt: int, corpus: Corpus | None = None) -> list[bytes]:
        return list(self.pool.block_keys((corpus or self.corpus).tokens(prompt)))

    def build(self, corpus: Corpus, prompts: Sequence[int]) -> float:
        g = corpus.geometry
        batch = max(1, ISOLANE_PUT_BATCH_BYTES // g.block_bytes)
        start = time.perf_counter()
        for p in prompts:
            if self.pool.layout is None:  # the first put of a KV tensor fixes the layout
                first = block_view(self.ws.base, corpus.block_id(p, 0), g.block_bytes)
                self.pool.put(corpus.tokens(p)[:g.chunk_tokens], torch.from_numpy(
                    first).view(torch.bfloat16).view(g.kv_shape(g.chunk_tokens)))
            keys = self.keys(p, corpus)
            for i in range(0, len(keys), batch):
                ids = range(i, min(i + batch, len(keys)))
                self.pool.put_blocks([keys[k] for k in ids], [block_view(
                    self.ws.base, corpus.block_id(p, k), g.block_bytes) for k in ids])
        os.sync()
        return time.perf_counter() - start

    def _out(self, n: int) -> torch.Tensor:
        g = self.corpus.geometry
        return self.ws.dest.tensor[:n * g.block_bytes].view(torch.bfloat16).view(
            g.kv_shape(n * g.chunk_tokens))

    def restore(self, prompt: int, n: int) -> float:
        g = self.corpus.geometry
        out = self._out(n)
        tokens = self.corpus.tokens(prompt)[:n * g.chunk_tokens]
        start = time.perf_counter()
        got = self.pool.get_into(tokens, out)
        seconds = time.perf_counter() - start
        if got != n * g.chunk_tokens:
            raise RuntimeError(f"get_into restored {got} of {n * g.chunk_tokens} tokens")
        return seconds

    def check(self, prompt: int, n: int, sample: int | None) -> str | None:
        """Block i of the prompt is the out tensor's tokens of chunk i (token dim 2)."""
        g, out = self.corpus.geometry, self._out(n)
        positions: Sequence[int] = range(n)
        if sample is not None and n > sample:
            positions = sorted({0, n - 1, *range(0, n, max(1, n // sample))})
        for pos in positions:
            got = out.narrow(g.token_dim, pos * g.chunk_tokens, g.chunk_tokens).contiguous()
            want = block_view(self.ws.base, self.corpus.block_id(prompt, pos), g.block_bytes)
            if not np.array_equal(got.view(torch.uint8).numpy().reshape(-1), want):
                return f"block {pos} of the out tensor differs from what was stored"
        return None

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def remove(self) -> None:
        self.close()
        self.scheduler.close()
        shutil.rmtree(self.folder, ignore_errors=True)


class FilesStore:
    key, label = "files", "one file per block, serial reads"

    def __init__(self, ws: Workspace) -> None:
        self.ws, self.folder = ws, ws.folder / "files"
        self.folder.mkdir(parents=True, exist_ok=True)

    def build(self, corpus: Corpus, prompts: Sequence[int]) -> float:
        b = corpus.geometry.block_bytes
        start = time.perf_counter()
        for j in (j for p in prompts for j in corpus.prompt_ids(p)):
            (self.folder / f"{j:010d}.kv").write_bytes(block_view(self.ws.base, j, b))
        os.sync()
        return time.perf_counter() - start

    def restore(self, prompt: int, n: int) -> float:
        b = self.ws.corpus.geometry.block_bytes
        ids = self.ws.corpus.prompt_ids(prompt, n)
        view = self.ws.dest.view
        start = time.perf_counter()
        for pos, j in enumerate(ids):
            fd = os.open(self.folder / f"{j:010d}.kv", os.O_RDONLY)
            try:
                read_fully(fd, view[pos * b:(pos + 1) * b], 0)
            finally:
                os.close(fd)
        return time.perf_counter() - start

    def check(self, prompt: int, n: int, sample: int | None) -> str | None:
        return self.ws.check(prompt, n, sample)

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


class LMCacheStore:
    """LMCache's ``LocalDiskBackend`` behind its ``LocalCPUBackend``, as its storage
    manager builds them: puts with ``submit_put_task``, restores with
    ``batched_get_blocking`` and a copy of every memory object into the caller's tensor."""

    key, label = "lmcache", "LMCache LocalDiskBackend"

    def __init__(self, ws: Workspace, max_n: int) -> None:
        import lmcache
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.memory_allocators.mixed_memory_allocator import MixedMemoryAllocator
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

        self.version = lmcache.__version__
        self.ws, self.folder = ws, ws.folder / "lmcache"
        self.folder.mkdir(parents=True, exist_ok=True)
        g = ws.corpus.geometry
        self.key_of = lambda j: CacheEngineKey("isolane-bench", 1, 0, j, torch.bfloat16)
        self.shape = torch.Size((2, g.layers, g.chunk_tokens, g.kv_heads * g.head_dim))
        pool_bytes = max_n * g.block_bytes + (64 << 20)
        self.config = LMCacheEngineConfig.from_defaults(
            chunk_size=g.chunk_tokens, local_cpu=False, max_local_cpu_size=pool_bytes / 2**30,
            local_disk=str(self.folder), max_local_disk_size=ws.corpus.nbytes * 1.5 / 2**30 + 1,
            lmcache_instance_id="isolane-bench", extra_config={"disk_io_threads": LMCACHE_THREADS})
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.cpu = LocalCPUBackend(self.config, memory_allocator=MixedMemoryAllocator(
            pool_bytes, config=self.config))
        self.backend = self._backend()

    def _backend(self) -> Any:
        from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

        return LocalDiskBackend(self.config, self.loop, self.cpu, dst_device="cpu")

    def build(self, corpus: Corpus, prompts: Sequence[int]) -> float:
        from lmcache.v1.memory_management import MemoryFormat

        ids = [j for p in prompts for j in corpus.prompt_ids(p)]
        b = corpus.geometry.block_bytes
        done = threading.Semaphore(0)
        start = time.perf_counter()
        for j in ids:
            obj = self.cpu.allocate(self.shape, torch.bfloat16, MemoryFormat.KV_2LTD)
            if obj is None:
                raise RuntimeError("LMCache's CPU staging pool ran out during the build")
            np.frombuffer(obj.byte_array, dtype=np.uint8)[:] = block_view(self.ws.base, j, b)
            self.backend.submit_put_task(self.key_of(j), obj,
                                         on_complete_callback=lambda _k: done.release())
            obj.ref_count_down()
        for _ in ids:
            done.acquire()
        os.sync()
        return time.perf_counter() - start

    def restore(self, prompt: int, n: int) -> float:
        b = self.ws.corpus.geometry.block_bytes
        keys = [self.key_of(j) for j in self.ws.corpus.prompt_ids(prompt, n)]
        dest = self.ws.dest.tensor
        start = time.perf_counter()
        objs = self.backend.batched_get_blocking(keys)
        for pos, obj in enumerate(objs):
            if obj is None:
                raise RuntimeError(f"LMCache missed block {pos} of {n}")
            dest[pos * b:(pos + 1) * b].copy_(obj.tensor.view(-1).view(torch.uint8))
            obj.ref_count_down()
        return time.perf_counter() - start

    def check(self, prompt: int, n: int, sample: int | None) -> str | None:
        return self.ws.check(prompt, n, sample)

    def found_after_reopen(self) -> int:
        """Blocks a new backend on the same folder finds (its index is in memory only)."""
        fresh = self._backend()
        try:
            return sum(fresh.contains(self.key_of(j)) for j in range(self.ws.corpus.blocks))
        finally:
            fresh.close()

    def remove(self) -> None:
        self.backend.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        shutil.rmtree(self.folder, ignore_errors=True)


class SequentialLimit:
    """One file read from offset 0 as far as a restore reads, into a reused ring of at most
    256 MiB: the disk and the kernel's copy, not the caller's memory."""

    def __init__(self, path: Path, capacity: int, base: Bytes) -> None:
        self.path = path
        self._mmap, arr = aligned_buffer(min(capacity, 256 << 20))
        self.ring = memoryview(self._mmap)[:len(arr)]
        self.pool = ThreadPoolExecutor(LIMIT_DIRECT_THREADS)
        with open(path, "wb") as f:
            for done in range(0, capacity, SPREAD):
                f.write(memoryview(base[done // SPREAD % 7 * 8:][:min(SPREAD, capacity - done)]))
        os.sync()

    def buffered(self, nbytes: int) -> float:
        start = time.perf_counter()
        fd = os.open(self.path, os.O_RDONLY)
        try:
            for off in range(0, nbytes, len(self.ring)):
                read_fully(fd, self.ring[:min(len(self.ring), nbytes - off)], off)
        finally:
            os.close(fd)
        return time.perf_counter() - start

    def direct(self, nbytes: int) -> float:
        chunk = min(8 << 20, max(128 << 10, nbytes // 8 // PAGE * PAGE))
        slots = len(self.ring) // chunk

        def one(fd: int, index: int) -> None:
            off = index * chunk
            length = (min(off + chunk, nbytes) - off + PAGE - 1) // PAGE * PAGE
            read_fully(fd, self.ring[index % slots * chunk:][:length], off)

        start = time.perf_counter()
        fd = os.open(self.path, os.O_RDONLY | O_DIRECT)
        try:
            list(self.pool.map(lambda i: one(fd, i), range(-(-nbytes // chunk))))
        finally:
            os.close(fd)
        return time.perf_counter() - start

    def remove(self) -> None:
        self.pool.shutdown(wait=True)
        self.ring.release()
        self._mmap.close()
        self.path.unlink(missing_ok=True)


# -- results ----------------------------------------------------------------------------------
@dataclass
class Row:
    """One store at one N of one geometry, over the rounds."""

    label: str
    nbytes: int
    seconds: list[float] = field(default_factory=list)
    shares: list[float] = field(default_factory=list)  # limit seconds / seconds, same round
    problems: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def median(self) -> float | None:
        return float(np.median(self.seconds)) if self.seconds else None

    @property
    def share(self) -> float | None:
        return float(np.median(self.shares)) if self.shares else None

    def check_text(self) -> str:
        if self.errors:
            return "ERROR: " + self.errors[0]
        if self.problems:
            return "MISMATCH: " + self.problems[0]
        return f"ok ({len(self.seconds)} restores compared)" if self.seconds else ""


@dataclass
class Results:
    restore: dict[tuple[str, str, int], Row] = field(default_factory=dict)
    latency: dict[tuple[str, str], list[tuple[float, float, float, int, int]]] = \
        field(default_factory=dict)  # (store, state) -> (p50, p99, p999 µs, checked, bad)
    restart: dict[str, Any] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    versions: dict[str, str] = field(default_factory=dict)
    cache_dropped: bool = True

    def row(self, geometry: str, key: str, label: str, n: int, nbytes: int) -> Row:
        return self.restore.setdefault((geometry, key, n), Row(label, nbytes))

    def drop(self) -> None:
        self.cache_dropped &= C.drop_page_cache()

    def share_ratio(self, geometry: str, a: str, b: str, n: int) -> float | None:
        ra, rb = self.restore.get((geometry, a, n)), self.restore.get((geometry, b, n))
        return C.ratio(ra.share, rb.share) if ra and rb else None


# -- prompt restore rounds --------------------------------------------------------------------
def restore_rounds(ws: Workspace, limit: SequentialLimit, stores: list[Any], ns: Sequence[int],
                   repeats: int, res: Results, phase: int = 0) -> None:
    """One untimed warm-up restore per store (lazy imports, thread pools, as in a server
    that runs long), then ``repeats`` rounds: per N the limit both ways, then every store
    (order rotated round by round), each after dropping the page cache."""
    g, corpus = ws.corpus.geometry, ws.corpus
    b = g.block_bytes
    for store in stores:
        try:
            store.restore(corpus.prompts - 1, max(ns))
        except Exception as exc:  # recorded; the rounds show it again
            res.row(g.name, store.key, store.label, max(ns), max(ns) * b).errors.append(
                f"warm-up: {type(exc).__name__}: {exc}"[:300])
    for rnd in range(repeats):
        for ni, n in enumerate(ns):
            prompt = (phase + rnd * len(ns) + ni) % corpus.prompts
            limits = []
            for read in (limit.buffered, limit.direct):
                res.drop()
                limits.append(read(n * b))
            best = min(limits)
            lim = res.row(g.name, "limit", "**sequential read: limit** (the faster of buffered "
                          f"and O_DIRECT, {LIMIT_DIRECT_THREADS} in flight)", n, n * b)
            lim.seconds.append(best)
            lim.shares.append(1.0)
            for store in stores[rnd % len(stores):] + stores[:rnd % len(stores)]:
                row = res.row(g.name, store.key, store.label, n, n * b)
                res.drop()
                try:
                    seconds = store.restore(prompt, n)
                except Exception as exc:  # recorded in the row; the others still run
                    traceback.print_exc()
                    row.errors.append(f"{type(exc).__name__}: {exc}"[:300])
                    continue
                finally:
                    gc.collect()
                row.seconds.append(seconds)
                row.shares.append(best / seconds)
                if problem := store.check(prompt, n, None if rnd == 0 else 4):
                    row.problems.append(problem)
            log(f"  {g.name} N={n} round {rnd + 1}: limit {n * b / best / C.GB:.2f} GB/s")


def make_workspace(g: Geometry, corpus_gb: float, ns: Sequence[int],
                   args: argparse.Namespace) -> tuple[Workspace, SequentialLimit]:
    corpus = plan_corpus(g, int(corpus_gb * C.GB), max(ns))
    folder = args.dir / f"kv-{g.name}"
    C.remove_path(folder)
    folder.mkdir(parents=True)
    base = np.random.default_rng(SEED).integers(0, 256, g.block_bytes + SPREAD, dtype=np.uint8)
    log(f"{g.name}: {corpus.prompts} prompt(s) x {corpus.blocks_per_prompt} blocks, "
        f"{C.fmt_gb(corpus.nbytes)}")
    limit = SequentialLimit(folder / "limit.bin", max(ns) * g.block_bytes, base)
    return Workspace(corpus, base, folder, Dest(max(ns) * g.block_bytes)), limit


def open_store(key: str, ws: Workspace, max_n: int, res: Results) -> Any:
    """Create and fill one store; None (the reason recorded) when it cannot run here."""
    g = ws.corpus.geometry
    try:
        store = {"isolane": IsolaneStore, "files": FilesStore,
                 "lmcache": lambda w: LMCacheStore(w, max_n)}[key](ws)
        if key == "lmcache":
            res.versions["LMCache"] = store.version
        log(f"{g.name}: building {key}")
        try:
            seconds = store.build(ws.corpus, range(ws.corpus.prompts))
        except Exception:
            store.remove()
            raise
    except Exception as exc:  # the report says why; the others still run
        traceback.print_exc()
        res.skipped.append(f"{key} ({g.name}) not measured: {type(exc).__name__}: {exc}"
                           .splitlines()[0][:300])
        return None
    log(f"  {key}: {ws.corpus.nbytes / seconds / C.GB:.2f} GB/s until durable")
    return store


def run_small(args: argparse.Namespace, res: Results) -> None:
    """64 KiB blocks: every store at once; then the random reads and the reopen."""
    ws, limit = make_workspace(LAYER, args.corpus_small_gb, RESTORE_NS, args)
    stores: list[Any] = []
    try:
        for key in ("isolane", "files", "lmcache"):
            if (store := open_store(key, ws, max(RESTORE_NS), res)) is not None:
                stores.append(store)
        restore_rounds(ws, limit, stores, RESTORE_NS, args.repeats, res)
        by_key = {s.key: s for s in stores}
        iso = by_key.get("isolane")
        if isinstance(iso, IsolaneStore):
            run_latency(iso, ws, args, res)
        if isinstance(lm := by_key.get("lmcache"), LMCacheStore):
            res.restart["lmcache_found"] = lm.found_after_reopen()
            res.restart["lmcache_blocks"] = ws.corpus.blocks
        for store in [s for s in stores if s is not iso]:
            stores.remove(store)
            store.remove()
        if isinstance(iso, IsolaneStore):
            reopen_isolane(iso, ws, args, res)
    finally:
        for store in stores:
            store.remove()
        ws.dest.release()
        limit.remove()
        C.remove_path(ws.folder)


def run_large(args: argparse.Namespace, res: Results) -> None:
    """32 MiB blocks: one store at a time (built, measured, deleted)."""
    ns = QUICK_NS_LARGE if args.quick else RESTORE_NS
    ws, limit = make_workspace(BLOCK, args.corpus_gb, ns, args)
    try:
        for phase, key in enumerate(("isolane", "lmcache")):
            max_n = max(ns)
            while key == "lmcache" and max_n and \
                    max_n * BLOCK.block_bytes + MEMORY_MARGIN > mem_available():
                max_n //= 2  # its staging pool, beside the caller's tensor
            if max_n < max(ns):
                res.skipped.append(f"{key} (32MiB): N > {max_n} left out, it would not fit "
                                   "in free memory")
            store = open_store(key, ws, max_n, res)
            if store is None:
                continue
            try:
                restore_rounds(ws, limit, [store], [n for n in ns if n <= max_n],
                               args.repeats, res, phase)
            finally:
                store.remove()
                gc.collect()
    finally:
        ws.dest.release()
        limit.remove()
        C.remove_path(ws.folder)


# -- small random reads -------------------------------------------------------------------
def latency(read: Callable[[int, memoryview], None], ids: list[int], ws: Workspace
            ) -> tuple[float, float, float, int, int]:
    """One thread reading ``ids`` one call at a time into a pre-touched buffer:
    p50, p99 and p999 in µs, and every 16th block compared after the clock stopped."""
    b = ws.corpus.geometry.block_bytes
    _m, buf = aligned_buffer(b)
    out, ns = memoryview(buf), np.zeros(len(ids), dtype=np.int64)
    checked = bad = 0
    for i, block_id in enumerate(ids):
        t0 = time.perf_counter_ns()
        read(block_id, out)
        ns[i] = time.perf_counter_ns() - t0
        if i % CHECK_EVERY == 0:
            checked += 1
            bad += not np.array_equal(buf, block_view(ws.base, block_id, b))
    p50, p99, p999 = np.percentile(ns / 1000.0, [50, 99, 99.9], method="higher")
    return float(p50), float(p99), float(p999), checked, bad


def run_latency(iso: IsolaneStore, ws: Workspace, args: argparse.Namespace,
                res: Results) -> None:
    import lmdb

    corpus, b = ws.corpus, ws.corpus.geometry.block_bytes
    keys = [k for p in range(corpus.prompts) for k in iso.keys(p)]
    folder = ws.folder / "lmdb"
    env = lmdb.open(str(folder), map_size=int(corpus.nbytes * 1.25) + (256 << 20))
    with env.begin(write=True) as txn:
        for j in range(corpus.blocks):
            txn.put(b"%010d" % j, memoryview(block_view(ws.base, j, b)), append=True)
    env.sync(True)
    res.versions["lmdb"] = lmdb.__version__

    def read_isolane(j: int, out: memoryview) -> None:
        out[:] = iso.pool.get_blocks([keys[j]])[0]

    def read_lmdb(j: int, out: memoryview) -> None:
        with env.begin(buffers=True) as txn:
            out[:] = txn.get(b"%010d" % j)

    def prepare(name: str, state: str) -> None:
        nonlocal env
        if name == "isolane":  # cold: an empty memory tier; warm: one holding the corpus
            iso.open(0 if state == "cold" else corpus.nbytes + (64 << 20))
            if state == "warm":
                for i in range(0, len(keys), 256):
                    iso.pool.get_blocks(keys[i:i + 256])
        elif state == "cold":  # unmapped first: mapped pages would survive the drop
            env.close()
            env = lmdb.open(str(folder), map_size=int(corpus.nbytes * 1.25) + (256 << 20))
        else:
            with env.begin(buffers=True) as txn:
                for j in range(corpus.blocks):
                    bytes(txn.get(b"%010d" % j)[::PAGE])  # every page touched
        if state == "cold":
            res.drop()

    try:
        for rnd in range(args.repeats):
            for state in ("cold", "warm"):
                ids = zipf_ids(corpus.blocks, args.latency_calls, seed=1000 * rnd)
                readers = [("isolane", read_isolane), ("lmdb", read_lmdb)]
                for name, read in readers[::-1] if rnd % 2 else readers:
                    prepare(name, state)
                    run = latency(read, ids, ws)
                    res.latency.setdefault((name, state), []).append(run)
                    log(f"  {name} {state}: p50 {run[0]:.0f} p99 {run[1]:.0f} µs")
    finally:
        env.close()
        iso.open(0)


def reopen_isolane(iso: IsolaneStore, ws: Workspace, args: argparse.Namespace,
                   res: Results) -> None:
    """Grow the pool to ``--restart-gb`` with prompts whose tokens and blocks follow the
    corpus's, then reopen it cold and warm; the last block stored must read back."""
    g, b = ws.corpus.geometry, ws.corpus.geometry.block_bytes
    per = ws.corpus.blocks_per_prompt
    first = ws.corpus.prompts
    extra = max(0, -(-(int(args.restart_gb * C.GB) - ws.corpus.nbytes) // (per * b)))
    if extra and shutil.disk_usage(ws.folder).free < extra * per * b + (5 << 30):
        res.skipped.append(f"isolane reopen: not grown to {args.restart_gb} GB (disk space)")
        extra = 0
    grown = Corpus(g, first + extra, per)
    if extra:
        log(f"{g.name}: growing the isolane pool by {C.fmt_gb(extra * per * b)}")
        iso.build(grown, range(first, grown.prompts))
    cold: list[float] = []
    warm: list[float] = []
    problem = None
    last = grown.block_id(grown.prompts - 1, per - 1)
    for _ in range(args.repeats):
        iso.close()
        res.drop()
        cold.append(iso.open(0))
        got = iso.pool.get_blocks(iso.keys(grown.prompts - 1, grown)[-1:])[0]
        if got is None or not np.array_equal(np.frombuffer(got, np.uint8),
                                             block_view(ws.base, last, b)):
            problem = "the last block stored was not found or differs after reopening"
        warm.append(iso.open(0))
    res.restart.update(system="isolane KVPool", geometry=g.name, nbytes=grown.nbytes,
                       blocks=grown.blocks, cold=cold, warm=warm,
                       check=problem or "ok: last block read back")


# -- the report and the recorded rows ------------------------------------------------------
def fmt_ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def render(res: Results, args: argparse.Namespace) -> str:
    out = ["## KV pool: prompt restore, random reads, reopen (`benchmarks/bench_kv.py`)", "",
           f"Command: `{C.command_line()}`, {C.now_text()}; medians of {args.repeats} "
           "round(s); share of limit = the same round's sequential read of as many bytes "
           "/ the restore's time.", ""]
    if not res.cache_dropped:
        out += ["> WARNING: dropping the page cache was refused (not root): the 'cold' "
                "numbers are not cold.", ""]
    out += [f"> {line}" for line in res.skipped] + ([""] if res.skipped else [])
    for g in (LAYER, BLOCK):
        table = [[row.label, n, f"{row.nbytes / 1e6:.1f}", fmt_ms(row.median),
                  C.fmt_rate(row.nbytes, row.median), C.fmt_ratio(row.share, percent=True),
                  C.fmt_ratio(res.share_ratio(g.name, key, "files", n)),
                  "" if key == "limit" else row.check_text()]
                 for (name, key, n), row in sorted(res.restore.items(), key=lambda kv: (
                     kv[0][2], kv[0][1] != "limit")) if name == g.name]
        if table:
            out += [f"### Prompt restore, cold page cache: {g.label}", "", C.markdown_table(
                ["system", "N", "MB", "median ms", "GB/s", "share of limit",
                 "vs serial files", "check"], table), ""]
    if res.latency:
        table = []
        for (name, state), runs in sorted(res.latency.items()):
            med = [float(np.median([r[i] for r in runs])) for i in range(3)]
            bad, checked = sum(r[4] for r in runs), sum(r[3] for r in runs)
            table.append([name, state, 1, *(f"{v:.0f}" for v in med),
                          f"MISMATCH {bad} of {checked}" if bad else f"ok ({checked} compared)"])
        out += ["### Small random reads: 64 KiB blocks, Zipf(1.0) over the corpus", "",
                C.markdown_table(["system", "state", "threads", "p50 µs", "p99 µs", "p999 µs",
                                  "check"], table), ""]
    r = res.restart
    if "cold" in r:
        found = (f"A new LMCache LocalDiskBackend on its folder finds "
                 f"{r['lmcache_found']} of its {r['lmcache_blocks']} blocks."
                 if "lmcache_found" in r else "")
        out += ["### Reopen a full store", "", C.markdown_table(
            ["system", "geometry", "size", "blocks", "reopen cold s", "reopen warm s", "check"],
            [[r["system"], r["geometry"], C.fmt_gb(r["nbytes"]), r["blocks"],
              C.fmt_seconds(float(np.median(r["cold"]))),
              C.fmt_seconds(float(np.median(r["warm"]))), r["check"]]]), found.lstrip("; "),
                ""]
    return "\n".join(out)


def headline_rows(res: Results, where: dict[str, str]) -> list[_results.Result]:
    """Prompt restores (get_into) against serial per-block files, LMCache and the same
    run's sequential read; random reads against LMDB; the reopen."""
    rows: list[_results.Result] = []

    def add(measure: str, row: Row | None, peer: str, peer_row: Row | None,
            ratio: float | None, target: float, share: bool = False) -> None:
        if row is None or row.median is None or peer_row is None or peer_row.median is None \
                or ratio is None:
            return
        value = ratio * 100 if share else ratio
        goal = target * 100 if share else target
        rows.append(_results.Result(
            area="KV pool", measure=measure, value=round(row.median * 1e3, 1), unit="ms",
            peer=peer, peer_value=round(peer_row.median * 1e3, 1),
            ratio=round(value, 0 if share else 2), ratio_unit="%" if share else "x",
            target=f"≥ {goal:.0f} %" if share else f"≥ {target:g}x", met=value >= goal,
            **where))

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
                into.share if into else None, TARGETS["vs_limit"], share=True)
    for state in ("warm", "cold"):
        iso, lm = res.latency.get(("isolane", state)), res.latency.get(("lmdb", state))
        if iso and lm and not any(r[4] for r in [*iso, *lm]):
            p99, peer = (float(np.median([r[1] for r in runs])) for runs in (iso, lm))
            target = TARGETS["warm_p99_us"] if state == "warm" else None
            rows.append(_results.Result(
                area="KV pool", measure=f"random 64 KiB reads (Zipf), {state}, 1 thread, p99",
                value=round(p99), unit="µs", peer="LMDB", peer_value=round(peer),
                ratio=round(peer / p99, 2), target=f"≤ {target:g} µs" if target else None,
                met=p99 <= target if target else None, **where))
    r = res.restart
    if r.get("cold") and r["check"].startswith("ok"):
        found = r.get("lmcache_found")
        rows.append(_results.Result(
            area="KV pool", measure=f"reopen a full store ({C.fmt_gb(r['nbytes'])} of "
            f"{r['geometry']} blocks), cold", value=round(float(np.median(r["cold"])), 3),
            unit="s", peer=None if found is None else "LMCache LocalDiskBackend: finds "
            + ("none" if found == 0 else f"{found} of {r['lmcache_blocks']}")
            + " of its blocks after a reopen", **where))
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
    args.dir = args.dir.resolve()
    args.dir.mkdir(parents=True, exist_ok=True)
    res = Results()
    run_small(args, res)
    run_large(args, res)
    packages = {"torch": torch.__version__, "numpy": np.__version__, **res.versions}
    rows = headline_rows(res, {"machine": C.machine_description(args.dir, packages),
                               "date": C.now_text(), "command": C.command_line()})
    C.print_report(render(res, args) + "\n" + _results.rows_markdown(rows), args.out, SECTION)
    if args.out and _results.is_page(args.out):
        _results.write_results(SECTION, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
