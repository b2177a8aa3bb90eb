"""Cold prompt restores through the inference engines' own storage APIs: isolane against
each engine's own disk backend, on the same bytes, and what each serves after a restart.

    python benchmarks/bench_kv_engines.py --out docs/BENCHMARKS.md
    python benchmarks/bench_kv_engines.py --quick   # smoke test: 64 pages, 1 round

A prompt of ``--pages`` pages of ``--page-kib`` KiB (bf16 KV, 4 layers x 16 tokens) is
stored through each path, then restored with the page cache dropped (the paths taking
turns, ``--repeats`` rounds, medians; each restore checked byte for byte untimed); then
a new engine on each folder: the share of the pages it serves. Target: isolane 1.5x the
engine's own disk backend, every page served after a restart.

- **LMCache 0.5**: a ``StorageManager`` from its YAML, storing as ``LMCacheEngine.store``
  (``batched_put``) and restoring as ``retrieve`` (``get_block_mapping``, ``batched_get``)
  do: isolane's storage plugin against ``LocalDiskBackend``.
- **SGLang 0.5 HiCache** (L3 storage): backends from ``StorageBackendFactory`` restoring
  into a ``page_first`` host KV pool as its cache controller does: isolane's
  (``batch_get_v1`` into the pool) against ``HiCacheFile`` (``batch_get``, then a copy).
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
from pathlib import Path
from typing import Any

import _common as C
import _quick
import _results

C.ensure_repo_importable()
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

import torch  # noqa: E402

from tests.integrations.sglang_host import HostPool  # noqa: E402

TARGET = 1.5
LAYERS, TOKENS = 4, 16  # a page: [K/V, layers, tokens, values] of bf16
QUICK = {"pages": 64, "repeats": 1}
# isolane's path and the engine's own disk backend it is compared with
PAIRS = (("isolane (plugin)", "LMCache LocalDiskBackend"),
         ("isolane (HiCache backend)", "SGLang HiCacheFile"))
# A path into storage (``LMCachePath``, ``SGLangPath``): ``store(pages)`` (seconds, until
# stored), ``restore(pages)`` (seconds, byte-exact), ``restart()`` (a new engine on the
# same folder), ``served()`` (how many leading pages it serves).
EnginePath = Any


def as_bytes(tensor: Any) -> bytes:
    return bytes(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes())


class LMCachePath:
    """An LMCache storage manager with one disk backend: isolane's plugin or its own."""

    engine = "LMCache"

    def __init__(self, backend: str, folder: Path, page_bytes: int, n_pages: int) -> None:
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.metadata import LMCacheMetadata

        iso = backend == "isolane"
        self.name = "isolane (plugin)" if iso else "LMCache LocalDiskBackend"
        self.location = "isolane" if iso else "LocalDiskBackend"
        folder.mkdir(parents=True, exist_ok=True)
        self.metadata = LMCacheMetadata(
            model_name="bench-model", world_size=1, local_world_size=1, worker_id=0,
            local_worker_id=0, kv_dtype=torch.bfloat16, chunk_size=TOKENS,
            kv_shape=(LAYERS, 2, TOKENS, 1, page_bytes // (2 * LAYERS * TOKENS * 2)))
        # CPU memory for the stored chunks until written, and for a whole restore
        lines = [f"chunk_size: {TOKENS}", "local_cpu: false",
                 f"max_local_cpu_size: {2.2 * n_pages * page_bytes / 2**30 + 0.01:.3f}"]
        lines += ['storage_plugins: ["isolane"]', "extra_config:",
                  "  storage_plugin.isolane.module_path: isolane.integrations.lmcache",
                  "  storage_plugin.isolane.class_name: IsolaneLMCacheBackend",
                  f"  isolane.pool: {folder}"] if iso else [
                  f"local_disk: {folder}", "max_local_disk_size: 64"]
        self.config_path = folder.parent / f"{backend}.yaml"
        self.config_path.write_text("\n".join(lines) + "\n")
        self.keys, prefix = [], 0
        for i in range(n_pages):  # chunk hashes chained as a prefix's are
            prefix = hash((prefix, i))
            self.keys.append(CacheEngineKey("bench-model", 1, 0, prefix, torch.bfloat16))
        self.infos = [(k, i * TOKENS, (i + 1) * TOKENS) for i, k in enumerate(self.keys)]
        self.manager = self._open()

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
        return time.perf_counter() - start

    def restore(self, pages: list[bytes]) -> tuple[float, bool]:
        start = time.perf_counter()
        mapping = self.manager.get_block_mapping(self.infos)
        found = [k for k, _, _ in mapping.get(self.location, [])]
        objs = self.manager.batched_get(found, location=self.location) if found else []
        seconds = time.perf_counter() - start
        got = [o for o in objs if o is not None]
        exact = len(got) == len(pages) and set(mapping) == {self.location} and all(
            as_bytes(o.tensor) == page for o, page in zip(got, pages, strict=False))
        for o in got:
            o.ref_count_down()
        return seconds, exact

    def restart(self) -> None:
        self.manager.close()
        self.manager = self._open()

    def served(self) -> int:
        return len(self.manager.get_block_mapping(self.infos).get(self.location, []))

    def close(self) -> None:
        self.manager.close()


class SGLangPath:
    """SGLang HiCache's L3 storage made by its ``StorageBackendFactory``: isolane's
    backend (``dynamic``, ``interface_v1``: pages read straight into the host pool, as
    the cache controller's zero-copy path does) or SGLang's ``HiCacheFile`` (``file``:
    one file a page, read into flat pages then copied into the host pool, as the
    controller's generic path does)."""

    engine = "SGLang"

    def __init__(self, backend: str, folder: Path, page_bytes: int, n_pages: int) -> None:
        self.iso, self.folder = backend == "isolane", folder
        self.name = "isolane (HiCache backend)" if self.iso else "SGLang HiCacheFile"
        folder.mkdir(parents=True, exist_ok=True)
        # the page_first host pool SGLang's cache controller restores pages into
        self.host = HostPool(layers=LAYERS, page_size=TOKENS, pages=n_pages, heads=2,
                             head_dim=page_bytes // (2 * LAYERS * TOKENS * 2 * 2))
        self.keys = [f"{i:064x}" for i in range(n_pages)]
        self.indices = torch.arange(n_pages * TOKENS, dtype=torch.int64)
        self.storage = self._open()

    def _open(self) -> Any:
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

        extra: dict[str, Any] = {
            "backend_name": "isolane", "module_path": "isolane.integrations.sglang",
            "class_name": "IsolaneHiCacheStorage", "interface_v1": 1,
            "isolane_pool": str(self.folder), "isolane_memory_budget": 0} if self.iso else {
            "file_storage_path": str(self.folder)}
        config = HiCacheStorageConfig(
            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
            is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
            model_name="bench/model", extra_config=extra)
        storage = StorageBackendFactory.create_backend("dynamic" if self.iso else "file",
                                                       config, self.host)
        storage.register_mem_pool_host(self.host)
        return storage

    def store(self, pages: list[bytes]) -> float:
        for i, page in enumerate(pages):  # the backup writes from the host pool
            self.host.set_from_flat_data_page(i * TOKENS, torch.frombuffer(
                bytearray(page), dtype=torch.uint8).view(self.host.dtype))
        start = time.perf_counter()
        if self.iso:
            ok = self.storage.batch_set_v1(self.keys, self.indices)
        else:  # the controller's generic backup: flat pages of the host pool
            ok = self.storage.batch_set(self.keys, [
                self.host.get_data_page(i * TOKENS) for i in range(len(pages))])
        seconds = time.perf_counter() - start
        if ok is False or (not isinstance(ok, bool) and not all(ok)):
            raise RuntimeError(f"{self.name} refused the pages")
        return seconds

    def restore(self, pages: list[bytes]) -> tuple[float, bool]:
        self.host.kv_buffer.zero_()
        start = time.perf_counter()
        n = self.storage.batch_exists(self.keys)
        if self.iso:
            done = self.storage.batch_get_v1(self.keys[:n], self.indices[:n * TOKENS])
            got = done.index(False) if False in done else len(done)
        else:
            flat = [self.host.get_dummy_flat_data_page() for _ in range(n)]
            got = 0
            for page in self.storage.batch_get(self.keys[:n], flat):
                if page is None:
                    break
                self.host.set_from_flat_data_page(got * TOKENS, page)
                got += 1
        seconds = time.perf_counter() - start
        return seconds, got == len(pages) and all(
            as_bytes(self.host.get_data_page(i * TOKENS)) == page for i, page in enumerate(pages))

    def restart(self) -> None:
        self.close()
        self.storage = self._open()

    def served(self) -> int:
        return int(self.storage.batch_exists(self.keys))

    def close(self) -> None:
        if hasattr(self.storage, "close"):  # HiCacheStorage has none
            self.storage.close()


def measure(paths: list[EnginePath], pages: list[bytes], repeats: int) -> dict[str, Any]:
    """Every path stores the pages, restores them ``repeats`` times (turns alternating),
    then restarts: the runs as ``headline_rows`` reads them."""
    runs = {p.name: {"name": p.name, "engine": p.engine, "restore_s": [], "exact": []}
            for p in paths}
    for p in paths:
        runs[p.name]["store_s"] = p.store(pages)
        if p.served() != len(pages):
            raise RuntimeError(f"{p.name} holds {p.served()} of {len(pages)} pages")
    cold = True
    for round_no in range(repeats):
        for p in paths if round_no % 2 == 0 else paths[::-1]:
            cold = C.drop_page_cache() and cold
            seconds, exact = p.restore(pages)
            runs[p.name]["restore_s"].append(seconds)
            runs[p.name]["exact"].append(exact)
    for p in paths:
        p.restart()
        runs[p.name]["after_restart"] = p.served()
    return {"pages": len(pages), "page_bytes": len(pages[0]), "cold": cold,
            "results": list(runs.values())}


def headline_rows(raw: dict[str, Any], where: dict[str, str]) -> list[_results.Result]:
    """Per engine: isolane's cold restore against the engine's own disk backend (target
    1.5x), and the share of the pages each serves after a restart (target: all)."""
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
        ratio, engine = peer_ms / ours_ms, ours["engine"]
        rows.append(_results.Result(
            measure=f"{engine}: cold restore of a {pages}-page prompt ({kib} KiB pages), "
                    f"{ours_name}", value=round(ours_ms, 2), unit="ms", peer=peer_name,
            peer_value=round(peer_ms, 2), ratio=round(ratio, 2), target=f"≥ {TARGET:g}x",
            met=ratio >= TARGET, why=warm if ratio < TARGET else None, **common))
        ours_pct, peer_pct = (r["after_restart"] / pages * 100 for r in (ours, peer))
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
    parser.add_argument("--dir", type=Path, default=C.REPO_ROOT / ".bench" / "kv-engines",
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
    import numpy as np
    import sglang
    args.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kv-engines-", dir=args.dir))
    rng = np.random.default_rng(0)
    pages = [rng.integers(0, 256, page_bytes, dtype=np.uint8).tobytes()
             for _ in range(args.pages)]
    paths: list[EnginePath] = []
    try:
        for kind, backends in ((LMCachePath, ("isolane", "local_disk")),
                               (SGLangPath, ("isolane", "file"))):
            paths += [kind(b, work / f"{kind.engine.lower()}-{b}", page_bytes, args.pages)
                      for b in backends]
        raw = measure(paths, pages, args.repeats)
    finally:
        for p in paths:
            p.close()
        shutil.rmtree(work, ignore_errors=True)
    facts = C.run_facts(args.dir, {"torch": torch.__version__, "lmcache": lmcache.__version__,
                                 "sglang": sglang.__version__})
    rows = headline_rows(raw, facts)  # raises when a restore was not byte-exact
    body = "\n".join([*C.report_head("KV restores through the engines' storage APIs "
                                     "(`benchmarks/bench_kv_engines.py`)", facts),
                      f"{args.pages} pages of {args.page_kib} KiB, {args.repeats} rounds "
                      "(medians), every restore compared byte for byte." + (
                          "" if raw["cold"] else " Not run as root: the page cache was not "
                          "dropped, these restores are **warm**.")])
    C.publish("kv_engines", body, rows, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
