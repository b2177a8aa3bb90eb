"""KVPool: store the KV cache of processed prompts, restore the longest cached prefix.

Embedded (in-process) use. Blocks of ``chunk_tokens`` tokens are keyed by chained
prefix hashes (``keys.py``), kept in a memory tier (``tiers/memory.py``) in front of
append-only segment logs on the read group's devices (``segment_log.py``). A prompt's new
blocks are appended in one batch to one device (chosen by the prompt's first key), so
restoring a prefix is one or a few sequential range reads (``coalesce.py``), run on the
read lane. Every record is checksummed; a damaged block is dropped and reads as a miss.

The namespace's dtype and layout (the KV tensor's shape without its token dimension)
are fixed by the first ``put`` and persisted beside the logs, so ``lookup``/``get`` in a
fresh process compute the same keys. Thread-safe.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import math
import os
import stat
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch

from isolane.cluster.chain_segments import device_runs
from isolane.config import Config, config_from_dict, default_config, load_config
from isolane.errors import (
    CapacityError,
    ConfigError,
    IntegrityError,
    InvalidArgumentError,
    InvalidNameError,
    IsolaneError,
    KeyNotFoundError,
    StorageError,
)
from isolane.kvpool.api import Block, Destinations, TokenLayer, block_bytes_of, shape_with_tokens
from isolane.kvpool.log.coalesce import ReadRange, coalesce_ranges, split_ranges
from isolane.kvpool.log.compaction import should_compact
from isolane.kvpool.log.keydir import Location
from isolane.kvpool.log.reader import (
    PieceOutcome,
    piece_bytes_for,
    scatter_piece,
    storage_bytes,
    tensor_chunks,
)
from isolane.kvpool.log.segment_log import SegmentLog, StaleLocationError, verify_record
from isolane.kvpool.namespaces import check_namespace, namespace_folder, namespace_from_folder
from isolane.kvpool.tiers.capacity import CapacityTier
from isolane.kvpool.tiers.memory import MemoryTier
from isolane.kvpool.token_dim import check_token_dim, resolve_token_dim
from isolane.lanes.assignment import JobKind
from isolane.lanes.scheduler import LaneScheduler, shared_registry
from isolane.storage.files import atomic_write, remove_tree
from isolane.storage.registry import blob_store_from_url

if TYPE_CHECKING:
    from isolane.client.kv_pool import RemoteKVPool

log = logging.getLogger(__name__)

DEFAULT_MEMORY_BUDGET = 1 << 30


def is_node_target(target: object) -> bool:
    """Whether ``KVPool(target)`` names storage nodes: an ``http(s)://`` URL (or several
    joined by commas) or a list/tuple of them."""
    if isinstance(target, str):
        return target.startswith(("http://", "https://"))
    return isinstance(target, list | tuple) and all(isinstance(t, str) for t in target)


class KVPool(TokenLayer):
    """A prefix-keyed KV block store. See the module docstring.

    ``KVPool(url_or_config)`` opens a config (a ``Config``, a YAML file) or a folder as
    the embedded pool; ``http(s)://`` node URLs (one, several joined by commas, or a
    list of them) give a ``RemoteKVPool`` on those nodes instead, as ``KVPool.connect``
    does (keyword arguments go to ``RemoteKVPool`` then)."""

    def __new__(cls, url_or_config: str | os.PathLike[str] | Sequence[str] | Config | None
                = None, **kwargs: Any) -> Any:
        if is_node_target(url_or_config):
            from isolane.client.kv_pool import connect  # lazy: the client is not needed here

            return connect(url_or_config, **kwargs)  # type: ignore[arg-type]
        return super().__new__(cls)

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
        direct_reads: bool = False,
    ) -> None:
        """``direct_reads``: block reads bypass the page cache (O_DIRECT where the
        filesystem allows it), so the memory tier is the only cache and every miss is a
        real device read; restores into a tensor (``get_into``) stay buffered."""
        self.config = _resolve(url_or_config)
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
        # One log per namespace and device: `kv ls` counts them, `kv evict` drops them.
        # With a capacity tier the pool keeps the budget itself, demoting before dropping.
        self.logs = [SegmentLog(namespace_dir(d, self.namespace) / "segments",
                                segment_bytes=segment_bytes,
                                max_bytes=None if self.capacity is not None else disk_budget,
                                direct_io="auto" if direct_reads else "off",
                                on_evict=self._forget)
                     for d in self.devices]
        self.scheduler = scheduler or shared_registry.get(self.config)
        self._lane = self.scheduler.lane(JobKind.KV_GET)
        self._put_lane = self.scheduler.lane(JobKind.KV_PUT)  # below gets in priority
        self._readers = group.threads
        self._demoting = threading.Lock()
        self._compacting = threading.Lock()
        self._closed = False
        self.compact_below = 0.5  # live share under which a sealed segment is compacted
        self._lock = threading.Lock()
        self._inflight: dict[tuple[int, int, int, int], Future[memoryview]] = {}
        self._layout: tuple[str, tuple[int, ...]] | None = self._load_layout()

    @staticmethod
    def connect(target: str | os.PathLike[str] | Sequence[str] | Config, **kwargs: Any
                ) -> RemoteKVPool:
        """The same API on storage nodes: ``target`` is a node URL, a list of them, or a
        config (file) whose ``cluster.nodes`` it uses (``isolane.client.kv_pool``)."""
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
    @property
    def _meta_path(self) -> Path:
        return self.devices[0] / "kvpool" / namespace_folder(self.namespace) / "namespace.json"

    def _load_layout(self) -> tuple[str, tuple[int, ...]] | None:
        meta = read_namespace_meta(self._meta_path, self.namespace)
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
                self._meta_path.parent.mkdir(parents=True, exist_ok=True)
                atomic_write(self._meta_path, json.dumps(
                    {"dtype": dtype, "shape": list(shape), "chunk_tokens": self.chunk_tokens,
                     "token_dim": token_dim}))
                self._layout = (dtype, shape)
                self.token_dim = token_dim
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

    def _locate_many(self, segment_log: SegmentLog, keys: list[bytes]
                     ) -> list[Location | None]:
        """``segment_log.locate_many(keys)``, but a stored block of the wrong size (see
        ``block_bytes``) is dropped and reads as a miss."""
        locs = segment_log.locate_many(keys)
        size = self.block_bytes
        if size is None:
            return locs
        for i, loc in enumerate(locs):
            if loc is not None and loc.value_length != size:
                log.warning("dropping KV block %s from %s: it holds %d bytes, a block of "
                            "namespace '%s' is %d", loc.key.hex(), segment_log.folder,
                            loc.value_length, self.namespace, size)
                segment_log.delete(loc.key)
                locs[i] = None
        return locs

    @property
    def layout(self) -> tuple[str, tuple[int, ...]] | None:
        """``(dtype, shape without the token dimension)`` fixed by the first put, or None."""
        return self._layout

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
        if size is not None and any(v.nbytes != size for v in views):
            for key, v in zip(keys, views, strict=True):
                n = v.nbytes
                if n != size:
                    raise InvalidArgumentError(
                        f"KV block {bytes(key).hex()} is {n} bytes; a block of namespace "
                        f"'{self.namespace}' is {size} bytes ({self.chunk_tokens} tokens of "
                        f"dtype {self._layout[0] if self._layout else '?'}); nothing was "
                        "stored")
        stored = 0
        runs = ([(0, 0, len(keys))] if len(self.logs) == 1 and keys else  # no placement
                _merge_runs(device_runs(keys, len(self.logs),
                                        self.config.cluster.segment_blocks, chain)))
        for device, start, stop in runs:
            # Views, not copies: the log checksums and writes them before append_blocks
            # returns, and the memory tier copies only what it admits.
            run_keys = [bytes(k) for k in keys[start:stop]]
            local = self._local_many(run_keys)
            if local.any():
                fresh = np.flatnonzero(~local).tolist()
                run_keys = [run_keys[i] for i in fresh]
                run_views = [views[start + i] for i in fresh]
            else:
                run_views = views[start:stop]
            if run_keys:
                stored += self._append(device, run_keys, run_views)
        return stored

    def _append(self, device: int, keys: list[bytes], views: list[memoryview]) -> int:
        try:
            self._put_lane.submit_sized(sum(v.nbytes for v in views),
                                        self.logs[device].append_blocks, keys, views).result()
        except (CapacityError, StorageError) as exc:
            log.warning("KV blocks not stored on %s: %s", self.devices[device], exc)
            return 0
        if self.memory.budget_bytes:
            for key, value in zip(keys, views, strict=True):
                self.memory.put(key, value)
        if (self.capacity is not None and self.disk_budget is not None
                and self.logs[device].total_bytes > self.disk_budget):
            self.scheduler.lane(JobKind.DEMOTE).submit(self._demote_quietly)
        return len(keys)

    def demote(self, target_bytes: int | None = None) -> int:
        """Move the oldest sealed segments of each device to the capacity tier until the
        device holds at most ``target_bytes`` (default: 80% of the disk budget). The
        local copy goes only after the upload committed. Returns segments moved."""
        if self.capacity is None:
            raise ConfigError("device_groups", "demotion needs a device group with role "
                              "'capacity' (e.g. an s3:// URL)")
        if target_bytes is None:
            target_bytes = int(self.disk_budget * 0.8) if self.disk_budget else 0
        moved = 0
        with self._demoting:
            if self._closed:
                return 0
            for device, segment_log in enumerate(self.logs):
                for info in segment_log.segments():
                    if segment_log.total_bytes <= target_bytes:
                        break
                    if info.state != "sealed":
                        continue
                    locations = segment_log.live_locations(info.segment_id)
                    if locations:
                        self.capacity.upload(device, info.segment_id,
                                             info.path.read_bytes(), locations)
                    segment_log.evict_segment(info.segment_id)
                    moved += 1
        return moved

    def _demote_quietly(self) -> None:
        try:
            self.demote()
        except (StorageError, OSError) as exc:  # retried after the next put
            log.warning("KV demotion to the capacity tier failed, will retry: %s", exc)

    def get_blocks(self, keys: Sequence[bytes]) -> list[Block | None]:
        """Each block's bytes (a read-only buffer: ``bytes``, or a ``memoryview`` into
        the range read that fetched it), or None for a miss (also for a damaged block,
        which is dropped)."""
        self._check_open()
        out: list[Block | None] = [self.memory.get(k) for k in keys]
        missing = [i for i, v in enumerate(out) if v is None]
        if not missing:
            return out
        found = self._read_disk([keys[i] for i in missing])
        for i, value in zip(missing, found, strict=True):
            if value is not None:
                out[i] = value
                self.memory.put(keys[i], value)  # promote
        remote = [i for i in missing if out[i] is None]
        if remote and self.capacity is not None:
            try:
                fetched = self.capacity.read([keys[i] for i in remote])
            except StorageError as exc:
                log.warning("KV capacity tier unreachable, reading as misses: %s", exc)
                fetched = [None] * len(remote)
            hot = []
            size = self.block_bytes
            for i, value in zip(remote, fetched, strict=True):
                if value is not None and (size is None or len(value) == size):
                    out[i] = value
                    hot.append((keys[i], value))
            if hot:  # promote: back to local disk (appended together) and memory
                self.put_blocks([k for k, _ in hot], [v for _, v in hot])
        return out

    def lookup_blocks(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` are stored in some tier (no data read)."""
        return len(self._present_prefix(list(keys)))

    def delete_blocks(self, keys: Sequence[bytes]) -> int:
        """Drop these blocks from every tier; returns how many were stored."""
        self._check_open()
        n = 0
        for key in keys:
            present = key in self.memory
            self.memory.remove(key)
            for segment_log in self.logs:
                present = segment_log.delete(key) or present
            if self.capacity is not None and key in self.capacity:
                self.capacity.forget([key])
                present = True
            n += present
        if n:
            self.scheduler.lane(JobKind.COMPACT).submit(self._compact_in_background)
        return n

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

    def stats(self) -> dict[str, Any]:
        m = self.memory.stats
        return {
            "namespace": self.namespace, "chunk_tokens": self.chunk_tokens,
            "memory": {"bytes": self.memory.nbytes, "blocks": len(self.memory),
                       "budget": self.memory.budget_bytes, "policy": self.memory.policy_name,
                       "hits": m.hits, "misses": m.misses, "evictions": m.evictions},
            "disk": [{"device": str(d), "blocks": len(lg), "bytes": lg.total_bytes}
                     for d, lg in zip(self.devices, self.logs, strict=True)],
            "capacity": None if self.capacity is None else {
                "url": self.capacity.store.url, "blocks": len(self.capacity),
                "bytes": self.capacity.nbytes},
        }

    def verify(self) -> dict[str, Any]:
        """Read back every stored block and check its checksum; damaged blocks are
        dropped (they would read as misses anyway). Also reports, once, the records
        dropped since the last verify by this process or an earlier one: by reopen scans
        (damage, torn tails) and by reads that found a block damaged
        (``SegmentLog.damage_report``). Returns ``checked`` (blocks read), ``damaged``
        (blocks that failed plus records dropped earlier) and ``dropped_earlier`` (one
        dict per dropped byte range)."""
        checked = damaged = 0
        dropped: list[dict[str, Any]] = []
        for device, segment_log in zip(self.devices, self.logs, strict=True):
            for drop in segment_log.damage_report():
                dropped.append({"device": str(device), **dataclasses.asdict(drop)})
            stored = segment_log.keys()  # a snapshot: damaged keys are deleted as we go
            for key in stored:
                try:
                    segment_log.get(key)
                except StaleLocationError:
                    continue  # compacted or evicted meanwhile
                except IntegrityError as exc:
                    log.warning("dropping damaged KV block: %s", exc)
                    segment_log.drop_damaged(key, exc)
                    self.memory.remove(key)
                    damaged += 1
                checked += 1
            segment_log.clear_damage()
        return {"checked": checked, "damaged": damaged + len(dropped),
                "dropped_earlier": dropped}

    def compact(self, min_live_ratio: float = 0.5, *, wait: bool = True) -> int:
        """Compact sealed segments whose live share fell below ``min_live_ratio`` (on the
        background lane, or in the calling thread with ``wait=False`` when it already is
        one); returns how many were compacted."""
        done = 0
        for segment_log in self.logs:
            for info in segment_log.segments():
                if info.state == "sealed" and should_compact(
                        info.live_bytes, info.file_bytes, min_live_ratio):
                    try:
                        if wait:
                            self.scheduler.lane(JobKind.COMPACT).submit(
                                segment_log.compact, info.segment_id).result()
                        else:
                            segment_log.compact(info.segment_id)
                    except StaleLocationError:
                        continue  # compacted or evicted meanwhile by another pass
                    done += 1
        return done

    def close(self) -> None:
        with self._demoting, self._compacting:  # let background work finish first
            self._closed = True
            for segment_log in self.logs:
                segment_log.close()

    def __enter__(self) -> KVPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgumentError(f"KV pool of namespace '{self.namespace}' is closed; "
                                       "open a new KVPool to use it again")

    def _local_many(self, keys: list[bytes]) -> npt.NDArray[np.bool_]:
        """Whether each key is on some local device (one vectorised probe per log)."""
        found = np.zeros(len(keys), bool)
        for lg in self.logs:
            found |= lg.contains_many(keys)
        return found

    def _present_prefix(self, keys: list[bytes]) -> list[bytes]:
        """The leading keys stored in some tier (no data read): only the prefix up to
        the first block stored nowhere can be useful."""
        self._check_open()
        if not keys:
            return keys
        keys = [bytes(k) for k in keys]
        present = self._local_many(keys) | self.memory.contains_many(keys)
        if self.capacity is not None and not present.all():
            for i in np.flatnonzero(~present).tolist():
                present[i] = keys[i] in self.capacity
                if not present[i]:
                    break
        n = len(keys) if present.all() else int(np.argmin(present))
        return keys[:n]

    def _read_prefix(self, keys: list[bytes], dests: Destinations) -> int:
        keys = self._present_prefix(keys)
        return self._fill(keys, dests(len(keys))) if keys else 0

    def _prefetch_prefix(self, keys: list[bytes]) -> Future[int]:
        def warm() -> int:
            n = 0
            for block in self.get_blocks(self._present_prefix(keys)):
                if block is None:
                    break
                n += 1
            return n * self.chunk_tokens

        return self._lane.submit(warm)

    def _fill(self, keys: Sequence[bytes], dests: Sequence[torch.Tensor]) -> int:
        """Fill ``dests[i]`` with block ``keys[i]``: memory tier hits are copied, local
        disk blocks are read straight into the destination, the rest (capacity tier, or
        moved by compaction meanwhile) go through ``get_blocks``. Returns how many leading
        blocks were filled."""
        filled = [False] * len(keys)
        on_disk: list[int] = []
        for i, key in enumerate(keys):
            block = self.memory.get(key)
            if block is None:
                on_disk.append(i)
            else:
                dests[i].copy_(self._block_tensor(block))
                filled[i] = True
        scattered = self._scatter_disk([keys[i] for i in on_disk], [dests[i] for i in on_disk])
        for i, done in zip(on_disk, scattered, strict=True):
            filled[i] = done
        rest = [i for i in on_disk if not filled[i]]
        if rest:
            for i, found in zip(rest, self.get_blocks([keys[i] for i in rest]), strict=True):
                if found is not None:
                    dests[i].copy_(self._block_tensor(found))
                    filled[i] = True
        n = 0
        while n < len(filled) and filled[n]:
            n += 1
        return n

    def _scatter_disk(self, keys: Sequence[bytes], dests: Sequence[torch.Tensor]) -> list[bool]:
        """Read local-disk blocks straight into ``dests`` (see ``reader.py``); returns
        which were read and verified. Damaged blocks are dropped."""
        done = [False] * len(keys)
        if not keys:
            return done
        bounce: dict[int, torch.Tensor] = {}
        targets: dict[int, list[memoryview]] = {}
        bases: dict[int, memoryview] = {}  # one view per storage, not one per block
        for i, dest in enumerate(dests):
            base = None
            if dest.device.type == "cpu":
                ptr = dest.untyped_storage().data_ptr()
                base = bases.get(ptr)
                if base is None:
                    base = bases[ptr] = storage_bytes(dest)
            chunks = tensor_chunks(dest, base)
            if chunks is None:  # not CPU memory, or too fragmented: read, then copy
                bounce[i] = torch.empty(dest.shape, dtype=dest.dtype)
                chunks = tensor_chunks(bounce[i])
                assert chunks is not None
            targets[i] = chunks
        jobs: list[tuple[SegmentLog, Future[PieceOutcome]]] = []
        claimed = [False] * len(keys)
        for segment_log in self.logs:
            unclaimed = [i for i in range(len(keys)) if not claimed[i]]
            locations: list[Location | None] = [None] * len(keys)
            for i, loc in zip(unclaimed, self._locate_many(
                    segment_log, [bytes(keys[i]) for i in unclaimed]), strict=True):
                if loc is not None:
                    locations[i] = loc
                    claimed[i] = True
            if not any(locations):
                continue
            ranges = coalesce_ranges(locations)
            total = sum(r.nbytes for r in ranges)
            for piece in split_ranges(ranges, piece_bytes_for(total, self._readers)):
                jobs.append((segment_log, self._lane.submit_sized(
                    piece.nbytes, scatter_piece, segment_log, piece, targets)))
        for segment_log, fut in jobs:
            outcome = fut.result()
            for i in outcome.verified:
                done[i] = True
            for i, exc in outcome.damaged:
                log.warning("dropping damaged KV block: %s", exc)
                segment_log.drop_damaged(keys[i], exc)
        for i, tensor in bounce.items():
            if done[i]:
                dests[i].copy_(tensor)
        if self.memory.budget_bytes:
            for i in range(len(keys)):
                if done[i]:
                    self.memory.put(keys[i], block_bytes_of(dests[i]))
        return done

    def _read_disk(self, keys: Sequence[bytes]) -> list[Block | None]:
        out: list[Block | None] = [None] * len(keys)
        for device, segment_log in enumerate(self.logs):
            todo = [i for i, v in enumerate(out) if v is None]
            locations = self._locate_many(segment_log, [bytes(keys[i]) for i in todo])
            if not any(locations):
                continue
            ranges = coalesce_ranges(locations)
            total = sum(r.nbytes for r in ranges)
            pieces = split_ranges(ranges, piece_bytes_for(total, self._readers))
            futures = [(r, self._read_range(device, r)) for r in pieces]
            for read_range, fut in futures:
                try:
                    run = fut.result()
                except StaleLocationError:
                    continue  # compacted meanwhile: the next get finds the new location
                for position, location in read_range.members:
                    try:
                        value = verify_record(run, read_range.start, location)
                    except IntegrityError as exc:
                        log.warning("dropping damaged KV block: %s", exc)
                        segment_log.drop_damaged(location.key, exc)
                        continue
                    out[todo[position]] = value  # a view into the run: no copy
        return out

    def _read_range(self, device: int, read_range: ReadRange) -> Future[memoryview]:
        """One pread on the read lane; concurrent gets of the same range share it.

        The lane is entered without holding ``_lock``: submitting may wait for the lane's
        in-flight budget, and the reads that free it need ``_lock`` when they finish."""
        ident = (device, read_range.segment_id, read_range.start, read_range.end)
        with self._lock:
            shared = self._inflight.get(ident)
            if shared is not None:
                return shared
            fut: Future[memoryview] = Future()
            self._inflight[ident] = fut

        def read() -> None:
            try:
                run = self.logs[device].read_run(read_range.segment_id, read_range.start,
                                                 read_range.end)
            except BaseException as exc:
                self._drop_inflight(ident)
                fut.set_exception(exc)
            else:
                self._drop_inflight(ident)
                fut.set_result(run)

        try:
            self._lane.submit_sized(read_range.nbytes, read)
        except BaseException as exc:
            self._drop_inflight(ident)
            fut.set_exception(exc)
        return fut

    def _drop_inflight(self, ident: tuple[int, int, int, int]) -> None:
        with self._lock:
            self._inflight.pop(ident, None)

    def _forget(self, keys: list[bytes]) -> None:
        """Disk evicted these on its own; the memory tier may keep its copies."""


def open_namespace(config: Config | str | os.PathLike[str] | None, namespace: str, *,
                   memory_budget: int | None = 0,
                   scheduler: LaneScheduler | None = None) -> KVPool:
    """Open a stored namespace with the chunk_tokens/token_dim it was stored with.
    An unknown namespace raises ``KeyNotFoundError`` and creates nothing (a bare
    ``KVPool(config, namespace=typo)`` would start an empty one); an invalid name
    ``InvalidNameError``; an unreadable ``namespace.json`` ``IntegrityError``."""
    config = _resolve(config)
    check_namespace(namespace)
    device = Path(config.require_group("read").devices[0])
    meta_path = namespace_dir(device, namespace) / "namespace.json"
    meta = read_namespace_meta(meta_path, namespace)
    if meta is None:
        raise KeyNotFoundError(f"KV namespace '{namespace}' not found; run 'isolane kv ls' "
                               "to list namespaces")
    return KVPool(config, namespace=namespace, chunk_tokens=meta.chunk_tokens,
                  token_dim=meta.token_dim, memory_budget=memory_budget, scheduler=scheduler)


@dataclass(frozen=True)
class NamespaceMeta:
    """A namespace's ``namespace.json``: its layout, fixed by the first put."""

    dtype: str
    shape: tuple[int, ...]
    chunk_tokens: int
    token_dim: int


def read_namespace_meta(path: Path, namespace: str) -> NamespaceMeta | None:
    """The namespace file at ``path``, None when there is none; ``IntegrityError`` naming
    the file and the way out when it does not parse (it is never followed as a link)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StorageError(exc.errno, f"cannot read the KV namespace file {path}: "
                           f"{exc.strerror}; check its permissions (a symbolic link is "
                           "refused: replace it by the file)") from None
    with open(fd, "rb") as f:
        raw = f.read(1 << 16)
    try:
        meta = json.loads(raw)
        dtype, shape = meta["dtype"], tuple(meta["shape"])
        chunk_tokens, token_dim = meta["chunk_tokens"], meta["token_dim"]
        if not (isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype)
                and all(type(d) is int and d > 0 for d in shape)
                and type(chunk_tokens) is int and chunk_tokens > 0
                and type(token_dim) is int and -len(shape) - 1 <= token_dim <= len(shape)):
            raise ValueError("fields out of range")
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise IntegrityError(f"KV namespace file {path}", f"unreadable ({exc})",
                             hint=f"drop the namespace with 'isolane kv evict --namespace "
                             f"{namespace}' (its blocks are recomputed)") from None
    return NamespaceMeta(dtype, shape, chunk_tokens, token_dim)


def namespace_dir(device: str | os.PathLike[str], namespace: str) -> Path:
    """``<device>/kvpool/<folder of namespace>``, refused (StorageError) when it or its
    ``segments`` folder is a symbolic link: the pool never reads, writes or deletes
    through a link inside its store."""
    folder = Path(device) / "kvpool" / namespace_folder(namespace)
    for path in (folder, folder / "segments"):
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            break
        if stat.S_ISLNK(mode):
            raise StorageError(f"{path} is a symbolic link: isolane never follows links "
                               f"inside its KV pool; remove the link (its target is not "
                               f"part of namespace '{namespace}')")
    return folder


def list_namespaces(config: Config | str | os.PathLike[str] | None = None,
                    problems: list[IsolaneError] | None = None) -> list[dict[str, Any]]:
    """Every namespace stored on the read group: blocks and bytes per device and tier.
    Opens each namespace's logs briefly (fails if a running node holds them).

    A folder that is not a namespace isolane wrote (a name that does not decode, a
    symbolic link) or a namespace whose ``namespace.json`` is unreadable is left out
    and described in ``problems`` (when given; else the first one is raised)."""
    config = _resolve(config)
    names: set[str] = set()
    found: dict[str, IsolaneError] = {}  # one report per problem, not per device

    def problem(exc: IsolaneError) -> None:
        if problems is None:
            raise exc
        found.setdefault(str(exc), exc)

    for device in config.require_group("read").devices:
        root = Path(device) / "kvpool"
        if not root.is_dir():
            continue
        for entry in sorted(os.scandir(root), key=lambda e: e.name):
            if entry.is_symlink():
                problem(StorageError(f"{entry.path} is a symbolic link: isolane never "
                                     "follows links inside its KV pool; remove the link"))
                continue
            if not os.path.lexists(Path(entry.path) / "namespace.json"):
                continue
            try:
                names.add(namespace_from_folder(entry.name, str(root)))
            except InvalidNameError as exc:
                problem(exc)
    out = []
    for name in sorted(names):
        try:
            pool = open_namespace(config, name)
        except (IntegrityError, StorageError) as exc:
            if isinstance(exc, StorageError) and exc.errno == errno.EBUSY:
                raise  # open in a running node: the whole listing is refused
            problem(exc)
            continue
        with pool:
            stats = pool.stats()
            dtype, shape = pool._layout or ("", ())
            block_shape = shape_with_tokens(shape, pool.token_dim, pool.chunk_tokens)
        out.append({"namespace": name, "dtype": dtype, "block_shape": block_shape,
                    "blocks": sum(d["blocks"] for d in stats["disk"]),
                    "disk_bytes": sum(d["bytes"] for d in stats["disk"]),
                    "devices": stats["disk"], "capacity": stats["capacity"]})
    if problems is not None:
        problems.extend(found.values())
    return out


def count_blocks(config: Config | str | os.PathLike[str] | None, namespace: str) -> int:
    """Blocks of ``namespace`` on the read group's disks, counted through its segment
    logs (so a process holding them makes this fail); works on a namespace whose
    ``namespace.json`` is damaged too. KeyNotFoundError for an unknown namespace."""
    config = _resolve(config)
    try:
        with open_namespace(config, namespace) as pool:
            return sum(len(lg) for lg in pool.logs)
    except IntegrityError as exc:  # a damaged namespace.json: the logs still open
        log.warning("%s", exc)
    blocks = 0
    for device in config.require_group("read").devices:
        folder = namespace_dir(device, namespace) / "segments"
        if folder.is_dir():
            with SegmentLog(folder) as segment_log:
                blocks += len(segment_log)
    return blocks


def drop_namespace(config: Config | str | os.PathLike[str] | None, namespace: str) -> int:
    """Delete every block of ``namespace`` on every device; returns the blocks dropped.
    Refuses (StorageError) while another process has the namespace open. Deletes only
    inside each device's ``kvpool`` folder, never through a symbolic link."""
    config = _resolve(config)
    blocks = count_blocks(config, namespace)
    for device in config.require_group("read").devices:
        root = Path(device) / "kvpool"
        remove_tree(namespace_dir(device, namespace), within=root)
    return blocks


def _merge_runs(runs: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Adjacent runs bound for the same device as one run (one append per device run:
    with one device, a whole batch is one append)."""
    merged: list[tuple[int, int, int]] = []
    for device, start, stop in runs:
        if merged and merged[-1][0] == device and merged[-1][2] == start:
            merged[-1] = (device, merged[-1][1], stop)
        else:
            merged.append((device, start, stop))
    return merged


def _resolve(target: str | os.PathLike[str] | Config | None) -> Config:
    if target is None:
        return default_config()
    if isinstance(target, Config):
        return target
    text = os.fspath(target)
    if text.endswith((".yaml", ".yml")) and Path(text).is_file():
        return load_config(text)
    return config_from_dict({"device_groups": {"kv": {"role": "read", "devices": [text]}}})


