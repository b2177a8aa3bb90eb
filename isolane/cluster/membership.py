"""Cluster membership for KV routing: the node list, node health and moves on join/leave
(pure: no I/O; the caller probes nodes and moves blocks, this only decides).

- The nodes come from the cluster config (a static list, ``cluster.nodes``).
- Health: the caller reports each probe with :meth:`Membership.observe`; a node that
  fails ``fail_after`` probes in a row is down until a probe succeeds. A down node is
  never returned: its chains route to the next live node of the ring, where they read
  as misses, never as errors. Chains written there while the owner was down stay there
  when it returns (they read as misses on the owner: this is a cache).
- Join/leave: the new ring takes over at once for writes; :func:`plan_moves` lists the
  digests (chain segments, ``chain_segments.segment_digest``: the unit of placement and
  migration) whose owner changed (only those: ~1/N of them) for the caller to copy over
  time, and until :meth:`Membership.complete_move` reads of a chain try the new owner,
  then the previous one(s).

Not thread-safe: the caller serialises calls (one instance per client or node).
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping
from typing import TYPE_CHECKING

from isolane.cluster.rendezvous import make_placement
from isolane.cluster.ring import (
    DEFAULT_LOAD_BOUND,
    DEFAULT_VNODES,
    BoundedLoadRouter,
    NodePlacement,
)
from isolane.errors import InvalidArgumentError

if TYPE_CHECKING:
    from isolane.config import ClusterConfig

DEFAULT_FAIL_AFTER = 3
"""Failed probes in a row before a node counts as down."""


def plan_moves(old: NodePlacement, new: NodePlacement, digests: Iterable[bytes]
               ) -> dict[tuple[str, str], list[bytes]]:
    """``(from_node, to_node) -> routing digests`` whose owner differs between the rings;
    chains that keep their owner are not listed. Digests keep their input order."""
    moves: dict[tuple[str, str], list[bytes]] = defaultdict(list)
    for digest in digests:
        before, after = old.owner(digest), new.owner(digest)
        if before != after:
            moves[(before, after)].append(digest)
    return dict(moves)


def reachable_share(ring: NodePlacement, reachable: Iterable[str], samples: int = 4096
                    ) -> float:
    """The share of the cache whose owner on ``ring`` is in ``reachable``: the fraction of
    ``samples`` evenly spread digests owned by a reachable node (weights included)."""
    live = set(reachable)
    owned = sum(ring.owner(hashlib.sha256(i.to_bytes(8, "big")).digest()) in live
                for i in range(samples))
    return owned / samples


class Membership:
    """The live view of the cluster a client routes with: the current ring, the rings
    whose chains are still moving (newest first) and the nodes that are down.

    ``load_bound`` is ``c`` of :meth:`place` (bounded loads) and ``min_load`` its floor
    (:class:`~isolane.cluster.ring.BoundedLoadRouter`); ``placement`` (``ring`` or
    ``rendezvous``, ``cluster.placement``) how digests go to nodes: the consistent-hash
    ring (:class:`~isolane.cluster.ring.HashRing`, shaped by ``vnodes`` and ``weights``)
    or rendezvous hashing (``rendezvous.RendezvousNodes``, ``weights``); "ring" below is
    either.
    """

    def __init__(self, nodes: Iterable[str], *, vnodes: int = DEFAULT_VNODES,
                 weights: Mapping[str, float] | None = None,
                 load_bound: float = DEFAULT_LOAD_BOUND,
                 fail_after: int = DEFAULT_FAIL_AFTER, min_load: float = 0.0,
                 placement: str = "ring") -> None:
        if isinstance(fail_after, bool) or not isinstance(fail_after, int) or fail_after < 1:
            raise InvalidArgumentError(f"fail_after must be a whole number >= 1, "
                                       f"got {fail_after!r}")
        self._ring = make_placement(placement, nodes, vnodes=vnodes, weights=weights)
        self._router = BoundedLoadRouter(self._ring, load_bound, min_load=min_load)
        self._previous: tuple[NodePlacement, ...] = ()
        self._failures: dict[str, int] = {}
        self._down: set[str] = set()
        self.fail_after = fail_after

    @classmethod
    def from_config(cls, cluster: ClusterConfig, *, vnodes: int = DEFAULT_VNODES,
                    weights: Mapping[str, float] | None = None,
                    fail_after: int = DEFAULT_FAIL_AFTER) -> Membership:
        """Membership of ``cluster.nodes`` with ``cluster.load_bound`` and
        ``cluster.placement``."""
        return cls(cluster.nodes, vnodes=vnodes, weights=weights,
                   load_bound=cluster.load_bound, fail_after=fail_after,
                   placement=cluster.placement)

    # -- state -----------------------------------------------------------------------------
    @property
    def ring(self) -> NodePlacement:
        return self._ring

    @property
    def previous(self) -> tuple[NodePlacement, ...]:
        """Rings whose chains may not have moved yet, newest first (empty when settled)."""
        return self._previous

    @property
    def down(self) -> frozenset[str]:
        return frozenset(self._down)

    def is_up(self, node: str) -> bool:
        return node in self._ring and node not in self._down

    def is_known(self, node: str) -> bool:
        """Whether ``node`` is in the current ring or one still moving."""
        return node in self._ring or any(node in r for r in self._previous)

    # -- health ----------------------------------------------------------------------------
    def mark_down(self, node: str) -> None:
        self._known(node)
        self._down.add(node)

    def mark_up(self, node: str) -> None:
        self._known(node)
        self._down.discard(node)
        self._failures.pop(node, None)

    def observe(self, node: str, ok: bool) -> bool:
        """Record one health probe of ``node``; returns whether it is up afterwards."""
        self._known(node)
        if ok:
            self.mark_up(node)
            return True
        self._failures[node] = self._failures.get(node, 0) + 1
        if self._failures[node] >= self.fail_after:
            self._down.add(node)
        return node not in self._down

    def _known(self, node: str) -> None:
        if not self.is_known(node):
            raise InvalidArgumentError(
                f"node {node!r} is not a cluster member {list(self._ring.nodes)}")

    # -- routing ---------------------------------------------------------------------------
    def owner(self, digest: bytes) -> str | None:
        """The first live node along the current ring from ``digest``'s owner; None when
        every node is down (the chain reads as a miss)."""
        return next(self._ring.walk(digest, skip=self._down), None)

    def place(self, digest: bytes, loads: Mapping[str, float], cost: float = 1.0, *,
              prefer: str | None = None, avoid: Collection[str] = ()) -> str | None:
        """Where a request for ``digest`` goes under bounded loads (live nodes only;
        ``prefer``: where the chain was placed last, kept while within its bound;
        ``avoid``: nodes to pass over as if down, e.g. past another bound)."""
        skip = self._down | set(avoid) if avoid else self._down
        return self._router.place(digest, loads, cost, skip=skip, prefer=prefer)

    @property
    def load_bound(self) -> float:
        """``c`` of bounded loads."""
        return self._router.c

    @property
    def members(self) -> tuple[str, ...]:
        """Every node of the current ring and of the rings still moving (to probe)."""
        out = dict.fromkeys(self._ring.nodes)
        for ring in self._previous:
            out.update(dict.fromkeys(ring.nodes))
        return tuple(out)

    def read_candidates(self, digest: bytes) -> list[str]:
        """Nodes to try for ``digest``, in order: the live owner on the current ring, then
        while a move is pending the owner on each previous ring (if up and different)."""
        out: list[str] = []
        first = self.owner(digest)
        if first is not None:
            out.append(first)
        for ring in self._previous:
            node = ring.owner(digest)
            if node not in out and node not in self._down:
                out.append(node)
        return out

    # -- join and leave --------------------------------------------------------------------
    def join(self, node: str, weight: float = 1.0) -> NodePlacement:
        """Add ``node`` (or change its weight); returns the ring it replaced, to pass to
        :func:`plan_moves`. Reads fall back to that ring until :meth:`complete_move`."""
        return self._change(self._ring.with_node(node, weight))

    def leave(self, node: str) -> NodePlacement:
        """Remove ``node``; as :meth:`join`. Its chains stay readable from it while it is
        up and the move is pending."""
        return self._change(self._ring.without_node(node))

    def _change(self, ring: NodePlacement) -> NodePlacement:
        old = self._ring
        self._previous = (old, *self._previous)
        self._ring = ring
        self._router = BoundedLoadRouter(ring, self._router.c, min_load=self._router.min_load)
        return old

    def complete_move(self) -> None:
        """Every planned move is done: reads stop falling back to previous rings, and
        nodes no longer in the ring are forgotten."""
        self._previous = ()
        self._down &= set(self._ring.nodes)
        self._failures = {n: f for n, f in self._failures.items() if n in self._ring}
