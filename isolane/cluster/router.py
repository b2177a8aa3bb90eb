"""ClusterRouter: where a RemoteKVPool sends each segment of a chain of KV blocks (no
I/O, no threads: the client reports what it saw and when, this decides).

It is the client's ``Router`` (``routing.py``) built from the pure pieces of
``isolane.kvpool``: chain segments (``chain_segments``: a chain is cut into segments of
``segment_blocks`` blocks, each placed by its own segment digest), the consistent-hash
ring or rendezvous placement (``placement``, ``cluster.placement``) and its membership
(``Membership``: health, moves on join/leave), bounded loads (``BoundedLoadRouter``).
Every decision below is per segment (its own digest and its chain's home digest; the
home is what nodes record and what moves on join/leave).

- **Writes** (``place``) and **reads** (``read_candidates``): ``chain_placement.
  ChainPlacement`` with the loads below: a segment goes to its chain's home node (the
  live owner of the chain's home digest, ``chain_segments``: a chain lives on one node,
  so a lost node costs about 1/N of the cached prefixes), or to the node this client
  placed it on last, while that node is within its load bound and its share of the
  segments this client placed lately; else bounded loads along the walk of the
  segment's own digest. Reads try, in order, previous rings' homes (while a move is
  pending: a move copies, then deletes, so the order never loses a block), where this
  client wrote it last, the home's live owner, the segment's own live owner, the first
  node past the home along its own walk, and where the write rule would place it now.
  A segment that starts past a small share of its home node's cache (``cache_blocks``
  of the node's ``/v1/stats`` for this client's namespace) is placed by its own digest
  instead (``chain_placement.spills``); reads try both.
  Down nodes are left out: their segments read as misses, never as errors.
- **Load** of a node, the unit of bounded loads: the expected wait of one more request,
  ``latency * (1 + queue)`` seconds. ``latency`` is the larger of this client's decayed
  average of request time per 4 MiB moved (``finished``; it fades with a half-life of
  ``latency_half_life_s`` without new samples, so a node that was slow gets traffic again
  and is measured anew) and the node's reported read-lane p99; ``queue`` the larger of
  this client's requests in flight to the node and the node's reported in-flight
  requests (``/v1/stats``, polled by the client). Below ``slow_s`` a node keeps its
  chains whatever the others' loads (loads that low are noise, not worth a miss).
- **Health**: a failed or timed-out request takes a node down at once (``failed``);
  the background probes (``observe``) bring it back on their first success and take it
  down after ``fail_after`` failures in a row.

Thread-safe: every method takes one lock (the pieces it composes are not thread-safe);
fork-safe (a forked child gets a fresh lock).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from isolane.cluster.chain_placement import DEFAULT_WRITE_HALF_LIFE, ChainPlacement
from isolane.cluster.chain_segments import (
    DEFAULT_SEGMENT_BLOCKS,
    ChainSegment,
    check_segment_blocks,
    plan_segments,
    segment_digest,
)
from isolane.cluster.membership import Membership
from isolane.cluster.rendezvous import check_placement
from isolane.cluster.ring import (
    DEFAULT_LOAD_BOUND,
    DEFAULT_PREFIX_BLOCKS,
    DEFAULT_VNODES,
    NodePlacement,
    prefix_digest,
)
from isolane.errors import InvalidArgumentError
from isolane.lanes.forksafe import ForkSafe

if TYPE_CHECKING:
    from isolane.config import ClusterConfig

LATENCY_UNIT_BYTES = 4 << 20
"""Latency samples are seconds per this many bytes moved (at least one unit a request),
so a large batch is not taken for a slow node."""
PLACEMENT_COST_S = 0.001
"""What one more request adds to a node's load (an idle loopback request, seconds)."""
LATENCY_WEIGHT = 0.3  # weight of a new sample in the moving average


@dataclass(frozen=True)
class ClusterOptions:
    """Routing settings of a cluster client (``cluster.load_bound``/``segment_blocks``/
    ``prefix_blocks`` in the config; the rest are for tuning and tests)."""

    load_bound: float = DEFAULT_LOAD_BOUND  # c of bounded loads
    segment_blocks: int = DEFAULT_SEGMENT_BLOCKS  # S: blocks per chain segment
    vnodes: int = DEFAULT_VNODES
    prefix_blocks: int = DEFAULT_PREFIX_BLOCKS  # k of the routing digest
    slow_s: float = 0.1  # a node expected to answer faster keeps its chains
    latency_half_life_s: float = 5.0
    fail_after: int = 3  # failed probes in a row before a node is down
    remember_chains: int = 1 << 16  # segments whose last write placement is remembered
    placement: str = "ring"  # how segment digests go to nodes: "ring" or "rendezvous"
    write_half_life: float = DEFAULT_WRITE_HALF_LIFE  # segments placed (ChainPlacement)

    @classmethod
    def from_config(cls, cluster: ClusterConfig) -> ClusterOptions:
        """``cluster.load_bound``/``segment_blocks``/``prefix_blocks``/``placement``."""
        return cls(load_bound=cluster.load_bound, segment_blocks=cluster.segment_blocks,
                   prefix_blocks=cluster.prefix_blocks, placement=cluster.placement)

    def __post_init__(self) -> None:
        positive = ("slow_s", "latency_half_life_s", "write_half_life")
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not 0 < value < math.inf:
                raise InvalidArgumentError(f"{name} must be a positive number, got {value!r}")
        for name in ("vnodes", "prefix_blocks", "fail_after", "remember_chains"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"{name} must be a whole number >= 1, "
                                           f"got {value!r}")
        check_segment_blocks(self.segment_blocks)
        check_placement(self.placement)


@dataclass(frozen=True)
class NodeLoad:
    """What a node's load report (``GET /v1/stats``) says about its load."""

    requests: int  # in flight, the report's own request not counted
    read_p99_s: float | None  # the read lane's recent p99


def load_from_stats(stats: Mapping[str, Any]) -> NodeLoad:
    """The parts of a ``/v1/stats`` answer routing uses (absent fields count as idle)."""
    inflight = stats.get("inflight")
    requests = inflight.get("requests") if isinstance(inflight, Mapping) else None
    lanes = stats.get("lanes")
    read = lanes.get("read") if isinstance(lanes, Mapping) else None
    p99 = read.get("p99") if isinstance(read, Mapping) else None
    return NodeLoad(
        requests=max(0, int(requests) - 1) if isinstance(requests, int) else 0,
        read_p99_s=float(p99) / 1000 if isinstance(p99, (int, float)) and p99 >= 0 else None)


def cache_blocks_from_stats(stats: Mapping[str, Any], namespace: str) -> int | None:
    """The blocks ``namespace`` keeps on the node before it evicts, from its ``/v1/stats``
    (``kv.cache_blocks``); None when the node reports none (unbounded, or the namespace
    not open there yet)."""
    kv = stats.get("kv")
    sizes = kv.get("cache_blocks") if isinstance(kv, Mapping) else None
    blocks = sizes.get(namespace) if isinstance(sizes, Mapping) else None
    if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 0:
        return None
    return blocks


class ClusterRouter(ForkSafe):
    """See the module docstring. ``nodes``: the cluster's node URLs (``cluster.nodes``).
    ``clock``: monotonic seconds (tests pass their own)."""

    def __init__(self, nodes: Iterable[str], options: ClusterOptions | None = None, *,
                 clock: Callable[[], float] = time.monotonic,
                 weights: Mapping[str, float] | None = None) -> None:
        self.options = o = options or ClusterOptions()
        self._members = Membership(nodes, vnodes=o.vnodes, weights=weights,
                                   load_bound=o.load_bound,
                                   fail_after=o.fail_after, min_load=o.slow_s,
                                   placement=o.placement)
        self._clock = clock
        self._lock = threading.Lock()
        self._latency: dict[str, tuple[float, float]] = {}  # node -> (s per unit, at)
        self._inflight: dict[str, int] = {}
        self._reported: dict[str, NodeLoad] = {}
        self._chains = ChainPlacement(self._members, remember=o.remember_chains,
                                      write_half_life=o.write_half_life)
        super().__init__()

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()
        self._inflight = {}  # the parent's requests are not the child's

    # -- the Router protocol ------------------------------------------------------------------
    @property
    def nodes(self) -> Sequence[str]:
        """The nodes of the current ring (sorted)."""
        with self._lock:
            return self._members.ring.nodes

    @property
    def segment_blocks(self) -> int:
        return self.options.segment_blocks

    def digest(self, chain: Sequence[bytes]) -> bytes:
        """The routing digest of the chain whose leading keys are ``chain``."""
        return prefix_digest(chain, self.options.prefix_blocks)

    def segments(self, keys: Sequence[bytes], chain: Sequence[bytes] | None = None
                 ) -> list[ChainSegment]:
        """The chain segments of ``keys`` (``chain``: the chain's keys from its first
        block, when ``keys`` do not start it; see ``chain_segments.chain_offset``)."""
        return plan_segments(keys, self.options.segment_blocks, chain=chain,
                             prefix_blocks=self.options.prefix_blocks)

    def owner(self, chain: Sequence[bytes]) -> str:
        """The node to write the first segment of the chain to (``Router`` protocol)."""
        home = segment_digest(self.digest(chain), 0)
        return self.place(home, home)

    def place(self, digest: bytes, home: bytes | None = None, start: int = 0) -> str:
        """The node to write the segment ``digest`` of the chain whose home digest is
        ``home`` to (default: the segment is its chain's home; ``start``: its position
        in the chain, in blocks): this client's last node for it, else the home's live
        owner, while within its load and write bounds; else along the segment's own walk
        (``ChainPlacement.place``). Remembered for its next writes. When every node is
        down, the home's ring owner (the write then fails and is dropped)."""
        return self.place_segment(digest, home, start)[0]

    def place_segment(self, digest: bytes, home: bytes | None = None, start: int = 0
                      ) -> tuple[str, bytes]:
        """``place`` and the home digest the node records the segment under: the
        chain's, or the segment's own when it spills from its home's cache
        (``ChainPlacement.home_for``)."""
        home = digest if home is None else home
        with self._lock:
            home = self._chains.home_for(digest, home, start)
            node = self._chains.place(digest, home, self._loads(self._clock()),
                                      PLACEMENT_COST_S, start)
            return (self._members.ring.owner(home) if node is None else node), home

    # -- reads ----------------------------------------------------------------------------
    def read_candidates(self, digest: bytes, home: bytes | None = None, start: int = 0
                        ) -> list[str]:
        """Live nodes to read the segment ``digest`` of the chain whose home digest is
        ``home`` (default: ``digest``; ``start``: its position in the chain) from, in
        order (module docstring); [] when every node that could hold it is down."""
        home = digest if home is None else home
        with self._lock:
            return self._chains.read_candidates(digest, home, self._loads(self._clock()),
                                                PLACEMENT_COST_S, start)

    # -- observations ---------------------------------------------------------------------
    def started(self, node: str) -> None:
        with self._lock:
            self._inflight[node] = self._inflight.get(node, 0) + 1

    def finished(self, node: str, seconds: float, nbytes: int = 0, *, ok: bool = True
                 ) -> None:
        """A request to ``node`` (``started`` before) took ``seconds`` and moved
        ``nbytes``. A failed one (``ok=False``, e.g. a timeout) counts as a slow answer
        too, for when the node is back; ``failed`` takes it down."""
        with self._lock:
            self._inflight[node] = max(0, self._inflight.get(node, 0) - 1)
            if not self._members.is_known(node):
                return
            now = self._clock()
            sample = seconds / max(1.0, nbytes / LATENCY_UNIT_BYTES)
            # From 0: one slow answer (a namespace opened on first use) is not a slow node.
            before = self._latency.get(node)
            value = (1 - LATENCY_WEIGHT) * (self._decayed(before, now) if before else 0.0)
            self._latency[node] = (value + LATENCY_WEIGHT * sample, now)

    def failed(self, node: str) -> None:
        """A request to ``node`` failed: it is down until a probe succeeds (``observe``)."""
        with self._lock:
            if self._members.is_known(node):
                self._members.mark_down(node)

    def observe(self, node: str, stats: Mapping[str, Any] | None,
                namespace: str | None = None) -> bool:
        """A background probe of ``node``: its ``/v1/stats`` answer, or None when it did
        not answer (``namespace``: the client's, whose cache size on the node the spill
        rule weighs). Returns whether the node is up afterwards."""
        with self._lock:
            if not self._members.is_known(node):
                return False
            if stats is not None:
                self._reported[node] = load_from_stats(stats)
                if namespace is not None:
                    self._chains.set_cache_blocks(node,
                                                  cache_blocks_from_stats(stats, namespace))
            return self._members.observe(node, stats is not None)

    def is_up(self, node: str) -> bool:
        with self._lock:
            return self._members.is_up(node)

    def is_down(self, node: str) -> bool:
        """Whether ``node`` is known to be down (a node not in any ring is not)."""
        with self._lock:
            return node in self._members.down

    # -- membership -----------------------------------------------------------------------
    @property
    def members(self) -> tuple[str, ...]:
        """Every node to probe: the current ring's and those of rings still moving."""
        with self._lock:
            return self._members.members

    @property
    def ring(self) -> NodePlacement:
        with self._lock:
            return self._members.ring

    @property
    def moving(self) -> bool:
        """Whether reads still fall back to previous rings (a move is pending)."""
        with self._lock:
            return bool(self._members.previous)

    @property
    def previous(self) -> tuple[NodePlacement, ...]:
        """Rings whose chains may not have moved yet, newest first."""
        with self._lock:
            return self._members.previous

    def join(self, node: str, weight: float = 1.0) -> tuple[NodePlacement, NodePlacement]:
        """Add ``node`` (or change its weight); returns (previous ring, new ring) for the
        mover."""
        with self._lock:
            old = self._members.join(node, weight)
            return old, self._members.ring

    def leave(self, node: str) -> tuple[NodePlacement, NodePlacement]:
        with self._lock:
            old = self._members.leave(node)
            return old, self._members.ring

    def complete_move(self) -> None:
        with self._lock:
            self._members.complete_move()
            known = set(self._members.members)
            for table in (self._latency, self._reported, self._inflight):
                for node in [n for n in table if n not in known]:
                    del table[node]
            self._chains.forget(known)

    # -- load -----------------------------------------------------------------------------
    def loads(self) -> dict[str, float]:
        """Each node's load (expected seconds of wait), as placements see it now."""
        with self._lock:
            return self._loads(self._clock())

    def describe(self) -> dict[str, Any]:
        """JSON-able: ring, down nodes, loads, pending move (``RemoteKVPool.stats``)."""
        with self._lock:
            now = self._clock()
            return {"nodes": list(self._members.ring.nodes),
                    "down": sorted(self._members.down),
                    "moving": bool(self._members.previous),
                    "loads_s": {n: round(v, 6) for n, v in self._loads(now).items()},
                    "segment_blocks": self.options.segment_blocks,
                    "cache_blocks": {n: int(v) for n, v in
                                     sorted(self._chains.cache_blocks().items())},
                    "placement": self.options.placement}

    def _decayed(self, entry: tuple[float, float], now: float) -> float:
        value, at = entry
        return value * math.pow(0.5, max(0.0, now - at) / self.options.latency_half_life_s)

    def _loads(self, now: float) -> dict[str, float]:
        out: dict[str, float] = {}
        for node in self._members.ring.nodes:
            entry = self._latency.get(node)
            latency = 0.0 if entry is None else self._decayed(entry, now)
            report = self._reported.get(node)
            if report is not None and report.read_p99_s is not None:
                latency = max(latency, report.read_p99_s)
            queue = max(self._inflight.get(node, 0), report.requests if report else 0)
            out[node] = latency * (1 + queue)
        return out
