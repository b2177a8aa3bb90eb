"""Rendezvous (highest-random-weight) hashing for ``bench_routing.py`` (session 9): a unit
goes to the node with the highest score ``mix64(xxh3_64(digest) ^ xxh3_64(node))``
(``mix64`` = the splitmix64 finaliser; ties: the node listed first). Every node's share
is 1 / N in expectation with a binomial spread, as even as ``hash mod N``, and a join or
leave moves only the units the new node wins or the gone node held: the ideal.

``Rendezvous`` stands in for ``HashRing`` under ``BoundedLoadRouter``: its ``walk`` is
the nodes in decreasing score, so a unit passed on over its bound goes to its
second-best node, a different node for every unit (on the ring it is the next node
along, the same for every unit of one arc).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence

import numpy as np
import numpy.typing as npt
import xxhash

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_MASK = (1 << 64) - 1
CHUNK = 1 << 15


def mix64(z: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """The splitmix64 finaliser, element-wise (a bijection of uint64)."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def mix64_int(z: int) -> int:
    """``mix64`` of one Python int (the reference the vectorised form is tested against)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def node_seeds(nodes: Sequence[str]) -> npt.NDArray[np.uint64]:
    return np.array([xxhash.xxh3_64_intdigest(n.encode()) for n in nodes], dtype=np.uint64)


def score(digest: bytes, node: str) -> int:
    """One node's score for one digest (pure Python)."""
    return mix64_int(xxhash.xxh3_64_intdigest(digest) ^ xxhash.xxh3_64_intdigest(node.encode()))


def scores(pos: npt.NDArray[np.uint64], seeds: npt.NDArray[np.uint64]
           ) -> npt.NDArray[np.uint64]:
    """(units, nodes) scores from the units' positions ``xxh3_64(digest)``."""
    return mix64(pos[:, None] ^ seeds[None, :])


def hrw_owners(nodes: Sequence[str], pos: npt.NDArray[np.uint64]) -> npt.NDArray[np.int64]:
    """Per position, the index in ``nodes`` of its highest-scoring node."""
    seeds = node_seeds(nodes)
    out = np.empty(len(pos), dtype=np.int64)
    with np.errstate(over="ignore"):
        for a in range(0, len(pos), CHUNK):
            out[a:a + CHUNK] = np.argmax(scores(pos[a:a + CHUNK], seeds), axis=1)
    return out


class Rendezvous:
    """The nodes as ``BoundedLoadRouter`` reads a ``HashRing`` (``walk``, ``nodes``,
    ``weight``, ``total_weight``, ``in``, ``len``), all of weight 1, walked in decreasing
    rendezvous score. ``owner(d)`` = the first node of ``walk(d)``."""

    def __init__(self, nodes: Sequence[str]) -> None:
        self._nodes = tuple(nodes)
        self._set = frozenset(self._nodes)
        self._seeds = node_seeds(self._nodes)
        self._orders: dict[bytes, tuple[str, ...]] = {}
        self._row_of: dict[bytes, int] = {}
        self._rows = np.empty((0, len(self._nodes)), dtype=np.int16)

    @property
    def nodes(self) -> tuple[str, ...]:
        return self._nodes

    def weight(self, node: str) -> float:
        return 1.0

    def total_weight(self, skip: Collection[str] = ()) -> float:
        return float(len(self._set - set(skip)))

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, node: object) -> bool:
        return node in self._set

    def prefill(self, digests: Sequence[bytes], pos: npt.NDArray[np.uint64]) -> None:
        """Rank the nodes for many digests at once (``pos``: their ``xxh3_64``), so
        ``order`` only looks a digest's ranking up: the same order, computed in bulk."""
        rows = np.empty((len(pos), len(self._nodes)), dtype=np.int16)
        with np.errstate(over="ignore"):
            for a in range(0, len(pos), CHUNK):
                rows[a:a + CHUNK] = np.argsort(~scores(pos[a:a + CHUNK], self._seeds),
                                               axis=1, kind="stable")
        self._rows = rows
        self._row_of = {d: i for i, d in enumerate(digests)}

    def order(self, digest: bytes) -> tuple[str, ...]:
        got = self._orders.get(digest)
        if got is None and digest in self._row_of:
            got = self._orders[digest] = tuple(
                self._nodes[i] for i in self._rows[self._row_of[digest]].tolist())
        if got is None:
            pos = np.array([xxhash.xxh3_64_intdigest(digest)], dtype=np.uint64)
            with np.errstate(over="ignore"):
                row = scores(pos, self._seeds)[0]
            # ~x reverses unsigned order: decreasing score, ties by list order
            got = self._orders[digest] = tuple(
                self._nodes[i] for i in np.argsort(~row, kind="stable"))
        return got

    def owner(self, digest: bytes) -> str:
        return self.order(digest)[0]

    def walk(self, digest: bytes, *, skip: Collection[str] = ()) -> Iterator[str]:
        for node in self.order(digest):
            if node not in skip:
                yield node
