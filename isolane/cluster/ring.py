"""Routing KV blocks across storage nodes and devices (pure: no I/O, no clock, no threads).

Two levels, both deterministic in every process and on every host (xxh3-64, never
Python's ``hash()``), so every client and node computes the same placement from the
same node list:

1. **Node.** A prompt's blocks are cut into chain segments of ``S`` blocks
   (``isolane.cluster.chain_segments``), and segment ``i`` routes by its segment digest,
   made from ``i`` and the key of its anchor block: for segment 0 the chain's *routing
   digest* (the key of its block ``min(k, len) - 1``, :func:`prefix_digest`), for later
   segments their own first block. Block keys are chained hashes, so a key names the
   whole prefix up to its block: a segment lives on one node and is restored there
   with one sequential read. A key alone does not reveal its chain, so a client that
   sends one block must carry the chain's leading keys with it. Digests are placed on a
   consistent-hash ring with virtual nodes (:class:`HashRing`); adding or removing a
   node moves only that node's share. (``cluster.placement: rendezvous`` places them by
   rendezvous hashing instead, ``isolane.cluster.rendezvous``; both are a
   :class:`NodePlacement`.) (:func:`route_blocks` routes a whole chain by its
   routing digest: the placement before segments, kept for the benchmarks' baselines.)
2. **Device** inside the node: rendezvous hashing of the same digest (:func:`device_for`).

Why ``k = 2`` by default and not 1: prompts that share their first block (a system
prompt) would all land on one node with ``k = 1``. In the Mooncake conversation trace
every request starts with the same block and the second block tells the conversations
apart (``benchmarks/bench_routing.py`` measures k = 1, 2, 4). ``k`` should cover the
prefixes shared across conversations; the price of a larger ``k`` is that a prompt
shorter than ``k`` blocks routes by its last key and changes node when it grows.

On top of the ring, driven by loads the caller passes in: :class:`BoundedLoadRouter`,
consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam, SODA'18): a node
whose load would pass ``c`` x the weighted average passes the placement on to the next
node along the ring; a chain stays on the node that served it last (``prefer``) while
that node is within its bound. (Hot replicas, copies of much-read segments on the next
nodes, were measured and removed: they cost hit rate; ``docs/BENCHMARKS.md``.)

What it costs and buys, measured by ``benchmarks/bench_routing.py`` (``docs/BENCHMARKS.md``,
"KV routing across nodes"): bounded loads hold max/mean load at or below 1.25 where the
plain ring reaches 2-8x on traces with long or shared prefixes, and cost hit rate where
the bound engages (a segment passed on finds no KV on the next node); segments cost hit
rate against per-block hashing where a node's cache holds only a few segments (a chain's
segments fall on its nodes in binomial numbers where per-block hashing spreads S times
finer). Chains sharing more than ``k`` leading blocks share segment 0's node only; their
later segments are anchored at their own first blocks.

Membership, health and moves on join/leave live in ``isolane.cluster.membership``.

Ring layout (version 1; ``docs/FORMATS.md``, "KV routing ring"): node ``n`` with weight
``w`` gets ``max(1, round(vnodes * w))`` points ``xxh3_64(utf8(f"{n}#{i}"))``, sorted by
``(point, node)``. A digest's position is ``xxh3_64(digest)`` (seed 0); its owner is the
node of the first point ``>= position``, wrapping around to the first point.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from itertools import repeat
from types import MappingProxyType
from typing import Protocol

import xxhash

from isolane.errors import InvalidArgumentError

DEFAULT_VNODES = 256
"""Points per node of weight 1: one node's share varies by ~1/sqrt(vnodes) (~6 %)."""
DEFAULT_PREFIX_BLOCKS = 2
"""``k``: a chain routes by the key of its block ``min(k, len) - 1``."""
DEFAULT_LOAD_BOUND = 1.25
"""``c`` of bounded loads (``cluster.load_bound``)."""
MAX_WEIGHT = 64.0
_position = xxhash.xxh3_64_intdigest


def prefix_digest(keys: Sequence[bytes], k: int = DEFAULT_PREFIX_BLOCKS) -> bytes:
    """The routing digest of the chain whose block keys are ``keys`` (first block first):
    the key of block ``min(k, len(keys)) - 1``, which names the first ``k`` blocks."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise InvalidArgumentError(f"k (prefix blocks) must be a whole number >= 1, got {k!r}")
    if not keys:
        raise InvalidArgumentError("a chain needs at least one block key to be routed")
    return bytes(keys[min(k, len(keys)) - 1])


def route_blocks(ring: HashRing, keys: Sequence[bytes], k: int = DEFAULT_PREFIX_BLOCKS) -> str:
    """The node that owns the chain of ``keys`` (all of its blocks live there)."""
    return ring.owner(prefix_digest(keys, k))


def device_for(digest: bytes, n_devices: int) -> int:
    """Index of the device (of ``n_devices``) that holds the chain routed by ``digest``.

    Rendezvous hashing: the device ``i`` with the highest ``xxh3_64(digest, seed=i + 1)``
    (ties: the lowest ``i``). Adding a device moves only the chains that the new device
    wins. Seeds start at 1 so that device choice is independent of the ring position
    (seed 0).
    """
    if isinstance(n_devices, bool) or not isinstance(n_devices, int) or n_devices < 1:
        raise InvalidArgumentError(f"n_devices must be a whole number >= 1, got {n_devices!r}")
    best, best_score = 0, -1
    for i in range(n_devices):
        score = _position(digest, seed=i + 1)
        if score > best_score:
            best, best_score = i, score
    return best


def checked_nodes(names: tuple[str, ...], weights: Mapping[str, float] | None
                  ) -> dict[str, float]:
    """Node -> weight (default 1.0) of a placement over ``names``, checked: at least one
    node, distinct non-empty names without surrounding whitespace, weights in
    ``(0, MAX_WEIGHT]`` naming only listed nodes."""
    if not names:
        raise InvalidArgumentError("a ring needs at least one node (cluster.nodes is empty)")
    for name in names:
        if not isinstance(name, str) or not name or name != name.strip():
            raise InvalidArgumentError(
                f"node names must be non-empty text without surrounding whitespace, "
                f"got {name!r}")
    if len(set(names)) != len(names):
        dupes = sorted({n for n in names if names.count(n) > 1})
        raise InvalidArgumentError(f"node names must be distinct, repeated: {dupes}")
    given = dict(weights or {})
    if unknown := sorted(set(given) - set(names)):
        raise InvalidArgumentError(f"weights name nodes not in the ring: {unknown}")
    out: dict[str, float] = {}
    for name in names:
        w = given.get(name, 1.0)
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 < w <= MAX_WEIGHT:
            raise InvalidArgumentError(
                f"weight of node {name!r} must lie in (0, {MAX_WEIGHT:g}], got {w!r}")
        out[name] = float(w)
    return out


class NodePlacement(Protocol):
    """What placement, bounded loads and moves read of the nodes: :class:`HashRing`
    (``cluster.placement: ring``) or ``rendezvous.RendezvousNodes`` (``rendezvous``).
    Immutable: a change returns new nodes, so the previous ones stay at hand for reads
    of segments not moved yet."""

    @property
    def nodes(self) -> tuple[str, ...]: ...
    def weight(self, node: str) -> float: ...
    def total_weight(self, skip: Collection[str] = ()) -> float: ...
    def __len__(self) -> int: ...
    def __contains__(self, node: object) -> bool: ...
    def owner(self, digest: bytes) -> str: ...
    def walk(self, digest: bytes, *, skip: Collection[str] = ()) -> Iterator[str]: ...
    def successors(self, digest: bytes, n: int, *, skip: Collection[str] = ()
                   ) -> list[str]: ...
    def with_node(self, node: str, weight: float = 1.0) -> NodePlacement: ...
    def without_node(self, node: str) -> NodePlacement: ...


class WeightedNodes:
    """Named nodes with weights, checked (``checked_nodes``) and immutable: the facts
    every placement of digests over nodes shares (:class:`HashRing`,
    ``rendezvous.RendezvousNodes``)."""

    __slots__ = ("_nodes", "_total_weight", "_weights")

    def __init__(self, nodes: Iterable[str], weights: Mapping[str, float] | None) -> None:
        self._weights = checked_nodes(tuple(nodes), weights)
        self._nodes = tuple(sorted(self._weights))
        self._total_weight = sum(self._weights.values())

    # -- facts -----------------------------------------------------------------------------
    @property
    def nodes(self) -> tuple[str, ...]:
        """The nodes, sorted by name."""
        return self._nodes

    @property
    def weights(self) -> Mapping[str, float]:
        """Node -> weight (read-only)."""
        return MappingProxyType(self._weights)

    def weight(self, node: str) -> float:
        return self._weights[node]

    def total_weight(self, skip: Collection[str] = ()) -> float:
        """The sum of the weights of the nodes not in ``skip``."""
        if not skip:
            return self._total_weight
        return sum(w for n, w in self._weights.items() if n not in skip)

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, node: object) -> bool:
        return node in self._weights


class HashRing(WeightedNodes):
    """A consistent-hash ring of named nodes with virtual nodes; immutable.

    ``nodes`` are names exactly as every client spells them (e.g. the URLs of
    ``cluster.nodes``); their order does not matter. ``weights`` (default 1.0 each) are
    relative to a standard node: weight 2 gets twice the points, so twice the keys.
    ``with_node``/``without_node`` return new rings, so the previous ring stays at hand
    for reads of keys not moved yet. Thread-safe (nothing mutates after construction).
    """

    __slots__ = ("_owners", "_points", "_vnodes")

    def __init__(self, nodes: Iterable[str], *, vnodes: int = DEFAULT_VNODES,
                 weights: Mapping[str, float] | None = None) -> None:
        super().__init__(nodes, weights)
        if isinstance(vnodes, bool) or not isinstance(vnodes, int) or vnodes < 1:
            raise InvalidArgumentError(f"vnodes must be a whole number >= 1, got {vnodes!r}")
        self._vnodes = vnodes
        points = sorted(
            (_position(f"{name}#{i}".encode()), name)
            for name in self._nodes
            for i in range(max(1, round(vnodes * self._weights[name]))))
        self._points = [p for p, _ in points]
        self._owners = [n for _, n in points]

    # -- facts -----------------------------------------------------------------------------
    @property
    def vnodes(self) -> int:
        return self._vnodes

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, HashRing):
            return NotImplemented
        return self._vnodes == other._vnodes and self._weights == other._weights

    def __hash__(self) -> int:
        return hash((self._vnodes, tuple(sorted(self._weights.items()))))

    def __repr__(self) -> str:
        return f"HashRing({list(self._nodes)!r}, vnodes={self._vnodes})"

    def shares(self) -> dict[str, float]:
        """The fraction of the hash space each node owns (sums to 1)."""
        size = 1 << 64
        out = dict.fromkeys(self._nodes, 0.0)
        prev = self._points[-1] - size  # the arc ending at the first point wraps around
        for point, owner in zip(self._points, self._owners, strict=True):
            out[owner] += (point - prev) / size
            prev = point
        return out

    def points(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """The ring's points in order and the node of each (for vectorised lookups: the
        owner of position ``p`` is that of the first point ``>= p``, wrapping around)."""
        return tuple(self._points), tuple(self._owners)

    # -- lookups ---------------------------------------------------------------------------
    def _start(self, digest: bytes) -> int:
        i = bisect.bisect_left(self._points, _position(digest))
        return 0 if i == len(self._points) else i

    def owner(self, digest: bytes) -> str:
        """The node that owns ``digest`` (a routing digest, see :func:`prefix_digest`)."""
        return self._owners[self._start(digest)]

    def walk(self, digest: bytes, *, skip: Collection[str] = ()) -> Iterator[str]:
        """Every node once, in ring order from ``digest``'s owner; ``skip`` left out."""
        seen = set(skip)
        left = len(self._nodes) - len(self._weights.keys() & seen)
        owners, n_points = self._owners, len(self._owners)
        i = self._start(digest)
        for _ in range(n_points):
            if left == 0:
                return
            node = owners[i]
            if node not in seen:
                seen.add(node)
                left -= 1
                yield node
            i = i + 1 if i + 1 < n_points else 0

    def successors(self, digest: bytes, n: int, *, skip: Collection[str] = ()) -> list[str]:
        """The first ``n`` distinct nodes along the ring from ``digest``'s owner (fewer
        when the ring has fewer), ``skip`` left out: where a walk from the owner goes."""
        out: list[str] = []
        if n <= 0:
            return out
        for node in self.walk(digest, skip=skip):
            out.append(node)
            if len(out) == n:
                break
        return out

    # -- changes ---------------------------------------------------------------------------
    def with_node(self, node: str, weight: float = 1.0) -> HashRing:
        """A new ring with ``node`` added (or its weight changed)."""
        return HashRing([*self._nodes, node] if node not in self else self._nodes,
                        vnodes=self._vnodes, weights={**self._weights, node: weight})

    def without_node(self, node: str) -> HashRing:
        """A new ring without ``node``; removing the last node is refused."""
        if node not in self:
            raise InvalidArgumentError(f"node {node!r} is not in the ring {list(self._nodes)}")
        weights = {n: w for n, w in self._weights.items() if n != node}
        return HashRing(weights, vnodes=self._vnodes, weights=weights)


class BoundedLoadRouter:
    """Consistent hashing with bounded loads over ``ring``: ``place(digest, loads)``
    walks the ring from the owner and takes the first node that stays within its bound
    after the placement.

    ``loads`` maps node -> current load in any unit (in-flight bytes from the nodes'
    load reports, blocks served, ...; missing nodes count 0) and ``cost`` is what the
    placement adds, in the same unit. Node ``i``'s bound is ``c * (sum(loads) + cost) *
    w_i / sum(w)``, and never less than ``min_load * w_i`` (loads that low are not worth
    giving up locality for: an idle cluster keeps every chain on its owner).

    1. The first node along the walk with ``load + cost <= bound`` takes it: no load
       passes ``c`` x its share of the average.
    2. If none can (a cold start, or a cost large next to the loads), the first node
       whose load is still below its bound takes it (the paper's rule: a bin below
       capacity takes the ball). The loads sum to less than the bounds, so one exists;
       it ends at most one ``cost`` above its bound.

    With unit costs and integer loads no load passes ``ceil(c * average)``, the
    paper's guarantee. ``prefer`` (where the chain was served last, if the caller
    remembers) is taken first while it stays within its bound: a chain that was passed
    on stays where its newest blocks are instead of going back and forth. Deterministic
    given ``loads`` and ``prefer``; nodes in ``skip`` (down) count for nothing.
    Immutable, so thread-safe.
    """

    __slots__ = ("c", "min_load", "ring")

    def __init__(self, ring: NodePlacement, c: float = DEFAULT_LOAD_BOUND, *,
                 min_load: float = 0.0) -> None:
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not 1 <= c < math.inf:
            raise InvalidArgumentError(
                f"c (cluster.load_bound) must be a finite number >= 1, got {c!r}")
        if not (isinstance(min_load, (int, float)) and 0 <= min_load < math.inf):
            raise InvalidArgumentError(f"min_load must be a number >= 0, got {min_load!r}")
        self.ring = ring
        self.c = float(c)
        self.min_load = float(min_load)

    def place(self, digest: bytes, loads: Mapping[str, float], cost: float = 1.0, *,
              skip: Collection[str] = (), prefer: str | None = None) -> str | None:
        """The node for one more placement of ``digest``; None when every node is skipped."""
        live, per_weight = self._share(loads, cost, skip)
        if not live:
            return None
        if (prefer is not None and prefer in self.ring and prefer not in skip
                and loads.get(prefer, 0.0) + cost <= self._bound(prefer, per_weight)):
            return prefer
        first_below: str | None = None
        for node in self.ring.walk(digest, skip=skip):
            bound = self._bound(node, per_weight)
            load = loads.get(node, 0.0)
            if load + cost <= bound:
                return node
            if first_below is None and load < bound:
                first_below = node
        if first_below is not None:
            return first_below
        # Unreachable but for float rounding: the loads sum to less than the bounds.
        weight = self.ring.weight
        return min(live, key=lambda n: (loads.get(n, 0.0) / weight(n), n))

    def fits(self, node: str, loads: Mapping[str, float], cost: float = 1.0, *,
             skip: Collection[str] = ()) -> bool:
        """Whether ``node`` stays within its bound after one more placement of ``cost``."""
        live, per_weight = self._share(loads, cost, skip)
        return node in live and loads.get(node, 0.0) + cost <= self._bound(node, per_weight)

    def _share(self, loads: Mapping[str, float], cost: float, skip: Collection[str]
               ) -> tuple[Sequence[str], float]:
        """The live nodes and ``c`` x the total load (with ``cost``) per unit of weight."""
        if not cost > 0:
            raise InvalidArgumentError(f"cost must be > 0, got {cost!r}")
        ring = self.ring
        live = [n for n in ring.nodes if n not in skip] if skip else ring.nodes
        if not live:
            return live, 0.0
        total = sum(map(loads.get, live, repeat(0.0))) + cost  # map: ~5x a generator
        return live, self.c * total / ring.total_weight(skip)

    def _bound(self, node: str, per_weight: float) -> float:
        return max(per_weight, self.min_load) * self.ring.weight(node)

