"""RemoteKVPool: the KVPool API over one or more storage nodes.

``isolane.open_kv_pool("http://node:port")`` (or several URLs) and
``KVPool.connect(urls or config)`` return one; an engine switches between the embedded
pool and a cluster by what it opens, nothing else. The token level (``put``, ``get``,
...) is the embedded pool's (``kvpool.api.TokenLayer``), so keys are computed exactly
as there (same namespace, dtype, layout, tp rank; the layout as the nodes know it:
``kv_layout.RemoteLayout``).
A prompt's chain of blocks is cut into segments of ``segment_blocks`` blocks
(``cluster.chain_segments``), each routed to its chain's home node (by the chain's home
digest) unless that node is over its load bound, so a restore of ``n`` blocks asks one
node for its segments in one request, a few when some spilled (the plan is
``kv_prefix.read_prefix``), and a lost node costs about 1/N of the cached prefixes. The
home digest travels with every put, so the node puts the chain on one device and
records it for moves.

Routing (``cluster.ClusterRouter``, the default): a consistent-hash ring of the nodes
with bounded loads for writes, read candidates tried in order until a hit (previous
owners while a move is pending, the owner), load reports polled from every node each
``poll_s`` (``poller.LoadPoller``; also the health probe) and segments moved on
``add_node``/``remove_node`` in the background (``mover.ChainMover``, at most
``move_bytes_per_s``). A ``router=`` with an ``owner(chain)`` method
(``routing.RendezvousRouter``) replaces all that: one node a chain, nothing in the
background.

Requests to nodes, their timing and node health: ``kv_nodes.KVNodeClient``.
Failures never reach the engine as exceptions: a node that cannot be reached, answers
too late (``timeout_s``, ``put_timeout_s``) or breaks off mid-response makes its blocks
read as misses (``get_blocks`` returns None for them, ``get`` the prefix that did
arrive), and a put to it is logged and dropped. Such a node is skipped for at least
``down_s`` seconds (a cluster client brings it back on its first successful probe), so
a dead node costs one failed request, not one per call. Mistakes (a malformed key, a
layout that contradicts the namespace's) are raised as on the embedded pool.

Thread-safe (the transport and router are; the layout is set once under a lock).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

from isolane.client.batch_stream import Readable, read_batch
from isolane.client.kv_layout import RemoteLayout
from isolane.client.kv_nodes import KVNodeClient
from isolane.client.kv_prefix import read_prefix
from isolane.client.membership_follower import MembershipFollower
from isolane.client.mover import ChainMover
from isolane.client.poller import LoadPoller
from isolane.client.transport import ClientOptions, check_node_url
from isolane.cluster.chain_segments import (
    DEFAULT_SEGMENT_BLOCKS,
    ChainSegment,
    plan_segments,
)
from isolane.cluster.etcd_membership import client_for
from isolane.cluster.membership import reachable_share
from isolane.cluster.router import ClusterOptions, ClusterRouter
from isolane.cluster.routing import Router
from isolane.config import Config, EtcdConfig, load_config, node_url_list
from isolane.errors import (
    InvalidArgumentError,
    KeyNotFoundError,
    NodeUnavailableError,
)
from isolane.kvpool.api import Destinations, TokenLayer
from isolane.kvpool.keys import KEY_BYTES, check_keys
from isolane.kvpool.tiers.base import copy_block
from isolane.kvpool.token_dim import check_token_dim
from isolane.wire.auth import resolve_token
from isolane.wire.chain_list import Chain
from isolane.wire.layout import NamespaceLayout
from isolane.wire.names import check_namespace

if TYPE_CHECKING:
    import torch

__all__ = ["Readable", "RemoteKVPool", "connect", "read_batch"]
log = logging.getLogger(__name__)
DEFAULT_CHUNK_TOKENS = 256


def connect(target: str | os.PathLike[str] | Sequence[str] | Config, **kwargs: Any
            ) -> RemoteKVPool:
    """A RemoteKVPool on ``target``: a node URL (several joined by commas), a list of
    them, an ``etcd://HOST:PORT/PREFIX`` URL (the nodes registered there), a ``Config``
    or a YAML config file (its ``cluster.nodes`` or ``cluster.etcd``, ``kvpool`` and
    ``node.token``)."""
    if isinstance(target, Config):
        return RemoteKVPool.from_config(target, **kwargs)
    if isinstance(target, str | os.PathLike):
        text = os.fspath(target)
        if text.strip().lower().startswith(("etcd://", "etcds://")):
            kwargs.setdefault("etcd", EtcdConfig(url=text.strip()))
            return RemoteKVPool([], **kwargs)
        if text.endswith((".yaml", ".yml")) and Path(text).is_file():
            return RemoteKVPool.from_config(load_config(text), **kwargs)
        return RemoteKVPool(node_url_list(text), **kwargs)
    return RemoteKVPool(node_url_list(target), **kwargs)


class RemoteKVPool(TokenLayer):
    """The public API of ``KVPool`` over storage nodes (see the module docstring).

    ``nodes``: node URLs (``http://host:port``). ``layout``: the namespace's layout for
    engines that use only the block API (token-level ``put`` fixes it otherwise, as on
    the embedded pool). ``cluster``: routing settings (``ClusterOptions``); ``router``:
    a custom router instead. ``timeout_s``: the longest wait for a get, lookup or
    delete's next bytes, ``put_timeout_s`` for a put's answer (it comes once the node
    has stored the batch). ``batch_bytes``: a larger put is sent as several requests.
    ``poll_s``: period of the load and health probes (None: none). ``connections``:
    kept-alive connections per node (as many as the threads that call at once).
    ``etcd``: take the nodes from etcd and follow their joins and leaves
    (``membership_follower``); ``nodes`` are then the fallback while etcd does not
    answer at start, used only with ``etcd.static_fallback``.
    """

    def __init__(self, nodes: Sequence[str], *, namespace: str = "default",
                 chunk_tokens: int | None = None, token_dim: int = 2, tp_rank: int = 0,
                 tp_size: int = 1, layout: NamespaceLayout | None = None,
                 token: str | None = None, router: Router | None = None,
                 cluster: ClusterOptions | None = None, timeout_s: float = 2.0,
                 put_timeout_s: float = 10.0, connect_timeout_s: float = 0.5,
                 retries: int = 2, backoff_s: float = 0.05, down_s: float = 1.0,
                 batch_bytes: int = 64 << 20, poll_s: float | None = 1.0,
                 move_bytes_per_s: float | None = 128 << 20, connections: int = 32,
                 etcd: EtcdConfig | None = None) -> None:
        if isinstance(nodes, str):
            nodes = [nodes]
        urls = [check_node_url(n) for n in nodes]
        weights: dict[str, float] | None = None
        self._follower: MembershipFollower | None = None
        if etcd is not None:
            if router is not None:
                raise InvalidArgumentError("pass either router= or etcd=, not both")
            self._follower = MembershipFollower(client_for(etcd), ttl_s=etcd.lease_ttl_s)
            weights = self._follower.open(urls if etcd.static_fallback else ())
            urls = [check_node_url(n) for n in weights]
        self.namespace = check_namespace(namespace)
        check_token_dim(token_dim)  # resolved once the layout is known (token_dim.py)
        if chunk_tokens is not None and chunk_tokens < 1:
            raise InvalidArgumentError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        if put_timeout_s <= 0:
            raise InvalidArgumentError(f"put_timeout_s must be positive, got {put_timeout_s}")
        self.chunk_tokens = chunk_tokens or (layout.chunk_tokens if layout else
                                             DEFAULT_CHUNK_TOKENS)
        self.token_dim = layout.token_dim if layout else token_dim
        self.tp_rank, self.tp_size = tp_rank, tp_size
        if layout is not None and (layout.chunk_tokens != self.chunk_tokens):
            raise InvalidArgumentError(f"chunk_tokens={chunk_tokens} contradicts the given "
                                       f"layout's {layout.chunk_tokens}")
        self.cluster: ClusterRouter | None = None
        if router is None:
            self.cluster = ClusterRouter(urls, cluster, weights=weights)
            router = self.cluster
        elif cluster is not None:
            raise InvalidArgumentError("pass either router= or cluster=, not both")
        self.router: Router = router
        self.down_s = down_s
        self.batch_bytes = batch_bytes
        # Reads are not retried after a timeout: a slow node costs one timeout, then
        # its blocks read as misses (retrying would multiply the wait).
        self._nodes = KVNodeClient(self.namespace, ClientOptions(
            token=resolve_token(token), timeout_s=timeout_s,
            connect_timeout_s=connect_timeout_s, retries=retries, backoff_s=backoff_s,
            read_retries=0, pool_size=connections), put_timeout_s=put_timeout_s,
            down_s=down_s, batch_bytes=batch_bytes, cluster=self.cluster)
        self._closed = False
        self._layouts = RemoteLayout(self.namespace, self._nodes, given=layout,
                                     chunk_tokens=chunk_tokens, token_dim=self.token_dim,
                                     down_s=down_s)
        self._poller: LoadPoller | None = None
        self._mover: ChainMover | None = None
        if self.cluster is not None:
            cluster_router = self.cluster
            follower = self._follower
            self._mover = ChainMover(_MoverIO(self), bytes_per_s=move_bytes_per_s,
                                     on_done=follower.moves_done if follower is not None
                                     else cluster_router.complete_move)
            if poll_s is not None:
                self._poller = LoadPoller(self._nodes.probe, lambda: cluster_router.members,
                                          self._nodes.probed, period_s=poll_s)
                self._nodes.probing = True
                self._poller.ensure_running()
            if follower is not None:
                for node in cluster_router.nodes if self._poller is not None else ():
                    if self._nodes.probe(node) is None:  # a registered URL that does not
                        cluster_router.failed(node)  # answer gets no traffic
                follower.bind(cluster_router, self._mover, probing=self._poller is not None)

    @classmethod
    def from_config(cls, config: Config, **kwargs: Any) -> RemoteKVPool:
        """On ``cluster.nodes`` (or the nodes registered in ``cluster.etcd``), with
        ``kvpool.namespace``/``chunk_tokens``, ``node.token`` and ``cluster.load_bound``/
        ``segment_blocks``/``prefix_blocks``/``placement`` as defaults (keyword arguments
        win)."""
        kwargs.setdefault("namespace", config.kvpool.namespace)
        kwargs.setdefault("chunk_tokens", config.kvpool.chunk_tokens)
        kwargs.setdefault("token", config.node.token)
        if "router" not in kwargs:
            kwargs.setdefault("cluster", ClusterOptions.from_config(config.cluster))
        etcd = config.cluster.etcd
        if etcd is not None and "router" not in kwargs:
            kwargs.setdefault("etcd", etcd)
            return cls(list(config.cluster.nodes) if etcd.static_fallback else [], **kwargs)
        return cls(list(config.cluster.nodes), **kwargs)

    @property
    def nodes(self) -> list[str]:
        """The nodes chains are placed on now."""
        return list(self.router.nodes)

    # -- namespace and layout -----------------------------------------------------------
    @property
    def layout(self) -> tuple[str, tuple[int, ...]] | None:
        """``(dtype, shape without the token dimension)``, as ``KVPool.layout``."""
        found = self._known_layout()
        return None if found is None else (found.dtype, found.shape)

    def _known_layout(self) -> NamespaceLayout | None:
        return self._follow(self._layouts.known(self.nodes))

    def _follow(self, layout: NamespaceLayout | None) -> NamespaceLayout | None:
        """Take the namespace's chunk_tokens and token_dim from its known layout."""
        if layout is not None:
            self.chunk_tokens, self.token_dim = layout.chunk_tokens, layout.token_dim
        return layout

    def _adopt_layout(self, dtype: str, shape: tuple[int, ...], token_dim: int
                      ) -> tuple[str, tuple[int, ...]]:
        known = self._known_layout()
        if known is None:  # the first put fixes it, as on the embedded pool
            known = self._follow(self._layouts.adopt(
                NamespaceLayout(dtype, shape, self.chunk_tokens, token_dim)))
        return (known.dtype, known.shape) if known else (dtype, shape)

    # -- block-level API -------------------------------------------------------------------
    def put_blocks(self, keys: Sequence[bytes], buffers: Sequence[Any], *,
                   chain: Sequence[bytes] | None = None) -> int:
        """Store blocks on the nodes of their chain segments; returns how many were new.
        ``chain``: the chain's keys from its first block, when ``keys`` do not start it
        (routing needs the chain's first keys and where ``keys`` start in it: ``chain``
        may include ``keys`` or end right before them). Unreachable node: logged, 0 for
        its blocks."""
        self._check_open()
        check_keys(keys)
        if len(keys) != len(buffers):
            raise InvalidArgumentError(f"put_blocks got {len(keys)} keys and "
                                       f"{len(buffers)} buffers")
        if not keys:
            return 0
        layout = self._known_layout()
        if layout is None:
            raise InvalidArgumentError(
                f"namespace '{self.namespace}' has no layout yet: put() a KV tensor first, "
                "or pass layout=NamespaceLayout(...) to RemoteKVPool")
        views = [memoryview(b).cast("B") for b in buffers]
        for key, view in zip(keys, views, strict=True):
            if len(key) != KEY_BYTES:
                raise InvalidArgumentError(f"a block key is {KEY_BYTES} bytes, got {len(key)}")
            if len(view) != layout.block_bytes:
                raise InvalidArgumentError(f"block {bytes(key).hex()} is {len(view)} bytes; a "
                                           f"block of this namespace is {layout.block_bytes}")
        self._ensure_background()
        stored = 0
        for seg in self._segments(keys, chain):
            node, home = self._writer(seg, chain or keys)
            stored += self._nodes.store(node, layout, home, keys[seg.start:seg.stop],
                                        views[seg.start:seg.stop], move=False) or 0
        return stored

    @property
    def segment_blocks(self) -> int:
        """``S``: blocks per chain segment, the unit of placement."""
        return self.cluster.segment_blocks if self.cluster else DEFAULT_SEGMENT_BLOCKS

    def _segments(self, keys: Sequence[bytes], chain: Sequence[bytes] | None
                  ) -> list[ChainSegment]:
        if self.cluster is not None:
            return self.cluster.segments(keys, chain)
        return plan_segments(keys, DEFAULT_SEGMENT_BLOCKS, chain=chain)

    def _writer(self, seg: ChainSegment, lead: Sequence[bytes]) -> tuple[str, bytes]:
        """The node to write ``seg`` to and the home digest it records it under."""
        if self.cluster is not None:
            return self.cluster.place_segment(seg.digest, seg.home,
                                              seg.index * self.segment_blocks)
        return self.router.owner(lead), seg.home

    def get_blocks(self, keys: Sequence[bytes], *, chain: Sequence[bytes] | None = None
                   ) -> list[bytes | None]:
        """Each block's bytes, or None for a miss (also for blocks of a node that is
        down or broke off). ``chain``: as for ``put_blocks``. One request per node
        tried, for all the segments whose next candidate it is."""
        self._check_open()
        check_keys(keys)
        if not keys:
            return []
        lead = chain or keys
        values: list[bytes | None] = [None] * len(keys)
        segs = self._segments(keys, chain)
        todo = {i: self._candidates(seg, lead) for i, seg in enumerate(segs)}
        while todo:
            by_node: dict[str, list[int]] = {}
            for i, nodes in list(todo.items()):
                if not nodes:
                    del todo[i]
                    continue
                by_node.setdefault(nodes.pop(0), []).append(i)
            for node, seg_ids in by_node.items():
                wanted = [j for i in seg_ids for j in range(segs[i].start, segs[i].stop)
                          if values[j] is None]
                got = self._fetch(node, [keys[j] for j in wanted], prefix=False)
                for j, value in zip(wanted, got, strict=True):
                    if value is not None:
                        values[j] = value
                for i in seg_ids:
                    seg = segs[i]
                    if all(values[j] is not None for j in range(seg.start, seg.stop)):
                        todo.pop(i, None)
        return values

    def get_blocks_into(self, keys: Sequence[bytes], dests: Sequence[torch.Tensor], *,
                        chain: Sequence[bytes] | None = None) -> int:
        """Read the longest stored prefix of ``keys`` into ``dests``, as on the embedded
        pool (``TokenLayer.get_blocks_into``). ``chain``: as for ``put_blocks``."""
        self._check_open()
        if not self._check_dests(keys, dests):
            return 0
        blocks = self._prefix([bytes(k) for k in keys], chain)
        for dest, block in zip(dests, blocks, strict=False):
            copy_block(block, dest)
        return len(blocks)

    def lookup_blocks(self, keys: Sequence[bytes], *, chain: Sequence[bytes] | None = None
                      ) -> int:
        """How many leading ``keys`` are stored (0 when their nodes are down)."""
        self._check_open()
        check_keys(keys)
        if not keys:
            return 0
        lead = chain or keys
        n = 0
        for seg in self._segments(keys, chain):
            for node in self._candidates(seg, lead):
                answer = self._nodes.keys_call(node, "lookup", keys[n:seg.stop])
                n += 0 if answer is None else int(answer["blocks"])
                if n == seg.stop:
                    break
            if n < seg.stop:
                break
        return n

    def delete_blocks(self, keys: Sequence[bytes], *, chain: Sequence[bytes] | None = None
                      ) -> int:
        """Drop these blocks from every node that may hold them (each segment's read
        candidates: previous owners, where it was written, the owner); returns how many
        were stored (per segment, on the node that had the most; 0 when those nodes are
        down: logged, the blocks stay there)."""
        self._check_open()
        check_keys(keys)
        if not keys:
            return 0
        lead = chain or keys
        deleted = 0
        for seg in self._segments(keys, chain):
            most = 0
            for node in self._candidates(seg, lead):
                answer = self._nodes.keys_call(node, "delete", keys[seg.start:seg.stop])
                if answer is None:
                    log.warning("KV blocks not deleted on %s: node unavailable", node)
                    continue
                most = max(most, int(answer["deleted"]))
            deleted += most
        return deleted

    def _candidates(self, seg: ChainSegment, lead: Sequence[bytes]) -> list[str]:
        """The live nodes to read the segment ``seg`` from, in order."""
        self._ensure_background()
        if self.cluster is not None:
            return self._nodes.live(self.cluster.read_candidates(
                seg.digest, seg.home, seg.index * self.segment_blocks))
        return self._nodes.live([self.router.owner(lead)])

    def _fetch(self, node: str, keys: Sequence[bytes], *, prefix: bool) -> list[bytes | None]:
        layout = self._known_layout()
        return self._nodes.fetch(node, keys, prefix=prefix,
                                 max_value_bytes=layout.block_bytes if layout else 1 << 30)

    # -- the token level's reads (api.TokenLayer) -------------------------------------
    def _read_prefix(self, keys: list[bytes], dests: Destinations) -> int:
        blocks = self._prefix(keys)
        if not blocks:
            return 0
        for dest, block in zip(dests(len(blocks)), blocks, strict=True):
            copy_block(block, dest)
        return len(blocks)

    def _prefetch_prefix(self, keys: list[bytes]) -> Future[int]:
        """Read the cached prefix on its nodes in the background (which warms their
        memory tiers, as ``KVPool.prefetch`` warms its own). One thread per call (as
        ``kv_prefix.leading_many``: nothing to shut down or break in a forked child)."""
        done: Future[int] = Future()

        def run() -> None:
            try:
                done.set_result(len(self._prefix(keys)) * self.chunk_tokens)
            except BaseException as exc:  # handed to the caller through the Future
                done.set_exception(exc)

        threading.Thread(target=run, name="isolane-kv-prefetch", daemon=True).start()
        return done

    def _prefix(self, keys: list[bytes], chain: Sequence[bytes] | None = None
                ) -> list[bytes]:
        """The longest stored prefix of ``keys`` on the nodes (``kv_prefix.read_prefix``;
        ``chain``: as for ``put_blocks``)."""
        self._check_open()
        if not keys:
            return []
        segs = self._segments(keys, chain)
        lead = chain or keys
        return read_prefix(keys, segs, [self._candidates(seg, lead) for seg in segs],
                           self._leading)

    def _leading(self, node: str, keys: Sequence[bytes]) -> list[bytes]:
        """The leading stored blocks of ``keys`` on ``node``."""
        out: list[bytes] = []
        for value in self._fetch(node, keys, prefix=True):
            if value is None:
                break
            out.append(value)
        return out

    # -- cluster membership ------------------------------------------------------------------
    def add_node(self, url: str, *, move: bool = True) -> None:
        """Add a node to the ring: new segments go to it at once, and (``move``) the
        segments it now owns are moved to it in the background; until then reads fall
        back to their previous owners. Other clients of the cluster call ``add_node(url,
        move=False)`` and ``complete_move()`` once the moving client's
        ``wait_moves()`` returned (or let their fallback reads run a little longer)."""
        cluster = self._require_cluster()
        url = check_node_url(url)
        old, new = cluster.join(url)
        if move and self._mover is not None:
            self._mover.rebalance(old, new)

    def remove_node(self, url: str, *, move: bool = True) -> None:
        """Take a node out of the ring; with ``move`` its segments are copied to their new
        owners in the background (while it still answers), reads falling back to it
        until then."""
        cluster = self._require_cluster()
        url = check_node_url(url)
        old, new = cluster.leave(url)
        if move and self._mover is not None:
            self._mover.rebalance(old, new)

    def wait_moves(self, timeout_s: float | None = None) -> bool:
        """Wait until no move is queued or running; whether it happened."""
        return self._mover.wait(timeout_s) if self._mover is not None else True

    def complete_move(self) -> None:
        """Stop reading from previous owners (the moves are done elsewhere)."""
        self._require_cluster().complete_move()

    @property
    def moving(self) -> bool:
        """Whether reads still fall back to the previous owners of chains."""
        return self.cluster is not None and self.cluster.moving

    def _require_cluster(self) -> ClusterRouter:
        if self.cluster is None:
            raise InvalidArgumentError("this RemoteKVPool routes with a custom router=; "
                                       "membership changes need the default cluster router")
        return self.cluster

    # -- the rest ---------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Each node's stats of this namespace (or the error that node gave), and with
        the cluster router its view: ring, down nodes, loads, moves."""
        nodes: dict[str, Any] = {}
        for node in self.cluster.members if self.cluster else self.nodes:
            try:
                nodes[node] = self._nodes.call_json(node, "GET", "/stats")
            except (NodeUnavailableError, KeyNotFoundError) as exc:
                nodes[node] = {"error": str(exc)}
        out: dict[str, Any] = {"namespace": self.namespace, "chunk_tokens": self.chunk_tokens,
                               "nodes": nodes}
        if self.cluster is not None and self._mover is not None:
            out["cluster"] = {**self.cluster.describe(),
                              "mover": dict(vars(self._mover.stats)),
                              "membership": self.membership()}
        return out

    def membership(self) -> dict[str, Any]:
        """Where the nodes come from (``source``: ``static`` or ``etcd``, with the watch's
        state), moves in flight and the share of the cache whose owner is reachable."""
        out: dict[str, Any] = ({"source": "static"} if self._follower is None
                               else self._follower.describe())
        if self.cluster is not None:
            ring = self.cluster.ring
            up = [n for n in ring.nodes if self.cluster.is_up(n)]
            out["moves_in_flight"] = self.cluster.moving
            out["reachable_share"] = round(reachable_share(ring, up), 4)
        return out

    def close(self) -> None:
        self._closed = True
        if self._follower is not None:
            self._follower.close()
        if self._poller is not None:
            self._poller.close()
        if self._mover is not None:
            self._mover.close()
        self._nodes.close()

    def __enter__(self) -> RemoteKVPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RemoteKVPool({self.nodes!r}, namespace={self.namespace!r})"

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgumentError(f"remote KV pool of namespace '{self.namespace}' is "
                                       "closed; open a new RemoteKVPool to use it again")

    # -- node health ---------------------------------------------------------------------------
    def _ensure_background(self) -> None:
        if self._poller is not None:
            self._poller.ensure_running()  # a forked child (DataLoader worker) starts its own

class _MoverIO:
    """The mover's I/O through its pool (``mover.MoverIO``)."""

    def __init__(self, pool: RemoteKVPool) -> None:
        self.pool = pool

    def slice_blocks(self) -> int:
        layout = self.pool._known_layout()
        return max(1, self.pool.batch_bytes // layout.block_bytes) if layout else 64

    def fetch(self, node: str, keys: Sequence[bytes]) -> list[bytes | None]:
        return self.pool._fetch(node, keys, prefix=False)

    def store(self, node: str, digest: bytes, keys: Sequence[bytes],
              values: Sequence[bytes]) -> bool:
        layout = self.pool._known_layout()
        return layout is not None and self.pool._nodes.store(
            node, layout, digest, keys, values, move=True) is not None

    def delete(self, node: str, keys: Sequence[bytes]) -> None:
        self.pool._nodes.keys_call(node, "delete", keys)

    def list_chains(self, node: str) -> list[Chain] | None:
        cluster = self.pool.cluster
        if cluster is not None and cluster.is_down(node):
            return None  # down (stopped, killed): asking would only wait for a timeout
        return self.pool._nodes.list_chains(node)
