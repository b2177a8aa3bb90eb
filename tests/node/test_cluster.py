"""A cluster of real nodes on loopback: three nodes serve KV and snapshots; a fourth
joins while clients read and write (no errors, no misses, no lost snapshot); a stopped
node costs one timeout and is skipped; a slow node gets fewer chains."""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml

from isolane.client.kv_pool import RemoteKVPool
from isolane.client.snapshot_store import RemoteSnapshotStore
from isolane.cluster.chain_segments import segment_digest
from isolane.cluster.rendezvous import PLACEMENTS, make_placement
from isolane.cluster.ring import HashRing, prefix_digest
from isolane.cluster.router import ClusterOptions
from isolane.errors import SnapshotExistsError, SnapshotNotFoundError
from isolane.kvpool.pool import KVPool
from isolane.wire.chain_list import decode_chain_list
from tests.support.cluster import wait_up
from tests.support.node import NodeProcess, chain_listing, holders, write_node_config

CT = 4
TOKEN = "cluster-token"
SLOW_MS = 400
STEADY = ClusterOptions(slow_s=30.0)  # placement by the ring alone, however busy the box


@dataclass
class Cluster:
    nodes: list[NodeProcess]  # a, b, c: the cluster; d: joins; e: slow
    folder: Path

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes[:3]]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    folder = tmp_path_factory.mktemp("cluster")
    nodes = [NodeProcess(write_node_config(folder / name), token=TOKEN,
                         args=("--debug-delay-ms", str(SLOW_MS)) if name == "e" else ())
             for name in "abcde"]
    for node in nodes:
        node.launch()
    try:
        for node in nodes:
            node.wait_ready()
        yield Cluster(nodes, folder)
    finally:
        for node in nodes:
            if node.pid is not None:
                os.kill(node.pid, signal.SIGCONT)  # in case a test stopped it
            node.kill()


def _seg0(keys: list[bytes]) -> bytes:
    """The digest of a chain's first segment (the short prompts here have one)."""
    return segment_digest(prefix_digest(keys), 0)


def _kv(n_tokens: int, seed: int) -> torch.Tensor:
    return torch.full((2, n_tokens, 8), float(seed))  # [layers, tokens, dim], token_dim 1


def _prompt(seed: int, n_tokens: int = 3 * CT) -> list[int]:
    return [seed * 1000 + i for i in range(n_tokens)]


def _pool(urls: list[str], namespace: str, **kwargs: object) -> RemoteKVPool:
    return RemoteKVPool(urls, namespace=namespace, chunk_tokens=CT, token_dim=1,
                        token=TOKEN, **kwargs)  # type: ignore[arg-type]


def _hit(pool: RemoteKVPool, seed: int) -> bool:
    n, kv = pool.get(_prompt(seed))
    return n == 3 * CT and kv is not None and torch.equal(kv, _kv(3 * CT, seed))


def test_three_nodes_serve_kv_and_snapshots_to_remote_clients(cluster: Cluster) -> None:
    nodes, urls, ns = cluster.nodes[:3], cluster.urls, "serve"
    ring = HashRing(urls)
    with _pool(urls, ns, cluster=STEADY) as pool:
        seeds = range(60)  # every node owns some whatever its port (3 x 0.8^60 misses)
        assert all(pool.put(_prompt(s), _kv(3 * CT, s)) == 3 for s in seeds)
        keys = {s: pool.block_keys(_prompt(s)) for s in seeds}
        home = {s: ring.owner(_seg0(keys[s])) for s in seeds}
        # One node a chain (its ring owner: the nodes are idle), every node some chains.
        assert all(holders(nodes, ns, keys[s]) == [home[s]] for s in seeds)
        assert set(home.values()) == set(urls)
        assert all(_hit(pool, s) for s in seeds)
        # Each node lists the chains it holds, with their keys in chain order.
        for node in nodes:
            status, body = node.request("GET", f"/v1/kv/{ns}/chains")
            assert status == 200
            listed = dict(decode_chain_list(body))
            assert listed == {_seg0(keys[s]): keys[s] for s in seeds
                              if home[s] == node.url}
        stats = pool.stats()
        assert set(stats["nodes"]) == set(urls) and stats["cluster"]["down"] == []
        # A forked child (a DataLoader worker) reads through the parent's client.
        child = os.fork()
        if child == 0:  # pragma: no cover - the child reports through its exit code
            os._exit(0 if all(_hit(pool, s) for s in seeds) else 1)
        assert os.waitpid(child, 0)[1] == 0

    # Another client from a cluster config reads the same blocks.
    config = cluster.folder / "client.yaml"
    config.write_text(yaml.safe_dump({
        "home": str(cluster.folder / "client-home"),
        "device_groups": {"kv": {"role": "read", "devices": [str(cluster.folder / "x")]}},
        "kvpool": {"namespace": ns, "chunk_tokens": CT},
        "cluster": {"nodes": urls, "load_bound": 1.25},
        "node": {"token": TOKEN}}))
    with KVPool.connect(str(config), token_dim=1) as other:
        assert all(_hit(other, s) for s in seeds)

    # Snapshots: each on the owner of its name; listing merges the nodes.
    store = RemoteSnapshotStore(urls, token=TOKEN)
    names = [f"serve-{i}" for i in range(12)]
    for i, name in enumerate(names):
        store.save({"w": torch.full((64,), float(i)), "step": i}, name)
        owner = ring.owner(name.encode())
        assert store.home(name)[0] == owner
        assert RemoteSnapshotStore(owner, token=TOKEN).info(name).name == name
    assert {ring.owner(n.encode()) for n in names} != {urls[0]}  # spread over nodes
    assert [i.name for i in store.list() if i.name in names] == names
    back = store.load(names[3])
    assert back["step"] == 3 and torch.equal(back["w"], torch.full((64,), 3.0))
    with pytest.raises(SnapshotExistsError):
        store.save({"w": torch.zeros(1)}, names[0])
    store.save({"w": torch.ones(2)}, names[0], overwrite=True)
    assert torch.equal(store.load(names[0])["w"], torch.ones(2))
    store.delete(names[0])
    with pytest.raises(SnapshotNotFoundError):
        store.info(names[0])
    store.close()


def test_a_fourth_node_joins_while_clients_read_and_write(cluster: Cluster) -> None:
    nodes, urls, ns = cluster.nodes[:4], cluster.urls, "join"
    newcomer = cluster.nodes[3].url
    pool = _pool(urls, ns, poll_s=0.2, cluster=STEADY)
    prefill = range(60)
    assert all(pool.put(_prompt(s), _kv(3 * CT, s)) == 3 for s in prefill)
    store = RemoteSnapshotStore(urls, token=TOKEN)
    bigger = HashRing([*urls, newcomer])
    # The ring's shares follow the nodes' free ports: pick names so that two of them
    # belong to the newcomer (found by fallback after the join), whatever the ports.
    names = (f"join-{i}" for i in itertools.count())
    snaps: list[str] = []
    while sum(bigger.owner(n.encode()) == newcomer for n in snaps) < 2 or len(snaps) < 12:
        snaps.append(next(names))
    for i, name in enumerate(snaps):
        store.save({"w": torch.full((1000,), float(i))}, name)

    errors: list[BaseException] = []
    misses: list[int] = []
    written: list[int] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            for seed in prefill:
                try:
                    if not _hit(pool, seed):
                        misses.append(seed)
                except BaseException as exc:  # collected: the test asserts there are none
                    errors.append(exc)

    def writer() -> None:
        seed = 1000
        while not stop.is_set():
            try:
                assert pool.put(_prompt(seed), _kv(3 * CT, seed)) == 3
                if not _hit(pool, seed):
                    misses.append(seed)
                written.append(seed)
            except BaseException as exc:  # collected, as above
                errors.append(exc)
            seed += 1

    threads = [threading.Thread(target=reader), threading.Thread(target=reader),
               threading.Thread(target=writer)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(0.3)
        pool.add_node(newcomer)
        assert pool.moving
        assert pool.wait_moves(60)
        time.sleep(0.3)  # reads and writes go on after the move
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert errors == [] and misses == []
    assert not pool.moving and len(written) > 10

    # Exactly the chains whose owner changed moved, all to the new node, none left behind.
    old = HashRing(urls)
    moved = 0
    for seed in prefill:
        digest = _seg0(pool.block_keys(_prompt(seed)))
        held_by = holders(nodes, ns, pool.block_keys(_prompt(seed)))
        assert held_by == [bigger.owner(digest)]
        moved += old.owner(digest) != bigger.owner(digest)
    # Consistent hashing: only the newcomer's share moved (every move went to it).
    assert moved == sum(bigger.owner(_seg0(pool.block_keys(_prompt(s)))) == newcomer
                        for s in prefill)
    assert 0 < moved <= 0.5 * len(prefill)
    report = pool.stats()["cluster"]
    assert report["mover"]["chains_moved"] >= moved and report["nodes"] == sorted(
        [*urls, newcomer])
    # The new node took the moves on its background lane (paced by its governor).
    background = cluster.nodes[3].json("GET", "/v1/stats")["lanes"]["background"]
    assert background["p50"] is not None
    assert all(_hit(pool, seed) for seed in [*prefill, *written])
    pool.close()

    # No lost snapshot: the four-node store finds those saved before the join.
    with RemoteSnapshotStore([*urls, newcomer], token=TOKEN) as after:
        for i, name in enumerate(snaps):
            assert torch.equal(after.load(name)["w"], torch.full((1000,), float(i)))
        assert {i.name for i in after.list()} >= set(snaps)
        after.save({"w": torch.ones(3)}, "join-after")
        assert after.home("join-after")[0] in _snapshot_holders(after, "join-after")
    store.close()


def _snapshot_holders(store: RemoteSnapshotStore, name: str) -> list[str]:
    out = []
    for node in store.nodes:
        try:
            RemoteSnapshotStore(node, token=TOKEN).info(name)
        except SnapshotNotFoundError:
            continue
        out.append(node)
    return out


def test_a_stopped_node_costs_one_timeout_then_is_skipped(cluster: Cluster) -> None:
    urls, ns = cluster.urls, "stopped"
    stopped = cluster.nodes[1]
    assert stopped.pid is not None
    ring = HashRing(urls)
    pool = _pool(urls, ns, timeout_s=0.5, put_timeout_s=0.5, poll_s=0.2, cluster=STEADY)
    seeds = range(30)
    assert all(pool.put(_prompt(s), _kv(3 * CT, s)) == 3 for s in seeds)
    home = {s: ring.owner(_seg0(pool.block_keys(_prompt(s)))) for s in seeds}
    assert stopped.url in home.values()
    os.kill(stopped.pid, signal.SIGSTOP)  # the process hangs: connections open, no answer
    try:
        started = time.monotonic()
        for seed in seeds:
            hit = _hit(pool, seed)
            assert hit == (home[seed] != stopped.url)  # its chains are misses, not errors
        assert time.monotonic() - started < 2.5  # one timeout (0.5 s), then skipped
        assert stopped.url in pool.stats()["cluster"]["down"]
        # New chains the stopped node owns go to the next node and read back from there.
        fresh = [s for s in range(100, 200)
                 if ring.owner(_seg0(pool.block_keys(_prompt(s)))) == stopped.url][:5]
        started = time.monotonic()
        for seed in fresh:
            assert pool.put(_prompt(seed), _kv(3 * CT, seed)) == 3
            assert _hit(pool, seed)
        assert time.monotonic() - started < 2.0
        others = [n for n in cluster.nodes[:3] if n is not stopped]
        assert all(len(holders(others, ns, pool.block_keys(_prompt(s)))) == 1
                   for s in fresh)
    finally:
        os.kill(stopped.pid, signal.SIGCONT)
    wait_up(pool, stopped.url)
    assert all(_hit(pool, s) for s in seeds)  # back: its chains read from it again
    pool.close()


def test_a_slow_node_gets_fewer_chains_and_is_still_read(cluster: Cluster) -> None:
    a, c, slow = cluster.nodes[0], cluster.nodes[2], cluster.nodes[4]
    urls, ns = [a.url, c.url, slow.url], "slow"
    ring = HashRing(urls)
    pool = _pool(urls, ns, timeout_s=2.0, put_timeout_s=2.0, poll_s=0.2,
                 cluster=ClusterOptions(latency_half_life_s=30.0))
    # The ring's shares follow the nodes' URLs, whose ports are free ones picked at run
    # time: a plain range of seeds gave the slow node 7 chains once. Add seeds it owns
    # until it has 10, so the test always measures the same thing.
    def owner(seed: int) -> str:
        return ring.owner(_seg0(pool.block_keys(_prompt(seed))))

    started = time.monotonic()
    assert pool.put(_prompt(0), _kv(3 * CT, 0)) == 3  # the layout: block_keys needs it
    seeds = list(range(45))
    extra = (s for s in itertools.count(45) if owner(s) == slow.url)
    while sum(owner(s) == slow.url for s in seeds) < 10:
        seeds.append(next(extra))
    assert all(pool.put(_prompt(s), _kv(3 * CT, s)) == 3 for s in seeds[1:])
    elapsed = time.monotonic() - started
    digests = {s: _seg0(pool.block_keys(_prompt(s))) for s in seeds}
    owned = [s for s in seeds if ring.owner(digests[s]) == slow.url]
    listed = {n.url: chain_listing(n, ns) for n in (a, c, slow)}
    placed = [s for s in seeds if digests[s] in listed[slow.url]]
    assert len(owned) >= 8  # its share of the ring
    assert len(placed) <= 2  # its first answers taught the client it is slow
    assert elapsed < SLOW_MS / 1000 * len(owned) / 2  # far less than a wait per owned chain
    assert sorted(d for chains in listed.values() for d in chains) == sorted(
        digests.values())  # every chain on exactly one node
    assert pool.stats()["cluster"]["loads_s"][slow.url] > 0.1
    started = time.monotonic()
    assert all(_hit(pool, s) for s in seeds)  # the slow node's chains too, slowly
    assert time.monotonic() - started < 2.0 + len(placed) * SLOW_MS / 1000
    pool.close()


def test_a_much_read_segment_stays_on_its_owner_alone(cluster: Cluster) -> None:
    """No hot replicas (removed): reads never copy a segment to another node."""
    nodes, urls, ns = cluster.nodes[:3], cluster.urls, "hot"
    ring = HashRing(urls)
    pool = _pool(urls, ns, cluster=ClusterOptions(slow_s=30.0))
    assert pool.put(_prompt(1), _kv(3 * CT, 1)) == 3
    keys = pool.block_keys(_prompt(1))
    for _ in range(40):
        assert _hit(pool, 1)
    assert pool.wait_moves(10)
    assert holders(nodes, ns, keys) == [ring.owner(_seg0(keys))]
    mover = pool.stats()["cluster"]["mover"]
    assert mover["bytes_sent"] == 0 and "chains_copied" not in mover
    assert pool.delete(_prompt(1)) == 3
    assert holders(nodes, ns, keys) == [] and pool.get(_prompt(1)) == (0, None)
    pool.close()


def test_a_leaving_node_hands_on_chains_it_holds_but_did_not_own(cluster: Cluster) -> None:
    """A node may hold chains it does not own on the ring: a writer that did not know
    their owner yet (or found it busy) put them there. When that node leaves, they move
    too, or they would be left behind on it and read as misses."""
    nodes, ns = cluster.nodes[:4], "leave-unowned"
    urls = [n.url for n in nodes]
    leaving, ring = urls[3], HashRing(urls)
    writer = _pool(urls[1:], ns, cluster=STEADY)  # a client that does not know urls[0]
    seeds = range(60)
    assert all(writer.put(_prompt(s), _kv(3 * CT, s)) == 3 for s in seeds)
    unowned = [s for s in seeds
               if ring.owner(_seg0(keys := writer.block_keys(_prompt(s)))) == urls[0]
               and holders(nodes, ns, keys) == [leaving]]
    assert unowned
    writer.close()
    pool = _pool(urls, ns, cluster=STEADY)
    pool.remove_node(leaving)
    assert pool.wait_moves(30) and not pool.moving
    assert chain_listing(nodes[3], ns) == {}
    smaller = HashRing(urls[:3])
    for seed in unowned:
        keys = pool.block_keys(_prompt(seed))
        assert holders(nodes, ns, keys) == [smaller.owner(_seg0(keys))]
    assert all(_hit(pool, s) for s in unowned)
    pool.close()


def test_a_leaving_node_hands_its_chains_to_the_others(cluster: Cluster) -> None:
    nodes, ns = cluster.nodes[:4], "leave"
    urls = [n.url for n in nodes]
    leaving = urls[3]
    pool = _pool(urls, ns, cluster=STEADY)
    seeds = range(40)
    assert all(pool.put(_prompt(s), _kv(3 * CT, s)) == 3 for s in seeds)
    theirs = [s for s in seeds if holders(nodes, ns, pool.block_keys(_prompt(s))) == [leaving]]
    assert theirs
    pool.remove_node(leaving)
    assert leaving not in pool.nodes and all(_hit(pool, s) for s in seeds)  # fallback reads
    assert pool.wait_moves(30) and not pool.moving
    assert chain_listing(nodes[3], ns) == {}  # moved away, deleted there
    smaller = HashRing(urls[:3])
    for seed in seeds:
        keys = pool.block_keys(_prompt(seed))
        assert holders(nodes, ns, keys) == [smaller.owner(_seg0(keys))]
    assert all(_hit(pool, s) for s in seeds)
    pool.close()


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_long_prompts_are_placed_restored_and_moved_by_segment(cluster: Cluster,
                                                               placement: str) -> None:
    """S = 2, prompts of 7 blocks: every segment on its chain's home node (the owner of
    segment 0's digest, on the ring or by rendezvous score: ``cluster.placement``), which
    records all of them under that home digest; a restore asks that node once; a join
    moves exactly the chains whose home changed, segments and all, the rest staying put."""
    nodes, urls, ns = cluster.nodes[:4], cluster.urls, f"segments-{placement}"
    newcomer = nodes[3].url
    ring = make_placement(placement, urls)
    bigger = make_placement(placement, [*urls, newcomer])
    n_tokens = 7 * CT
    pool = _pool(urls, ns, cluster=ClusterOptions(slow_s=30.0, segment_blocks=2,
                                                  placement=placement))
    seeds = range(30)
    assert all(pool.put(_prompt(s, n_tokens), _kv(n_tokens, s)) == 7 for s in seeds)

    def chain(seed: int) -> tuple[bytes, list[bytes]]:
        keys = pool.block_keys(_prompt(seed, n_tokens))
        return segment_digest(prefix_digest(keys), 0), keys  # FORMATS.md: the home

    homes = {s: chain(s)[0] for s in seeds}
    for seed in seeds:
        home, keys = chain(seed)
        for i in range(4):  # each segment, on the home's owner alone
            assert holders(nodes, ns, keys[2 * i:2 * i + 2]) == [ring.owner(home)]
        before = pool._nodes.get_requests
        n, kv = pool.get(_prompt(seed, n_tokens))
        assert n == n_tokens and kv is not None and torch.equal(kv, _kv(n_tokens, seed))
        assert pool._nodes.get_requests - before == 1  # one node, one request
    assert len({ring.owner(h) for h in homes.values()}) == 3  # chains spread over nodes
    listed = {n.url: chain_listing(n, ns) for n in nodes[:3]}  # nodes index chains by home
    assert all(listed[ring.owner(homes[s])][homes[s]] == chain(s)[1] for s in seeds)

    pool.add_node(newcomer)
    assert pool.wait_moves(60) and not pool.moving
    moved = sum(ring.owner(h) != bigger.owner(h) for h in homes.values())
    for seed in seeds:
        home, keys = chain(seed)
        assert holders(nodes, ns, keys) == [bigger.owner(home)]  # moved whole, or kept
    assert 0 < moved < 0.6 * len(seeds)
    assert pool.stats()["cluster"]["mover"]["chains_moved"] == moved
    assert set(chain_listing(nodes[3], ns)) == {h for h in homes.values()
                                                if bigger.owner(h) == newcomer}
    assert all(pool.get(_prompt(s, n_tokens))[0] == n_tokens for s in seeds)
    # A segment gone from its node ends the prefix there, whatever later runs brought.
    home, keys = chain(0)
    RemoteKVPool([bigger.owner(home)], namespace=ns, token=TOKEN).delete_blocks(keys[4:6])
    n, kv = pool.get(_prompt(0, n_tokens))
    assert n == 4 * CT and kv is not None and torch.equal(kv, _kv(n_tokens, 0)[:, :n])
    pool.close()
