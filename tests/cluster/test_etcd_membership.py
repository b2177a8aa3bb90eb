"""Membership through a real etcd: real ``isolane serve`` processes register under
leases, a ``RemoteKVPool`` follows them; joins, kills, stops, etcd restarts, auth.

Short leases (2 s) keep the file fast; every wait is bounded by what the feature
promises (a join seen within ~2 s, a dead node gone within its lease).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from isolane.client.kv_pool import RemoteKVPool, connect
from isolane.cluster.etcd_client import EtcdClient, parse_etcd_url
from isolane.cluster.etcd_records import node_key
from isolane.cluster.router import ClusterOptions
from isolane.config import EtcdConfig
from isolane.errors import ConfigError, EtcdUnavailableError, InvalidArgumentError
from tests.support.cluster import wait_until
from tests.support.etcd import EtcdServer
from tests.support.node import NodeProcess, write_node_config
from tests.support.procs import free_ports

CT = 16
TTL_S = 2
STEADY = ClusterOptions(slow_s=30.0)  # placement by the ring alone, however busy the box


def _kv(n_tokens: int, seed: int) -> torch.Tensor:
    return torch.full((2, n_tokens, 8), float(seed))


def _prompt(seed: int, n_tokens: int = 8 * CT) -> list[int]:
    return [seed * 10_000 + i for i in range(n_tokens)]


def _hits(pool: RemoteKVPool, seeds: range, n_tokens: int = 8 * CT) -> int:
    hit = 0
    for seed in seeds:
        n, kv = pool.get(_prompt(seed, n_tokens))
        hit += n == n_tokens and kv is not None and torch.equal(kv, _kv(n_tokens, seed))
    return hit


def _node(folder: Path, etcd: EtcdServer, *extra: str, **sections: Any) -> NodeProcess:
    return NodeProcess(write_node_config(folder, **sections),
                       args=("--cluster", etcd.url(), *extra))


def _etcd_config(etcd: EtcdServer, **more: Any) -> EtcdConfig:
    return EtcdConfig(url=etcd.url(), lease_ttl_s=TTL_S, **more)


def _pool(etcd: EtcdConfig, namespace: str, **kwargs: Any) -> RemoteKVPool:
    return RemoteKVPool([], etcd=etcd, namespace=namespace, chunk_tokens=CT, token_dim=1,
                        cluster=STEADY, poll_s=0.2, **kwargs)


def _up(pool: RemoteKVPool, urls: list[str]) -> bool:
    cluster = pool.cluster
    return cluster is not None and sorted(pool.nodes) == sorted(urls) \
        and all(cluster.is_up(u) for u in urls)


@pytest.fixture()
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    server = EtcdServer(tmp_path / "etcd").start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture()
def nodes(tmp_path: Path, etcd: EtcdServer) -> Iterator[list[NodeProcess]]:
    """Four nodes registering with 2 s leases; the first three started."""
    procs = [_node(tmp_path / name, etcd, cluster={"etcd": {"url": etcd.url(),
                                                            "lease_ttl_s": TTL_S}})
             for name in "abcd"]
    for proc in procs[:3]:
        proc.launch()
    try:
        for proc in procs[:3]:
            proc.wait_ready()
        yield procs
    finally:
        for proc in procs:
            if proc.pid is not None:
                os.kill(proc.pid, signal.SIGCONT)
            proc.kill()


def test_a_node_joins_and_a_killed_node_leaves_without_a_call_by_hand(
        etcd: EtcdServer, nodes: list[NodeProcess]) -> None:
    urls = [n.url for n in nodes[:3]]
    with _pool(_etcd_config(etcd), "join") as pool:
        assert sorted(pool.nodes) == sorted(urls)
        seeds = range(24)
        assert all(pool.put(_prompt(s), _kv(8 * CT, s)) == 8 for s in seeds)
        assert _hits(pool, seeds) == len(seeds)

        nodes[3].start()  # registers itself: nobody calls add_node
        seen = time.monotonic()
        wait_until(lambda: nodes[3].url in pool.nodes, 3.0, "the new node in the ring")
        assert time.monotonic() - seen < 2.5
        wait_until(lambda: _up(pool, [*urls, nodes[3].url]), 5.0, "the new node probed up")
        wait_until(lambda: not pool.moving, 20.0, "the move recorded complete in etcd")
        assert _hits(pool, seeds) == len(seeds)  # moved chains read from their new owner
        moved = pool.stats()["cluster"]
        assert moved["mover"]["chains_moved"] > 0
        assert moved["membership"]["source"] == "etcd"
        assert moved["membership"]["moves_in_flight"] is False

        nodes[0].kill()  # SIGKILL: no withdrawal, the lease expires
        killed = time.monotonic()
        wait_until(lambda: nodes[0].url not in pool.nodes, TTL_S + 2.0,
                   "the killed node out of the ring")
        assert time.monotonic() - killed <= TTL_S + 2.0
        # Chains the dead node owned are misses now, the others still hit.
        assert _hits(pool, seeds) > 0
        wait_until(lambda: pool.membership()["reachable_share"] == 1.0, 10.0,
                   "every owner reachable again")


def test_a_second_client_follows_the_mover(etcd: EtcdServer,
                                           nodes: list[NodeProcess]) -> None:
    """Two clients: one is elected to move, the other switches when it is recorded."""
    config = _etcd_config(etcd)
    with _pool(config, "two") as first, _pool(config, "two") as second:
        seeds = range(12)
        assert all(first.put(_prompt(s), _kv(8 * CT, s)) == 8 for s in seeds)
        nodes[3].start()
        for pool in (first, second):
            wait_until(lambda p=pool: nodes[3].url in p.nodes, 3.0, "join seen")  # type: ignore[misc]
        wait_until(lambda: not first.moving and not second.moving, 20.0, "moves complete")
        movers = [p.stats()["cluster"]["mover"]["rebalances"] for p in (first, second)]
        assert sorted(movers)[0] == 0 and sorted(movers)[1] >= 1  # exactly one moved
        wait_until(lambda: _up(second, [n.url for n in nodes]), 5.0, "all up")
        assert _hits(second, seeds) == len(seeds)


def test_a_stopped_node_leaves_and_comes_back_with_its_blocks(
        etcd: EtcdServer, nodes: list[NodeProcess]) -> None:
    urls = [n.url for n in nodes[:3]]
    with _pool(_etcd_config(etcd), "stop") as pool:
        seeds = range(24)
        assert all(pool.put(_prompt(s), _kv(8 * CT, s)) == 8 for s in seeds)
        victim = nodes[1]
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGSTOP)
        wait_until(lambda: victim.url not in pool.nodes, TTL_S + 2.5, "stopped node gone")
        os.kill(victim.pid, signal.SIGCONT)  # its lease is gone: it registers anew
        wait_until(lambda: _up(pool, urls), 8.0, "the node back in the ring and up")
        status = victim.json("GET", "/v1/stats")["cluster"]
        assert status["registered"] and status["registrations"] == 2
        wait_until(lambda: _hits(pool, seeds) == len(seeds), 10.0, "its blocks served again")


def test_clients_keep_serving_through_an_etcd_restart(
        etcd: EtcdServer, nodes: list[NodeProcess], caplog: pytest.LogCaptureFixture) -> None:
    urls = [n.url for n in nodes[:3]]
    with _pool(_etcd_config(etcd), "restart") as pool:
        wait_until(lambda: _up(pool, urls), 5.0, "nodes up")
        seeds = range(12)
        assert all(pool.put(_prompt(s), _kv(8 * CT, s)) == 8 for s in seeds)
        with caplog.at_level(logging.WARNING, "isolane.cluster.etcd_membership"):
            etcd.kill()
            wait_until(lambda: not pool.membership()["connected"], 5.0, "outage noticed")
            assert sorted(pool.nodes) == sorted(urls)  # the last membership stays
            assert _hits(pool, seeds) == len(seeds)
            time.sleep(1.5)
            assert _hits(pool, seeds) == len(seeds)
        lost = [r for r in caplog.records if "unreachable" in r.getMessage()]
        assert len(lost) == 1  # said once, not once per retry
        etcd.start()  # same data folder: leases survive, or nodes register anew
        wait_until(lambda: pool.membership()["connected"], 8.0, "watch back")
        client = EtcdClient(parse_etcd_url(etcd.url()))
        wait_until(lambda: len(client.range_prefix("/isolane/nodes/")[1]) == 3, 8.0,
                   "the nodes registered again")
        assert sorted(pool.nodes) == sorted(urls)
        assert _hits(pool, seeds) == len(seeds)
