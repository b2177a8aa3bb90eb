"""Membership through a real etcd: real ``isolane serve`` processes register under
leases, a ``RemoteKVPool`` follows them; joins, kills, stops, etcd restarts, auth.

Short leases (2 s) keep the file fast; every wait is bounded by what the feature
promises (a join seen within ~2 s, a dead node gone within its lease).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from isolane.cli.main import cli
from isolane.client.kv_pool import RemoteKVPool, connect
from isolane.cluster.etcd_client import EtcdAuth, EtcdClient, parse_etcd_url
from isolane.cluster.etcd_membership import NodeRegistration
from isolane.cluster.etcd_records import NodeRecord, node_key
from isolane.cluster.router import ClusterOptions
from isolane.config import EtcdConfig
from isolane.errors import AuthenticationError, ConflictError, EtcdUnavailableError
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


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    server = EtcdServer(tmp_path_factory.mktemp("etcd")).start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory, etcd: EtcdServer
          ) -> Iterator[list[NodeProcess]]:
    """Four nodes registering with 2 s leases; the first three started (the tests leave
    them running: the fourth is the one that joins and dies)."""
    folder = tmp_path_factory.mktemp("nodes")
    procs = [_node(folder / name, etcd, cluster={"etcd": {"url": etcd.url(),
                                                          "lease_ttl_s": TTL_S}})
             for name in "abcd"]
    for proc in procs[:3]:
        proc.startup_timeout_s = 120.0  # three torch imports at once on a busy box
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


def _client(etcd: EtcdServer) -> EtcdClient:
    return EtcdClient(parse_etcd_url(etcd.url()))


def test_a_node_joins_and_a_killed_node_leaves_without_a_call_by_hand(
        etcd: EtcdServer, nodes: list[NodeProcess]) -> None:
    """Two clients; nobody calls add_node: the fourth node registers, one client is
    elected to move, the other switches when the move is recorded; then SIGKILL."""
    urls = [n.url for n in nodes[:3]]
    config = _etcd_config(etcd)
    with _pool(config, "join") as first, _pool(config, "join") as second:
        assert sorted(first.nodes) == sorted(urls)
        seeds = range(24)
        assert all(first.put(_prompt(s), _kv(8 * CT, s)) == 8 for s in seeds)
        assert _hits(second, seeds) == len(seeds)

        joiner = nodes[3]
        joiner.startup_timeout_s = 120.0
        joiner.launch()
        wait_until(lambda: joiner.url in first.nodes, 120.0, "the new node in the ring")
        seen = time.monotonic()
        wait_until(lambda: joiner.url in second.nodes, 2.0, "the new node in every client")
        assert time.monotonic() - seen < 2.0
        joiner.wait_ready()
        everyone = [*urls, joiner.url]
        wait_until(lambda: _up(first, everyone) and _up(second, everyone), 5.0, "probed up")
        wait_until(lambda: not first.moving and not second.moving, 30.0,
                   "the move recorded complete in etcd")
        rebalances = sorted(p.stats()["cluster"]["mover"]["rebalances"] for p in (first, second))
        assert rebalances[0] == 0 and rebalances[1] >= 1  # exactly one client moved
        moved = sum(p.stats()["cluster"]["mover"]["chains_moved"] for p in (first, second))
        assert moved > 0
        assert _hits(first, seeds) == len(seeds)  # moved chains read from their new owner
        assert _hits(second, seeds) == len(seeds)
        membership = second.membership()
        assert membership["source"] == "etcd" and membership["connected"]
        assert membership["moves_in_flight"] is False and membership["reachable_share"] == 1

        joiner.kill()  # SIGKILL: no withdrawal, the lease expires
        killed = time.monotonic()
        wait_until(lambda: joiner.url not in first.nodes, TTL_S + 2.0,
                   "the killed node out of the ring")
        assert time.monotonic() - killed <= TTL_S + 2.0
        wait_until(lambda: joiner.url not in second.nodes, 1.0, "out of every client")
        assert _hits(first, seeds) > len(seeds) // 2  # the other owners still serve


def test_a_stopped_node_leaves_and_comes_back_with_its_blocks(
        etcd: EtcdServer, nodes: list[NodeProcess]) -> None:
    urls = [n.url for n in nodes[:3]]
    with _pool(_etcd_config(etcd), "stop") as pool:
        wait_until(lambda: _up(pool, urls), 5.0, "nodes up")
        seeds = range(24)
        assert all(pool.put(_prompt(s), _kv(8 * CT, s)) == 8 for s in seeds)
        victim = nodes[1]
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGSTOP)
        try:
            # The lease runs out within TTL_S of the last keep-alive; etcd's expiry sweep,
            # the watch and the ring switch come on top (once over 4.5 s in a full run).
            wait_until(lambda: victim.url not in pool.nodes, TTL_S + 5.0, "stopped node gone")
            assert _hits(pool, seeds) < len(seeds)  # its segments are out of reach
        finally:
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
            time.sleep(TTL_S + 0.5)  # longer than a lease: nothing leaves meanwhile
            assert sorted(pool.nodes) == sorted(urls)
            assert _hits(pool, seeds) == len(seeds)
        lost = [r for r in caplog.records if "unreachable" in r.getMessage()]
        assert len(lost) == 1  # said once, not once per retry
        etcd.start()  # same data folder
        wait_until(lambda: pool.membership()["connected"], 8.0, "watch back")
        wait_until(lambda: len(_client(etcd).range_prefix("/isolane/nodes/")[1]) == 3, 10.0,
                   "every node registered again")
        wait_until(lambda: _up(pool, urls), 8.0, "all nodes in the ring and up")
        assert _hits(pool, seeds) == len(seeds)


def test_etcd_down_at_client_start_names_the_url_or_falls_back(
        nodes: list[NodeProcess]) -> None:
    dead = f"etcd://127.0.0.1:{free_ports(1)[0]}/isolane"
    with pytest.raises(EtcdUnavailableError, match=dead.replace(".", r"\.")):
        connect(dead)
    urls = [n.url for n in nodes[:3]]
    fallback = EtcdConfig(url=dead, lease_ttl_s=TTL_S, static_fallback=True)
    with RemoteKVPool(urls, etcd=fallback, namespace="fallback", chunk_tokens=CT,
                      token_dim=1, cluster=STEADY, poll_s=0.2) as pool:
        assert sorted(pool.nodes) == sorted(urls)
        assert pool.membership()["connected"] is False
        assert pool.put(_prompt(1), _kv(8 * CT, 1)) == 8
        assert _hits(pool, range(1, 2)) == 1


def test_bad_records_are_ignored_and_a_dead_url_gets_no_traffic(
        etcd: EtcdServer, nodes: list[NodeProcess], caplog: pytest.LogCaptureFixture) -> None:
    client = _client(etcd)
    urls = [n.url for n in nodes[:3]]
    garbage = node_key("/isolane", "http://127.0.0.1:1")
    client.put(garbage, b"{not json")
    client.put(node_key("/isolane", "http://127.0.0.1:2"), b'{"url": "http://elsewhere:9"}')
    dead_url = f"http://127.0.0.1:{free_ports(1)[0]}"  # registered, nobody answers there
    dead = NodeRegistration(client, dead_url, ttl_s=TTL_S)
    dead.start()
    try:
        with caplog.at_level(logging.WARNING, "isolane.cluster.etcd_membership"), \
                _pool(_etcd_config(etcd), "bad") as pool:
            assert sorted(pool.nodes) == sorted([*urls, dead_url])
            assert pool.cluster is not None and not pool.cluster.is_up(dead_url)
            seeds = range(16)
            assert all(pool.put(_prompt(s), _kv(8 * CT, s)) == 8 for s in seeds)
            assert _hits(pool, seeds) == len(seeds)  # nothing went to the dead URL
            assert pool.membership()["reachable_share"] < 1.0
            client.put(garbage, b"[[[[[[[[[[1]]]]]]]]]]")  # a change while watching
            wait_until(lambda: sum("ignoring etcd key" in r.getMessage()
                                   for r in caplog.records) >= 3, 3.0, "three warnings")
            assert sorted(pool.nodes) == sorted([*urls, dead_url])
            report = json.loads(CliRunner().invoke(
                cli, ["cluster", "status", "--etcd", etcd.url(), "--json"]).output)
        warned = [r.getMessage() for r in caplog.records if "ignoring etcd key" in r.getMessage()]
        assert len(warned) == 3  # once per bad value, not once per read
        assert report["source"] == "etcd" and len(report["ignored"]) == 2
        by_url = {n["url"]: n for n in report["nodes"]}
        assert not by_url[dead_url]["reachable"] and all(by_url[u]["reachable"] for u in urls)
        assert 0 < by_url[urls[0]]["lease_left_s"] <= TTL_S
        assert by_url[urls[0]]["cluster"]["source"] == "etcd"
        assert 0.5 < report["reachable_share"] < 1.0
        assert report["moves"]["in_flight"] is False
    finally:
        dead.close()
        client.delete(garbage)
        client.delete(node_key("/isolane", "http://127.0.0.1:2"))


def test_two_nodes_cannot_claim_one_url(etcd: EtcdServer, nodes: list[NodeProcess]) -> None:
    client = _client(etcd)
    taken = nodes[0].url  # registered by the running node a, which keeps refreshing it
    with pytest.raises(ConflictError, match="already registered"):
        NodeRegistration(client, taken, ttl_s=TTL_S).start()
    assert nodes[0].json("GET", "/v1/stats")["cluster"]["registered"]  # a keeps it
    _, kvs = client.range_prefix("/isolane/nodes/")
    assert sum(json.loads(kv.value)["url"] == taken for kv in kvs) == 1

    # The key of a process that died (nobody refreshes it) is no claim: a node started
    # at once on its URL waits for it to expire and registers.
    url = f"http://127.0.0.1:{free_ports(1)[0]}"
    dead = NodeRecord(url, 1.0, time.time(), "died", 7)
    client.put(node_key("/isolane", url), dead.encode(), lease=client.grant(TTL_S))
    restarted = NodeRegistration(client, url, ttl_s=TTL_S)
    restarted.start()
    try:
        held = client.get(node_key("/isolane", url))
        assert held is not None and json.loads(held.value)["instance"] != "died"
    finally:
        restarted.close()


def test_auth_with_user_and_password(tmp_path: Path, nodes: list[NodeProcess]) -> None:
    with EtcdServer(tmp_path / "etcd-auth") as secured:
        secured.enable_auth("s3cret")
        with pytest.raises(AuthenticationError, match="user"):
            EtcdClient(parse_etcd_url(secured.url())).range_prefix("/isolane/")
        wrong = EtcdClient(parse_etcd_url(secured.url()), EtcdAuth("root", "wrong"))
        with pytest.raises(AuthenticationError, match="invalid user ID or password"):
            wrong.range_prefix("/isolane/")
        right = EtcdClient(parse_etcd_url(secured.url()), EtcdAuth("root", "s3cret"))
        registration = NodeRegistration(right, nodes[2].url, ttl_s=TTL_S)
        registration.start()
        try:
            config = EtcdConfig(url=secured.url(), lease_ttl_s=TTL_S, user="root",
                                password="s3cret")
            with _pool(config, "auth") as pool:
                assert pool.nodes == [nodes[2].url]
                assert pool.put(_prompt(5), _kv(8 * CT, 5)) == 8
                assert _hits(pool, range(5, 6)) == 1
        finally:
            registration.close()
        assert right.range_prefix("/isolane/nodes/")[1] == []  # withdrawn on close


def test_lease_expiry_follows_etcds_clock_not_the_nodes(
        etcd: EtcdServer, nodes: list[NodeProcess]) -> None:
    """A record written by a node whose wall clock is an hour off (``started`` in the
    future) is a member while its lease lives and leaves when etcd expires it: nothing
    a node's clock says takes part in expiry (the TTL counts on the server)."""
    client = _client(etcd)
    skewed = NodeRecord(nodes[2].url.replace("127.0.0.1", "localhost"), 1.0,
                        time.time() + 3600, "skewed", 1)
    lease = client.grant(TTL_S)
    client.put(node_key("/isolane", skewed.url), skewed.encode(), lease=lease)
    with _pool(_etcd_config(etcd), "skew") as pool:
        assert skewed.url in pool.nodes
        assert 0 < client.time_to_live(lease) <= TTL_S
        gone = time.monotonic()  # nobody refreshes the lease: etcd expires it
        wait_until(lambda: skewed.url not in pool.nodes, TTL_S + 2.0, "expired by etcd")
        assert time.monotonic() - gone <= TTL_S + 2.0


def test_cluster_status_of_a_static_list_and_of_an_etcd_that_is_down(
        tmp_path: Path, nodes: list[NodeProcess]) -> None:
    dead_node = f"http://127.0.0.1:{free_ports(1)[0]}"
    config = tmp_path / "client.yaml"
    config.write_text(json.dumps({"cluster": {"nodes": [nodes[0].url, dead_node]}}))
    result = CliRunner().invoke(cli, ["--config", str(config), "cluster", "status", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["source"] == "static"
    assert [n["reachable"] for n in report["nodes"]] == [True, False]
    assert 0 < report["reachable_share"] < 1
    text = CliRunner().invoke(cli, ["--config", str(config), "cluster", "status"]).output
    assert "membership: static" in text and "UNREACHABLE" in text

    dead_etcd = f"etcd://127.0.0.1:{free_ports(1)[0]}/isolane"
    down = CliRunner().invoke(cli, ["cluster", "status", "--etcd", dead_etcd])
    assert down.exit_code == 1 and dead_etcd in down.output and "Traceback" not in down.output
