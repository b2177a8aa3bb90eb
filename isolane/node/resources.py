"""One storage node's resources: the host's LaneScheduler, SnapshotStore and KV pools.

Opened once per ``isolane serve`` (or per test app) and closed once: ``close`` waits
for the node's worker threads, then closes the KV pools (flushing their indexes) and
the snapshot store (waiting for saves and mirrors in flight), then the lanes. Blocking
library calls run in the node's own thread pool (``run``), never on the event loop;
those calls in turn queue their I/O on the lanes.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web

from isolane.config import Config, NodeConfig, is_url
from isolane.errors import InvalidArgumentError
from isolane.lanes.scheduler import LaneScheduler
from isolane.node.load import Load, lane_latency_ms
from isolane.node.namespaces import KVNamespaces
from isolane.node.part_leases import PartLeases
from isolane.node.upload_plans import PlanCounts, UploadPlans
from isolane.snapshot.store import SnapshotStore

log = logging.getLogger(__name__)
T = TypeVar("T")
WORKER_THREADS = 32  # callers waiting on lanes, not I/O threads: the lanes bound the I/O


@dataclass(frozen=True)
class NodeLimits:
    """What one request may carry: the config's ``node`` caps, or ``isolane serve``
    flags over them (``from_config``)."""

    max_request_bytes: int = 256 << 20  # a KV batch body
    max_block_bytes: int = 64 << 20  # one KV block value
    max_batch_blocks: int = 1 << 16  # keys or frames in one KV request
    max_json_bytes: int = 1 << 20  # a JSON request body
    max_upload_bytes: int | None = None  # a snapshot upload's tensor bytes (None: no cap)
    upload_stall_s: float = 120.0  # an upload that sends nothing this long is dropped

    def __post_init__(self) -> None:
        for name in ("max_request_bytes", "max_block_bytes", "max_batch_blocks",
                     "max_json_bytes"):
            if getattr(self, name) < 1:
                raise InvalidArgumentError(f"{name} must be at least 1")
        if self.upload_stall_s <= 0:
            raise InvalidArgumentError("upload_stall_s must be positive")

    @classmethod
    def from_config(cls, node: NodeConfig, **overrides: Any) -> NodeLimits:
        """The caps of ``node`` (the config's ``node:`` section), each override that is
        not None (a serve flag) in place of its field."""
        caps: dict[str, Any] = {
            "max_request_bytes": node.max_request_bytes,
            "max_block_bytes": node.max_block_bytes,
            "max_batch_blocks": node.max_batch_blocks,
            "max_upload_bytes": node.max_upload_bytes}
        caps.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**caps)


class Node:
    """See the module docstring. ``token``: the bearer token every request must carry
    (None: no check). Uploads stream into the write group's chunk files (no spool).
    ``debug_delay_s``: a slow node for fault tests (``isolane serve --debug-delay-ms``)."""

    def __init__(self, config: Config, *, token: str | None = None,
                 limits: NodeLimits | None = None, debug_delay_s: float = 0.0) -> None:
        self.config = config
        self.debug_delay_s = debug_delay_s  # tests: every KV request waits this long first
        self.token = token
        self.limits = limits or NodeLimits.from_config(config.node)
        self.started = time.time()
        self.load = Load()
        self.scheduler = LaneScheduler(config, node=True)
        self.scheduler.join_host()
        self.store: SnapshotStore | None = None
        try:
            if config.group("write") is not None:
                self.store = SnapshotStore(config, scheduler=self.scheduler)
            self.kv = KVNamespaces(config, self.scheduler)
        except BaseException:
            self.scheduler.close()
            raise
        self.executor = ThreadPoolExecutor(WORKER_THREADS, thread_name_prefix="isolane-node")
        self.upload_plans: UploadPlans[Any] = UploadPlans()  # plan request -> its upload
        self.plan_counts = PlanCounts()
        self.part_leases = PartLeases(config.node.part_save_lease_s)  # open DCP saves
        self.draining = False  # set on SIGTERM: finish what is in flight, take nothing new
        self._closed = False

    def require_store(self) -> SnapshotStore:
        if self.store is None:
            raise InvalidArgumentError(f"this node keeps no snapshots: its config "
                                       f"({self.config.source}) has no group with role 'write'")
        return self.store

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` in the node's thread pool."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, functools.partial(fn, *args, **kwargs))

    # -- load report --------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """JSON-able load report (``GET /v1/stats``): what a router weighs nodes by."""
        now = time.time()
        load = self.load.snapshot(now)
        lanes: dict[str, Any] = {}
        for name, lane in self.scheduler.stats().items():
            if not isinstance(lane, dict) or "ops" not in lane:
                continue  # "governor", "isolation": not lanes
            lanes[name] = {**lane_latency_ms(lane),
                           "queue_depth": lane.get("queue_depth", lane.get("queued")),
                           "in_flight_bytes": lane.get("in_flight_bytes"),
                           "bytes_per_s": lane.get("bytes_per_s")}
        return {
            "node": {"pid": os.getpid(), "uptime_s": round(now - self.started, 3),
                     "config": self.config.source, "auth": self.token is not None},
            "inflight": {"requests": load.requests, "bytes": load.bytes_in_flight},
            "recent": {"bytes_in_per_s": round(load.bytes_in_per_s),
                       "bytes_out_per_s": round(load.bytes_out_per_s), "window_s": 10},
            "totals": {"bytes_in": load.bytes_in_total, "bytes_out": load.bytes_out_total},
            "lanes": lanes,
            "host": self.scheduler.host_view(),  # every process on this host config
            "capacity": self.capacity(),
            "kv": {"namespaces": self.kv.stored_names(), "cache_blocks": self.cache_blocks()},
            "snapshots": self.plan_counts.to_dict(),
            "part_saves": self.part_leases.to_dict(),
        }

    def cache_blocks(self) -> dict[str, int]:
        """The blocks each open namespace keeps before it evicts: its disk budget on
        every read device, in blocks of its layout (what clients weigh when they spill a
        long chain's later segments off its home, ``cluster.chain_placement``). Left out:
        namespaces without a layout yet, without a disk budget (bounded by free space
        alone) or with a capacity tier (what the disks drop stays readable there)."""
        out: dict[str, int] = {}
        for name, pool in self.kv.open_pools().items():
            size = pool.block_bytes
            if size and pool.disk_budget is not None and pool.capacity is None:
                out[name] = pool.disk_budget * len(pool.devices) // size
        return out

    def capacity(self) -> dict[str, Any]:
        """Free and total bytes of each local device, per role."""
        out: dict[str, Any] = {}
        for group in self.config.device_groups.values():
            devices: list[dict[str, Any]] = []
            for device in group.devices:
                if is_url(device):
                    devices.append({"device": device, "free_bytes": None, "total_bytes": None})
                    continue
                usage = shutil.disk_usage(_existing(Path(device)))
                devices.append({"device": device, "free_bytes": usage.free,
                                "total_bytes": usage.total})
            free = [d["free_bytes"] for d in devices if d["free_bytes"] is not None]
            out[group.role] = {"group": group.name, "devices": devices,
                               "free_bytes": sum(free) if free else None}
        if "read" in out:  # a per-namespace, per-device cap on top of the free space
            out["read"]["disk_budget"] = self.config.kvpool.disk_budget
        return out

    def close(self) -> None:
        """Idempotent; see the module docstring for the order."""
        if self._closed:
            return
        self._closed = True
        self.executor.shutdown(wait=True)
        try:
            self.kv.close()
        finally:
            try:
                if self.store is not None:
                    self.store.close()
            finally:
                self.scheduler.close()


def _existing(path: Path) -> Path:
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


NODE = web.AppKey("isolane_node", Node)
"""The app's ``Node`` (typed key: no globals)."""
STREAMING = "isolane.streaming"
"""Set on a request by a handler once its response has started (errors can no longer
be answered as JSON: the connection is ended instead)."""
