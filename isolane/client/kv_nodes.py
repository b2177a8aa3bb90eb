"""KVNodeClient: one KV namespace's endpoints on any node, and what a client knows of
each node's health (the I/O half of ``RemoteKVPool``; where chains go is the router's).

Every request is timed for the cluster router's load estimate (``ClusterRouter.started``
/ ``finished``). A node that cannot be reached, answers too late or breaks off is
skipped for ``down_s`` seconds (``live``), and with background probes running
(``probing``) it stays down in the router until a probe answers. Failures come back as
None / misses, never as exceptions; a node's answer that it has no such namespace is
an empty answer (nothing stored there).

Thread-safe (the transports are; the sets and maps here take single operations).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import quote

from isolane.client.batch_stream import json_object, read_batch
from isolane.client.transport import ClientOptions, Response, Transport, finish
from isolane.cluster.router import ClusterRouter
from isolane.errors import KeyNotFoundError, NodeUnavailableError
from isolane.wire import frames
from isolane.wire.chain_list import Chain, decode_chain_list
from isolane.wire.layout import NamespaceLayout

log = logging.getLogger(__name__)
BATCH_TYPE = "application/x-isolane-kv-batch"
KEYS_TYPE = {"Content-Type": "application/octet-stream"}
JSON_TYPE = {"Content-Type": "application/json"}
LIST_TIMEOUT_S = 30.0  # a chain list is read once per move, and may be long


class KVNodeClient:
    """``options``: how to talk to nodes (``read_retries`` 0 for KV: a slow node costs
    one timeout). ``put_timeout_s``: the wait for a put's answer (it comes once the node
    has stored the batch). ``batch_bytes``: a larger put is sent as several requests."""

    def __init__(self, namespace: str, options: ClientOptions, *, put_timeout_s: float,
                 down_s: float, batch_bytes: int, cluster: ClusterRouter | None) -> None:
        self.path = f"/v1/kv/{quote(namespace, safe='')}"
        self.namespace = namespace
        self.options = options
        self.put_timeout_s = put_timeout_s
        self.down_s = down_s
        self.batch_bytes = batch_bytes
        self.cluster = cluster
        self.probing = False  # set by the owner once background probes run
        self.transport = Transport(options)
        # Probes: no retries (a failed probe is the answer), their own connections.
        self.probes = Transport(ClientOptions(
            token=options.token, timeout_s=min(options.timeout_s, 1.0),
            connect_timeout_s=options.connect_timeout_s, retries=0, pool_size=1))
        self._registered: set[str] = set()
        self._down_until: dict[str, float] = {}
        self.get_requests = 0  # batch gets sent (a statistic: not exact under threads)

    # -- health ----------------------------------------------------------------------------
    def live(self, nodes: Sequence[str]) -> list[str]:
        """``nodes`` without those skipped since a recent failure."""
        now = time.monotonic()
        return [n for n in nodes if self._down_until.get(n, 0.0) <= now]

    def mark_down(self, node: str, exc: Exception) -> None:
        if self.cluster is not None and self.probing:
            self.cluster.failed(node)  # down until a probe answers (else: down_s only)
        if self._down_until.get(node, 0.0) <= time.monotonic():
            log.warning("KV node %s unavailable for %.1f s, reading its blocks as misses: %s",
                        node, self.down_s, exc)
        self._down_until[node] = time.monotonic() + self.down_s

    def probe(self, node: str) -> dict[str, Any] | None:
        """The node's load report, or None when it does not answer in time."""
        try:
            stats = self.probes.json("GET", node, "/v1/stats", idempotent=False)
        except (NodeUnavailableError, KeyNotFoundError):
            return None
        return stats if isinstance(stats, dict) else None

    def probed(self, node: str, stats: Mapping[str, Any] | None) -> None:
        """Hand a probe's answer to the router; a node that answers is tried again."""
        if self.cluster is not None and self.cluster.observe(node, stats, self.namespace) \
                and stats:
            self._down_until.pop(node, None)

    def _started(self, node: str) -> float:
        if self.cluster is not None:
            self.cluster.started(node)
        return time.perf_counter()

    def _finished(self, node: str, started: float, nbytes: int, *, ok: bool) -> None:
        if self.cluster is not None:
            self.cluster.finished(node, time.perf_counter() - started, nbytes, ok=ok)

    # -- requests --------------------------------------------------------------------------
    def call(self, node: str, method: str, suffix: str = "", *, body: Any = None,
             headers: dict[str, str] | None = None, timeout_s: float | None = None,
             nbytes: int = 0) -> Response:
        """One idempotent request to ``path + suffix``, timed; raises the node's error."""
        started = self._started(node)
        ok = True  # any answer, errors included, says the node is up
        try:
            return self.transport.request(method, node, self.path + suffix, body=body,
                                          headers=headers, idempotent=True,
                                          timeout_s=timeout_s)
        except NodeUnavailableError:
            ok = False
            raise
        finally:
            self._finished(node, started, nbytes, ok=ok)

    def call_json(self, node: str, method: str, suffix: str = "", body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        response = self.call(node, method, suffix, body=data,
                             headers=JSON_TYPE if data is not None else None)
        return json_object(response.data)

    def register(self, node: str, layout: NamespaceLayout) -> None:
        """Register the namespace's layout on ``node`` (once per node and client)."""
        if node in self._registered:
            return
        self.call_json(node, "PUT", body=layout.to_dict())
        self._registered.add(node)

    def store(self, node: str, layout: NamespaceLayout, digest: bytes,
              keys: Sequence[bytes], views: Sequence[frames.Buffer], *, move: bool
              ) -> int | None:
        """Put blocks of the chain segment ``digest`` on ``node`` in batches; how many were new,
        or None (logged) when the node is unavailable."""
        if not self.live([node]):
            return None
        query = f"?chain={digest.hex()}" + ("&move=1" if move else "")
        stored = 0
        try:
            self.register(node, layout)
            for batch_keys, batch_views in self._batches(keys, views):
                stored += self._put_batch(node, layout, batch_keys, batch_views, query)
        except NodeUnavailableError as exc:
            self.mark_down(node, exc)
            log.warning("KV blocks not stored on %s (dropped): %s", node, exc)
            return None
        return stored

    def _batches(self, keys: Sequence[bytes], views: Sequence[frames.Buffer]
                 ) -> list[tuple[list[bytes], list[frames.Buffer]]]:
        out: list[tuple[list[bytes], list[frames.Buffer]]] = []
        size = 0
        for key, view in zip(keys, views, strict=True):
            if not out or size + len(view) > self.batch_bytes:
                out.append(([], []))
                size = 0
            out[-1][0].append(bytes(key))
            out[-1][1].append(view)
            size += len(view)
        return out

    def _put_batch(self, node: str, layout: NamespaceLayout, keys: list[bytes],
                   views: list[frames.Buffer], query: str) -> int:
        body: list[frames.Buffer] = [frames.encode_batch_header(len(keys))]
        for key, view in zip(keys, views, strict=True):
            body.extend(frames.encode_frame(key, view))
        length = sum(len(part) for part in body)
        headers = {"Content-Type": BATCH_TYPE, "Content-Length": str(length)}
        try:
            response = self.call(node, "POST", f"/put{query}", body=body, headers=headers,
                                 timeout_s=self.put_timeout_s, nbytes=length)
        except KeyNotFoundError:  # the node lost the namespace (wiped, evicted): again
            self._registered.discard(node)
            self.register(node, layout)
            response = self.call(node, "POST", f"/put{query}", body=body, headers=headers,
                                 timeout_s=self.put_timeout_s, nbytes=length)
        return int(json_object(response.data)["stored"])

    def keys_call(self, node: str, verb: str, keys: Sequence[bytes]) -> dict[str, Any] | None:
        """``lookup`` or ``delete`` of ``keys``; None when the node is unavailable."""
        if not self.live([node]):
            return None
        try:
            response = self.call(node, "POST", f"/{verb}", body=frames.encode_keys(keys),
                                 headers=KEYS_TYPE)
        except NodeUnavailableError as exc:
            self.mark_down(node, exc)
            return None
        except KeyNotFoundError:  # the node has no such namespace: nothing stored there
            return {"blocks": 0, "deleted": 0}
        return json_object(response.data)

    def fetch(self, node: str, keys: Sequence[bytes], *, prefix: bool,
              max_value_bytes: int) -> list[bytes | None]:
        """Each key's value from ``node`` or None (``prefix``: only the leading stored
        keys); a node that is down or breaks off gives misses for what did not arrive."""
        misses: list[bytes | None] = [None] * len(keys)
        if not keys or not self.live([node]):
            return misses
        started = self._started(node)
        self.get_requests += 1
        try:
            response = self.transport.request(
                "POST", node, f"{self.path}/get" + ("?prefix=1" if prefix else ""),
                body=frames.encode_keys(keys), headers=KEYS_TYPE, idempotent=True,
                stream=True)
        except NodeUnavailableError as exc:
            self._finished(node, started, 0, ok=False)
            self.mark_down(node, exc)
            return misses
        except KeyNotFoundError:
            self._finished(node, started, 0, ok=True)
            return misses
        values, complete = misses, False
        try:
            values, complete = read_batch(response, keys, max_value_bytes)
        finally:
            finish(response, complete=complete)
            received = sum(len(v) for v in values if v is not None)
            self._finished(node, started, received, ok=complete)
        if not complete:
            self.mark_down(node, NodeUnavailableError(node, "the response broke off"))
        return values

    def list_chains(self, node: str) -> list[Chain] | None:
        """The chains ``node`` holds in the namespace; None when it is unavailable."""
        if not self.live([node]):
            return None
        try:
            response = self.transport.request("GET", node, f"{self.path}/chains",
                                              idempotent=True, timeout_s=LIST_TIMEOUT_S)
        except KeyNotFoundError:
            return []  # the namespace was never put on this node
        except NodeUnavailableError as exc:
            self.mark_down(node, exc)
            return None
        return decode_chain_list(response.data)

    def close(self) -> None:
        self.transport.close()
        self.probes.close()
