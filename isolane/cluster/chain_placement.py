"""Chain placement: which node a segment of a chain is written to and read from, given
the nodes' loads (pure: no I/O, no clock, no lock; ``ClusterRouter`` composes it with
its measured loads, ``benchmarks/bench_routing.py`` with the blocks served).

- **Writes** (:meth:`ChainPlacement.place`): a segment goes to where this client placed
  it last, else to its chain's home node (the live owner of the home digest), while
  that node is within both bounds: its request load (bounded loads, ``c`` x its share)
  and its *write share*, the segments this client placed on it lately against ``c`` x
  its share of them. Else along the walk of the segment's own digest to the first node
  within both. The write share keeps a hot long chain, or the many chains of one home,
  from filling one node's cache while the others' stay cold: the request load alone
  lets a home keep writing while its reads are light, and its cache then evicts what
  the chain's next request needs. "Lately": each placement decays every node's count
  by ``0.5 ** (1 / write_half_life)``; a node's write bound is never less than
  ``write_half_life`` x its weight share (a cluster that has written less than that
  keeps every chain on its home).
- **Reads** (:meth:`ChainPlacement.read_candidates`): the home's owner on each ring
  still moving; where this client wrote the segment last; the home's live owner; the
  segment's own live owner; the first node within its load bound past the home along
  the segment's own walk; and where the write rule would place it now.
- **Spill by cache size** (:func:`spills`): a segment that starts at or past
  ``SPILL_SHARE`` of its home node's cache (in blocks, as the node reports it) is placed
  as a chain of its own: its own digest is its home (:meth:`ChainPlacement.home_for`),
  so it goes along its own walk and is recorded and moved under its own digest. A long
  chain kept whole on a node whose cache holds few blocks floods that cache's eviction
  queue with one request (S3-FIFO's small queue is a tenth of it) and evicts the hot
  heads of other chains: on the Mooncake trace with 64 nodes each caching 143 blocks,
  chains kept whole lost 0.76 points of hit rate (``benchmarks/bench_routing.py``).
  Reads try both homes, the rule's current choice first, so a cache size that changed
  between a write and a read loses no block.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping

from isolane.cluster.membership import Membership
from isolane.errors import InvalidArgumentError

DEFAULT_WRITE_HALF_LIFE = 4096
"""Segments placed by a client over which a node's write share halves (``ClusterOptions.
write_half_life``): the simulation keeps hit rates with about half the segments the
cluster's caches hold; fewer lets chains leave their home sooner (a lost node costs
more), more lets a hot home's cache overflow."""
SPILL_SHARE = 0.03
"""A segment starting at or past this share of its home node's cache (in blocks) spills
(:func:`spills`). The routing simulation (Mooncake, 64 nodes caching 5 % of the unique
blocks) closes the hit-rate gap of whole chains from 3 %; much more keeps long chains
flooding small caches, much less spreads chains and a lost node costs more than 1/N."""


def spills(start: int, cache_blocks: float) -> bool:
    """Whether a segment that starts at chain position ``start`` (in blocks) is placed
    by its own digest rather than its chain's home, on a home node whose cache holds
    ``cache_blocks`` blocks (``math.inf``: unbounded or not known yet). A chain's head
    never spills."""
    return start > 0 and start >= SPILL_SHARE * cache_blocks


class ChainPlacement:
    """See the module docstring. ``members``: the cluster's membership (its ring, health
    and request-load bound ``c``); ``remember``: segments whose last write node is kept;
    ``write_half_life``: in segments placed (``math.inf``: no write bound, the request
    load alone, as segments placed by their own digests were)."""

    def __init__(self, members: Membership, *, remember: int = 1 << 16,
                 write_half_life: float = DEFAULT_WRITE_HALF_LIFE) -> None:
        if isinstance(write_half_life, bool) or not isinstance(write_half_life, (int, float)) \
                or not 0 < write_half_life <= math.inf:
            raise InvalidArgumentError(
                f"write_half_life must be a positive number (or inf: no write bound), "
                f"got {write_half_life!r}")
        self.members = members
        self.remember = remember
        self.write_half_life = float(write_half_life)
        self._decay = math.pow(0.5, 1.0 / self.write_half_life)
        self._last: OrderedDict[bytes, str] = OrderedDict()  # digest -> last write node
        self._written: dict[str, float] = {}  # node -> decayed segments placed there
        self._cache_blocks: dict[str, float] = {}  # node -> blocks its cache holds

    def set_cache_blocks(self, node: str, blocks: float | None) -> None:
        """What ``node``'s cache holds, in blocks (None: unbounded or not known)."""
        if blocks is None:
            self._cache_blocks.pop(node, None)
        else:
            self._cache_blocks[node] = float(blocks)

    def cache_blocks(self) -> dict[str, float]:
        """Each node's cache size in blocks, as far as known."""
        return dict(self._cache_blocks)

    def home_for(self, digest: bytes, home: bytes, start: int) -> bytes:
        """The home the segment ``digest``, starting at chain position ``start`` of the
        chain whose home digest is ``home``, is placed and recorded by: its own digest
        when it spills from its home node's cache (:func:`spills`), else ``home``. A node
        whose cache size is not known (not probed yet, or no disk budget) counts as
        unbounded: the chain stays whole, as it was placed before sizes were known, and
        reads try both homes, so a size learned later loses nothing."""
        if digest == home:
            return home
        owner = self.members.owner(home)
        if owner is None:
            return home
        return digest if spills(start, self._cache_blocks.get(owner, math.inf)) else home

    def last(self, digest: bytes) -> str | None:
        """Where this client placed the segment ``digest`` last (None: not remembered)."""
        return self._last.get(digest)

    def written(self) -> dict[str, float]:
        """Each node's decayed count of segments placed on it (its write share)."""
        return dict(self._written)

    def over_written(self) -> set[str]:
        """Nodes at or past their write bound: placements avoid them."""
        if self.write_half_life == math.inf:
            return set()
        ring = self.members.ring
        total = sum(self._written.values()) + 1.0
        weight_sum = ring.total_weight() or 1.0
        c = self.members.load_bound
        out = set()
        for node, count in self._written.items():
            share = ring.weight(node) / weight_sum if node in ring else 0.0
            bound = max(c * total, self.write_half_life) * share
            if count + 1.0 > bound:
                out.add(node)
        return out

    def _choose(self, digest: bytes, prefer: str | None, home_node: str | None,
                loads: Mapping[str, float], cost: float) -> str | None:
        """``home_node``: the home's live owner to pass over when past its write share
        (None: the segment is its chain's head, which stays on its home's walk)."""
        full = self.over_written()
        if prefer is not None and prefer in full:
            prefer = None
        # Past its write share the home is passed over: the segment goes where its own
        # digest's walk puts it under bounded loads, as a reader that saw none of these
        # writes looks for it (``read_candidates``).
        avoid = (home_node,) if home_node is not None and home_node in full else ()
        node = self.members.place(digest, loads, cost, prefer=prefer, avoid=avoid)
        return node if node is not None else self.members.place(digest, loads, cost)

    def place(self, digest: bytes, home: bytes, loads: Mapping[str, float],
              cost: float, start: int = 0) -> str | None:
        """The node to write the segment ``digest`` of the chain whose home digest is
        ``home`` to (module docstring; ``start``: its position in the chain, in blocks),
        remembered and counted; None when every node is down."""
        home = self.home_for(digest, home, start)
        owner = self.members.owner(home)
        node = self._choose(digest, self._last.get(digest) or owner,
                            owner if digest != home else None, loads, cost)
        if node is None:
            return None
        self._last[digest] = node
        self._last.move_to_end(digest)
        if len(self._last) > self.remember:
            self._last.popitem(last=False)
        for other in self._written:
            self._written[other] *= self._decay
        self._written[node] = self._written.get(node, 0.0) + 1.0
        return node

    def read_candidates(self, digest: bytes, home: bytes, loads: Mapping[str, float],
                        cost: float, start: int = 0) -> list[str]:
        """Live nodes to read the segment from, in order (module docstring): those of
        the home the spill rule picks now, then those of the other one."""
        chosen = self.home_for(digest, home, start)
        out = self._read_candidates(digest, chosen, loads, cost)
        other = home if chosen == digest else digest
        if other != chosen:
            out += [n for n in self._read_candidates(digest, other, loads, cost)
                    if n not in out]
        return out

    def _read_candidates(self, digest: bytes, home: bytes, loads: Mapping[str, float],
                         cost: float) -> list[str]:
        members = self.members
        out: list[str] = [ring.owner(home) for ring in members.previous]
        last = self._last.get(digest)
        if last is not None:
            out.append(last)
        owner = members.owner(home)
        if owner is not None:
            out.append(owner)
            # Where the segment spilled if the home was over a bound: along its own walk,
            # where the write rule puts it for another client that saw the same loads.
            own = members.owner(digest)
            if own is not None:
                out.append(own)
            if own == owner and digest != home:
                # Past the home along its own walk: where it goes while the home is
                # past its write share (which this client may not have seen).
                past = members.place(digest, loads, cost, avoid=(owner,))
                if past is not None:
                    out.append(past)
            placed = self._choose(digest, owner, owner if digest != home else None, loads,
                                  cost)
            if placed is not None:
                out.append(placed)
        down = members.down
        return [n for n in dict.fromkeys(out) if n not in down and members.is_known(n)]

    def forget(self, nodes: set[str]) -> None:
        """Drop the write counts of nodes no longer in any ring."""
        for node in [n for n in self._written if n not in nodes]:
            del self._written[node]
        for node in [n for n in self._cache_blocks if n not in nodes]:
            del self._cache_blocks[node]
