"""The KV pools of one node: one ``KVPool`` per namespace, opened on first use.

A namespace exists on the node once its layout is registered (``register``, behind
``PUT /v1/kv/{ns}``) or stored by an earlier run (its ``namespace.json`` on the read
group); ``get`` of anything else is a ``KeyNotFoundError`` that says how to register.
Every pool shares the node's LaneScheduler. Each namespace also has a ``ChainIndex``
(``chains.py``: which chains the node holds, for moves), opened with it. Thread-safe;
``close`` closes every pool (flushing its index) and chain index, and is idempotent.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from isolane.config import Config
from isolane.errors import (
    ConfigError,
    ConflictError,
    InvalidArgumentError,
    InvalidNameError,
    KeyNotFoundError,
    StorageError,
)
from isolane.kvpool.catalog import open_namespace
from isolane.kvpool.namespaces import namespace_from_folder
from isolane.kvpool.pool import KVPool
from isolane.lanes.scheduler import LaneScheduler
from isolane.node.chains import ChainIndex
from isolane.wire.layout import NamespaceLayout


class KVNamespaces:
    def __init__(self, config: Config, scheduler: LaneScheduler) -> None:
        self.config = config
        self.scheduler = scheduler
        self._pools: dict[str, KVPool] = {}
        self._chains: dict[str, ChainIndex] = {}
        self._lock = threading.Lock()
        self._closed = False

    @property
    def enabled(self) -> bool:
        return self.config.group("read") is not None

    def _require_read_group(self) -> None:
        if not self.enabled:
            raise InvalidArgumentError(f"this node has no KV pool: its config "
                                       f"({self.config.source}) has no device group with "
                                       "role 'read'")

    def peek(self, namespace: str) -> KVPool | None:
        """The pool if already open (never blocks on I/O: callable on the event loop)."""
        return self._pools.get(namespace)

    def get(self, namespace: str) -> KVPool:
        """The open pool of a registered namespace (opening it may read the disk)."""
        self._require_read_group()
        with self._lock:
            self._check_open()
            pool = self._pools.get(namespace)
            if pool is None:
                try:
                    pool = open_namespace(self.config, namespace, memory_budget=None,
                                          scheduler=self.scheduler)
                except KeyNotFoundError:
                    raise KeyNotFoundError(
                        f"KV namespace '{namespace}' is not registered on this node; "
                        f"register its layout with PUT /v1/kv/{namespace} (a RemoteKVPool "
                        "does so on its first put)") from None
                self._pools[namespace] = pool
            return pool

    def register(self, namespace: str, layout: NamespaceLayout) -> tuple[KVPool, bool]:
        """Open ``namespace`` with ``layout``, creating it if new; returns the pool and
        whether it was created. ConflictError when it is stored with another layout."""
        self._require_read_group()
        with self._lock:
            self._check_open()
            pool = self._pools.get(namespace)
            if pool is None:
                try:
                    pool = KVPool(self.config, namespace=namespace,
                                  chunk_tokens=layout.chunk_tokens, token_dim=layout.token_dim,
                                  memory_budget=None, scheduler=self.scheduler)
                except ConfigError as exc:  # stored with other chunk_tokens / token_dim
                    raise ConflictError(str(exc)) from None
                self._pools[namespace] = pool
            stored = self.layout_of(pool)
            if stored is not None:
                if stored != layout:
                    raise ConflictError(
                        f"KV namespace '{namespace}' is stored with layout {stored.to_dict()}"
                        f", not {layout.to_dict()}; use another namespace for another model "
                        "or layout")
                return pool, False
            # The embedded pool fixes the layout on its first token-level put: an empty
            # one (no tokens, no keys) fixes it and stores no block.
            empty = torch.empty(layout.full_shape(0), dtype=getattr(torch, layout.dtype))
            pool.put([], empty)
            return pool, True

    def layout_of(self, pool: KVPool) -> NamespaceLayout | None:
        if pool.layout is None:
            return None
        dtype, shape = pool.layout
        return NamespaceLayout(dtype, shape, pool.chunk_tokens, pool.token_dim)

    def stored_names(self) -> list[str]:
        """Namespaces with a layout on the read group (open or not)."""
        if not self.enabled:
            return []
        names = set(self._pools)
        root = Path(self.config.require_group("read").devices[0]) / "kvpool"
        if root.is_dir():
            for folder in root.iterdir():
                # Folders the pool cannot have written (and links) are left to
                # 'isolane kv ls', which reports them.
                if folder.is_symlink() or not (folder / "namespace.json").is_file():
                    continue
                try:
                    names.add(namespace_from_folder(folder.name))
                except InvalidNameError:
                    continue
        return sorted(names)

    def chains(self, namespace: str, pool: KVPool) -> ChainIndex:
        """The chain index of ``namespace`` (whose open pool is ``pool``), beside its
        segments on the read group's first device."""
        with self._lock:
            self._check_open()
            index = self._chains.get(namespace)
            if index is None:
                index = ChainIndex(pool.logs[0].folder.parent / "chains.log")
                self._chains[namespace] = index
            return index

    def open_pools(self) -> dict[str, KVPool]:
        with self._lock:
            return dict(self._pools)

    def _check_open(self) -> None:
        if self._closed:
            raise StorageError("this node is shutting down; retry on another node")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pools, self._pools = list(self._pools.values()), {}
            indexes, self._chains = list(self._chains.values()), {}
        for index in indexes:
            index.close()
        for pool in pools:
            pool.close()

