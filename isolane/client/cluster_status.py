"""The state of a cluster as ``isolane cluster status`` shows it: the members and where
they come from (``static``: ``cluster.nodes``; ``etcd``: the nodes registered under the
prefix), each member's lease (time left by etcd's clock) and answer to a probe, moves in
flight (the etcd move lock) and the share of the cache whose owner answers.

One pass, no background threads; a node that does not answer within ``timeout_s`` is
reported unreachable. Malformed records under the prefix are listed, not trusted.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from isolane.client.transport import ClientOptions, Transport
from isolane.cluster.etcd_client import EtcdClient
from isolane.cluster.etcd_records import (
    MOVE_DONE,
    MOVE_LOCK,
    MoveRecord,
    NodeRecord,
    RecordError,
    url_of_node_key,
)
from isolane.cluster.membership import reachable_share
from isolane.cluster.rendezvous import make_placement
from isolane.errors import AuthenticationError, IsolaneError, KeyNotFoundError


def etcd_status(client: EtcdClient) -> dict[str, Any]:
    """Members, leases and the move lock as etcd has them (raises
    ``EtcdUnavailableError`` when etcd does not answer)."""
    prefix = client.target.prefix
    revision, kvs = client.range_prefix(prefix + "/")
    nodes: list[dict[str, Any]] = []
    ignored: list[dict[str, str]] = []
    moves: dict[str, Any] = {"in_flight": False, "mover": None, "ring": None,
                             "last_done_ring": None}
    now = time.time()
    for kv in kvs:
        url = url_of_node_key(prefix, kv.key)
        try:
            if url is not None:
                record = NodeRecord.decode(url, kv.value)
                nodes.append({"url": record.url, "weight": record.weight, "pid": record.pid,
                              "lease_id": f"{kv.lease:x}",
                              "lease_left_s": client.time_to_live(kv.lease) if kv.lease
                              else None,
                              "registered_s": round(now - record.started, 3)})
            elif kv.key == prefix + MOVE_LOCK:
                lock = MoveRecord.decode(kv.value)
                moves.update(in_flight=True, mover=lock.client, ring=lock.ring)
            elif kv.key == prefix + MOVE_DONE:
                moves["last_done_ring"] = MoveRecord.decode(kv.value).ring
        except RecordError as exc:
            ignored.append({"key": kv.key, "why": str(exc)})
    return {"source": "etcd", "etcd": client.target.url, "revision": revision,
            "nodes": nodes, "moves": moves, "ignored": ignored}


def static_status(urls: Sequence[str]) -> dict[str, Any]:
    return {"source": "static", "nodes": [{"url": u, "weight": 1.0} for u in urls],
            "moves": {"in_flight": False}, "ignored": []}


def probe_nodes(report: dict[str, Any], *, token: str | None, placement: str = "ring",
                timeout_s: float = 1.0) -> dict[str, Any]:
    """``report`` with each node's probe (``reachable``, its ``cluster`` section) and
    the ``reachable_share`` of the cache."""
    transport = Transport(ClientOptions(token=token, timeout_s=timeout_s,
                                        connect_timeout_s=timeout_s, retries=0))
    try:
        for node in report["nodes"]:
            try:
                stats = transport.json("GET", node["url"], "/v1/stats", idempotent=False)
                node["reachable"] = True
                node["cluster"] = stats.get("cluster") if isinstance(stats, dict) else None
            except (IsolaneError, AuthenticationError, KeyNotFoundError) as exc:
                node["reachable"] = False
                node["error"] = str(exc)
    finally:
        transport.close()
    nodes = report["nodes"]
    if nodes:
        ring = make_placement(placement, [n["url"] for n in nodes],
                              weights={n["url"]: n["weight"] for n in nodes})
        share = reachable_share(ring, [n["url"] for n in nodes if n["reachable"]])
    else:
        share = 0.0
    report["reachable_share"] = round(share, 4)
    return report
