"""The KV stores under test and how each restores a prompt's blocks into the caller's tensor.

A ``Store`` holds one corpus on disk (``build``) and offers one or more ``Restorer``s;
a restorer copies the blocks of a prompt's first ``n`` blocks into the shared
destination (``Dest``: one page-aligned, pre-touched buffer, so no timing pays
first-touch page faults for the *caller's* memory) and returns the seconds from the call
until the last byte is there. ``check`` compares the destination with the stored blocks
afterwards (outside the timing).

Stores: isolane ``KVPool`` (``get_blocks`` + copy, and token-level ``get_into``), one
file per block (serial, and a thread pool), LMDB, LMCache's LocalDiskBackend (a child
process in LMCache's own venv, ``_kv_lmcache_child.py``), and the disk's sequential read
of the same number of bytes (``SequentialLimit``: one buffered read, and O_DIRECT with
several requests in flight).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _kv_data as D
import numpy as np
import torch

O_DIRECT = getattr(os, "O_DIRECT", 0)
PAGE = 4096
FILE_THREADS = 8
LIMIT_DIRECT_THREADS = 8
ISOLANE_PUT_BATCH_BYTES = 256 << 20


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
    note: str
    restore: Callable[[int, int, int | None], float]  # (prompt, n, sample) -> seconds
    check: Callable[[int, int, int | None], str | None]  # (prompt, n, sample) -> problem
    extra_bytes: Callable[[int], int] = lambda n: 0  # memory the restore of n blocks adds
    before_cold: Callable[[], None] = lambda: None  # before the page cache is dropped


class Store(ABC):
    key: str
    label: str

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


def read_until_eof(fd: int, view: memoryview, offset: int) -> None:
    """Fill ``view`` from ``offset`` on, or stop at the end of the file: an O_DIRECT
    read widened to pages may pass the end of a live segment, inside its last page."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            break
        done += got


def segment_path(seg: Any, segment_id: int) -> Path:
    """The data file (not the hint file) of segment ``segment_id`` of log ``seg``."""
    return next(f for f in seg.folder.glob(f"seg-{segment_id:08d}.*") if f.suffix != ".hint")


def check_dest(dest: Dest, base: D.Bytes, corpus: D.Corpus, prompt: int, n: int,
               sample: int | None) -> str | None:
    return D.check_blocks(dest.array, base, corpus.prompt_ids(prompt, n),
                          corpus.geometry.block_bytes, sample=sample)


# -- isolane --------------------------------------------------------------------------------


class IsolaneStore(Store):
    key = "isolane"
    label = "isolane KVPool"

    def __init__(self, folder: Path, corpus: D.Corpus, base: D.Bytes, dest: Dest | None, *,
                 memory_budget: int = 0, segment_bytes: int | None = None,
                 inflight_bytes: int | None = None) -> None:
        from isolane.config import config_from_dict
        from isolane.kvpool.pool import KVPool
        from isolane.lanes.scheduler import LaneScheduler

        self._pool_cls = KVPool
        group: dict[str, Any] = {"role": "read", "devices": [str(folder)]}
        if inflight_bytes is not None:
            group["inflight_bytes"] = inflight_bytes
        self.config = config_from_dict({"device_groups": {"kv": group}})
        self.inflight_bytes = self.config.device_groups["kv"].inflight_bytes
        self.scheduler = LaneScheduler(self.config)  # its own: the registry keys by devices
        self.folder = folder
        self.corpus = corpus
        self.geometry = corpus.geometry
        self.base = base
        self.dest = dest
        self.segment_bytes = segment_bytes
        self.keys: dict[int, list[bytes]] = {}
        self.pool: Any = None
        self.open(memory_budget)

    def open(self, memory_budget: int) -> float:
        """(Re)open the pool; returns the seconds the constructor took."""
        if self.pool is not None:
            self.pool.close()
        start = time.perf_counter()
        self.pool = self._pool_cls(
            self.config, namespace=f"bench-{self.geometry.name}",
            chunk_tokens=self.geometry.chunk_tokens, token_dim=self.geometry.token_dim,
            memory_budget=memory_budget, segment_bytes=self.segment_bytes,
            scheduler=self.scheduler)
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

    def get_blocks(self, keys: list[bytes]) -> list[Any]:
        return list(self.pool.get_blocks(keys))

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
            Restorer("isolane:get_blocks", "isolane get_blocks(keys) + copy", (
                "memory tier 0 B; block-level call with the prompt's N keys, then each "
                "returned buffer copied into the caller's tensor (inside the timing)"),
                self._restore_blocks,
                lambda p, n, s: check_dest(self.dest, self.base, self.corpus, p, n, s),
                extra_bytes=lambda n: n * self.geometry.block_bytes),
            Restorer("isolane:get_into", "isolane get_into(tokens, out)", (
                "memory tier 0 B; token-level call (block keys hashed from the token ids "
                "inside the timing) filling a preallocated [layers, 2, T, 8, 128] bf16 "
                "tensor"), self._restore_into, self._check_into,
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
    key = "files"
    label = "one file per block"

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
            Restorer("files:serial", "one file per block, serial reads",
                     "open + pread into the caller's tensor + close, block after block",
                     self._serial, check),
            Restorer("files:threads", f"one file per block, {FILE_THREADS} threads",
                     f"the same reads on a pool of {FILE_THREADS} threads", self._threaded,
                     check),
        ]

    def close(self) -> None:
        self.pool.shutdown(wait=True)

    def remove(self) -> None:
        self.close()
        shutil.rmtree(self.folder, ignore_errors=True)


# -- LMDB -----------------------------------------------------------------------------------
class LmdbStore(Store):
    key = "lmdb"
    label = "LMDB"

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
        return [Restorer("lmdb", "LMDB", "one read transaction, `get` of each block "
                         "(a view into the map) copied into the caller's tensor; the "
                         "environment is reopened before the page cache is dropped (pages "
                         "still mapped would survive the drop)",
                         self._restore,
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

    key = "lmcache"
    label = "LMCache LocalDiskBackend"
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
        self.threads = threads
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

        return [Restorer("lmcache", "LMCache LocalDiskBackend", (
            f"`batched_get_blocking(keys)` ({self.threads} read threads, buffered reads "
            "into its CPU staging pool), then each memory object copied into the caller's "
            "tensor and released; in a child process with LMCache's own venv"),
            restore, check)]

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

    key = "limit"
    label = "sequential read (limit)"
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
            Restorer("limit:buffered", "sequential read, buffered", (
                "the same number of bytes from one file: plain `preadv` calls of up to "
                "256 MiB, in order (kernel read-ahead)"),
                lambda p, n, s: self.buffered(n * b), lambda p, n, s: None),
            Restorer("limit:direct", f"sequential read, O_DIRECT, {LIMIT_DIRECT_THREADS} "
                     "in flight", ("the same bytes with O_DIRECT in requests of up to 8 "
                                   f"MiB, {LIMIT_DIRECT_THREADS} threads"),
                     lambda p, n, s: self.direct(n * b), lambda p, n, s: None),
        ]

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.ring.release()
        self._mmap.close()

    def remove(self) -> None:
        self.close()
        self.path.unlink(missing_ok=True)


def mem_available_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def process_read_bytes() -> int:
    """Bytes this process caused to be read from storage (``/proc/self/io``)."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def python_of_venv(venv: Path) -> Path:
    return venv / "bin" / "python"


def log_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
