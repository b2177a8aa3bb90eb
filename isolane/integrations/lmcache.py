"""isolane as an LMCache storage backend plugin (imports LMCache; written for LMCache 0.5).

Turn it on in LMCache's YAML (docs/INTEGRATIONS.md has the whole file)::

    storage_plugins: ["isolane"]
    extra_config:
      storage_plugin.isolane.module_path: isolane.integrations.lmcache
      storage_plugin.isolane.class_name: IsolaneLMCacheBackend
      isolane.pool: /mnt/nvme2/isolane-kv      # a folder, a config file or node URLs

LMCache's storage manager creates the backend (``storage_plugin_launcher``) with its
config, the engine's metadata and the ``LocalCPUBackend`` whose allocator holds the
memory objects a get returns. Each full chunk LMCache stores becomes one block of an
isolane KV pool: appended to the pool's segment logs with a checksum, kept across
restarts of the engine (the pool's index is on disk), read back straight into the
memory object, checked, and served as a miss when damaged (counted in ``stats()`` as
``unreadable``), never as wrong KV.

Options (``extra_config``): ``isolane.pool`` — the embedded pool's folder (it must exist:
a missing mount point is an error, not a new folder on the root disk) or config file,
or storage node URLs, comma-separated, which several engine processes (tensor
parallelism) can share; not given: the embedded default under ``$ISOLANE_HOME``.
``isolane.namespace`` — default ``lmcache:<model>-<dtype>-tp<world size>``. A namespace
holds one chunk size, dtype and chunk shape: opening it with others is an error at
creation (LMCache logs it and runs without the backend).

Keys: a block's key is BLAKE2b-128 over ``KEY_MAGIC``, the digest of a ``KVNamespace``
(model, dtype, the chunk's layout, worker and world size) and LMCache's own key text
(``CacheEngineKey.to_string``: model, world size, worker, chunk hash, dtype, tags), so a
key of another model or layout is a miss (docs/FORMATS.md, "LMCache chunk keys"). Only
full chunks of the engine's one KV layer group are stored (LMCache's default,
``save_unfull_chunk: false``); a partial chunk or a memory object of another shape is
skipped (``skipped`` in ``stats()``). Layer-wise mode is refused at creation. ``pin``
keeps nothing: a block evicted between LMCache's lookup and its get reads as a miss,
which LMCache handles as a shorter hit.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from isolane.config import is_node_target
from isolane.errors import (
    ConfigError,
    InvalidArgumentError,
    InvalidNameError,
    IsolaneError,
    MissingDependencyError,
    StorageError,
)
from isolane.kvpool.api import KVPoolAPI, block_bytes_of, shape_with_tokens
from isolane.kvpool.keys import KEY_BYTES, KVNamespace
from isolane.kvpool.namespaces import check_namespace
from isolane.kvpool.pool import KVPool

try:
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.memory_management import MemoryFormat, MemoryObj
    from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface
except ImportError as exc:  # the plugin is useless without LMCache: say how to get it
    raise MissingDependencyError("lmcache", "isolane.integrations.lmcache") from exc

__all__ = ["KEY_MAGIC", "IsolaneLMCacheBackend", "PluginOptions"]

log = logging.getLogger(__name__)

KEY_MAGIC = b"isolane-lmc-v1\x00\x00"
"""Leads every block key the plugin derives from an LMCache key (16 bytes)."""
TOKEN_DIM = 2
"""LMCache's chunk formats (``KV_2LTD``, ``KV_MLA_FMT``: [kv, layers, tokens, hidden])
keep the tokens in dimension 2."""
OPTION_PREFIX = "isolane."


@dataclass(frozen=True)
class PluginOptions:
    """The plugin's ``extra_config`` entries, checked (see the module docstring)."""

    pool: str | None
    namespace: str

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None, *, model: str, dtype: str,
                          world_size: int) -> PluginOptions:
        extra = extra or {}
        pool = extra.get(OPTION_PREFIX + "pool")
        if pool is not None and (not isinstance(pool, str) or not pool.strip()):
            raise ConfigError("extra_config.isolane.pool", f"expected a folder, a config "
                              f"file or node URLs, got {pool!r:.80}")
        named = extra.get(OPTION_PREFIX + "namespace")
        namespace = named or f"lmcache:{model.lstrip('/')}-{dtype}-tp{world_size}"
        try:
            check_namespace(namespace)
        except InvalidNameError as exc:
            raise ConfigError("extra_config.isolane.namespace",
                              f"{exc}{'' if named else ' (the default from the model name)'}"
                              "; set extra_config 'isolane.namespace' to a valid name") from None
        return cls(pool=pool.strip() if pool else None, namespace=namespace)


@dataclass(frozen=True)
class ChunkLayout:
    """What one stored chunk is: its dtype, LMCache memory format and full shape."""

    dtype: torch.dtype
    fmt: MemoryFormat
    shape: torch.Size

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def shape_without_tokens(self) -> tuple[int, ...]:
        return tuple(int(s) for i, s in enumerate(self.shape) if i != TOKEN_DIM)

    def text(self) -> str:
        """``lmcache:KV_2LTD[2,32,T,1024]``: what the key namespace hashes."""
        dims = shape_with_tokens(self.shape_without_tokens, TOKEN_DIM, "T")
        return f"lmcache:{self.fmt.name}{dims}"

    def fits(self, obj: MemoryObj) -> bool:
        """True when ``obj`` holds exactly one full chunk of this layout."""
        tensor = obj.tensor
        return (tensor is not None and len(obj.get_shapes()) == 1
                and tensor.shape == self.shape and tensor.dtype == self.dtype
                and tensor.device.type == "cpu")


@dataclass
class PluginStats:
    """Counters of one backend (``IsolaneLMCacheBackend.stats``), in chunks."""

    stored: int = 0  # new in the pool
    skipped: int = 0  # not a full chunk of the layout: never stored
    put_failures: int = 0  # the pool refused or failed to write them (logged)
    hits: int = 0  # served by a get
    misses: int = 0  # asked for by a get and not served (not stored, unreadable, or after one)
    unreadable: int = 0  # of the misses: in the index but damaged or gone when read (ends it)


class IsolaneLMCacheBackend(StoragePluginInterface):  # type: ignore[misc]
    """An LMCache storage backend over an isolane KV pool. See the module docstring.

    Created by LMCache's ``storage_plugin_launcher`` (keyword arguments below).
    Thread-safe: puts run in order on one writer thread of the backend's own; contains
    and gets run on the caller's thread (or, for LMCache's async loads, a worker of its
    event loop's default executor)."""

    def __init__(self, dst_device: str = "cpu", config: Any = None, metadata: Any = None,
                 local_cpu_backend: Any = None,
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(dst_device=dst_device, config=config, metadata=metadata,
                         local_cpu_backend=local_cpu_backend, loop=loop)
        if config is None or metadata is None:
            raise InvalidArgumentError("IsolaneLMCacheBackend needs LMCache's config and "
                                       "metadata: list it in storage_plugins and let "
                                       "LMCache's storage manager create it")
        if config.use_layerwise:
            raise ConfigError("use_layerwise", "the isolane LMCache plugin stores whole "
                              "chunks; set use_layerwise: false to use it")
        if local_cpu_backend is None and metadata.role != "scheduler":
            raise ConfigError("max_local_cpu_size", "the isolane LMCache plugin reads into "
                              "memory objects of LMCache's LocalCPUBackend; set "
                              "max_local_cpu_size above 0")
        shapes, dtypes = metadata.get_shapes(config.chunk_size), metadata.get_dtypes()
        if len(shapes) != 1 or len(dtypes) != 1:
            raise ConfigError("storage_plugins", f"the isolane LMCache plugin stores one KV "
                              f"layer group; this engine has {len(shapes)}")
        self.layout = ChunkLayout(
            dtypes[0], MemoryFormat.KV_MLA_FMT if metadata.use_mla else MemoryFormat.KV_2LTD,
            torch.Size(shapes[0]))
        self.options = PluginOptions.from_extra_config(
            config.extra_config, model=metadata.model_name, dtype=self.layout.dtype_name,
            world_size=metadata.world_size)
        self.chunk_tokens = int(config.chunk_size)
        self.pool: KVPoolAPI = self._open_pool()
        self._seed = KEY_MAGIC + KVNamespace(
            model=metadata.model_name, dtype=self.layout.dtype_name,
            layout=self.layout.text(), tp_rank=metadata.worker_id,
            tp_size=metadata.world_size).digest()
        self._lock = threading.Lock()
        self._putting: set[CacheEngineKey] = set()
        self._stats = PluginStats()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="isolane-lmcache-put")
        self._closed = False

    def __str__(self) -> str:
        return self.__class__.__name__

    def _open_pool(self) -> KVPoolAPI:
        target, namespace = self.options.pool, self.options.namespace
        where = f"isolane LMCache plugin, pool {target or '$ISOLANE_HOME'} namespace " \
                f"'{namespace}'"
        if target is not None and not is_node_target(target):
            path = Path(target).expanduser()
            if not path.exists():
                raise ConfigError("extra_config.isolane.pool", (
                    f"{path} does not exist; create it (mkdir -p {path}) or name another "
                    "folder (the plugin does not create the folder it is given: an "
                    "unmounted device would fill the disk beneath it)"))
            if path.is_dir() and not os.access(path, os.R_OK | os.W_OK | os.X_OK):
                raise StorageError(13, f"{where}: {path} is not writable; give the "
                                   "engine's user write access or name another folder")
        try:
            # LMCache's LocalCPUBackend is the memory tier in front of this backend: the
            # pool keeps no second copy in memory.
            pool: KVPoolAPI = (
                KVPool.connect(target, namespace=namespace, chunk_tokens=self.chunk_tokens,
                               token_dim=TOKEN_DIM) if target and is_node_target(target)
                else KVPool(target, namespace=namespace, chunk_tokens=self.chunk_tokens,
                            token_dim=TOKEN_DIM, memory_budget=0))
        except IsolaneError as exc:
            raise _in_context(exc, where) from exc
        try:
            want = (self.layout.dtype_name, self.layout.shape_without_tokens)
            known = pool.adopt_layout(*want)
            if known != want:
                raise InvalidArgumentError(
                    f"namespace '{namespace}' stores dtype {known[0]}, shape "
                    f"{shape_with_tokens(known[1], TOKEN_DIM, 'T')}; LMCache's chunks are "
                    f"dtype {want[0]}, shape {shape_with_tokens(want[1], TOKEN_DIM, 'T')}: "
                    "use another namespace (extra_config 'isolane.namespace') for another "
                    "model or layout")
            if pool.chunk_tokens != self.chunk_tokens:
                raise ConfigError("chunk_size", (
                    f"namespace '{namespace}' holds chunks of {pool.chunk_tokens} tokens, "
                    f"LMCache's chunk_size is {self.chunk_tokens}; use the same chunk_size "
                    "or another namespace (extra_config 'isolane.namespace')"))
        except IsolaneError as exc:
            pool.close()
            raise _in_context(exc, where) from exc
        return pool

    # -- keys ------------------------------------------------------------------------------
    def pool_key(self, key: CacheEngineKey) -> bytes:
        """The pool's block key of an LMCache key (see the module docstring)."""
        return hashlib.blake2b(self._seed + key.to_string().encode("utf-8"),
                               digest_size=KEY_BYTES).digest()

    # -- lookups ---------------------------------------------------------------------------
    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        return self.pool.lookup_blocks([self.pool_key(key)]) == 1

    def batched_contains(self, keys: list[CacheEngineKey], pin: bool = False) -> int:
        """How many leading ``keys`` are stored (one probe of the pool's index)."""
        return self.pool.lookup_blocks([self.pool_key(k) for k in keys]) if keys else 0

    async def batched_async_contains(self, lookup_id: str, keys: list[CacheEngineKey],
                                     pin: bool = False) -> int:
        return self.batched_contains(keys, pin)

    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool:
        with self._lock:
            return key in self._putting

    def pin(self, key: CacheEngineKey) -> bool:
        return self.contains(key)

    def unpin(self, key: CacheEngineKey) -> bool:
        return self.contains(key)

    def touch_cache(self) -> None:
        """Nothing to do: the pool keeps its own recency."""

    # -- puts ------------------------------------------------------------------------------
    def batched_submit_put_task(
        self, keys: Sequence[CacheEngineKey], objs: list[MemoryObj],
        transfer_spec: Any = None,
        on_complete_callback: Callable[[CacheEngineKey], None] | None = None,
    ) -> list[Future[None]] | None:
        """Queue the full chunks among ``objs`` for one append to the pool; returns the
        write's future (None when nothing was queued). Each object is held (its
        reference count raised) until written; ``on_complete_callback`` runs per key
        once its chunk is in the pool."""
        todo: list[tuple[CacheEngineKey, MemoryObj]] = []
        with self._lock:
            if self._closed:
                return None
            for key, obj in zip(keys, objs, strict=True):
                if key in self._putting:
                    continue
                if not self.layout.fits(obj):
                    self._stats.skipped += 1
                    continue
                obj.ref_count_up()
                self._putting.add(key)
                todo.append((key, obj))
        if not todo:
            return None
        return [self._writer.submit(self._store, todo, on_complete_callback)]

    def _store(self, todo: list[tuple[CacheEngineKey, MemoryObj]],
               on_complete: Callable[[CacheEngineKey], None] | None) -> None:
        stored = False
        try:
            tensors = [obj.tensor for _, obj in todo]
            new = self.pool.put_blocks([self.pool_key(k) for k, _ in todo],
                                       [block_bytes_of(t) for t in tensors if t is not None])
            with self._lock:
                self._stats.stored += new
            stored = True
        except (IsolaneError, OSError) as exc:  # a cache: log it and keep serving
            log.warning("isolane LMCache plugin: storing %d chunks failed: %s",
                        len(todo), exc)
            with self._lock:
                self._stats.put_failures += len(todo)
        finally:
            for _, obj in todo:
                obj.ref_count_down()
            with self._lock:
                self._putting.difference_update(k for k, _ in todo)
        if stored and on_complete is not None:
            for key, _ in todo:
                try:
                    on_complete(key)
                except Exception as exc:  # LMCache's rule: a callback's error is logged
                    log.warning("on_complete_callback failed for %s: %s", key, exc)

    # -- gets ------------------------------------------------------------------------------
    def _read_prefix(self, keys: Sequence[CacheEngineKey]) -> list[MemoryObj]:
        """Memory objects of the longest stored prefix of ``keys`` (checked reads
        straight into them); a damaged chunk ends the prefix (counted ``unreadable``;
        the pool drops it and reports it in its stats' ``damaged``)."""
        if not keys:
            return []
        pool_keys = [self.pool_key(k) for k in keys]
        present = self.pool.lookup_blocks(pool_keys)
        objs = self._allocate(present)
        filled = self.pool.get_blocks_into(pool_keys[:len(objs)], [o.tensor for o in objs])
        for obj in objs[filled:]:
            obj.ref_count_down()
        short = int(filled < len(objs))  # the chunk the read stopped at
        with self._lock:
            self._stats.hits += filled
            self._stats.unreadable += short
            self._stats.misses += len(keys) - filled
        if short:
            log.warning("isolane LMCache plugin: a stored chunk could not be read (damaged "
                        "or dropped); the %d chunks from it on are served as misses",
                        len(keys) - filled)
        return objs[:filled]

    def _allocate(self, n: int) -> list[MemoryObj]:
        """Up to ``n`` memory objects from LMCache's CPU allocator (fewer when it is
        full: never wait for memory on a read)."""
        if n <= 0 or self.local_cpu_backend is None:
            return []
        lay = self.layout
        objs = self.local_cpu_backend.batched_allocate(lay.shape, lay.dtype, n, lay.fmt,
                                                       busy_loop=False)
        if objs is not None:
            return list(objs)
        got: list[MemoryObj] = []
        while len(got) < n:
            obj = self.local_cpu_backend.allocate(lay.shape, lay.dtype, lay.fmt,
                                                  busy_loop=False)
            if obj is None:
                break
            got.append(obj)
        return got

    def get_blocking(self, key: CacheEngineKey) -> MemoryObj | None:
        objs = self._read_prefix([key])
        return objs[0] if objs else None

    def batched_get_blocking(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        """The stored prefix of ``keys`` as memory objects, then None for the rest."""
        objs: list[MemoryObj | None] = list(self._read_prefix(keys))
        return objs + [None] * (len(keys) - len(objs))

    async def batched_get_non_blocking(self, lookup_id: str, keys: list[CacheEngineKey],
                                       transfer_spec: Any = None) -> list[MemoryObj]:
        return await asyncio.to_thread(self._read_prefix, keys)

    # -- removal, stats, lifecycle ------------------------------------------------------------
    def remove(self, key: CacheEngineKey, force: bool = True) -> bool:
        return self.pool.delete_blocks([self.pool_key(key)]) > 0

    def batched_remove(self, keys: list[CacheEngineKey], force: bool = True) -> int:
        return self.pool.delete_blocks([self.pool_key(k) for k in keys]) if keys else 0

    def get_allocator_backend(self) -> Any:
        return self.local_cpu_backend

    def stats(self) -> dict[str, Any]:
        """The backend's counters (``PluginStats``, in chunks) and the pool's stats."""
        with self._lock:
            counters = dict(vars(self._stats))
        return {**counters, "namespace": self.options.namespace, "pool": self.pool.stats()}

    def close(self) -> None:
        """Finish the queued puts, then close the pool. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._writer.shutdown(wait=True)
        self.pool.close()


def _in_context(exc: IsolaneError, where: str) -> IsolaneError:
    """``exc`` as the same kind of error with ``where`` leading its message (LMCache logs
    only the message of a plugin that failed to start)."""
    if isinstance(exc, ConfigError):
        return ConfigError(exc.field, f"{where}: {exc.problem}")
    if isinstance(exc, StorageError):
        return StorageError(exc.errno, f"{where}: {exc.strerror}")
    return InvalidArgumentError(f"{where}: {exc}")
