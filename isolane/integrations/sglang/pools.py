"""The KV pool an SGLang HiCache backend stores its pages in, from its extra config.

``isolane_pool`` names it: a folder or a config file (the embedded ``KVPool``; the folder
must exist and be writable: a mistyped mount point or a read-only volume is an error at
backend creation, not a cache that silently never fills), storage node URLs (``RemoteKVPool``),
or nothing: the embedded default under ``$ISOLANE_HOME``. A process keeps one pool per
embedded folder and namespace, shared by its backends (an embedded folder's namespace is
open in one process at a time; ``open_pool`` says so clearly when another process holds
it); on storage nodes each backend has a client of its own.
Thread-safe.
"""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path
from typing import Any

from isolane.cluster.router import ClusterOptions
from isolane.config import is_node_target, target_config
from isolane.errors import ConfigError, StorageError
from isolane.kvpool.api import KVPoolAPI
from isolane.kvpool.pool import KVPool

PAGE_CHAINS = ClusterOptions(prefix_blocks=1)
"""Routing of SGLang's page chains on storage nodes: a chain's first segment placed by
its first page. SGLang stores a prompt's pages once, in batches after its stored prefix
(never the prefix again), so an anchor must not move as the chain grows: with the
default second-page anchor, a prompt sharing only its first page with a stored one
would put its next pages on another node than that first page and never find them."""

_pools: dict[tuple[str, str], tuple[KVPoolAPI, int]] = {}  # (target, namespace) -> pool, users
_pools_lock = threading.Lock()


def pool_target(setting: Any) -> str | list[str] | None:
    """``isolane_pool`` checked: None, node URLs, or an existing writable folder or a
    config file (ConfigError naming the problem otherwise)."""
    if setting is None or setting == "":
        return None
    if is_node_target(setting):
        return setting if isinstance(setting, str) else list(setting)
    if not isinstance(setting, str | os.PathLike):
        raise ConfigError("isolane_pool", f"expected a folder, a config file or node URLs, "
                          f"got {setting!r:.80}")
    text = os.fspath(setting)
    path = Path(text)
    if text.endswith((".yaml", ".yml")) and path.is_file():
        for device in target_config(text, "read").require_group("read").devices:
            if "://" not in device:
                _check_folder(Path(device), "isolane_pool (the config's read group)")
        return text
    _check_folder(path, "isolane_pool")
    return text


def _check_folder(path: Path, field: str) -> None:
    """The pool folder must exist and be writable at start: a mistyped mount point or a
    read-only volume is an error now, not a cache that silently never fills."""
    if not path.is_dir():
        raise ConfigError(field, f"the KV pool folder {path} does not exist (or is not a "
                          "folder); create it, or fix the path")
    st = os.stat(path)
    read_only_mount = bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    if read_only_mount or not st.st_mode & 0o222 or not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(field, f"the KV pool folder {path} is read-only; give the engine "
                          "a writable folder (check its mount and permissions)")


def open_pool(target: str | list[str] | None, namespace: str,
              memory_budget: int = 0) -> KVPoolAPI:
    """A pool for this target and namespace: a client of its own on storage nodes, else
    the process's embedded pool for the folder and namespace (shared by the process's
    backends: an embedded namespace is open in one pool at a time). Give it back with
    ``release_pool``."""
    if isinstance(target, list) or (target is not None and is_node_target(target)):
        return _checked(KVPool.connect(target, namespace=namespace, chunk_tokens=1,
                                       token_dim=0, cluster=PAGE_CHAINS), namespace)
    where = None if target is None else os.path.realpath(target)
    key = (where or "<default>", namespace)
    with _pools_lock:
        held = _pools.get(key)
        if held is None:
            try:
                pool: KVPoolAPI = KVPool(target, namespace=namespace, chunk_tokens=1,
                                         token_dim=0, memory_budget=memory_budget)
            except StorageError as exc:
                if exc.errno != errno.EBUSY:
                    raise
                raise ConfigError("isolane_pool", (
                    f"namespace '{namespace}' of the embedded pool {where or '$ISOLANE_HOME'} "
                    "is open in another process (another engine, or another rank of this "
                    "one: MLA pages are one copy for every tensor-parallel rank); give "
                    "isolane_pool storage node URLs (isolane serve) to share a pool between "
                    "processes, or another isolane_namespace")) from None
            held = (_checked(pool, namespace), 0)
        _pools[key] = (held[0], held[1] + 1)
        return held[0]


def _checked(pool: KVPoolAPI, namespace: str) -> KVPoolAPI:
    """``pool`` if its namespace holds SGLang pages (one block a page), else closed and a
    ConfigError."""
    if pool.chunk_tokens != 1:
        pool.close()
        raise ConfigError("isolane_namespace", (
            f"namespace '{namespace}' holds blocks of {pool.chunk_tokens} tokens, not "
            "SGLang pages; use another isolane_namespace"))
    return pool


def release_pool(pool: KVPoolAPI) -> None:
    """Give back a pool from ``open_pool``: closed when no backend uses it any more."""
    with _pools_lock:
        for key, (held, users) in list(_pools.items()):
            if held is pool:
                if users > 1:
                    _pools[key] = (held, users - 1)
                    return
                del _pools[key]
                break
    pool.close()
