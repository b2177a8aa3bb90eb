"""Spill by cache size on real nodes: three ``isolane serve`` nodes whose KV disks keep
256 blocks each report it in ``/v1/stats``; a client that learned it keeps a long
chain's first segments on its home node and places those starting past 3 % of that
cache by their own digests, recorded there under them. Clients that know the size and
clients that do not read each other's chains back bit-exact."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from isolane.client.kv_pool import RemoteKVPool
from isolane.cluster.chain_placement import SPILL_SHARE
from isolane.cluster.ring import HashRing
from isolane.cluster.router import ClusterOptions
from tests.support.cluster import wait_until
from tests.support.node import (
    NodeProcess,
    chain_listing,
    holders,
    running_nodes,
    write_node_config,
)

CT = 4  # tokens per block
DIM = 256  # a block: 2 x 4 x 256 float32 = 8 KiB
TOKEN = "spill-token"
CACHE_BLOCKS = 256  # 2 MiB of disk budget in 8 KiB blocks
S = 4
STEADY = ClusterOptions(slow_s=30.0, segment_blocks=S)  # placement by the ring alone
LONG = 40  # blocks: segments from position 8 (>= 3 % of 256) spill


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[NodeProcess]]:
    folder = tmp_path_factory.mktemp("spill")
    procs = [NodeProcess(write_node_config(
        folder / name, kvpool={"segment_bytes": "1MiB", "disk_budget": "2MiB"}),
        token=TOKEN) for name in "abc"]
    with running_nodes(procs):
        yield procs


def _kv(n_tokens: int, seed: int) -> torch.Tensor:
    return torch.arange(2 * n_tokens * DIM, dtype=torch.float32).reshape(
        2, n_tokens, DIM) + seed * 1e6


def _prompt(seed: int, n_blocks: int) -> list[int]:
    return [seed * 10_000 + i for i in range(n_blocks * CT)]


def _pool(urls: list[str], ns: str, **kwargs: object) -> RemoteKVPool:
    return RemoteKVPool(urls, namespace=ns, chunk_tokens=CT, token_dim=1, token=TOKEN,
                        cluster=STEADY, **kwargs)  # type: ignore[arg-type]


def _learn_sizes(pool: RemoteKVPool, urls: list[str]) -> None:
    """Open the namespace on every node (one-block chains land on their homes, which
    fixes the layout there), then wait for the probes to bring every node's size."""
    for seed in range(200):
        if all(pool._nodes.list_chains(u) for u in urls):
            break
        pool.put(_prompt(10_000 + seed, 1), _kv(CT, seed))
    wait_until(lambda: pool.stats()["cluster"]["cache_blocks"] == dict.fromkeys(
        urls, CACHE_BLOCKS), 10.0, "cache sizes known to the client")


def test_nodes_report_their_cache_in_blocks(nodes: list[NodeProcess]) -> None:
    urls = [n.url for n in nodes]
    with _pool(urls, "sizes", poll_s=0.2) as pool:
        _learn_sizes(pool, urls)
    for proc in nodes:
        status, body = proc.request("GET", "/v1/stats")
        assert status == 200
        assert json.loads(body)["kv"]["cache_blocks"]["sizes"] == CACHE_BLOCKS


def test_a_long_chain_spills_past_a_share_of_its_home_cache(
        nodes: list[NodeProcess], tmp_path: Path) -> None:
    urls, ns = [n.url for n in nodes], "spill"
    ring = HashRing(urls)
    assert 0.03 * CACHE_BLOCKS < 2 * S <= 0.03 * CACHE_BLOCKS + S and SPILL_SHARE == 0.03
    with _pool(urls, ns, poll_s=0.2) as writer:
        _learn_sizes(writer, urls)
        spilled_somewhere = False
        for seed in range(3):
            assert writer.put(_prompt(seed, LONG), _kv(LONG * CT, seed)) == LONG
            keys = writer.block_keys(_prompt(seed, LONG))
            segs = writer.cluster.segments(keys)  # type: ignore[union-attr]
            home = ring.owner(segs[0].home)
            for seg in segs:
                part = keys[seg.start:seg.stop]
                if seg.index * S < 0.03 * CACHE_BLOCKS:  # the first two: on the home
                    assert holders(nodes, ns, part) == [home]
                    continue
                owner = ring.owner(seg.digest)  # by its own digest, recorded under it
                assert holders(nodes, ns, part) == [owner]
                assert chain_listing(nodes[urls.index(owner)], ns)[seg.digest] == part
                spilled_somewhere |= owner != home
            # Read back bit-exact by the writer and by fresh clients, one that knows
            # the cache sizes and one that does not (it would keep the chain whole).
            with _pool(urls, ns, poll_s=0.2) as knowing, _pool(urls, ns, poll_s=None) as blind:
                _learn_sizes(knowing, urls)
                for pool in (writer, knowing, blind):
                    n, kv = pool.get(_prompt(seed, LONG))
                    assert n == LONG * CT and kv is not None
                    assert torch.equal(kv, _kv(LONG * CT, seed))
        assert spilled_somewhere  # 24 spilled segments, not all on their homes


def test_a_chain_written_before_the_size_was_known_still_reads(
        nodes: list[NodeProcess]) -> None:
    urls, ns = [n.url for n in nodes], "blind"
    ring = HashRing(urls)
    with _pool(urls, ns, poll_s=None) as blind:  # no probes: sizes unknown, chains whole
        blind.put(_prompt(7, 1), _kv(CT, 7))  # fixes the layout
        assert blind.put(_prompt(8, LONG), _kv(LONG * CT, 8)) == LONG
        keys = blind.block_keys(_prompt(8, LONG))
        home = ring.owner(blind.cluster.segments(keys)[0].home)  # type: ignore[union-attr]
        assert holders(nodes, ns, keys) == [home]
    with _pool(urls, ns, poll_s=0.2) as knowing:
        _learn_sizes(knowing, urls)
        n, kv = knowing.get(_prompt(8, LONG))
        assert n == LONG * CT and kv is not None and torch.equal(kv, _kv(LONG * CT, 8))
