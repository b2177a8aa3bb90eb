"""Cold prompt restores through the inference engines' own storage APIs: isolane against
each engine's own disk backend, on the same bytes, and what each serves after a restart.

    python benchmarks/bench_kv_engines.py --out docs/BENCHMARKS.md
    python benchmarks/bench_kv_engines.py --quick   # smoke test: 64 pages, 1 round

A prompt of ``--pages`` pages of ``--page-kib`` KiB (bf16 KV of 4 layers x 16 tokens) is
stored through each path, then restored with the page cache dropped (root; else the
report says the restores were warm), the paths in turn within each of ``--repeats``
rounds (medians), each restore checked byte for byte outside the timing. Then a new
engine is opened on each folder: the share of the pages it still serves.

- **LMCache 0.5**: a ``StorageManager`` from its YAML, storing as ``LMCacheEngine.store``
  does (``batched_put`` of ``LocalCPUBackend`` memory objects) and restoring as
  ``retrieve`` does (``get_block_mapping``, then ``batched_get``). isolane's storage
  plugin against LMCache's ``LocalDiskBackend`` (``disk_io_threads`` 4, its default).
- **SGLang 0.5 HiCache** (its L3 storage API): backends from its
  ``StorageBackendFactory``, restoring into a ``page_first`` host KV pool as its cache
  controller does: ``IsolaneHiCacheStorage`` (``batch_get_v1`` straight into the pool)
  against ``HiCacheFile`` (``batch_get`` into flat pages, then copied into the pool).

Targets: isolane at least 1.5x the engine's own disk backend on the cold restore, and
every page served after a restart.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _quick
import _results
from _common import (
    REPO_ROOT,
    command_line,
    drop_page_cache,
    ensure_repo_importable,
    fmt_ratio,
    machine_description,
    markdown_table,
    now_text,
    print_report,
)

ensure_repo_importable()
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

SECTION = "kv-engines"
BENCH = "kv_engines"  # benchmarks/results/kv_engines.json
TARGET = 1.5
LAYERS, TOKENS = 4, 16  # a page: [K/V, layers, tokens, values] of bf16
QUICK = {"pages": 64, "repeats": 1}
# isolane's path and the engine's own disk backend it is compared with
PAIRS = (("isolane (plugin)", "LMCache LocalDiskBackend"),
         ("isolane (HiCache backend)", "SGLang HiCacheFile"))


@dataclass
class Restore:
    seconds: float
    pages: int
    exact: bool


@dataclass
class PathResult:
    name: str
    engine: str
    restores: list[Restore] = field(default_factory=list)
    store_s: float = 0.0
    after_restart: int = 0
    pages: int = 0

    @property
    def median_s(self) -> float:
        return statistics.median(r.seconds for r in self.restores)


# A path into storage (``LMCachePath``, ``SGLangPath``): ``store(pages)`` stores every
# page and waits until the store holds them (seconds); ``restore(pages)`` restores every
# page, timed, then checks them untimed; ``restart()`` closes the engine and opens a new
# one on the same folder; ``served()`` is how many leading pages it serves now.
EnginePath = Any


# -- LMCache -------------------------------------------------------------------------------
class LMCachePath:
    """An LMCache storage manager with one disk backend: the isolane plugin or LMCache's
    own LocalDiskBackend."""

    engine = "LMCache"

    def __init__(self, backend: str, folder: Path, page_bytes: int, n_pages: int) -> None:
        import torch
        from lmcache.v1.metadata import LMCacheMetadata

        self.backend, self.folder = backend, folder
        self.name = "isolane (plugin)" if backend == "isolane" else "LMCache LocalDiskBackend"
        self.location = "isolane" if backend == "isolane" else "LocalDiskBackend"
        folder.mkdir(parents=True, exist_ok=True)
        values = page_bytes // (2 * LAYERS * TOKENS * 2)
        self.metadata = LMCacheMetadata(
            model_name="bench-model", world_size=1, local_world_size=1, worker_id=0,
            local_worker_id=0, kv_dtype=torch.bfloat16,
            kv_shape=(LAYERS, 2, TOKENS, 1, values), chunk_size=TOKENS)
        # CPU memory for the stored chunks until written, and for a whole restore
        self.cpu_gb = 2.2 * n_pages * page_bytes / 2**30 + 0.01
        self.config_path = folder.parent / f"{backend}.yaml"
        self.config_path.write_text(self._yaml())
        self.keys = self._keys(n_pages)
        self.manager = self._open()

    def _yaml(self) -> str:
        lines = [f"chunk_size: {TOKENS}", "local_cpu: false",
                 f"max_local_cpu_size: {self.cpu_gb:.3f}"]
        if self.backend == "isolane":
            lines += ['storage_plugins: ["isolane"]', "extra_config:",
                      "  storage_plugin.isolane.module_path: isolane.integrations.lmcache",
                      "  storage_plugin.isolane.class_name: IsolaneLMCacheBackend",
                      f"  isolane.pool: {self.folder}"]
        else:
            lines += [f"local_disk: {self.folder}", "max_local_disk_size: 64"]
        return "\n".join(lines) + "\n"

    def _keys(self, n: int) -> list[Any]:
        import torch
        from lmcache.utils import CacheEngineKey

        md, keys, prefix = self.metadata, [], 0
        for i in range(n):
            prefix = hash((prefix, i))
            keys.append(CacheEngineKey(md.model_name, 1, 0, prefix, torch.bfloat16))
        return keys

    def _open(self) -> Any:
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.event_manager import EventManager
        from lmcache.v1.storage_backend.storage_manager import StorageManager

        config = LMCacheEngineConfig.from_file(str(self.config_path))
        manager = StorageManager(config, self.metadata, EventManager())
        if self.location not in manager.storage_backends:
            manager.close()
            raise RuntimeError(f"LMCache did not create {self.location} (see its log)")
        return manager

    def store(self, pages: list[bytes]) -> float:
        import torch
        from lmcache.v1.memory_management import MemoryFormat

        md = self.metadata
        start = time.perf_counter()
        objs = []
        for page in pages:
            obj = self.manager.allocate(md.get_shapes(TOKENS), md.get_dtypes(),
                                        fmt=MemoryFormat.KV_2LTD)
            if obj is None or obj.tensor is None:
                raise RuntimeError("LMCache's CPU pool is full")
            obj.tensor.view(-1).view(torch.uint8).copy_(
                torch.frombuffer(bytearray(page), dtype=torch.uint8))
            objs.append(obj)
        self.manager.batched_put(self.keys[:len(pages)], objs)
        backend = self.manager.storage_backends[self.location]
        for key in self.keys:  # each put finished (LMCache's own in-flight check)
            while backend.exists_in_put_tasks(key):
                time.sleep(0.002)
        seconds = time.perf_counter() - start
        if self.served() != len(pages):
            raise RuntimeError(f"{self.name} holds {self.served()} of {len(pages)} pages")
        return seconds

    def _infos(self) -> list[tuple[Any, int, int]]:
        return [(k, i * TOKENS, (i + 1) * TOKENS) for i, k in enumerate(self.keys)]

    def restore(self, pages: list[bytes]) -> Restore:
        import torch

        start = time.perf_counter()
        mapping = self.manager.get_block_mapping(self._infos())
        found = [k for k, _, _ in mapping.get(self.location, [])]
        objs = self.manager.batched_get(found, location=self.location) if found else []
        seconds = time.perf_counter() - start
        got = [o for o in objs if o is not None]
        exact = len(got) == len(pages) and set(mapping) == {self.location} and all(
            o.tensor.view(-1).view(torch.uint8).numpy().tobytes() == page
            for o, page in zip(got, pages, strict=False))
        for o in got:
            o.ref_count_down()
        return Restore(seconds, len(got), exact)

    def restart(self) -> None:
        self.manager.close()
        self.manager = self._open()

    def served(self) -> int:
        mapping = self.manager.get_block_mapping(self._infos())
        return len(mapping.get(self.location, []))

    def close(self) -> None:
        self.manager.close()


# -- SGLang --------------------------------------------------------------------------------
class HostKVPool:
    """A host KV pool with the page API and ``page_first`` buffer of SGLang 0.5's
    ``MHATokenToKVPoolHost`` (``kv_buffer`` [K/V, slots, layers, heads, head_dim]), the
    memory SGLang's cache controller restores pages into. SGLang's own class cannot be
    imported on the CPU wheel (its configs import a CUDA torchvision)."""

    layout, mla, device, pin_memory = "page_first", False, "cpu", False

    def __init__(self, pages: int, page_bytes: int) -> None:
        import torch

        self.layer_num, self.page_size, self.head_num = LAYERS, TOKENS, 2
        self.head_dim = page_bytes // (2 * LAYERS * TOKENS * 2 * 2)
        self.page_num, self.size, self.dtype = pages, pages * TOKENS, torch.bfloat16
        self.kv_buffer = torch.zeros((2, self.size, self.layer_num, self.head_num,
                                      self.head_dim), dtype=self.dtype)

    def get_data_page(self, index: int, flat: bool = True) -> Any:
        page = self.kv_buffer[:, index:index + self.page_size, :, :, :]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> Any:
        import torch

        return torch.zeros((2, self.layer_num, self.page_size, self.head_num, self.head_dim),
                           dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page: Any) -> None:
        page = self.get_data_page(index, flat=False)
        page.copy_(data_page.reshape(page.shape))

    def page_bytes(self, page: int) -> bytes:
        import torch

        flat = self.get_data_page(page * self.page_size).contiguous()
        return bytes(flat.view(torch.uint8).numpy().tobytes())

    def fill(self, pages: list[bytes]) -> None:
        import torch

        for i, page in enumerate(pages):
            self.set_from_flat_data_page(i * self.page_size, torch.frombuffer(
                bytearray(page), dtype=torch.uint8).view(self.dtype))


class SGLangPath:
    """SGLang HiCache's L3 storage made by its ``StorageBackendFactory``: isolane's
    backend (``dynamic``, ``interface_v1``: pages read straight into the host pool, as
    the cache controller's zero-copy path does) or SGLang's ``HiCacheFile`` (``file``:
    one file a page, read into flat pages then copied into the host pool, as the
    controller's generic path does)."""

    engine = "SGLang"

    def __init__(self, backend: str, folder: Path, page_bytes: int, n_pages: int) -> None:
        import torch

        self.backend, self.folder = backend, folder
        self.name = "isolane (HiCache backend)" if backend == "isolane" else "SGLang HiCacheFile"
        folder.mkdir(parents=True, exist_ok=True)
        self.host = HostKVPool(n_pages, page_bytes)
        self.keys = [f"{i:064x}" for i in range(n_pages)]
        self.indices = torch.arange(n_pages * TOKENS, dtype=torch.int64)
        self.storage = self._open()

    def _open(self) -> Any:
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

        if self.backend == "isolane":
            extra = {"backend_name": "isolane", "module_path": "isolane.integrations.sglang",
                     "class_name": "IsolaneHiCacheStorage", "interface_v1": 1,
                     "isolane_pool": str(self.folder), "isolane_memory_budget": 0}
            kind = "dynamic"
        else:
            extra, kind = {"file_storage_path": str(self.folder)}, "file"
        config = HiCacheStorageConfig(
            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
            is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
            model_name="bench/model", extra_config=extra)
        storage = StorageBackendFactory.create_backend(kind, config, self.host)
        storage.register_mem_pool_host(self.host)
        return storage

    def store(self, pages: list[bytes]) -> float:
        self.host.fill(pages)  # the backup writes from the host pool
        start = time.perf_counter()
        if self.backend == "isolane":
            ok = self.storage.batch_set_v1(self.keys, self.indices)
        else:  # the controller's generic backup: flat pages of the host pool
            ok = self.storage.batch_set(self.keys, [
                self.host.get_data_page(i * TOKENS) for i in range(len(pages))])
            ok = [ok] * len(pages) if isinstance(ok, bool) else ok
        seconds = time.perf_counter() - start
        if not all(ok) or self.served() != len(pages):
            raise RuntimeError(f"{self.name} holds {self.served()} of {len(pages)} pages")
        return seconds

    def restore(self, pages: list[bytes]) -> Restore:
        self.host.kv_buffer.zero_()
        start = time.perf_counter()
        n = self.storage.batch_exists(self.keys)
        if self.backend == "isolane":
            done = self.storage.batch_get_v1(self.keys[:n], self.indices[:n * TOKENS])
            got = done.index(False) if False in done else len(done)
        else:
            flat = [self.host.get_dummy_flat_data_page() for _ in range(n)]
            data = self.storage.batch_get(self.keys[:n], flat)
            got = 0
            for i, page in enumerate(data):
                if page is None:
                    break
                self.host.set_from_flat_data_page(i * TOKENS, page)
                got += 1
        seconds = time.perf_counter() - start
        exact = got == len(pages) and all(self.host.page_bytes(i) == page
                                          for i, page in enumerate(pages))
        return Restore(seconds, got, exact)

    def restart(self) -> None:
        self.close()
        self.storage = self._open()

    def served(self) -> int:
        return int(self.storage.batch_exists(self.keys))

    def close(self) -> None:
        close = getattr(self.storage, "close", None)  # HiCacheStorage has none
        if close is not None:
            close()


def sglang_paths(folder: Path, page_bytes: int, n_pages: int) -> tuple[list[EnginePath], str]:
    """The SGLang HiCache pair, or none and the reason."""
    try:
        import isolane.integrations.sglang  # noqa: F401
    except ImportError as exc:
        return [], f"SGLang rows left out: `isolane.integrations.sglang` does not import ({exc})"
    return [SGLangPath("isolane", folder / "sglang-isolane", page_bytes, n_pages),
            SGLangPath("file", folder / "sglang-file", page_bytes, n_pages)], ""


# -- the run -------------------------------------------------------------------------------
def make_pages(n: int, page_bytes: int, seed: int = 0) -> list[bytes]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, page_bytes, dtype=np.uint8).tobytes() for _ in range(n)]


def measure(paths: list[EnginePath], pages: list[bytes], repeats: int
            ) -> tuple[list[PathResult], bool]:
    results = {p.name: PathResult(p.name, p.engine, pages=len(pages)) for p in paths}
    for p in paths:
        results[p.name].store_s = p.store(pages)
    cold = True
    for round_no in range(repeats):
        order = paths if round_no % 2 == 0 else paths[::-1]
        for p in order:
            cold = drop_page_cache() and cold
            results[p.name].restores.append(p.restore(pages))
    for p in paths:
        p.restart()
        results[p.name].after_restart = p.served()
    return [results[p.name] for p in paths], cold


def report(results: list[PathResult], pairs: list[tuple[str, str]], cold: bool,
           page_bytes: int, notes: list[str]) -> str:
    by_name = {r.name: r for r in results}
    rows = []
    for r in results:
        runs = ", ".join(f"{x.seconds * 1000:.1f}" for x in r.restores)
        nbytes = r.pages * page_bytes
        rows.append([r.engine, r.name, f"{r.median_s * 1000:.1f}",
                     f"{nbytes / r.median_s / 1e9:.2f}", runs,
                     "yes" if all(x.exact for x in r.restores) else "NO",
                     f"{r.after_restart}/{r.pages} ({r.after_restart / r.pages * 100:.0f} %)"])
    lines = [markdown_table(["engine", "path", "cold restore ms (median)", "GB/s",
                             "runs ms", "bit-exact", "served after a restart"], rows), ""]
    ratio_rows = []
    for ours, peer in pairs:
        if ours in by_name and peer in by_name:
            value = by_name[peer].median_s / by_name[ours].median_s
            ratio_rows.append([f"{ours} vs {peer}", fmt_ratio(value),
                               f">= {TARGET:.1f}x", "met" if value >= TARGET else "not met"])
    lines += [markdown_table(["cold restore", "speed-up", "target", ""], ratio_rows), ""]
    if not cold:
        lines.append("Not run as root: the page cache was not dropped, these restores are "
                     "**warm**.")
    lines += notes
    return "\n".join(lines)


def headline_rows(raw: dict[str, Any], where: dict[str, str]) -> list[_results.Result]:
    """The page's rows from ``raw`` (the runs as ``main`` gathers them), per engine whose pair ran:
    isolane's cold restore against the engine's own disk backend (target 1.5x), and the
    share of the pages each serves after a restart (target: all). ``where``: machine,
    date and command."""
    by_name = {r["name"]: r for r in raw["results"]}
    inexact = sorted(name for name, r in by_name.items() if not all(r["exact"]))
    if inexact:
        raise ValueError(f"restores through {', '.join(inexact)} were not byte-exact; "
                         "nothing recorded")
    pages, kib = raw["pages"], raw["page_bytes"] // 1024
    common: dict[str, Any] = dict(area="KV pool", **where)
    warm = None if raw["cold"] else (
        "not root: the page cache was not dropped, these restores are warm")
    rows = []
    for ours_name, peer_name in PAIRS:
        ours, peer = by_name.get(ours_name), by_name.get(peer_name)
        if ours is None or peer is None:
            continue
        ours_ms = statistics.median(ours["restore_s"]) * 1000
        peer_ms = statistics.median(peer["restore_s"]) * 1000
        ratio = peer_ms / ours_ms
        engine = ours["engine"]
        rows.append(_results.Result(
            measure=f"{engine}: cold restore of a {pages}-page prompt ({kib} KiB pages), "
                    f"{ours_name}", value=round(ours_ms, 2), unit="ms", peer=peer_name,
            peer_value=round(peer_ms, 2), ratio=round(ratio, 2), target=f"≥ {TARGET:g}x",
            met=ratio >= TARGET, why=warm if ratio < TARGET else None, **common))
        ours_pct = ours["after_restart"] / pages * 100
        peer_pct = peer["after_restart"] / pages * 100
        rows.append(_results.Result(
            measure=f"{engine}: pages served after a restart, {ours_name}",
            value=round(ours_pct, 1), unit="%", peer=peer_name, peer_value=round(peer_pct, 1),
            ratio=round(ours_pct - peer_pct, 1), ratio_unit="points", target="100 %",
            met=ours["after_restart"] == pages, **common))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", type=int, default=1024)
    parser.add_argument("--page-kib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=REPO_ROOT / ".bench" / "kv-engines",
                        help="scratch folder (its contents are removed at the end)")
    parser.add_argument("--out", type=Path,
                        help="docs/BENCHMARKS.md: record the rows in results/kv_engines.json "
                             "and render the page; another file: write the report's section")
    _quick.add_argument(parser)
    args = parser.parse_args(argv)
    if args.quick:
        _quick.enter(args, parser, files=())
        vars(args).update(QUICK)
    page_bytes = args.page_kib * 1024
    if page_bytes % (2 * LAYERS * TOKENS * 2):
        parser.error(f"--page-kib must make pages of a multiple of {2 * LAYERS * TOKENS * 2} "
                     "bytes")
    logging.getLogger("isolane").setLevel(logging.WARNING)
    import lmcache
    import torch

    args.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kv-engines-", dir=args.dir))
    pages = make_pages(args.pages, page_bytes)
    paths: list[EnginePath] = []
    try:
        paths += [LMCachePath("isolane", work / "lmcache-isolane", page_bytes, args.pages),
                  LMCachePath("local_disk", work / "lmcache-local-disk", page_bytes,
                              args.pages)]
        extra, note = sglang_paths(work, page_bytes, args.pages)
        paths += extra
        results, cold = measure(paths, pages, args.repeats)
    finally:
        for p in paths:
            p.close()
        shutil.rmtree(work, ignore_errors=True)

    packages = {"torch": torch.__version__, "lmcache": lmcache.__version__}
    if any(p.engine == "SGLang" for p in paths):
        import sglang

        packages["sglang"] = sglang.__version__
    where = {"machine": machine_description(args.dir, packages), "date": now_text(),
             "command": command_line()}
    body = "\n".join([
        "## KV restores through the engines' storage APIs (`benchmarks/bench_kv_engines.py`)",
        "", f"Command: `{where['command']}`  ", f"Date: {where['date']}  ",
        f"Machine: {where['machine']}", "",
        f"{args.pages} pages of {args.page_kib} KiB, {args.repeats} rounds (medians).", "",
        report(results, list(PAIRS), cold, page_bytes, [note] if note else [])])
    raw = {"pages": args.pages, "page_bytes": page_bytes, "cold": cold,
           "results": [{"name": r.name, "engine": r.engine, "store_s": r.store_s,
                        "restore_s": [x.seconds for x in r.restores],
                        "exact": [x.exact for x in r.restores],
                        "after_restart": r.after_restart} for r in results]}
    print_report(body, args.out, SECTION)
    ok = all(all(x.exact for x in r.restores) for r in results)
    if ok and args.out and _results.is_page(args.out):
        _results.write_results(BENCH, headline_rows(raw, where))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
