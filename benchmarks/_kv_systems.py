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
WIDE_READERS = 8  # _restore_into_wide: the limit's O_DIRECT threads


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
        self.readers = self.config.device_groups["kv"].threads  # the read lane's threads
        self._direct_pool = ThreadPoolExecutor(self.readers, thread_name_prefix="bench-ranges")
        self.scheduler = LaneScheduler(self.config)  # its own: the registry keys by devices
        self.folder = folder
        self.corpus = corpus
        self.geometry = corpus.geometry
        self.base = base
        self.dest = dest
        self.segment_bytes = segment_bytes
        self.keys: dict[int, list[bytes]] = {}
        self.pool: Any = None
        self._ring: tuple[Any, D.Bytes] | None = None  # for the stored-range reads
        self._ring_spans: list[tuple[int, int]] = []  # (ring offset, file offset) a range
        self._wide: Any = None  # the LaneScheduler of _restore_into_wide, made on first use
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

    def _stored_ranges(self, prompt: int, n: int) -> list[tuple[Path, int, int, list[Any]]]:
        """(segment file, start, end, locations) of the byte ranges the prompt's first
        ``n`` blocks occupy in isolane's segment files, as its reads coalesce them."""
        from isolane.kvpool.log.coalesce import coalesce_ranges

        seg = self.pool.logs[0]
        out = []
        for r in coalesce_ranges(seg.locate_many(self.prompt_keys(prompt)[:n])):
            out.append((segment_path(seg, r.segment_id), r.start, r.end,
                        [loc for _, loc in r.members]))
        return out

    def _restore_ranges(self, prompt: int, n: int, sample: int | None = None) -> float:
        """The same bytes isolane reads for this restore, read plainly: one buffered
        ``preadv`` per stored range (after its file is opened), in order, no checks and
        no scatter: what the stored layout costs the disk."""
        ranges = self._stored_ranges(prompt, n)
        need = sum(end - start for _, start, end, _ in ranges)
        if self._ring is None or len(self._ring[1]) < need:
            self._ring = D.aligned_buffer(need)
        view = memoryview(self._ring[0])
        start_t = time.perf_counter()
        at = 0
        for path, start, end, _ in ranges:
            fd = os.open(path, os.O_RDONLY)
            try:
                read_fully(fd, view[at:at + end - start], start)
            finally:
                os.close(fd)
            at += end - start
        return time.perf_counter() - start_t

    def _check_ranges(self, prompt: int, n: int, sample: int | None) -> str | None:
        assert self._ring is not None
        ring, at, pos = self._ring[1], 0, 0
        want_ids = self.corpus.prompt_ids(prompt, n)
        b = self.geometry.block_bytes
        for _, start, end, locs in self._stored_ranges(prompt, n):
            for loc in locs:
                got = ring[at + loc.value_offset - start:at + loc.value_end - start]
                if not np.array_equal(got, D.block_view(self.base, want_ids[pos], b)):
                    return f"block {pos}: the stored range does not hold its value"
                pos += 1
            at += end - start
        return None

    def _restore_ranges_direct(self, prompt: int, n: int, sample: int | None = None) -> float:
        """The same stored ranges read the way isolane's cold reads now go: widened to
        pages, each cut into ``readers`` equal page-aligned O_DIRECT requests, all on a
        pool of ``readers`` threads (the read lane's count), into a pre-touched aligned
        buffer; no checks and no copy out: the bound of isolane's O_DIRECT reads."""
        ranges = self._stored_ranges(prompt, n)
        spans = [(path, start // PAGE * PAGE, -(-end // PAGE) * PAGE)
                 for path, start, end, _ in ranges]
        need = sum(hi - lo for _, lo, hi in spans)
        if self._ring is None or len(self._ring[1]) < need:
            self._ring = D.aligned_buffer(need)
        view = memoryview(self._ring[0])
        requests: list[tuple[int, int, int, int]] = []  # (span, file offset, at, bytes)
        self._ring_spans, at = [], 0
        for index, (_, lo, hi) in enumerate(spans):
            self._ring_spans.append((at, lo))
            step = max(PAGE, -(-(hi - lo) // self.readers) // PAGE * PAGE)
            for off in range(lo, hi, step):
                requests.append((index, off, at + off - lo, min(step, hi - off)))
            at += hi - lo
        start_t = time.perf_counter()
        fds = [os.open(path, os.O_RDONLY | O_DIRECT) for path, _, _ in spans]
        try:
            def one(req: tuple[int, int, int, int]) -> None:
                index, off, to, length = req
                read_until_eof(fds[index], view[to:to + length], off)

            list(self._direct_pool.map(one, requests))
        finally:
            for fd in fds:
                os.close(fd)
        return time.perf_counter() - start_t

    def _check_ranges_direct(self, prompt: int, n: int, sample: int | None) -> str | None:
        assert self._ring is not None
        ring, pos = self._ring[1], 0
        want_ids = self.corpus.prompt_ids(prompt, n)
        b = self.geometry.block_bytes
        for (at, lo), (_, _, _, locs) in zip(self._ring_spans, self._stored_ranges(prompt, n),
                                             strict=True):
            for loc in locs:
                got = ring[at + loc.value_offset - lo:at + loc.value_end - lo]
                if not np.array_equal(got, D.block_view(self.base, want_ids[pos], b)):
                    return f"block {pos}: the O_DIRECT read does not hold its value"
                pos += 1
        return None

    def _restore_pieces_checked(self, prompt: int, n: int, sample: int | None = None
                                ) -> float:
        """The floor of a checked cold restore in Python: the pieces isolane's planner
        cuts for this restore (located and cut outside the timing), each read O_DIRECT
        (widened to pages) on a plain thread pool of the read lane's size, the last on
        the calling thread, into a pre-touched aligned buffer; then on the same thread
        each record checked (``records.verify_record``) and its value copied into the
        ``get_into`` tensor (``reader.TensorTargets``), as a lane thread does. No lane,
        budget, page-cache probe, bounce pool or planning inside the timing."""
        from isolane.kvpool.api import BlockViews
        from isolane.kvpool.log.reader import TensorTargets
        from isolane.kvpool.log.records import verify_record

        g, seg = self.geometry, self.pool.logs[0]
        pieces = [piece for _log, piece in self.pool.disk.plan_read(
            self.prompt_keys(prompt)[:n])]
        spans = [(p.start // PAGE * PAGE, -(-p.end // PAGE) * PAGE) for p in pieces]
        need = sum(hi - lo for lo, hi in spans)
        if self._ring is None or len(self._ring[1]) < need:
            self._ring = D.aligned_buffer(need)
        view = memoryview(self._ring[0])
        starts = np.cumsum([0] + [hi - lo for lo, hi in spans]).tolist()
        paths = {p.segment_id: segment_path(seg, p.segment_id) for p in pieces}
        out = self._out(n)
        start_t = time.perf_counter()
        fds = {sid: os.open(path, os.O_RDONLY | O_DIRECT) for sid, path in paths.items()}
        try:
            targets = TensorTargets(BlockViews(out, g.token_dim, g.chunk_tokens, n))

            def one(i: int) -> None:
                piece, (lo, hi), at = pieces[i], spans[i], starts[i]
                read_until_eof(fds[piece.segment_id], view[at:at + hi - lo], lo)
                run = view[at + piece.start - lo:at + piece.end - lo]
                for position, loc in piece.members:
                    value, k = verify_record(run, piece.start, loc), 0
                    for part in targets[position]:
                        part[:] = value[k:k + len(part)]
                        k += len(part)

            futures = [self._direct_pool.submit(one, i) for i in range(len(pieces) - 1)]
            one(len(pieces) - 1)
            for fut in futures:
                fut.result()
        finally:
            for fd in fds.values():
                os.close(fd)
        return time.perf_counter() - start_t

    def _restore_into_cached(self, prompt: int, n: int, sample: int | None = None) -> float:
        """``get_into`` with the pool's logs reading through the page cache for this
        call (``direct_io`` off, the way every read went before the 'cold' policy)."""
        logs = self.pool.logs
        modes = [lg.direct_io for lg in logs]
        for lg in logs:
            lg.direct_io = "off"
        try:
            return self._restore_into(prompt, n, sample)
        finally:
            for lg, mode in zip(logs, modes, strict=True):
                lg.direct_io = mode

    def _restore_into_wide(self, prompt: int, n: int, sample: int | None = None) -> float:
        """``get_into`` on a read lane of ``WIDE_READERS`` threads for this call (the
        read group's ``threads``; the default is 4): as many requests in flight as the
        limit's O_DIRECT reader keeps, pieces cut for that many threads."""
        from isolane.lanes.assignment import JobKind
        from isolane.lanes.scheduler import LaneScheduler

        if self._wide is None:
            from isolane.config import config_from_dict

            group = {"role": "read", "devices": [str(self.folder)], "threads": WIDE_READERS,
                     "inflight_bytes": self.inflight_bytes}
            self._wide = LaneScheduler(config_from_dict({"device_groups": {"kv": group}}))
        disk = self.pool.disk
        lane, readers = disk._read_lane, disk._readers
        disk._read_lane, disk._readers = self._wide.lane(JobKind.KV_GET), WIDE_READERS
        try:
            return self._restore_into(prompt, n, sample)
        finally:
            disk._read_lane, disk._readers = lane, readers

    def restorers(self) -> list[Restorer]:
        return [
            Restorer("isolane:ranges", "isolane's stored ranges, plain reads (bound)", (
                "the byte ranges isolane's segment files hold the N blocks in (located "
                "and coalesced outside the timing), one buffered `preadv` each into a "
                "pre-touched buffer, no record checks and no scatter: what the stored "
                "layout costs the disk, the bound of isolane's own reads"),
                self._restore_ranges, self._check_ranges,
                extra_bytes=lambda n: n * (self.geometry.block_bytes + 128)),
            Restorer("isolane:ranges_direct",
                     "isolane's stored ranges, O_DIRECT, lane-many in flight (bound)", (
                         "the same ranges widened to pages and cut into as many equal "
                         "O_DIRECT requests as the read lane has threads, read on that "
                         "many threads into a pre-touched aligned buffer; no checks, no "
                         "copy out: the bound of isolane's cold reads, which go O_DIRECT"),
                     self._restore_ranges_direct, self._check_ranges_direct,
                     extra_bytes=lambda n: n * (self.geometry.block_bytes + 128) + 2 * PAGE),
            Restorer("isolane:pieces_checked",
                     "isolane's pieces, O_DIRECT, checked and copied on plain threads "
                     "(floor)", (
                         "the pieces isolane's planner cuts (outside the timing), each "
                         "read O_DIRECT on a plain pool of the read lane's thread count "
                         "(the last on the calling thread), then its records checked and "
                         "the values copied into the get_into tensor on the same thread: "
                         "the floor of a checked restore in Python, without the lane"),
                     self._restore_pieces_checked, self._check_into,
                     extra_bytes=lambda n: n * (self.geometry.block_bytes + 128) + 2 * PAGE),
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
            Restorer("isolane:get_into_cached",
                     "isolane get_into, reads through the page cache (direct_io off)", (
                         "the same call with the pool's segment logs set to `direct_io` "
                         "'off' for it: every read buffered, the path before the 'cold' "
                         "policy; the effect of that policy, same run"),
                     self._restore_into_cached, self._check_into,
                     extra_bytes=lambda n: n * self.geometry.block_bytes),
            Restorer("isolane:get_into_wide",
                     f"isolane get_into, {WIDE_READERS} read-lane threads", (
                         f"the same call on a read lane of {WIDE_READERS} threads (read "
                         f"group `threads: {WIDE_READERS}`; the default is "
                         f"{self.readers}), pieces cut for that many: the requests in "
                         "flight of the limit's O_DIRECT reader"),
                     self._restore_into_wide, self._check_into,
                     extra_bytes=lambda n: n * self.geometry.block_bytes),
        ]

    def stats(self) -> dict[str, Any]:
        return dict(self.pool.stats())

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        if self._wide is not None:
            self._wide.close()
            self._wide = None

    def remove(self) -> None:
        self.close()
        self._direct_pool.shutdown(wait=True)
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
