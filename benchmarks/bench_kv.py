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
import contextlib
import gc
import json
import os
import select
import shutil
import subprocess
import sys
import time
import traceback
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _common as C
import _kv_data as D
import _kv_latency as L
import _quick
import _results
import numpy as np
import torch

O_DIRECT = getattr(os, "O_DIRECT", 0)
PAGE = 4096
FILE_THREADS = 8
LIMIT_DIRECT_THREADS = 8
ISOLANE_PUT_BATCH_BYTES = 256 << 20
LMCACHE_THREADS = 4  # its own default disk_io_threads


# -- the caller's tensor ------------------------------------------------------------------
class Dest:
    """The caller's destination: ``capacity`` bytes, page-aligned, every page touched."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._mmap, self.array = D.aligned_buffer(capacity)
        self.view = memoryview(self._mmap)
        self.tensor = torch.from_numpy(self.array)

    def release(self) -> None:
        self.view.release()
        del self.tensor, self.array
        self._mmap.close()


@dataclass(frozen=True)
class Restorer:
    key: str
    label: str
    restore: Callable[[int, int, int | None], float]  # (prompt, n, sample) -> seconds
    check: Callable[[int, int, int | None], str | None]  # (prompt, n, sample) -> problem
    extra_bytes: Callable[[int], int] = lambda n: 0  # memory the restore of n blocks adds
    before_cold: Callable[[], None] = lambda: None  # before the page cache is dropped


class Store(ABC):
    @abstractmethod
    def build(self, corpus: D.Corpus, prompts: Sequence[int]) -> float:
        """Store the blocks of ``prompts``; seconds until durable (``os.sync`` included)."""

    @abstractmethod
    def restorers(self) -> list[Restorer]: ...

    @abstractmethod
    def close(self) -> None: ...

    @abstractmethod
    def remove(self) -> None: ...


def read_fully(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise OSError(f"short read: {done} of {len(view)} bytes at offset {offset}")
        done += n


def check_dest(dest: Dest, base: D.Bytes, corpus: D.Corpus, prompt: int, n: int,
               sample: int | None) -> str | None:
    return D.check_blocks(dest.array, base, corpus.prompt_ids(prompt, n),
                          corpus.geometry.block_bytes, sample=sample)


# -- isolane --------------------------------------------------------------------------------


class IsolaneStore(Store):

    def __init__(self, folder: Path, corpus: D.Corpus, base: D.Bytes,
                 dest: Dest | None) -> None:
        from isolane.config import config_from_dict
        from isolane.kvpool.pool import KVPool
        from isolane.lanes.scheduler import LaneScheduler

        self._pool_cls = KVPool
        self.config = config_from_dict(
            {"device_groups": {"kv": {"role": "read", "devices": [str(folder)]}}})
        self.scheduler = LaneScheduler(self.config)  # its own: the registry keys by devices
        self.folder = folder
        self.corpus = corpus
        self.geometry = corpus.geometry
        self.base = base
        self.dest = dest
        self.keys: dict[int, list[bytes]] = {}
        self.pool: Any = None
        self.open(0)

    def open(self, memory_budget: int) -> float:
        """(Re)open the pool; returns the seconds the constructor took."""
        if self.pool is not None:
            self.pool.close()
        start = time.perf_counter()
        self.pool = self._pool_cls(
            self.config, namespace=f"bench-{self.geometry.name}",
            chunk_tokens=self.geometry.chunk_tokens, token_dim=self.geometry.token_dim,
            memory_budget=memory_budget, scheduler=self.scheduler)
        return time.perf_counter() - start

    def block_tensor(self, block_id: int) -> torch.Tensor:
        view = D.block_view(self.base, block_id, self.geometry.block_bytes)
        return torch.from_numpy(view).view(torch.bfloat16).view(
            self.geometry.kv_shape(self.geometry.chunk_tokens))

    def prompt_keys(self, prompt: int) -> list[bytes]:
        if prompt not in self.keys:
            self.keys[prompt] = self.pool.block_keys(self.corpus.tokens(prompt))
        return self.keys[prompt]

    def build(self, corpus: D.Corpus, prompts: Sequence[int]) -> float:
        g = self.geometry
        batch = max(1, ISOLANE_PUT_BATCH_BYTES // g.block_bytes)
        start = time.perf_counter()
        for p in prompts:
            tokens = corpus.tokens(p)
            if not self.pool.block_keys(tokens[:g.chunk_tokens]):  # fixes the layout
                self.pool.put(tokens[:g.chunk_tokens], self.block_tensor(corpus.block_id(p, 0)))
            keys = (self.prompt_keys(p) if corpus == self.corpus
                    else self.pool.block_keys(tokens))  # another corpus: its own prompts
            if len(keys) != corpus.blocks_per_prompt:
                raise RuntimeError(f"prompt {p} has {len(keys)} block keys, expected "
                                   f"{corpus.blocks_per_prompt}")
            for i in range(0, len(keys), batch):
                ids = range(i, min(i + batch, len(keys)))
                self.pool.put_blocks(
                    [keys[k] for k in ids],
                    [D.block_view(self.base, corpus.block_id(p, k), g.block_bytes)
                     for k in ids])
        os.sync()
        return time.perf_counter() - start

    def _restore_blocks(self, prompt: int, n: int, sample: int | None = None) -> float:
        assert self.dest is not None
        keys = self.prompt_keys(prompt)[:n]
        b = self.geometry.block_bytes
        dest = self.dest.array
        start = time.perf_counter()
        blocks = self.pool.get_blocks(keys)
        for pos, block in enumerate(blocks):
            if block is None:
                raise RuntimeError(f"get_blocks missed block {pos} of {n}")
            dest[pos * b:(pos + 1) * b] = np.frombuffer(block, dtype=np.uint8)
        return time.perf_counter() - start

    def _out(self, n: int) -> torch.Tensor:
        assert self.dest is not None
        g = self.geometry
        raw = self.dest.tensor[:n * g.block_bytes]
        return raw.view(torch.bfloat16).view(g.kv_shape(n * g.chunk_tokens))

    def _restore_into(self, prompt: int, n: int, sample: int | None = None) -> float:
        g = self.geometry
        tokens = self.corpus.tokens(prompt)[:n * g.chunk_tokens]
        out = self._out(n)
        start = time.perf_counter()
        got = self.pool.get_into(tokens, out)
        seconds = time.perf_counter() - start
        if got != n * g.chunk_tokens:
            raise RuntimeError(f"get_into restored {got} of {n * g.chunk_tokens} tokens")
        return seconds

    def _check_into(self, prompt: int, n: int, sample: int | None) -> str | None:
        g = self.geometry
        out = self._out(n)
        positions: Sequence[int] = range(n)
        if sample is not None and n > sample:
            positions = sorted({0, n - 1, *range(0, n, max(1, n // sample))})
        for pos in positions:
            got = out.narrow(g.token_dim, pos * g.chunk_tokens, g.chunk_tokens)
            want = self.block_tensor(self.corpus.block_id(prompt, pos))
            if not torch.equal(got.contiguous().view(torch.int16), want.view(torch.int16)):
                return f"block {pos} of the out tensor differs from what was stored"
        return None

    def restorers(self) -> list[Restorer]:
        return [
            Restorer("isolane:get_blocks", "isolane get_blocks(keys) + copy",
                self._restore_blocks,
                lambda p, n, s: check_dest(self.dest, self.base, self.corpus, p, n, s),
                extra_bytes=lambda n: n * self.geometry.block_bytes),
            Restorer("isolane:get_into", "isolane get_into(tokens, out)",
                self._restore_into, self._check_into,
                extra_bytes=lambda n: n * self.geometry.block_bytes),
        ]

    def stats(self) -> dict[str, Any]:
        return dict(self.pool.stats())

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def remove(self) -> None:
        self.close()
        self.scheduler.close()
        shutil.rmtree(self.folder, ignore_errors=True)


# -- one file per block -------------------------------------------------------------------
class FilesStore(Store):

    def __init__(self, folder: Path, corpus: D.Corpus, base: D.Bytes, dest: Dest) -> None:
        self.folder = folder
        self.corpus = corpus
        self.base = base
        self.dest = dest
        self.pool = ThreadPoolExecutor(FILE_THREADS, thread_name_prefix="bench-files")
        folder.mkdir(parents=True, exist_ok=True)

    def path(self, block_id: int) -> Path:
        return self.folder / f"{block_id:010d}.kv"

    def build(self, corpus: D.Corpus, prompts: Sequence[int]) -> float:
        b = corpus.geometry.block_bytes
        start = time.perf_counter()
        for p in prompts:
            for j in corpus.prompt_ids(p):
                with open(self.path(j), "wb") as f:
                    f.write(D.block_view(self.base, j, b))
        os.sync()
        return time.perf_counter() - start

    def _read_one(self, pos: int, block_id: int) -> None:
        b = self.corpus.geometry.block_bytes
        fd = os.open(self.path(block_id), os.O_RDONLY)
        try:
            read_fully(fd, self.dest.view[pos * b:(pos + 1) * b], 0)
        finally:
            os.close(fd)

    def _serial(self, prompt: int, n: int, sample: int | None = None) -> float:
        ids = self.corpus.prompt_ids(prompt, n)
        start = time.perf_counter()
        for pos, j in enumerate(ids):
            self._read_one(pos, j)
        return time.perf_counter() - start

    def _threaded(self, prompt: int, n: int, sample: int | None = None) -> float:
        ids = self.corpus.prompt_ids(prompt, n)
        start = time.perf_counter()
        list(self.pool.map(self._read_one, range(n), ids))
        return time.perf_counter() - start

    def restorers(self) -> list[Restorer]:
        def check(p: int, n: int, s: int | None) -> str | None:
            return check_dest(self.dest, self.base, self.corpus, p, n, s)

        return [
            Restorer("files:serial", "one file per block, serial reads", self._serial, check),
            Restorer("files:threads", f"one file per block, {FILE_THREADS} threads",
                     self._threaded, check),
        ]

    def close(self) -> None:
        self.pool.shutdown(wait=True)

    def remove(self) -> None:
        self.close()
        shutil.rmtree(self.folder, ignore_errors=True)


# -- LMDB -----------------------------------------------------------------------------------
class LmdbStore(Store):

    def __init__(self, folder: Path, corpus: D.Corpus, base: D.Bytes, dest: Dest | None,
                 *, map_bytes: int) -> None:
        import lmdb

        self.folder = folder
        self.corpus = corpus
        self.base = base
        self.dest = dest
        self.map_bytes = map_bytes
        folder.mkdir(parents=True, exist_ok=True)
        self.env = lmdb.open(str(folder), map_size=map_bytes, max_readers=256)

    def reopen(self) -> float:
        import lmdb

        self.env.close()
        start = time.perf_counter()
        self.env = lmdb.open(str(self.folder), map_size=self.map_bytes, max_readers=256)
        return time.perf_counter() - start

    @staticmethod
    def key_of(block_id: int) -> bytes:
        return b"%010d" % block_id

    def build(self, corpus: D.Corpus, prompts: Sequence[int]) -> float:
        b = corpus.geometry.block_bytes
        start = time.perf_counter()
        for p in prompts:
            with self.env.begin(write=True) as txn:
                for j in corpus.prompt_ids(p):
                    txn.put(self.key_of(j), memoryview(D.block_view(self.base, j, b)),
                            append=True)
        self.env.sync(True)
        os.sync()
        return time.perf_counter() - start

    def get(self, block_id: int, out: memoryview) -> None:
        with self.env.begin(buffers=True) as txn:
            out[:] = txn.get(self.key_of(block_id))

    def _restore(self, prompt: int, n: int, sample: int | None = None) -> float:
        assert self.dest is not None
        b = self.corpus.geometry.block_bytes
        ids = self.corpus.prompt_ids(prompt, n)
        view = self.dest.view
        start = time.perf_counter()
        with self.env.begin(buffers=True) as txn:
            for pos, j in enumerate(ids):
                view[pos * b:(pos + 1) * b] = txn.get(self.key_of(j))
        return time.perf_counter() - start

    def restorers(self) -> list[Restorer]:
        # Reopened before the page cache is dropped: pages still mapped would survive it.
        return [Restorer("lmdb", "LMDB", self._restore,
                         lambda p, n, s: check_dest(self.dest, self.base, self.corpus, p,
                                                    n, s), before_cold=self.reopen)]

    def close(self) -> None:
        self.env.close()

    def remove(self) -> None:
        self.close()
        shutil.rmtree(self.folder, ignore_errors=True)


# -- LMCache (child process) ----------------------------------------------------------------
class ChildError(RuntimeError):
    pass


class LmcacheStore(Store):
    """LMCache's LocalDiskBackend in a child process (its venv pins numpy <= 2.2.6)."""

    PREFIX = "KVCHILD "

    def __init__(self, python: Path, folder: Path, corpus: D.Corpus, base_file: Path, *,
                 dest_bytes: int, pool_bytes: int, threads: int, log_path: Path,
                 timeout_s: float = 1800) -> None:
        if not python.exists():
            raise ChildError(f"no LMCache venv at {python.parent.parent}: create it with "
                             f"`python3 -m venv {python.parent.parent} && "
                             f"{python.parent}/pip install torch==2.13.0 lmcache==0.5.6`")
        self.folder = folder
        self.corpus = corpus
        self.timeout_s = timeout_s
        folder.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in close()
        child = Path(__file__).resolve().parent / "_kv_lmcache_child.py"
        env = dict(os.environ, LMCACHE_LOG_LEVEL="WARNING", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([str(python), str(child)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, env=env)
        self._buf = b""
        self.versions = self.request(
            "init", geometry=corpus.geometry.name, folder=str(folder), base=str(base_file),
            pool_bytes=pool_bytes, dest_bytes=dest_bytes, threads=threads,
            disk_gib=corpus.nbytes * 1.5 / 2**30 + 1)

    def request(self, cmd: str, **fields: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write((json.dumps({"cmd": cmd, **fields}) + "\n").encode())
        self.proc.stdin.flush()
        deadline = time.monotonic() + self.timeout_s
        fd = self.proc.stdout.fileno()
        while True:
            while b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                text = line.decode(errors="replace")
                if text.startswith(self.PREFIX):
                    answer: dict[str, Any] = json.loads(text[len(self.PREFIX):])
                    if "error" in answer:
                        raise ChildError(answer["error"])
                    return answer
            left = deadline - time.monotonic()
            if left <= 0:
                raise ChildError(f"LMCache child did not answer '{cmd}' in {self.timeout_s} s")
            ready, _, _ = select.select([fd], [], [], min(left, 5.0))
            if ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise ChildError(f"LMCache child exited ({self.proc.wait()}) during "
                                     f"'{cmd}'; see {self._log.name}")
                self._buf += chunk

    def build(self, corpus: D.Corpus, prompts: Sequence[int]) -> float:
        ids = [j for p in prompts for j in corpus.prompt_ids(p)]
        return float(self.request("build", ids=ids)["seconds_synced"])

    def restorers(self) -> list[Restorer]:
        checks: dict[tuple[int, int], str | None] = {}

        def restore(prompt: int, n: int, sample: int | None) -> float:
            answer = self.request("restore", ids=self.corpus.prompt_ids(prompt, n),
                                  sample=sample)
            checks[(prompt, n)] = answer["check"]
            return float(answer["seconds"])

        def check(prompt: int, n: int, sample: int | None) -> str | None:
            return checks.pop((prompt, n), None)

        return [Restorer("lmcache", "LMCache LocalDiskBackend", restore, check)]

    def reopen(self) -> dict[str, Any]:
        return self.request("reopen", ids=list(range(self.corpus.blocks)))

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ChildError):
                self.request("close")
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def remove(self) -> None:
        self.close()
        shutil.rmtree(self.folder, ignore_errors=True)


# -- the disk's sequential read limit -----------------------------------------------------------
class SequentialLimit(Store):
    """One file of ``capacity`` bytes, read from offset 0 as far as a restore reads.

    The bytes land in a buffer of its own (at most ``RING_BYTES``, pre-touched, reused
    in a ring), so the limit of an 8 GB restore needs no 8 GB of memory: what it measures
    is the disk and the kernel's copy, not the caller's memory.
    """

    RING_BYTES = 256 << 20

    def __init__(self, path: Path, capacity: int, base: D.Bytes) -> None:
        self.path = path
        self.capacity = capacity
        self.base = base
        self._mmap, arr = D.aligned_buffer(min(capacity, self.RING_BYTES))
        self.ring = memoryview(self._mmap)[:len(arr)]
        self.pool = ThreadPoolExecutor(LIMIT_DIRECT_THREADS, thread_name_prefix="bench-limit")

    def build(self, corpus: D.Corpus | None = None, prompts: Sequence[int] = ()) -> float:
        start = time.perf_counter()
        chunk = D.SPREAD  # random bytes, 16 MiB at a time
        with open(self.path, "wb") as f:
            done = 0
            while done < self.capacity:
                n = min(chunk, self.capacity - done)
                f.write(memoryview(self.base[done // chunk % 7 * 8:][:n]))
                done += n
        os.sync()
        return time.perf_counter() - start

    def buffered(self, nbytes: int) -> float:
        """Plain reads of up to 256 MiB each, in order (kernel read-ahead streams)."""
        ring = self.ring
        start = time.perf_counter()
        fd = os.open(self.path, os.O_RDONLY)
        try:
            off = 0
            while off < nbytes:
                n = min(len(ring), nbytes - off)
                read_fully(fd, ring[:n], off)
                off += n
        finally:
            os.close(fd)
        return time.perf_counter() - start

    def direct(self, nbytes: int) -> float:
        """O_DIRECT reads of up to 8 MiB, ``LIMIT_DIRECT_THREADS`` in flight."""
        chunk = min(8 << 20, max(128 << 10, nbytes // 8 // PAGE * PAGE))
        slots = len(self.ring) // chunk
        ring = self.ring

        def one(fd: int, index: int) -> None:
            off = index * chunk
            length = (min(off + chunk, nbytes) - off + PAGE - 1) // PAGE * PAGE
            slot = index % slots * chunk
            read_fully(fd, ring[slot:slot + length], off)

        start = time.perf_counter()
        fd = os.open(self.path, os.O_RDONLY | O_DIRECT)
        try:
            list(self.pool.map(lambda i: one(fd, i), range(-(-nbytes // chunk))))
        finally:
            os.close(fd)
        return time.perf_counter() - start

    def restorers(self, block_bytes: int = 0) -> list[Restorer]:
        b = block_bytes
        return [
            Restorer("limit:buffered", "sequential read, buffered",
                     lambda p, n, s: self.buffered(n * b), lambda p, n, s: None),
            Restorer("limit:direct", f"sequential read, O_DIRECT, {LIMIT_DIRECT_THREADS} "
                     "in flight", lambda p, n, s: self.direct(n * b), lambda p, n, s: None),
        ]

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.ring.release()
        self._mmap.close()

    def remove(self) -> None:
        self.close()
        self.path.unlink(missing_ok=True)


def mem_available_bytes() -> int:
    return C.proc_number("/proc/meminfo", "MemAvailable") * 1024


def process_read_bytes() -> int:
    """Bytes this process caused to be read from storage (``/proc/self/io``)."""
    return C.proc_number("/proc/self/io", "read_bytes")


THREADS = (1, 8, 32)
TARGETS = {"vs_serial_64k": 3.0, "vs_lmcache": 1.5, "vs_limit": 0.85, "warm_p99_us": 100.0}


# -- results -------------------------------------------------------------------------------
@dataclass
class Row:
    """One restorer at one N of one geometry, over the rounds."""

    label: str
    nbytes: int
    seconds: C.Samples = field(default_factory=C.Samples)
    shares: list[float] = field(default_factory=list)  # limit seconds / seconds, same round
    problems: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    skipped: str = ""

    @property
    def median(self) -> float | None:
        return self.seconds.median if self.seconds else None

    @property
    def share(self) -> float | None:
        return float(np.median(self.shares)) if self.shares else None

    def check_text(self, rounds: int) -> str:
        if self.errors:
            return "ERROR: " + self.errors[0]
        if self.skipped:
            return "skipped: " + self.skipped
        if self.problems:
            return "MISMATCH: " + self.problems[0]
        return f"ok ({len(self.seconds.values)} restores compared)" if self.seconds else ""


@dataclass
class Results:
    corpora: dict[str, D.Corpus] = field(default_factory=dict)
    restore: dict[tuple[str, str, int], Row] = field(default_factory=dict)
    builds: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    latency: dict[tuple[str, str, int], list[L.LatencyRun]] = field(default_factory=dict)
    restart: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    versions: dict[str, str] = field(default_factory=dict)
    revision: str = ""
    cache_dropped: bool = True

    def row(self, geometry: str, r: Restorer, n: int, block_bytes: int) -> Row:
        key = (geometry, r.key, n)
        if key not in self.restore:
            self.restore[key] = Row(r.label, n * block_bytes)
        return self.restore[key]

    def limit_row(self, geometry: str, n: int, block_bytes: int) -> Row:
        key = (geometry, "limit", n)
        if key not in self.restore:
            self.restore[key] = Row("**sequential read: limit** (the faster of the two)",
                                    n * block_bytes)
        return self.restore[key]


# -- the report -----------------------------------------------------------------------------
def fmt_ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:.1f}" if seconds < 10 else f"{seconds:.1f} s"


def fmt_us(value: float) -> str:
    return f"{value:.0f}" if value >= 10 else f"{value:.1f}"


def share_ratio(res: Results, geometry: str, a: str, b: str, n: int) -> float | None:
    ra, rb = res.restore.get((geometry, a, n)), res.restore.get((geometry, b, n))
    if ra is None or rb is None:
        return None
    return C.ratio(ra.share, rb.share)


def render(res: Results, args: argparse.Namespace) -> str:
    out = ["## KV pool: prompt restore, random reads, restart (`benchmarks/bench_kv.py`)", ""]
    packages = {"torch": torch.__version__, "numpy": np.__version__, **res.versions}
    out += [f"Command: `{C.command_line()}`  ",
            f"Date: {C.now_text()}  ",
            f"Machine: {C.machine_description(args.dir, packages)}  ",
            f"isolane: {res.revision or C.isolane_revision()} (when the run started)", ""]
    out += [f"Medians of {args.repeats} round(s); **share of limit** = the same round's "
            "sequential read of as many bytes ÷ the restore's time (see the module's "
            "docstring for the method).", ""]
    if not res.cache_dropped:
        out += ["> WARNING: dropping the page cache was refused (not root): the 'cold' "
                "numbers are not cold.", ""]
    out += [f"> {line}" for line in res.skipped] + ([""] if res.skipped else [])

    rows = []
    for name in res.corpora:
        for (geom, key), b in res.builds.items():
            if geom != name:
                continue
            if "error" in b:
                rows.append([name, key, "", "", "ERROR: " + b["error"]])
                continue
            rows.append([name, key, C.fmt_gb(b["nbytes"]), C.fmt_seconds(b["seconds"]),
                         C.fmt_rate(b["nbytes"], b["seconds"]) + (
                             f" ({b['note']})" if b.get("note") else "")])
    out += ["### Corpora", "", C.markdown_table(
        ["geometry", "prompts x blocks", "blocks", "size", "memory tier (isolane)"],
        [[c.geometry.label, f"{c.prompts} x {c.blocks_per_prompt}", c.blocks,
          C.fmt_gb(c.nbytes), "0 B; whole corpus for the warm random reads"
          if c.geometry.name == D.LLAMA3_8B_LAYER.name and res.latency else "0 B"]
         for c in res.corpora.values()]), "",
        "Filling each store, until durable (`os.sync()` timed):", "",
        C.markdown_table(["geometry", "store", "bytes", "seconds", "GB/s"], rows), ""]

    for name in dict.fromkeys(g for (g, _k, _n) in res.restore):
        corpus = res.corpora[name]
        keys = list(dict.fromkeys(k for (g, k, _n) in res.restore if g == name))
        ns = sorted({n for (g, _k, n) in res.restore if g == name})
        table = []
        for n in ns:
            for key in keys:
                row = res.restore.get((name, key, n))
                if row is None:
                    continue
                table.append([
                    row.label, n, f"{row.nbytes / 1e6:.1f}", fmt_ms(row.median),
                    C.fmt_rate(row.nbytes, row.median),
                    C.fmt_ratio(row.share, percent=True) if key != "limit" else "100 %",
                    C.fmt_ratio(share_ratio(res, name, key, "files:serial", n)),
                    ", ".join(f"{v * 1e3:.1f}" for v in row.seconds.values),
                    row.check_text(args.repeats) if not key.startswith("limit") else ""])
        out += [f"### Prompt restore, cold page cache: {corpus.geometry.label}", "",
                C.markdown_table(
                    ["system", "N", "MB", "median ms", "GB/s", "share of limit",
                     "vs serial files", "runs (ms)", "check"], table),
                ""]

    if res.latency:
        table = []
        for (name, state, threads), runs in res.latency.items():
            err = next((r.error for r in runs if r.error), None)
            if err:
                table.append([name, state, threads, "", "", "", "", "", "ERROR: " + err])
                continue
            def med(attr: str, runs: list[L.LatencyRun] = runs) -> float:
                return float(np.median([getattr(r, attr) for r in runs]))

            bad = sum(r.mismatches for r in runs)
            checked = sum(r.checked for r in runs)
            table.append([
                name, state, threads, fmt_us(med("p50_us")), fmt_us(med("p99_us")),
                fmt_us(med("p999_us")), sum(r.calls for r in runs),
                f"{med('disk_read_bytes') / 1e6:.0f}" if name != "redis" else "-",
                f"MISMATCH {bad} of {checked}" if bad else f"ok ({checked} compared)"])
        table.sort(key=lambda r: (str(r[0]), str(r[1]), int(r[2])))
        out += ["### Small random reads: 64 KiB blocks, Zipf(1.0) over the corpus", "",
                f"µs per call, {args.latency_calls} calls per run over the threads of one "
                "process; 'disk MB' from `/proc/self/io`.", "", C.markdown_table(
                    ["system", "state", "threads", "p50 µs", "p99 µs", "p999 µs", "calls",
                     "disk MB", "check"], table), ""]

    if res.restart:
        table = []
        for r in res.restart:
            cold = float(np.median(r["cold"])) if r["cold"] else None
            warm = float(np.median(r["warm"])) if r["warm"] else None
            first = float(np.median(r["first_get"])) if r["first_get"] else None
            table.append([
                r["system"], r["geometry"], C.fmt_gb(r["nbytes"]), r["blocks"], r["segments"],
                C.fmt_seconds(cold), C.fmt_seconds(warm),
                f"{cold / (r['nbytes'] / C.GB):.4f}" if cold is not None else "-",
                f"{cold / max(r['blocks'], 1) * 1e6:.1f}" if cold is not None else "-",
                fmt_ms(first), r["check"], r["note"]])
        out += ["### Restart: reopen a full store", "", C.markdown_table(
                    ["system", "geometry", "size", "blocks", "files", "reopen cold s",
                     "reopen warm s", "s per GB (cold)", "µs per block (cold)",
                     "first get ms", "check", "what reopening does"], table), ""]

    return "\n".join(out)


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



# -- prompt restore rounds ------------------------------------------------------------------
def restore_rounds(geometry: D.Geometry, corpus: D.Corpus, limit: SequentialLimit,
                   restorers: list[Restorer], ns: Sequence[int], args: argparse.Namespace,
                   res: Results, *, phase: int = 0) -> None:
    """``args.repeats`` rounds; in each, per N: the limit (both ways), then every restorer
    (order rotated round by round), each after dropping the page cache."""
    warm_up(geometry, corpus, restorers, max(ns), res)
    for rnd in range(args.repeats):
        for ni, n in enumerate(ns):
            prompt = (phase + rnd * len(ns) + ni) % corpus.prompts
            one_round(geometry, limit, restorers, n, prompt, rnd, res)


def one_round(geometry: D.Geometry, limit: SequentialLimit, restorers: list[Restorer],
              n: int, prompt: int, rnd: int, res: Results) -> None:
    """The limit (both ways), then every restorer (order rotated round by round), each
    after dropping the page cache."""
    b = geometry.block_bytes
    gkey = geometry.name
    limits = []
    for lr in limit.restorers(b):
        drop(res)
        row = res.row(gkey, lr, n, b)
        seconds = lr.restore(prompt, n, None)
        row.seconds.add(seconds)
        limits.append(seconds)
    best = min(limits)
    lim_row = res.limit_row(gkey, n, b)
    lim_row.seconds.add(best)
    lim_row.shares.append(1.0)
    order = restorers[rnd % len(restorers):] + restorers[:rnd % len(restorers)] \
        if restorers else []
    for r in order:
        row = res.row(gkey, r, n, b)
        if row.skipped:
            continue
        need = r.extra_bytes(n) + MEMORY_MARGIN
        if mem_available_bytes() < need:
            row.skipped = (f"needs ~{need / C.GB:.1f} GB of free memory, "
                           f"{mem_available_bytes() / C.GB:.1f} GB available")
            continue
        sample = None if rnd == 0 else 4
        r.before_cold()
        drop(res)
        try:
            seconds = r.restore(prompt, n, sample)
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


def warm_up(geometry: D.Geometry, corpus: D.Corpus, restorers: list[Restorer], n: int,
            res: Results) -> None:
    """One untimed restore of ``n`` blocks per restorer (page cache not dropped): lazy
    imports, thread pools and staging pools are set up before the first timed round, as
    in a long-running server. A mismatch here is recorded like any other."""
    prompt = corpus.prompts - 1
    for r in restorers:
        if mem_available_bytes() < r.extra_bytes(n) + MEMORY_MARGIN:
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


def open_store(key: str, ws: Workspace, dest: Dest | None, args: argparse.Namespace,
               res: Results) -> Store | None:
    """Create and fill one store; None (reason recorded) when it cannot run here."""
    g, corpus = ws.geometry, ws.corpus
    b = g.block_bytes
    store: Store
    try:
        if key == "isolane":
            store = IsolaneStore(ws.folder / "isolane", corpus, ws.base, dest)
        elif key == "files":
            assert dest is not None
            store = FilesStore(ws.folder / "files", corpus, ws.base, dest)
        elif key == "lmdb":
            store = LmdbStore(ws.folder / "lmdb", corpus, ws.base, dest,
                              map_bytes=int(corpus.nbytes * 1.25) + (256 << 20))
        elif key == "lmcache":
            max_n = max(ws.ns)
            while max_n and 2 * max_n * b + MEMORY_MARGIN > mem_available_bytes():
                max_n //= 2
            if max_n < max(ws.ns):
                res.skipped.append(f"LMCache ({g.name}): N > {max_n} skipped, its staging "
                                   "pool and tensor would not fit in free memory")
            store = LmcacheStore(
                args.lmcache_venv / "bin" / "python", ws.folder / "lmcache", corpus,
                ws.base_file, dest_bytes=max(max_n, 1) * b,
                pool_bytes=max(max_n, 1) * b + (64 << 20), threads=LMCACHE_THREADS,
                log_path=args.dir / "lmcache-child.log")
            res.versions["LMCache"] = store.versions.get("lmcache", "?")
            res.versions["LMCache venv: torch"] = store.versions.get("torch", "?")
            res.versions["LMCache venv: numpy"] = store.versions.get("numpy", "?")
        else:
            raise ValueError(key)
        log(f"{g.name}: building {key} ({C.fmt_gb(corpus.nbytes)})")
        try:
            seconds = store.build(corpus, range(corpus.prompts))
        except Exception:
            store.remove()
            raise
    except Exception as exc:  # the row says why; the others still run
        traceback.print_exc()
        why = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        res.builds[(g.name, key)] = {"error": why}
        res.skipped.append(f"{key} ({g.name}) not measured: {why}")
        return None
    res.builds[(g.name, key)] = {"seconds": seconds, "nbytes": corpus.nbytes}
    log(f"  {key}: {seconds:.1f} s, {corpus.nbytes / seconds / C.GB:.2f} GB/s until durable")
    return store


def restorers_of(store: Store, args: argparse.Namespace) -> list[Restorer]:
    return [r for r in store.restorers() if r.key.split(":")[0] in args.stores
            or r.key in args.stores]


# -- the 64 KiB geometry: all stores at once ------------------------------------------------
def run_small(args: argparse.Namespace, res: Results) -> None:
    g, ns = D.LLAMA3_8B_LAYER, RESTORE_NS
    ws, limit = make_workspace(g, args.corpus_small_gb, ns, args, res)
    corpus = ws.corpus
    dest = Dest(max(ns) * g.block_bytes)
    stores: dict[str, Store] = {}
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
        run_latency(ws, stores, args, res)
        lmcache = stores.get("lmcache")
        if isinstance(lmcache, LmcacheStore):
            lmcache_restart(lmcache, g, res)
        for key in [k for k in stores if k != "isolane"]:
            stores.pop(key).remove()
        dest.release()
        if isinstance(iso, IsolaneStore):
            restart_isolane(iso, ws, args.restart_small_gb, args, res)
    finally:
        for store in stores.values():
            store.remove()
        limit.remove()
        C.remove_path(ws.folder)


def make_workspace(g: D.Geometry, corpus_gb: float, ns: tuple[int, ...],
                   args: argparse.Namespace, res: Results) -> tuple[Workspace, SequentialLimit]:
    """The corpus, its base bytes and the limit file of one geometry."""
    corpus = D.plan_corpus(g, int(corpus_gb * C.GB), max(ns))
    res.corpora[g.name] = corpus
    folder = args.dir / f"kv-{g.name}"
    C.remove_path(folder)
    folder.mkdir(parents=True)
    base_file = folder / "base.bin"
    base = D.make_base(g.block_bytes, base_file)
    log(f"{g.name}: corpus of {corpus.prompts} prompt(s) x {corpus.blocks_per_prompt} blocks "
        f"= {corpus.blocks} blocks, {C.fmt_gb(corpus.nbytes)}")
    limit = SequentialLimit(folder / "limit.bin", max(ns) * g.block_bytes, base)
    log(f"{g.name}: writing the limit file ({C.fmt_gb(limit.capacity)})")
    res.builds[(g.name, "limit")] = {"seconds": limit.build(), "nbytes": limit.capacity}
    return Workspace(g, corpus, base, base_file, folder, ns), limit


# -- the 32 MiB geometry: one store at a time -------------------------------------------------
def run_large(args: argparse.Namespace, res: Results) -> None:
    g, ns = D.LLAMA3_8B_BLOCK, QUICK_NS_LARGE if args.quick else RESTORE_NS
    ws, limit = make_workspace(g, args.corpus_gb, ns, args, res)
    corpus = ws.corpus
    try:
        for phase, key in enumerate(k for k in STORE_KEYS if k in args.stores):
            parent_side = key != "lmcache"
            dest = Dest(max(ns) * g.block_bytes) if parent_side else None
            store = open_store(key, ws, dest, args, res)
            try:
                if store is None:
                    continue
                log(f"{g.name}: prompt restore from {key}, {args.repeats} round(s)")
                restore_rounds(g, corpus, limit, restorers_of(store, args), ns, args, res,
                               phase=phase)
                if isinstance(store, LmdbStore):
                    lmdb_restart(store, g, corpus, res)
                if isinstance(store, LmcacheStore):
                    lmcache_restart(store, g, res)
                if dest is not None:
                    dest.release()
                    dest = None
                if isinstance(store, IsolaneStore):
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
def run_latency(ws: Workspace, stores: dict[str, Store], args: argparse.Namespace,
                res: Results) -> None:
    g, corpus, base = ws.geometry, ws.corpus, ws.base
    b = g.block_bytes
    readers: dict[str, Callable[[], L.Reader]] = {}
    prepare: dict[str, Callable[[str], None]] = {}
    server: L.RedisServer | None = None
    iso = stores.get("isolane")
    if isinstance(iso, IsolaneStore):
        add_isolane_readers(iso, corpus, readers, prepare, res)
    lm = stores.get("lmdb")
    if isinstance(lm, LmdbStore):
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
                                        read_bytes=process_read_bytes)
                        res.latency.setdefault((name, state, threads), []).append(run)
                        log(f"  {name} {state} x{threads}: p50 {run.p50_us:.0f} p99 "
                            f"{run.p99_us:.0f} p999 {run.p999_us:.0f} us"
                            + (f" ERROR {run.error}" if run.error else ""))
    finally:
        if server is not None:
            server.stop()
        if isinstance(iso, IsolaneStore):
            iso.open(0)


def add_isolane_readers(iso: IsolaneStore, corpus: D.Corpus,
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


# -- restart --------------------------------------------------------------------------------
def restart_isolane(store: IsolaneStore, ws: Workspace, target_gb: float,
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


def lmdb_restart(store: LmdbStore, g: D.Geometry, corpus: D.Corpus, res: Results) -> None:
    cold, first = C.Samples(), C.Samples()
    out = Dest(g.block_bytes)
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


def lmcache_restart(store: LmcacheStore, g: D.Geometry, res: Results) -> None:
    try:
        answer = store.reopen()
    except ChildError as exc:
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
    p.add_argument("--stores", default="isolane,files,lmdb,lmcache,redis",
                   help="comma list: isolane, files, lmdb, lmcache, redis")
    p.add_argument("--lmcache-venv", type=Path, default=C.REPO_ROOT / ".bench" / "lmcache-venv",
                   help="virtual env with torch==2.13.0 lmcache==0.5.6")
    p.add_argument("--dir", type=Path, default=C.REPO_ROOT / ".bench",
                   help="scratch folder (deleted after use)")
    p.add_argument("--out", type=Path, help="docs/BENCHMARKS.md records the headline rows "
                   "in benchmarks/results/kv.json; another file gets the report")
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
    unknown = args.stores - {*STORE_KEYS, "redis"}
    if unknown or args.repeats < 1:
        p.error(f"unknown store {sorted(unknown)}, or --repeats < 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    res = Results(revision=C.isolane_revision())  # what is imported below, not at the end
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
    run_small(args, res)
    run_large(args, res)
    machine = C.machine_description(args.dir, dict(res.versions))
    rows = headline_rows(res, {"machine": machine, "date": C.now_text(),
                               "command": C.command_line()})
    C.print_report(render(res, args) + "\n" + _results.rows_markdown(rows), args.out, SECTION)
    if args.out and _results.is_page(args.out):
        _results.write_results(SECTION, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
