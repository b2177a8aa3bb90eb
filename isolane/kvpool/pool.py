"""KVPool: store the KV cache of processed prompts, restore the longest cached prefix.

Embedded (in-process) use. Blocks of ``chunk_tokens`` tokens are keyed by chained
prefix hashes (``keys.py``; the token level is ``api.TokenLayer``, shared with the
remote pool). This module only orchestrates the tiers (``tiers/``, one ``Tier``
interface, fastest first): the memory tier (``tiers/memory.py``) in front of the disk
tier (``tiers/disk.py``: append-only segment logs on the read group's devices,
``kvpool/log``), and the optional capacity tier (``tiers/capacity.py``: cold sealed
segments on object storage, filled by ``tiers/demotion.py``). A get walks the tiers in
that order and writes each hit back into the faster ones; no tier calls back here. A
prompt's new blocks are appended in one batch per device, so restoring a prefix is one
or a few sequential range reads on the read lane. Every record is checksummed; a
damaged block is dropped and reads as a miss.

The namespace's dtype and layout (the KV tensor's shape without its token dimension)
are fixed by the first ``put`` and persisted beside the logs (``namespace_files.py``),
so ``lookup``/``get`` in a fresh process compute the same keys. Stored namespaces are
listed, counted and dropped by ``catalog.py``. Thread-safe.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from isolane.config import Config, refuse_node_target, target_config
from isolane.errors import ConfigError, IntegrityError, InvalidArgumentError, StorageError
from isolane.kvpool.api import Destinations, TokenLayer, block_bytes_of
from isolane.kvpool.keys import check_keys
from isolane.kvpool.log.segment_log import SegmentLog
from isolane.kvpool.namespace_files import (
    NamespaceMeta,
    meta_path,
    namespace_dir,
    read_namespace_meta,
    write_namespace_meta,
)
from isolane.kvpool.namespaces import check_namespace, namespace_folder
from isolane.kvpool.tiers.base import Block, Tier, WritableTier, copy_block
from isolane.kvpool.tiers.capacity import CapacityTier
from isolane.kvpool.tiers.demotion import demote_segments
from isolane.kvpool.tiers.disk import DiskTier
from isolane.kvpool.tiers.memory import MemoryTier
from isolane.kvpool.token_dim import check_token_dim, resolve_token_dim
from isolane.lanes.assignment import JobKind
from isolane.lanes.scheduler import LaneScheduler, shared_registry
from isolane.storage.registry import blob_store_from_url

if TYPE_CHECKING:
    from isolane.client.kv_pool import RemoteKVPool

log = logging.getLogger(__name__)

DEFAULT_MEMORY_BUDGET = 1 << 30


class KVPool(TokenLayer):
    """A prefix-keyed KV block store. See the module docstring.

    ``KVPool(url_or_config)`` opens a config (a ``Config``, a YAML file) or a folder as
    the embedded pool. Storage node URLs are ``isolane.open_kv_pool``'s or
    ``KVPool.connect``'s (a ``RemoteKVPool``)."""

    def __init__(
        self,
        url_or_config: str | os.PathLike[str] | Config | None = None,
        *,
        namespace: str | None = None,
        chunk_tokens: int | None = None,
        token_dim: int = 2,
        memory_budget: int | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        policy: str | None = None,
        segment_bytes: int | None = None,
        disk_budget: int | None = None,
        scheduler: LaneScheduler | None = None,
        direct_reads: bool | None = None,
    ) -> None:
        """``direct_reads``: True: block reads bypass the page cache (O_DIRECT where the
        filesystem allows it), so the memory tier is the only cache and every miss is a
        real device read; False: every read goes through the page cache; None (the
        default): reads of 256 KiB or more (several blocks of a restore) whose bytes are
        not all in the page cache go O_DIRECT, the others through the page cache
        (``SegmentLog`` ``direct_io="cold"``). ``get_into`` of an O_DIRECT read copies
        each checked value out of a reused page-aligned buffer; a buffered one scatters
        straight into the tensor."""
        refuse_node_target(url_or_config, "KVPool", "open_kv_pool")
        self.config = target_config(url_or_config, "read")
        group = self.config.require_group("read")
        self.namespace = check_namespace(self.config.kvpool.namespace if namespace is None
                                         else namespace)
        self.chunk_tokens = chunk_tokens or self.config.kvpool.chunk_tokens
        if self.chunk_tokens < 1:
            raise InvalidArgumentError(f"chunk_tokens must be >= 1, got {self.chunk_tokens}")
        # Resolved to a non-negative index once the layout is known (token_dim.py).
        self.token_dim = check_token_dim(token_dim)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        budget = (memory_budget if memory_budget is not None
                  else group.memory_budget or DEFAULT_MEMORY_BUDGET)
        kv_config = self.config.kvpool
        self.memory = MemoryTier(budget, policy or kv_config.policy)
        segment_bytes = segment_bytes or kv_config.segment_bytes
        disk_budget = disk_budget if disk_budget is not None else kv_config.disk_budget
        self.devices = [Path(d) for d in group.devices]
        if any("://" in str(d) for d in group.devices):
            raise ConfigError(f"device_groups.{group.name}.devices",
                              "the KV pool's read group needs local folders; put object "
                              "storage in a 'capacity' group")
        self.disk_budget = disk_budget
        self.capacity = self._open_capacity()
        self.scheduler = scheduler or shared_registry.get(self.config)
        self._lane = self.scheduler.lane(JobKind.KV_GET)
        # One log per namespace and device: `kv ls` counts them, `kv evict` drops them.
        # With a capacity tier the pool keeps the budget itself, demoting before dropping.
        self.logs = [SegmentLog(namespace_dir(d, self.namespace) / "segments",
                                segment_bytes=segment_bytes,
                                max_bytes=None if self.capacity is not None else disk_budget,
                                direct_io=("cold" if direct_reads is None
                                           else "auto" if direct_reads else "off"))
                     for d in self.devices]
        self.disk = DiskTier(self.logs, self.devices, read_lane=self._lane,
                             put_lane=self.scheduler.lane(JobKind.KV_PUT),  # below gets
                             readers=group.threads,
                             segment_blocks=self.config.cluster.segment_blocks)
        self.tiers: list[Tier] = [self.memory, self.disk]  # fastest first
        if self.capacity is not None:
            self.tiers.append(self.capacity)
        self._demoting = threading.Lock()
        self._compacting = threading.Lock()
        self._closed = False
        self.compact_below = 0.5  # live share under which a sealed segment is compacted
        self._lock = threading.Lock()
        try:
            self._layout: tuple[str, tuple[int, ...]] | None = self._load_layout()
        except BaseException:  # a refused open lets go of the logs (their folder locks)
            self.disk.close()
            raise
        self.disk.block_bytes = self.block_bytes

    @staticmethod
    def connect(target: str | os.PathLike[str] | Sequence[str] | Config, **kwargs: Any
                ) -> RemoteKVPool:
        """The same API on storage nodes: ``target`` is a node URL, a list of them, an
        ``etcd://HOST:PORT/PREFIX`` URL (the nodes registered there), or a config (file)
        whose ``cluster.nodes`` or ``cluster.etcd`` it uses (``isolane.client.kv_pool``)."""
        from isolane.client.kv_pool import connect

        return connect(target, **kwargs)

    def _open_capacity(self) -> CapacityTier | None:
        group = self.config.group("capacity")
        if group is None:
            return None
        store = blob_store_from_url(group.devices[0], storage_options=group.storage_options)
        tier = CapacityTier(store, f"kvpool/{namespace_folder(self.namespace)}")
        try:
            tier.load()
        except (StorageError, IntegrityError) as exc:
            log.warning("KV capacity tier %s unreadable, serving local tiers only: %s",
                        store.url, exc)
        return tier

    # -- namespace and layout --------------------------------------------------------------
    def _load_layout(self) -> tuple[str, tuple[int, ...]] | None:
        meta = read_namespace_meta(meta_path(self.devices[0], self.namespace), self.namespace)
        if meta is None:
            return None
        ndim = len(meta.shape) + 1
        try:
            token_dim = resolve_token_dim(self.token_dim, ndim)
            stored_dim = resolve_token_dim(meta.token_dim, ndim)
        except InvalidArgumentError:
            token_dim, stored_dim = -1, meta.token_dim
        if meta.chunk_tokens != self.chunk_tokens or stored_dim != token_dim:
            raise ConfigError("kvpool.chunk_tokens", (
                f"namespace '{self.namespace}' was stored with chunk_tokens="
                f"{meta.chunk_tokens} and token_dim={meta.token_dim}; open it "
                "with the same values or use another namespace"))
        self.token_dim = token_dim
        return meta.dtype, meta.shape

    def _adopt_layout(self, dtype: str, shape: tuple[int, ...], token_dim: int
                      ) -> tuple[str, tuple[int, ...]]:
        with self._lock:
            if self._layout is None:
                write_namespace_meta(meta_path(self.devices[0], self.namespace),
                                     NamespaceMeta(dtype, shape, self.chunk_tokens, token_dim))
                self._layout = (dtype, shape)
                self.token_dim = token_dim
                self.disk.block_bytes = self.block_bytes
            return self._layout

    @property
    def layout(self) -> tuple[str, tuple[int, ...]] | None:
        """``(dtype, shape without the token dimension)`` fixed by the first put, or None."""
        return self._layout

    @property
    def block_bytes(self) -> int | None:
        """Bytes of one block (``chunk_tokens`` tokens of the layout), None before the
        layout is fixed. Blocks of another size are refused by ``put_blocks`` and read
        as misses (and dropped) when found stored."""
        if self._layout is None:
            return None
        dtype, shape = self._layout
        itemsize: int = getattr(torch, dtype).itemsize
        return math.prod(shape) * self.chunk_tokens * itemsize

    # -- block-level API ---------------------------------------------------------------------
    def put_blocks(self, keys: Sequence[bytes], buffers: Sequence[Any], *,
                   chain: bytes | None = None) -> int:
        """Store blocks (already keyed); returns how many were new. Best effort: a full
        device is logged, not raised (the cache keeps serving). Blocks are placed on
        devices by chain segment (``chain_segments``, ``cluster.segment_blocks`` blocks
        each): ``keys`` start a chain and each of its segments goes to one device, or
        with ``chain`` (the segment digest of the segment these blocks belong to, as a
        node receives it) all of them go to that segment's device."""
        self._check_open()
        check_keys(keys)
        if len(keys) != len(buffers):
            raise InvalidArgumentError(f"put_blocks got {len(keys)} keys and "
                                       f"{len(buffers)} buffers")
        size = self.block_bytes
        if size is None and keys:  # nothing to check a block's size against yet
            raise InvalidArgumentError(
                f"namespace '{self.namespace}' has no layout yet, so the size of its blocks "
                "is unknown: put() a KV tensor first (it fixes the dtype and shape), then "
                "put_blocks; nothing was stored")
        views = [b if type(b) is memoryview and b.format == "B" and b.contiguous
                 else memoryview(b).cast("B") for b in buffers]
        for key, view in zip(keys, views, strict=True):
            if view.nbytes != size:
                raise InvalidArgumentError(
                    f"KV block {bytes(key).hex()} is {view.nbytes} bytes; a block of "
                    f"namespace '{self.namespace}' is {size} bytes ({self.chunk_tokens} "
                    f"tokens of dtype {self._layout[0] if self._layout else '?'}); "
                    "nothing was stored")
        # Views, not copies: the disk tier writes them before it returns, and the memory
        # tier copies only what it admits.
        stored = self.disk.store(keys, views, chain=chain)
        if stored:
            if self.memory.budget_bytes:  # a 0-byte tier admits nothing: skip the lists
                self.memory.put_many([bytes(keys[i]) for i in stored],
                                     [views[i] for i in stored])
            if (self.capacity is not None and self.disk_budget is not None
                    and self.disk.over_budget(self.disk_budget)):
                self.scheduler.lane(JobKind.DEMOTE).submit(self._demote_quietly)
        return len(stored)

    def get_blocks(self, keys: Sequence[bytes]) -> list[Block | None]:
        """Each block's bytes (a read-only buffer: ``bytes``, or a ``memoryview`` into
        the range read that fetched it), or None for a miss (also for a damaged block,
        which is dropped). The tiers are asked fastest first, each for what the faster
        ones did not have; a hit is written back into the faster tiers."""
        self._check_open()
        check_keys(keys)
        out: list[Block | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        size = self.block_bytes
        for level, tier in enumerate(self.tiers):
            if not todo:
                break
            try:
                found = tier.get_many([keys[i] for i in todo])
            except StorageError as exc:
                if tier is not self.capacity:
                    raise
                log.warning("KV capacity tier unreachable, reading as misses: %s", exc)
                break
            hits = [i for i, v in zip(todo, found, strict=True)
                    if v is not None and (size is None or len(v) == size)]
            for i, value in zip(todo, found, strict=True):
                if value is not None and (size is None or len(value) == size):
                    out[i] = value
            if hits and level:
                self._promote(level, [keys[i] for i in hits], [out[i] for i in hits])
            todo = [i for i in todo if out[i] is None]
        return out

    def _promote(self, level: int, keys: Sequence[bytes], values: Sequence[Any]) -> None:
        """Write hits of ``self.tiers[level]`` back into the faster tiers."""
        for tier in self.tiers[:level]:
            if isinstance(tier, WritableTier):
                tier.put_many(keys, values)

    def lookup_blocks(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` are stored in some tier (no data read)."""
        return len(self._present_prefix(list(keys)))

    def delete_blocks(self, keys: Sequence[bytes]) -> int:
        """Drop these blocks from every tier; returns how many were stored."""
        self._check_open()
        check_keys(keys)
        if not keys:
            return 0
        held = np.zeros(len(keys), bool)
        for tier in self.tiers:
            held |= np.asarray(tier.delete_many(keys), bool)
        n = int(held.sum())
        if n:
            self.scheduler.lane(JobKind.COMPACT).submit(self._compact_in_background)
        return n

    # -- the token level's reads (api.TokenLayer) -------------------------------------------
    def _present_prefix(self, keys: list[bytes]) -> list[bytes]:
        """The leading keys stored in some tier (no data read): only the prefix up to
        the first block stored nowhere can be useful."""
        self._check_open()
        if not keys:
            return keys
        keys = [bytes(k) for k in check_keys(keys)]
        present = np.zeros(len(keys), bool)
        for tier in self.tiers:
            present |= tier.contains_many(keys)
            if present.all():
                return keys
        return keys[:int(np.argmin(present))]

    def _read_prefix(self, keys: list[bytes], dests: Destinations) -> int:
        """The present prefix (one index probe a tier, fastest first, no data read),
        then its blocks read into ``dests`` (``_fill``)."""
        self._check_open()
        if not keys:
            return 0
        keys = [bytes(k) for k in keys]
        # Lists, not numpy: at a few keys each numpy call costs more than the list work.
        in_memory = self.memory.contains_many(keys).tolist()
        present = in_memory
        for tier in self.tiers[1:]:
            if all(present):
                break
            present = [p or t for p, t in zip(present, tier.contains_many(keys).tolist(),
                                               strict=True)]
        n = present.index(False) if False in present else len(keys)
        if not n:
            return 0
        return self._fill(keys[:n], dests(n), memory=any(in_memory[:n]))

    def _prefetch_prefix(self, keys: list[bytes]) -> Future[int]:
        def warm() -> int:
            n = 0
            for block in self.get_blocks(self._present_prefix(keys)):
                if block is None:
                    break
                n += 1
            return n * self.chunk_tokens

        return self._lane.submit(warm)

    def _fill(self, keys: Sequence[bytes], dests: Sequence[torch.Tensor], *,
              memory: bool = True) -> int:
        """Fill ``dests[i]`` with block ``keys[i]``, each tier's ``read_into`` on what
        the faster ones did not fill: memory tier hits are copied, local disk blocks
        read straight into the destination (and admitted to the memory tier), the rest
        (capacity tier, or moved by compaction meanwhile) go through ``get_blocks``.
        ``memory=False``: the memory tier held none of ``keys`` when probed, so it is
        not read (a block admitted since is read from disk, checked the same). Returns
        how many leading blocks were filled."""
        n = len(keys)
        filled = list(self.memory.read_into(keys, dests)) if memory else [False] * n
        if not all(filled):
            todo = [i for i in range(n) if not filled[i]]
            if len(todo) == n:  # the destinations as given: their strided views stay
                done = self.disk.read_into(keys, dests)
            else:
                done = self.disk.read_into([keys[i] for i in todo], [dests[i] for i in todo])
            hits = [i for i, ok in zip(todo, done, strict=True) if ok]
            for i in hits:
                filled[i] = True
            if hits and self.memory.budget_bytes:
                self.memory.put_many([keys[i] for i in hits],
                                     [block_bytes_of(dests[i]) for i in hits])
        todo = [i for i in range(n) if not filled[i]]
        if todo:
            for i, found in zip(todo, self.get_blocks([keys[i] for i in todo]), strict=True):
                if found is not None:
                    copy_block(found, dests[i])
                    filled[i] = True
        return filled.index(False) if False in filled else n

    # -- maintenance ---------------------------------------------------------------------------
    def demote(self, target_bytes: int | None = None) -> int:
        """Move the oldest sealed segments of each device to the capacity tier until the
        device holds at most ``target_bytes`` (default: 80% of the disk budget). The
        local copy goes only after the upload committed. Returns segments moved."""
        if self.capacity is None:
            raise ConfigError("device_groups", "demotion needs a device group with role "
                              "'capacity' (e.g. an s3:// URL)")
        if target_bytes is None:
            target_bytes = int(self.disk_budget * 0.8) if self.disk_budget else 0
        with self._demoting:
            if self._closed:
                return 0
            return demote_segments(self.disk, self.capacity, target_bytes)

    def _demote_quietly(self) -> None:
        try:
            self.demote()
        except (StorageError, OSError) as exc:  # retried after the next put
            log.warning("KV demotion to the capacity tier failed, will retry: %s", exc)

    def _compact_in_background(self) -> None:
        """After deletes: compact mostly-dead segments, one pass at a time."""
        if not self._compacting.acquire(blocking=False):
            return
        try:
            if not self._closed:
                self.compact(self.compact_below, wait=False)
        except (StorageError, OSError) as exc:
            log.warning("KV compaction failed, will retry after the next delete: %s", exc)
        finally:
            self._compacting.release()

    def compact(self, min_live_ratio: float = 0.5, *, wait: bool = True) -> int:
        """Compact sealed segments whose live share fell below ``min_live_ratio`` (on the
        background lane, or in the calling thread with ``wait=False`` when it already is
        one); returns how many were compacted."""
        lane = self.scheduler.lane(JobKind.COMPACT)
        return self.disk.compact(min_live_ratio,
                                 (lambda job: lane.submit(job).result()) if wait else None)

    def verify(self) -> dict[str, Any]:
        """Read back every stored block and check its checksum; damaged blocks are
        dropped (they would read as misses anyway). Also reports, once, the records
        dropped since the last verify by this process or an earlier one: by reopen scans
        (damage, torn tails) and by reads that found a block damaged
        (``SegmentLog.damage_report``). Returns ``checked`` (blocks read), ``damaged``
        (blocks that failed plus records dropped earlier) and ``dropped_earlier`` (one
        dict per dropped byte range)."""
        checked, damaged, dropped = self.disk.verify()
        self.memory.delete_many(damaged)
        return {"checked": checked, "damaged": len(damaged) + len(dropped),
                "dropped_earlier": dropped}

    def stats(self) -> dict[str, Any]:
        m = self.memory.stats
        return {
            "namespace": self.namespace, "chunk_tokens": self.chunk_tokens,
            "memory": {"bytes": self.memory.nbytes, "blocks": len(self.memory),
                       "budget": self.memory.budget_bytes, "policy": self.memory.policy_name,
                       "hits": m.hits, "misses": m.misses, "evictions": m.evictions},
            "disk": self.disk.stats(),
            "capacity": None if self.capacity is None else {
                "url": self.capacity.store.url, "blocks": len(self.capacity),
                "bytes": self.capacity.nbytes},
        }

    def close(self) -> None:
        with self._demoting, self._compacting:  # let background work finish first
            self._closed = True
            self.disk.close()

    def __enter__(self) -> KVPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgumentError(f"KV pool of namespace '{self.namespace}' is closed; "
                                       "open a new KVPool to use it again")

