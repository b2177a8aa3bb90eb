"""``IsolaneHiCacheStorage``: isolane's KV pool as SGLang HiCache's L3 storage backend.

SGLang loads it with its ``dynamic`` backend (docs/INTEGRATIONS.md has the command)::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
      '{"backend_name": "isolane", "module_path": "isolane.integrations.sglang",
        "class_name": "IsolaneHiCacheStorage", "interface_v1": 1,
        "isolane_pool": "/mnt/nvme2/kv"}'

``isolane_pool``: a folder or a config file (the embedded ``KVPool``; the folder must
exist and be writable), storage node URLs (comma-separated, or a list: ``RemoteKVPool``,
token from ``ISOLANE_TOKEN``), or nothing: the embedded default under ``$ISOLANE_HOME``.
On storage nodes a prompt's pages are placed as one chain across its batches by the
page keys SGLang passes before each batch (``prefix_keys``: its extra config's
``hicache_storage_pass_prefix_keys: true``; without them each batch is a chain).
``isolane_namespace`` (default ``sglang/<model>``) names the pool's namespace; its page
size and dtype are fixed by the first page stored, and a backend whose pages differ is
refused (``ConfigError``) when its host pool is registered. ``interface_v1: 1`` makes
SGLang call the zero-copy ``batch_get_v1``/``batch_set_v1``. ``isolane_memory_budget``
(bytes, default 0) sizes the embedded pool's memory tier: SGLang's host pool already
keeps hot pages in RAM in front of this backend, so by default isolane keeps none
(another copy of each page would cost RAM and a copy a page on every read and write).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any, cast

import torch

from isolane.client.kv_pool import RemoteKVPool
from isolane.config import is_node_target
from isolane.errors import ConfigError, InvalidArgumentError, MissingDependencyError
from isolane.integrations.sglang.host_pages import HostPages, dtype_name
from isolane.integrations.sglang.pages import (
    PageFormat,
    StorageScope,
    check_page_format,
    default_namespace,
    page_keys,
    scope_digest,
    sharded,
    storage_scope,
)
from isolane.integrations.sglang.pools import open_pool, pool_target, release_pool
from isolane.kvpool.api import KVPoolAPI, block_bytes_of
from isolane.kvpool.namespaces import check_namespace

try:
    from sglang.srt.mem_cache.hicache_storage import (
        HiCacheStorage,
        HiCacheStorageConfig,
        HiCacheStorageExtraInfo,
        PoolHitPolicy,
        PoolName,
        PoolTransfer,
        PoolTransferResult,
    )
except ImportError as exc:  # the backend is useless without SGLang: say how to get it
    raise MissingDependencyError("sglang", "isolane.integrations.sglang") from exc

log = logging.getLogger(__name__)

class IsolaneHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    """SGLang's ``HiCacheStorage`` on an isolane KV pool (see the module docstring).

    Built by SGLang's ``StorageBackendFactory`` as ``cls(storage_config, kwargs)``."""

    def __init__(self, storage_config: HiCacheStorageConfig,
                 kwargs: dict[str, Any] | None = None) -> None:
        config = storage_config
        settings: dict[str, Any] = dict(config.extra_config or {})
        if config.dcp_size > 1:
            raise ConfigError("dcp_size", "isolane's HiCache backend does not store "
                              "decode-context-parallel shards; run without DCP")
        if config.tp_lcm_size and config.tp_lcm_size != config.tp_size:
            raise ConfigError("tp_lcm_size", "isolane keys pages per tensor-parallel rank "
                              "of one TP size; drop tp_lcm_size from the extra config")
        self.config = config
        self.scope: StorageScope = storage_scope(
            config.model_name, tp_rank=config.tp_rank, tp_size=config.tp_size,
            pp_rank=config.pp_rank, pp_size=config.pp_size, cp_rank=config.attn_cp_rank,
            cp_size=config.attn_cp_size, is_mla=config.is_mla_model,
            writer=config.is_storage_writer)
        self.target = pool_target(settings.get("isolane_pool"))
        namespace = check_namespace(settings.get("isolane_namespace")
                                    or default_namespace(config.model_name))
        embedded = self.target is None or not is_node_target(self.target)
        if embedded and config.tp_size > 1 and not self.scope.is_mla:
            namespace = f"{namespace}@tp{config.tp_rank}of{config.tp_size}"
        # SGLang's host pool is the memory tier in front of this one: a second copy of
        # each page in isolane's memory tier would only cost RAM and a copy per page
        budget = settings.get("isolane_memory_budget", 0)
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise ConfigError("isolane_memory_budget", f"expected bytes >= 0, got {budget!r}")
        self._memory_budget: int = budget
        self.namespace = namespace
        self.pool = open_pool(self.target, namespace, budget)
        self._aux_pools: dict[str, KVPoolAPI] = {}
        self._lock = threading.Lock()
        self._host: HostPages | None = None
        self._hosts: dict[str, HostPages] = {}
        self._format: PageFormat | None = None
        self._digests: dict[tuple[str, PageFormat], bytes] = {}
        stored = self.pool.layout
        if stored is not None and len(stored[1]) == 1:  # pages stored by an earlier run
            self._format = PageFormat(stored[0], stored[1][0], self._config_layout())
        self._stats = {"get_pages": 0, "hit_pages": 0, "miss_pages": 0,
                       "unreadable_pages": 0, "read_bytes": 0, "set_pages": 0,
                       "written_bytes": 0}
        self._prefetch_pgs: list[int] = []
        self._backup_pgs: list[int] = []
        self._prefetch_bandwidth: list[float] = []
        self._backup_bandwidth: list[float] = []
        self._closed = False
        self._warned_unchained = False
        if kwargs and kwargs.get("mem_pool_host") is not None:
            self.register_mem_pool_host(kwargs["mem_pool_host"])

    # -- registration ----------------------------------------------------------------------
    def _config_layout(self) -> str:
        return "page_first" if self.config.is_page_first_layout else "layer_first"

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """The host KV pool pages are read into and written from; fixes the page format
        (ConfigError when the namespace holds pages of another size or dtype)."""
        host = HostPages(mem_pool_host)
        self._adopt(self.pool, host.format, "the registered host KV pool")
        with self._lock:
            self.mem_pool_host = mem_pool_host
            self._host = host
            self._format = host.format
            self._hosts[str(PoolName.KV)] = host

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """A host pool of the v2 transfers (KV, Mamba, SWA, indexer, ...); each pool name
        but KV keeps its pages in a namespace of its own, ``<namespace>/<pool name>``."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = str(host_pool_name)
        host = HostPages(host_pool)
        self._adopt(self._pool_for(name), host.format, f"host pool '{name}'")
        with self._lock:
            self._hosts[name] = host

    def _pool_for(self, name: str) -> KVPoolAPI:
        if name == str(PoolName.KV):
            return self.pool
        with self._lock:
            pool = self._aux_pools.get(name)
            if pool is None:
                pool = self._aux_pools[name] = open_pool(
                    self.target, check_namespace(f"{self.namespace}/{name}"),
                    self._memory_budget)
            return pool

    def _adopt(self, pool: KVPoolAPI, page: PageFormat, where: str) -> None:
        check_page_format(pool.adopt_layout(page.dtype, (page.elements,)), page,
                          pool.namespace, where)

    def _scope_of(self, name: str) -> StorageScope:
        if name == str(PoolName.MAMBA) and self.scope.is_mla:
            return sharded(self.scope, self.config.tp_rank, self.config.tp_size)
        return self.scope

    def _keys(self, names: Sequence[str], page: PageFormat, pool_name: str = "kv"
              ) -> list[bytes]:
        scope = self._scope_of(pool_name)
        tagged = page if pool_name == "kv" else PageFormat(
            page.dtype, page.elements, f"{pool_name}:{page.host_layout}")
        digest = self._digests.get((scope.model + str(scope.tp_rank), tagged))
        if digest is None:
            digest = self._digests[(scope.model + str(scope.tp_rank), tagged)] = \
                scope_digest(scope, tagged)
        return page_keys(digest, names)

    def _writes(self, pool_name: str = "kv") -> bool:
        return self._scope_of(pool_name).writer

    # -- single pages ----------------------------------------------------------------------
    def _page_format_of(self, value: torch.Tensor) -> PageFormat:
        page = PageFormat(dtype_name(value.dtype), int(value.numel()),
                          self._format.host_layout if self._format else self._config_layout())
        if self._format is None:
            self._adopt(self.pool, page, "the page being set")
            with self._lock:
                self._format = self._format or page
        if page != self._format:
            check_page_format((self._format.dtype, (self._format.elements,)), page,
                              self.namespace, "the page being set")
        return page

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None
            ) -> torch.Tensor | None:
        """The page ``key`` into ``target_location`` (a page-sized tensor, returned), or
        a new flat tensor of the page's dtype; None on a miss (or a damaged page)."""
        return self.batch_get([key], [target_location] if target_location is not None
                              else None)[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        page = self._format
        if page is None or not keys:
            return [None] * len(keys)
        pool_keys = self._keys(keys, page)
        if target_locations is None:
            dtype = getattr(torch, page.dtype)
            target_locations = [torch.empty(page.elements, dtype=dtype) for _ in keys]
        filled = self._read(self.pool, pool_keys, list(target_locations))
        return [t if ok else None for t, ok in zip(target_locations, filled, strict=True)]

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        if not keys:
            return True
        if values is None or len(values) != len(keys):
            raise InvalidArgumentError(f"batch_set got {len(keys)} keys and "
                                       f"{0 if values is None else len(values)} values")
        if not self._writes():
            return True
        pages = {self._page_format_of(v) for v in values}
        page = pages.pop()
        return all(self._write(self.pool, self._keys(keys, page),
                               [block_bytes_of(v) for v in values]))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many leading pages are stored (no data read)."""
        page = self._format
        if page is None or not keys:
            return 0
        return self._lookup(self.pool, self._keys(keys, page),
                            self._chain(self.pool, extra_info, page))

    # -- zero-copy pages of the registered host pool ---------------------------------------
    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Read pages straight into the host pool at ``host_indices`` (``page_size``
        slots a page); True for each page filled."""
        return self._host_get(self._require_host(str(PoolName.KV)), keys, host_indices,
                              str(PoolName.KV), extra_info)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Store the host pool's pages at ``host_indices``; True for each page stored
        (or already stored). A non-writer MLA rank stores nothing and reports True."""
        return self._host_set(self._require_host(str(PoolName.KV)), keys, host_indices,
                              str(PoolName.KV), extra_info)

    def _require_host(self, name: str) -> HostPages:
        host = self._hosts.get(name)
        if host is None:
            raise InvalidArgumentError(
                f"no SGLang host pool '{name}' is registered with the isolane backend; "
                "SGLang registers it (register_mem_pool_host) before moving pages")
        return host

    def _host_get(self, host: HostPages, keys: list[str], host_indices: torch.Tensor,
                  name: str, extra_info: HiCacheStorageExtraInfo | None) -> list[bool]:
        if not keys:
            return []
        starts = host.starts(host_indices, len(keys))
        pool = self._pool_for(name)
        pool_keys = self._keys(keys, host.format, name)
        chain = self._chain(pool, extra_info, host.format, name)
        begin = time.perf_counter()
        if host.views:
            filled = self._read(pool, pool_keys, host.page_views(starts), chain)
        else:  # the pool's own flat pages, copied in by its own method
            dtype = getattr(torch, host.format.dtype)
            staged = [torch.empty(host.format.elements, dtype=dtype) for _ in keys]
            filled = self._read(pool, pool_keys, staged, chain)
            for start, page, ok in zip(starts, staged, filled, strict=True):
                if ok:
                    host.host.set_from_flat_data_page(start, page)
        if name == str(PoolName.KV):
            self._record(self._prefetch_pgs, self._prefetch_bandwidth, sum(filled),
                         host.format, time.perf_counter() - begin)
        return filled

    def _host_set(self, host: HostPages, keys: list[str], host_indices: torch.Tensor,
                  name: str, extra_info: HiCacheStorageExtraInfo | None) -> list[bool]:
        if not keys:
            return []
        if not self._writes(name):
            return [True] * len(keys)
        starts = host.starts(host_indices, len(keys))
        pool = self._pool_for(name)
        begin = time.perf_counter()
        done = self._write(pool, self._keys(keys, host.format, name),
                           host.page_buffers(starts),
                           self._chain(pool, extra_info, host.format, name))
        if name == str(PoolName.KV):
            self._record(self._backup_pgs, self._backup_bandwidth, sum(done), host.format,
                         time.perf_counter() - begin)
        return done

    # -- v2: several host pools at once -----------------------------------------------------
    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None
                        ) -> PoolTransferResult:
        """The usable prefix over the KV pages and each extra pool's pages, by each
        pool's hit policy (as SGLang's own file backend decides it)."""
        kv_pages = self.batch_exists(keys, extra_info)
        hit_count: dict[str, int] = {str(PoolName.KV): kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        for transfer in pool_transfers or []:
            if not restorable:
                break
            name = str(transfer.name)
            present = self._present(name, keys[:kv_pages], extra_info)
            if transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
                boundary = present.index(False) if False in present else kv_pages
                pool_ok = set(range(1, boundary + 1))
            elif transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                trailing = max(1, len(transfer.keys) if transfer.keys else 1)
                pool_ok = {n for n in range(1, kv_pages + 1)
                           if all(present[max(0, n - trailing):n])}
                boundary = max(pool_ok, default=0)
            else:
                raise InvalidArgumentError(f"pool '{name}': hit policy "
                                           f"{transfer.hit_policy} is not supported")
            if boundary:
                hit_count[name] = boundary
            restorable = [p for p in restorable if p in pool_ok]
        return PoolTransferResult(restorable[-1] if restorable else 0, hit_count, restorable)

    def _present(self, name: str, keys: list[str],
                 extra_info: HiCacheStorageExtraInfo | None) -> list[bool]:
        host = self._hosts.get(name)
        if host is None or not keys:
            return [False] * len(keys)
        pool = self._pool_for(name)
        return self._each_present(pool, self._keys(keys, host.format, name),
                                  self._chain(pool, extra_info, host.format, name))

    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None
                     ) -> dict[str, list[bool]]:
        return {str(t.name): self._transfer(t, self._host_get, extra_info)
                for t in transfers}

    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None
                     ) -> dict[str, list[bool]]:
        return {str(t.name): self._transfer(t, self._host_set, extra_info)
                for t in transfers}

    def _transfer(self, transfer: PoolTransfer, move: Any,
                  extra_info: HiCacheStorageExtraInfo | None) -> list[bool]:
        name = str(transfer.name)
        keys = list(transfer.keys or [])
        host = self._hosts.get(name)
        if host is None or transfer.host_indices is None:
            log.error("isolane HiCache backend: pool '%s' %s", name,
                      "is not registered" if host is None else "has no host indices")
            return [False] * len(keys)
        result: list[bool] = move(host, keys, transfer.host_indices, name, extra_info)
        return result

    # -- pool calls ---------------------------------------------------------------------------
    def _chain(self, pool: KVPoolAPI, extra_info: HiCacheStorageExtraInfo | None,
               page: PageFormat, pool_name: str = "kv") -> list[bytes] | None:
        """The pool keys of the pages before this call's, from the prompt's first page
        (SGLang's ``prefix_keys``), when ``pool`` places pages by their chain (storage
        nodes): a prompt's pages, stored and read in several batches, are one chain.
        None on an embedded pool (it finds a page wherever it is)."""
        if not isinstance(pool, RemoteKVPool):
            return None
        prefix = extra_info.prefix_keys if extra_info is not None else None
        if prefix is None and len(pool.nodes) > 1 and not self._warned_unchained:
            self._warned_unchained = True
            log.warning("isolane HiCache backend on %d storage nodes without SGLang's "
                        "prefix keys: each batch of pages is placed as a chain of its own, "
                        "so pages stored in one batch and asked for in another may miss; "
                        "add \"hicache_storage_pass_prefix_keys\": true and \"interface_v1\""
                        ": 1 to --hicache-storage-backend-extra-config", len(pool.nodes))
        return self._keys(prefix, page, pool_name) if prefix else []

    @staticmethod
    def _lookup(pool: KVPoolAPI, keys: list[bytes], chain: list[bytes] | None) -> int:
        if chain is None:
            return int(pool.lookup_blocks(keys))
        return cast(RemoteKVPool, pool).lookup_blocks(keys, chain=chain)

    def _each_present(self, pool: KVPoolAPI, keys: list[bytes], chain: list[bytes] | None
                      ) -> list[bool]:
        """Whether each page is stored (not only the leading run)."""
        return [self._lookup(pool, [k], None if chain is None else chain + keys[:i]) == 1
                for i, k in enumerate(keys)]

    def _read(self, pool: KVPoolAPI, keys: list[bytes], dests: list[torch.Tensor],
              chain: list[bytes] | None = None) -> list[bool]:
        """Each page read into its destination? Reads each stored run (a page missing in
        the middle does not hide the ones after it); a page stored but unreadable (its
        checksum fails: dropped) ends its run and is counted. ``chain``: the pool keys
        before ``keys`` (``_chain``)."""
        n = len(keys)
        filled = [False] * n
        unreadable = 0
        i = 0
        while i < n:
            before = None if chain is None else chain + keys[:i]
            present = self._lookup(pool, keys[i:], before)
            if present:
                if before is None:
                    got = pool.get_blocks_into(keys[i:i + present], dests[i:i + present])
                else:
                    got = cast(RemoteKVPool, pool).get_blocks_into(
                        keys[i:i + present], dests[i:i + present], chain=before)
                filled[i:i + got] = [True] * got
                unreadable += got < present
                i += got
            i += 1  # past the page that ended the run
        hits = sum(filled)
        with self._lock:
            self._stats["get_pages"] += n
            self._stats["hit_pages"] += hits
            self._stats["miss_pages"] += n - hits
            self._stats["unreadable_pages"] += unreadable
            self._stats["read_bytes"] += sum(d.numel() * d.element_size()
                                             for d, ok in zip(dests, filled, strict=True) if ok)
        if unreadable:
            log.warning("isolane HiCache backend: %d stored pages could not be read (damaged "
                        "or evicted meanwhile); read as misses", unreadable)
        return filled

    def _write(self, pool: KVPoolAPI, keys: list[bytes], buffers: Sequence[Any],
               chain: list[bytes] | None = None) -> list[bool]:
        if chain is None:
            new = pool.put_blocks(keys, buffers)
        else:
            new = cast(RemoteKVPool, pool).put_blocks(keys, buffers, chain=chain)
        with self._lock:
            self._stats["set_pages"] += new
            if new:  # pages of one batch are one size
                self._stats["written_bytes"] += new * memoryview(buffers[0]).nbytes
        if new == len(keys):
            return [True] * len(keys)
        return self._each_present(pool, keys, chain)  # stored before, or refused

    def _record(self, pgs: list[int], bandwidth: list[float], pages: int, page: PageFormat,
                seconds: float) -> None:
        if not pages:
            return
        nbytes = pages * page.elements * getattr(torch, page.dtype).itemsize
        with self._lock:
            pgs.append(pages)
            bandwidth.append(nbytes / 1e9 / max(seconds, 1e-9))

    # -- stats and life ----------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Since the last call: ``prefetch_pgs``/``backup_pgs`` (pages a zero-copy read
        or write moved) and their ``prefetch_bandwidth``/``backup_bandwidth`` (GB/s);
        since start, ``isolane``: pages asked for (``get_pages``), read (``hit_pages``,
        ``read_bytes``), not read (``miss_pages``), of them ``unreadable_pages``: stored
        but unreadable at read time (a damaged page, or one evicted meanwhile), and pages
        newly stored (``set_pages``, ``written_bytes``; a page stored before counts 0)."""
        with self._lock:
            out: dict[str, Any] = {
                "prefetch_pgs": list(self._prefetch_pgs), "backup_pgs": list(self._backup_pgs),
                "prefetch_bandwidth": list(self._prefetch_bandwidth),
                "backup_bandwidth": list(self._backup_bandwidth),
                "isolane": dict(self._stats)}
            for kept in (self._prefetch_pgs, self._backup_pgs, self._prefetch_bandwidth,
                         self._backup_bandwidth):
                kept.clear()
        return out

    def get_stats(self) -> Any:
        """``stats()`` as SGLang's ``StorageMetrics`` (what its metrics logger takes), the
        isolane counts as its ``isolane`` attribute."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        counts = self.stats()
        metrics = StorageMetrics(prefetch_pgs=counts["prefetch_pgs"],
                                 backup_pgs=counts["backup_pgs"],
                                 prefetch_bandwidth=counts["prefetch_bandwidth"],
                                 backup_bandwidth=counts["backup_bandwidth"])
        metrics.isolane = counts["isolane"]
        return metrics

    def clear(self) -> None:
        """SGLang's "clear storage": isolane keeps stored pages (they survive restarts and
        other engines may share them); drop a namespace with ``isolane kv evict --namespace NS``."""
        log.info("isolane HiCache backend: clear() keeps the pool's pages (namespace %s)",
                 self.namespace)

    def close(self) -> None:
        """Release the pool (closed when its last backend in the process closes)."""
        if self._closed:
            return
        self._closed = True
        for pool in [self.pool, *self._aux_pools.values()]:
            release_pool(pool)
