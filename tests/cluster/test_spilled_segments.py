"""Every client finds the segments another client placed, whatever that client's history:
three real nodes; a writer whose write share passes segments on from their homes while
it sees one node down writes prompts whose later segments then lie further along their
own walks than a reader with no history looks first. Once the node is back, the writer
and a fresh reader both restore every prompt whole, bit-exact (a segment is found
wherever a bounded walk could have put it, not only on the home and the first node past
it), through restores, lookups and block gets; a prompt found on its home is still one
request."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from isolane.client.kv_pool import RemoteKVPool
from isolane.cluster.router import ClusterOptions
from isolane.wire.chain_list import decode_chain_list
from tests.support.cluster import wait_until
from tests.support.node import NodeProcess, running_nodes, write_node_config

CT = 16  # chunk_tokens
BLOCKS = 16
TOKEN = "spill-token"
# slow_s: placement by the write share and health alone, however busy the shared test
# machine is (a node's measured wait never passes this floor).
WRITER = ClusterOptions(segment_blocks=2, slow_s=30.0, write_half_life=8)
READER = ClusterOptions(segment_blocks=2, slow_s=30.0)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[NodeProcess]]:
    folder: Path = tmp_path_factory.mktemp("spill")
    with running_nodes([NodeProcess(write_node_config(folder / name), token=TOKEN,
                                    startup_timeout_s=120.0) for name in "abc"]) as out:
        yield out


def _prompt(seed: int) -> list[int]:
    return [seed * 10_000 + i for i in range(BLOCKS * CT)]


def _kv(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((2, BLOCKS * CT, 8), generator=gen)  # [layers, tokens, dim]


def _pool(urls: list[str], options: ClusterOptions) -> RemoteKVPool:
    return RemoteKVPool(urls, namespace="spill", chunk_tokens=CT, token_dim=1, token=TOKEN,
                        cluster=options, timeout_s=0.5, poll_s=0.1)


def _restored(pool: RemoteKVPool, seeds: list[int]) -> dict[int, int]:
    out = {}
    for seed in seeds:
        n, kv = pool.get(_prompt(seed))
        if n:
            assert kv is not None and torch.equal(kv, _kv(seed)[:, :n])
        out[seed] = n
    return out


def _holders(nodes: list[NodeProcess], keys: list[bytes]) -> set[str]:
    """The nodes whose chain index lists any of ``keys``."""
    out = set()
    for node in nodes:
        status, body = node.request("GET", "/v1/kv/spill/chains")
        assert status == 200
        if any(k in keys for _, chain_keys in decode_chain_list(body) for k in chain_keys):
            out.add(node.url)
    return out


def test_a_reader_without_the_writers_history_finds_every_segment(
        nodes: list[NodeProcess]) -> None:
    urls = [n.url for n in nodes]
    stopped = nodes[0]
    assert stopped.pid is not None
    with _pool(urls, WRITER) as writer:
        cluster = writer.cluster
        assert cluster is not None
        assert writer.put(_prompt(0), _kv(0)) == BLOCKS  # the namespace's layout, on all
        keys = {s: writer.block_keys(_prompt(s)) for s in range(1, 200)}
        # Prompts whose home is not the node about to stop (a chain written while its
        # home is down lives on the next node of the home's walk: another matter).
        seeds = [s for s in keys
                 if cluster.ring.owner(cluster.segments(keys[s])[0].home) != stopped.url][:24]
        os.kill(stopped.pid, signal.SIGSTOP)
        try:
            wait_until(lambda: cluster.is_down(stopped.url), 10.0, "the stopped node down")
            assert all(writer.put(_prompt(s), _kv(s)) == BLOCKS for s in seeds)
        finally:
            os.kill(stopped.pid, signal.SIGCONT)
        wait_until(lambda: cluster.is_up(stopped.url), 10.0, "the node back up")
        assert _restored(writer, seeds) == dict.fromkeys(seeds, BLOCKS * CT)
    # The write share passed segments on: a prompt's blocks lie on several nodes.
    assert max(len(_holders(nodes, keys[s])) for s in seeds) >= 2
    with _pool(urls, READER) as reader:
        wait_until(lambda: all(reader.cluster is not None and reader.cluster.is_up(u)
                               for u in urls), 10.0, "all nodes up for the reader")
        assert _restored(reader, seeds) == dict.fromkeys(seeds, BLOCKS * CT)
        for s in seeds:  # the block API and lookups find them too
            assert reader.lookup_blocks(keys[s]) == BLOCKS
            assert None not in reader.get_blocks(keys[s])
        # A prompt on its home alone (the reader's own put) is one request.
        assert reader.put(_prompt(500), _kv(500)) == BLOCKS
        sent = reader._nodes.get_requests
        assert _restored(reader, [500]) == {500: BLOCKS * CT}
        assert reader._nodes.get_requests - sent == 1
