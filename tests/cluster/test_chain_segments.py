"""Chain segments (pure): the segment digest byte for byte, how key lists are cut, how
many nodes a restore touches, and that joins and leaves move segments only."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import pytest
import torch
import xxhash

from isolane.cluster.chain_segments import (
    DEFAULT_SEGMENT_BLOCKS,
    chain_offset,
    check_segment_blocks,
    device_runs,
    plan_segments,
    segment_digest,
    segments_per_restore,
)
from isolane.cluster.membership import plan_moves
from isolane.cluster.ring import HashRing, device_for
from isolane.config import config_from_dict
from isolane.errors import ConfigError, InvalidArgumentError
from isolane.kvpool.pool import KVPool

NODES = [f"http://10.0.0.{i}:7070" for i in range(1, 9)]


def _key(*parts: object) -> bytes:
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()


def _chain(c: int, n: int) -> list[bytes]:
    return [_key(c, b) for b in range(n)]


def test_the_segment_digest_is_xxh3_128_of_tag_anchor_key_and_index() -> None:
    chain = bytes(range(16))
    assert segment_digest(chain, 3).hex() == "fc89de402b5ab1e98eb89b2a8c89e8de"  # FORMATS.md
    expected = xxhash.xxh3_128_intdigest(b"isolane-seg\x01" + chain + (3).to_bytes(4, "little"))
    assert segment_digest(chain, 3) == expected.to_bytes(16, "big")
    assert len({segment_digest(chain, i) for i in range(1000)}) == 1000
    with pytest.raises(InvalidArgumentError, match="16 bytes"):
        segment_digest(b"short", 0)
    with pytest.raises(InvalidArgumentError, match="segment index"):
        segment_digest(chain, -1)


def test_a_key_list_is_cut_at_multiples_of_s_counted_from_the_chain_start() -> None:
    keys = _chain(1, 20)
    assert [(s.index, s.start, s.stop) for s in plan_segments(keys, 8)] == [
        (0, 0, 8), (1, 8, 16), (2, 16, 20)]
    # Blocks 5..17 of the chain: the rest of segment 0, all of 1, the start of 2.
    later = plan_segments(keys[5:18], 8, chain=keys[:5])
    assert [(s.index, s.start, s.stop) for s in later] == [(0, 0, 3), (1, 3, 11), (2, 11, 13)]
    assert [s.digest for s in later] == [s.digest for s in plan_segments(keys, 8)]
    assert plan_segments(keys[5:18], 8, chain=keys) == later  # a chain that includes them
    assert [len(s) for s in plan_segments(keys[:5], 1)] == [1] * 5  # S = 1: per block
    assert len(plan_segments(keys, 1 << 20)) == 1  # a huge S: the whole chain
    assert plan_segments([], 8) == []
    for bad in (0, -1, True, 2.0, (1 << 20) + 1):
        with pytest.raises(InvalidArgumentError, match="segment_blocks"):
            check_segment_blocks(bad)
    with pytest.raises(InvalidArgumentError, match="prefix_blocks"):
        plan_segments(keys, 8, prefix_blocks=0)


def test_segment_0_is_anchored_at_the_routing_digest_and_later_ones_at_their_first_block(
        ) -> None:
    keys = _chain(2, 20)
    assert [s.digest for s in plan_segments(keys, 8)] == [
        segment_digest(keys[1], 0), segment_digest(keys[8], 1), segment_digest(keys[16], 2)]
    assert plan_segments(keys, 8, prefix_blocks=3)[0].digest == segment_digest(keys[2], 0)
    assert plan_segments(keys[:1], 8)[0].digest == segment_digest(keys[0], 0)  # n < k
    # Two chains behind one shared 12-block prefix: they share segments 0 and 1 (all of
    # 1 is shared), and from segment 2 on, whose first block differs, each has its own.
    shared = _chain(3, 12)
    a = shared + _chain(4, 12)
    b = shared + _chain(5, 12)
    da = [s.digest for s in plan_segments(a, 8)]
    db = [s.digest for s in plan_segments(b, 8)]
    assert da[:1] == db[:1] and da[1] == db[1] and da[2] != db[2]
    # the suffixes of one prefix spread over the nodes instead of piling on one
    ring = HashRing(NODES)
    thirds = {ring.owner(plan_segments(shared[:8] + _chain(c, 12), 8)[1].digest)
              for c in range(100, 160)}
    assert len(thirds) == len(NODES)


def test_chain_offset_finds_where_keys_start_in_their_chain() -> None:
    chain = _chain(1, 10)
    assert chain_offset(chain[4:], None) == 0
    assert chain_offset(chain[4:], chain) == 4  # the chain includes the keys
    assert chain_offset(chain[4:], chain[:4]) == 4  # the chain ends before them
    assert chain_offset(chain, chain) == 0


def test_a_restore_touches_at_most_ceil_n_over_s_nodes_and_long_chains_spread() -> None:
    ring = HashRing(NODES)
    spread = 0
    for c in range(300):
        n = 1 + c % 70
        keys = _chain(c, n)
        segs = plan_segments(keys, 8)
        owners = [ring.owner(s.digest) for s in segs]
        assert len(segs) == segments_per_restore(n, 8) == math.ceil(n / 8)
        assert len(set(owners)) <= math.ceil(n / 8)
        # the same prefix routes the same whatever the prompt's length
        if n > 8:
            shorter = plan_segments(keys[:9], 8)
            assert [ring.owner(s.digest) for s in shorter] == owners[:2]
        spread += len(set(owners)) > 1
    assert spread > 200  # a long chain is not piled on one node's cache


def test_a_join_or_leave_moves_only_segments_whose_owner_changed() -> None:
    old = HashRing(NODES)
    chains = [_chain(c, 40) for c in range(500)]
    digests = [s.digest for keys in chains for s in plan_segments(keys, 8)]
    for new in (old.with_node("http://10.0.0.99:7070"), old.without_node(NODES[3])):
        plan = plan_moves(old, new, digests)
        moved = {d for ds in plan.values() for d in ds}
        assert moved == {d for d in digests if old.owner(d) != new.owner(d)}
        share = len(moved) / len(digests)
        ideal = 1 / max(len(old), len(new))
        assert 0.6 * ideal < share < 1.5 * ideal  # ~1/N of the segments, not whole chains
        # a chain with one moved segment keeps its other segments where they were
        partly = [keys for keys in chains if 0 < sum(
            s.digest in moved for s in plan_segments(keys, 8)) < 5]
        assert len(partly) > 100


def test_device_runs_put_each_segment_on_the_device_of_its_digest() -> None:
    keys = _chain(7, 20)
    runs = device_runs(keys, 4, 8)
    segs = plan_segments(keys, 8)
    assert runs == [(device_for(s.digest, 4), s.start, s.stop) for s in segs]
    one = segment_digest(keys[8], 1)
    assert device_runs(keys[8:16], 4, 8, one) == [(device_for(one, 4), 0, 8)]
    assert device_runs([], 4, 8) == []


def test_the_embedded_pool_places_segments_on_devices(tmp_path: Path) -> None:
    ct, s = 4, 2
    config = config_from_dict({
        "device_groups": {"kv": {"role": "read", "devices": [
            str(tmp_path / f"d{i}") for i in range(4)]}},
        "cluster": {"segment_blocks": s}})
    with KVPool(config, namespace="seg", chunk_tokens=ct, token_dim=0,
                memory_budget=0) as pool:
        seen = set()
        for p in range(6):
            tokens = list(range(1000 * p, 1000 * p + 12 * ct))
            pool.put(tokens, torch.full((12 * ct, 3), float(p)))
            keys = pool.block_keys(tokens)
            for seg in plan_segments(keys, s):
                holders = {i for i, lg in enumerate(pool.logs)
                           for k in keys[seg.start:seg.stop] if k in lg}
                assert holders == {device_for(seg.digest, 4)}
                seen |= holders
            assert pool.get(tokens)[0] == 12 * ct
        assert seen == {0, 1, 2, 3}


def test_segment_blocks_is_a_validated_config_field() -> None:
    assert config_from_dict({}).cluster.segment_blocks == DEFAULT_SEGMENT_BLOCKS
    assert config_from_dict({"cluster": {"segment_blocks": 1}}).cluster.segment_blocks == 1
    for bad in (0, -3, "8", 2.5):
        with pytest.raises(ConfigError, match=r"cluster\.segment_blocks"):
            config_from_dict({"cluster": {"segment_blocks": bad}})
        with pytest.raises(ConfigError, match=r"cluster\.prefix_blocks"):
            config_from_dict({"cluster": {"prefix_blocks": bad}})
    assert config_from_dict({"cluster": {"prefix_blocks": 6}}).cluster.prefix_blocks == 6
