"""ClusterRouter (pure): writes by bounded loads on observed latency and reported load,
reads from previous owners first while moving, health."""

from __future__ import annotations

import hashlib
from collections import Counter

import pytest

from isolane.cluster.chain_segments import segment_digest
from isolane.cluster.ring import HashRing, prefix_digest
from isolane.cluster.router import ClusterOptions, ClusterRouter, NodeLoad, load_from_stats
from isolane.errors import InvalidArgumentError

NODES = [f"http://127.0.0.1:{7070 + i}" for i in range(3)]
NEW = "http://127.0.0.1:7079"


def _key(*parts: object) -> bytes:
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()


CHAINS = [[_key(c, b) for b in range(4)] for c in range(600)]  # one segment each


def seg0(chain: list[bytes]) -> bytes:
    """The digest of the chain's first (here: only) segment, its placement unit."""
    return segment_digest(prefix_digest(chain), 0)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _router(**options: object) -> tuple[ClusterRouter, Clock]:
    clock = Clock()
    router = ClusterRouter(NODES, ClusterOptions(**options),  # type: ignore[arg-type]
                           clock=clock)
    return router, clock


def test_an_idle_cluster_places_and_reads_every_chain_at_its_ring_owner() -> None:
    router, _ = _router()
    ring = HashRing(NODES)
    for chain in CHAINS[:200]:
        owner = ring.owner(seg0(chain))
        assert router.owner(chain) == owner
        assert router.read_candidates(seg0(chain)) == [owner]
        assert router.read_candidates(seg0(chain[:3])) == [owner]  # the digest is block 1's key
    assert Counter(router.owner(c) for c in CHAINS).keys() == set(NODES)
    for node in NODES:  # fast answers (big ones per 4 MiB) stay below slow_s
        router.started(node)
        router.finished(node, 0.2, 64 << 20)
    assert all(router.owner(c) == ring.owner(seg0(c)) for c in CHAINS[:200])


def test_a_slow_node_gets_fewer_new_chains_until_its_record_fades() -> None:
    router, clock = _router(latency_half_life_s=5.0)
    slow = NODES[0]
    for _ in range(3):
        router.started(slow)
        router.finished(slow, 0.3)  # 300 ms a request, others unmeasured (idle)
    assert router.loads()[slow] > 0.05
    placed = Counter(router.owner(c) for c in CHAINS)
    assert placed[slow] == 0  # passed on along the ring, chain by chain
    assert sum(placed.values()) == len(CHAINS)
    # A chain placed elsewhere is read where it was written, then at its owner.
    chain = next(c for c in CHAINS if HashRing(NODES).owner(seg0(c)) == slow)
    assert router.read_candidates(seg0(chain)) == [router.owner(chain), slow]
    clock.now += 60  # no new samples: the record fades and the node takes chains again
    fresh = [[_key("fresh", c, b) for b in range(2)] for c in range(300)]
    assert Counter(router.owner(c) for c in fresh)[slow] > 50


def test_reported_p99_and_requests_in_flight_steer_placements() -> None:
    stats = {"inflight": {"requests": 9}, "lanes": {"read": {"p99": 40.0}}}
    assert load_from_stats(stats) == NodeLoad(requests=8, read_p99_s=0.04)
    assert load_from_stats({}) == NodeLoad(requests=0, read_p99_s=None)
    router, _ = _router()
    busy = NODES[1]
    assert router.observe(busy, stats)
    assert router.loads()[busy] == pytest.approx(0.04 * 9)
    assert Counter(router.owner(c) for c in CHAINS)[busy] == 0


def test_failures_take_a_node_down_and_a_probe_brings_it_back() -> None:
    router, _ = _router(fail_after=2)
    dead = NODES[2]
    theirs = [c for c in CHAINS if HashRing(NODES).owner(seg0(c)) == dead][:20]
    router.failed(dead)
    assert not router.is_up(dead)
    for chain in theirs:
        assert dead not in router.read_candidates(seg0(chain))  # misses, never errors
        assert router.owner(chain) != dead  # writes go to the next live node
    assert router.observe(dead, {"inflight": {"requests": 1}})
    assert router.is_up(dead)
    assert router.observe(dead, None) and not router.observe(dead, None)  # 2 failed probes
    for node in NODES:
        router.failed(node)
    assert router.read_candidates(seg0(theirs[0])) == []
    assert router.owner(theirs[0]) == dead  # nowhere live: the ring's owner, dropped later
    assert not router.observe("http://elsewhere:1", None)


def test_while_moving_reads_try_the_previous_owner_first() -> None:
    router, _ = _router()
    old, new = router.join(NEW)
    assert router.moving and set(router.members) == {*NODES, NEW}
    moved = [c for c in CHAINS if old.owner(seg0(c)) != new.owner(seg0(c))]
    assert 0.15 < len(moved) / len(CHAINS) < 0.35  # ~1/4 to the new node
    for chain in moved[:30]:
        before = old.owner(seg0(chain))
        assert router.read_candidates(seg0(chain)) == [before, NEW]
        assert router.owner(chain) == NEW
    router.complete_move()
    assert not router.moving
    assert router.read_candidates(seg0(moved[0])) == [NEW]
    old, new = router.leave(NEW)
    assert router.read_candidates(seg0(moved[0])) == [NEW, new.owner(seg0(moved[0]))]


def test_a_loaded_owner_is_read_first_then_where_bounded_loads_would_place_it_now() -> None:
    router, _ = _router()
    chain = CHAINS[0]
    owner = HashRing(NODES).owner(seg0(chain))
    router.observe(owner, {"inflight": {"requests": 20}, "lanes": {"read": {"p99": 10}}})
    candidates = router.read_candidates(seg0(chain))
    placed = router.owner(chain)  # 0.01 s x 20 requests: past its bound, passed on
    assert placed != owner and candidates == [owner, placed]


def test_options_are_checked() -> None:
    with pytest.raises(InvalidArgumentError, match="slow_s"):
        ClusterOptions(slow_s=0)
    with pytest.raises(InvalidArgumentError, match="load_bound"):
        ClusterRouter(NODES, ClusterOptions(load_bound=0.5))


def test_each_segment_of_a_long_chain_is_placed_and_read_on_its_home_node() -> None:
    router, _ = _router(segment_blocks=4)
    ring = HashRing(NODES)
    chain = [_key("long", b) for b in range(30)]
    segs = router.segments(chain)
    assert [(s.start, s.stop) for s in segs] == [(i, min(30, i + 4)) for i in range(0, 30, 4)]
    home = ring.owner(segs[0].digest)
    for seg in segs:
        anchor = prefix_digest(chain) if seg.index == 0 else chain[4 * seg.index]
        assert seg.digest == segment_digest(anchor, seg.index)
        assert seg.home == segs[0].digest
        assert router.place(seg.digest, seg.home) == home
        assert router.read_candidates(seg.digest, seg.home)[0] == home
    # blocks 10..29, named with the chain's leading keys: the same segments from 10 on
    later = router.segments(chain[10:], chain[:10])
    assert [(s.index, s.start, s.stop) for s in later][:2] == [(2, 0, 2), (3, 2, 6)]
    assert [s.digest for s in later] == [s.digest for s in segs[2:]]
    with pytest.raises(InvalidArgumentError, match="segment_blocks"):
        ClusterOptions(segment_blocks=0)
