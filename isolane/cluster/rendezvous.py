"""Rendezvous (highest-random-weight) placement of segment digests over nodes: the
``cluster.placement: rendezvous`` alternative to the ring (pure: no I/O, no threads).

Every node scores every digest and the digest goes to the highest score; bounded loads
(``BoundedLoadRouter``) walk down a digest's scores, so segments passed on by one node
spread over all the others instead of all going to the next node along the ring. Each
node's share is ``w / sum(w)`` in expectation with a binomial spread (no ring arcs: as
even as ``hash mod N``), and a join moves only the digests the new node wins, a leave
only those the gone node held. ``docs/BENCHMARKS.md`` ("KV routing across nodes",
rendezvous rows and the segment-size table) measures it against the ring.

Layout (version 1; ``docs/FORMATS.md``, "KV routing rendezvous")::

    raw(d, n)   = mix64(xxh3_64(d) ^ xxh3_64(utf8(n)))      # mix64: splitmix64 finaliser
    score(d, n) = raw(d, n)                                  # every weight equal (exact)
                = w_n / -ln((raw(d, n) + 0.5) / 2**64)       # weights differ (IEEE double)

the nodes ranked by decreasing score, ties by node name. ``xxh3_64`` has seed 0, never
Python's ``hash()``, so every process and host ranks alike (with unequal weights up to
a last-bit difference of ``log``, which can swap only near-equal scores).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Iterator, Mapping

import xxhash

from isolane.cluster.ring import DEFAULT_VNODES, HashRing, NodePlacement, WeightedNodes
from isolane.errors import InvalidArgumentError

PLACEMENTS = ("ring", "rendezvous")
"""``cluster.placement``: how segment digests are placed on nodes."""
_MASK = (1 << 64) - 1
_position = xxhash.xxh3_64_intdigest


def mix64(z: int) -> int:
    """The splitmix64 finaliser (a bijection of 64-bit integers)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


class RendezvousNodes(WeightedNodes):
    """Named nodes ranked per digest by rendezvous score; immutable, thread-safe. The
    same interface as :class:`~isolane.cluster.ring.HashRing` where placement reads it
    (``owner``, ``walk``, ``successors``, weights, ``with_node``/``without_node``)."""

    __slots__ = ("_equal", "_seeds")

    def __init__(self, nodes: Iterable[str], *,
                 weights: Mapping[str, float] | None = None) -> None:
        super().__init__(nodes, weights)
        self._seeds = tuple(_position(n.encode()) for n in self._nodes)
        self._equal = len(set(self._weights.values())) == 1

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RendezvousNodes):
            return NotImplemented
        return self._weights == other._weights

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._weights.items())))

    def __repr__(self) -> str:
        return f"RendezvousNodes({list(self._nodes)!r})"

    # -- lookups ---------------------------------------------------------------------------
    def ranked(self, digest: bytes) -> list[str]:
        """Every node, by decreasing score for ``digest`` (ties by name)."""
        at = _position(digest)
        if self._equal:
            keys: list[float] = [-mix64(at ^ s) for s in self._seeds]
        else:
            keys = [-self._weights[n] / -math.log((mix64(at ^ s) + 0.5) / 2.0 ** 64)
                    for n, s in zip(self._nodes, self._seeds, strict=True)]
        order = sorted(range(len(self._nodes)), key=lambda i: (keys[i], self._nodes[i]))
        return [self._nodes[i] for i in order]

    def owner(self, digest: bytes) -> str:
        return self.ranked(digest)[0]

    def walk(self, digest: bytes, *, skip: Collection[str] = ()) -> Iterator[str]:
        """Every node once, by decreasing score; ``skip`` left out."""
        for node in self.ranked(digest):
            if node not in skip:
                yield node

    def successors(self, digest: bytes, n: int, *, skip: Collection[str] = ()) -> list[str]:
        return [] if n <= 0 else list(self.walk(digest, skip=skip))[:n]

    # -- changes ---------------------------------------------------------------------------
    def with_node(self, node: str, weight: float = 1.0) -> RendezvousNodes:
        """New nodes with ``node`` added (or its weight changed)."""
        return RendezvousNodes({**self._weights, node: weight},
                               weights={**self._weights, node: weight})

    def without_node(self, node: str) -> RendezvousNodes:
        if node not in self:
            raise InvalidArgumentError(f"node {node!r} is not in the ring {list(self._nodes)}")
        weights = {n: w for n, w in self._weights.items() if n != node}
        return RendezvousNodes(weights, weights=weights)


def make_placement(placement: str, nodes: Iterable[str], *, vnodes: int = DEFAULT_VNODES,
                   weights: Mapping[str, float] | None = None) -> NodePlacement:
    """The nodes under ``placement`` (``PLACEMENTS``); ``vnodes`` shapes the ring only."""
    check_placement(placement)
    if placement == "ring":
        return HashRing(nodes, vnodes=vnodes, weights=weights)
    return RendezvousNodes(nodes, weights=weights)


def check_placement(placement: object) -> str:
    if placement not in PLACEMENTS:
        raise InvalidArgumentError(
            f"placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
    return str(placement)
