"""HTTP to storage nodes for the clients: pooled connections, timeouts, retries.

urllib3 (a dependency of botocore already, so of s3fs) does the connection pooling
(one pool per node, ``pool_size`` kept-alive connections), timeouts and retries with
exponential backoff: a refused or reset connection is retried for every call (the
request never reached the node), a read timeout or a 502/503/504 answer only for
idempotent calls. Errors come back as isolane errors: ``NodeUnavailableError`` when the
node cannot be reached (or breaks off), else the error the node described
(``statuses.error_from_body``).

Thread-safe. Fork-safe: a forked child (a DataLoader worker) opens its own connections
on its first request instead of sharing the parent's sockets.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import urlsplit

import urllib3
from urllib3.exceptions import HTTPError
from urllib3.util.retry import Retry

from isolane import bounded_json
from isolane.errors import InvalidArgumentError, NodeUnavailableError
from isolane.wire.auth import bearer
from isolane.wire.statuses import error_from_body

Body = bytes | Iterable[bytes | bytearray | memoryview] | None
Response = urllib3.BaseHTTPResponse


@dataclass(frozen=True)
class ClientOptions:
    """How a client talks to nodes. ``token``: the bearer token (None: none sent)."""

    token: str | None = None
    timeout_s: float = 30.0  # longest wait for the next bytes of an answer
    connect_timeout_s: float = 2.0
    retries: int = 2
    backoff_s: float = 0.05  # first retry waits 0, then 2x, 4x this ...
    pool_size: int = 8  # kept-alive connections per node
    read_retries: int | None = None  # after a read timeout or reset (None: ``retries``)

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise InvalidArgumentError("timeout_s and connect_timeout_s must be positive")
        if self.retries < 0 or self.backoff_s < 0 or self.pool_size < 1 or (
                self.read_retries is not None and self.read_retries < 0):
            raise InvalidArgumentError("retries, read_retries and backoff_s must be >= 0, "
                                       "pool_size >= 1")


def check_node_url(url: str) -> str:
    """``http(s)://host:port`` without a trailing slash; InvalidArgumentError otherwise."""
    try:
        parts = urlsplit(url)
        port_ok = parts.port is None or parts.port > 0  # reading it checks its range
    except ValueError:  # an unclosed '[', a port out of range
        port_ok = False
        parts = urlsplit("")
    if not port_ok or parts.scheme not in ("http", "https") or not parts.hostname \
            or parts.path not in ("", "/") or parts.query or parts.fragment:
        raise InvalidArgumentError(f"a storage node URL looks like http://127.0.0.1:7070, got "
                                   f"{url!r}")
    return url.rstrip("/")


class Transport:
    def __init__(self, options: ClientOptions | None = None) -> None:
        self.options = o = options or ClientOptions()
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._manager = self._new_manager()
        self._pools: dict[str, urllib3.HTTPConnectionPool] = {}
        # Built once: a KV get costs a few hundred microseconds of Python in all.
        reads = o.retries if o.read_retries is None else o.read_retries
        self._retry = {replay: Retry(
            total=o.retries, connect=o.retries, read=reads if replay else 0,
            status=o.retries if replay else 0, other=0, allowed_methods=None,
            status_forcelist=(502, 503, 504), backoff_factor=o.backoff_s,
            raise_on_status=False, redirect=0) for replay in (True, False)}
        self._timeouts: dict[float, urllib3.Timeout] = {}
        self._auth = bearer(o.token)

    def _new_manager(self) -> urllib3.PoolManager:
        return urllib3.PoolManager(num_pools=64, maxsize=self.options.pool_size, block=False)

    def _pool(self, node: str) -> urllib3.HTTPConnectionPool:
        if os.getpid() != self._pid:
            with self._lock:
                if os.getpid() != self._pid:
                    self._manager = self._new_manager()
                    self._pools = {}
                    self._pid = os.getpid()
        pool = self._pools.get(node)
        if pool is None:
            with self._lock:
                pool = self._manager.connection_from_url(node)
                self._pools[node] = pool
        return pool

    def _timeout(self, read_s: float) -> urllib3.Timeout:
        timeout = self._timeouts.get(read_s)
        if timeout is None:
            timeout = urllib3.Timeout(connect=self.options.connect_timeout_s, read=read_s)
            self._timeouts[read_s] = timeout
        return timeout

    def request(self, method: str, node: str, path: str, *, body: Body = None,
                headers: Mapping[str, str] | None = None, idempotent: bool,
                stream: bool = False, timeout_s: float | None = None) -> Response:
        """Send one request; an answer of 400 or more is raised as the node's error.
        With ``stream`` the caller reads the body and must ``release_conn()``."""
        replayable = body is None or isinstance(body, bytes | list | tuple)
        timeout = self._timeout(timeout_s if timeout_s is not None else self.options.timeout_s)
        try:
            response = self._pool(node).urlopen(
                # urllib3 sends any bytes-like chunk of an iterable body as is.
                method, path, body=cast(Any, body),
                headers={**self._auth, **(headers or {})},
                retries=self._retry[idempotent and replayable], timeout=timeout,
                preload_content=not stream, redirect=False, assert_same_host=False)
        except (HTTPError, OSError) as exc:
            raise NodeUnavailableError(node, _describe(exc)) from None
        if response.status >= 400:
            raise self._error(response, node)
        return response

    def json(self, method: str, node: str, path: str, *, body: Any = None,
             idempotent: bool, timeout_s: float | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        response = self.request(method, node, path, body=data, headers=headers,
                                idempotent=idempotent, timeout_s=timeout_s)
        try:
            return bounded_json.loads(response.data)
        except ValueError:
            raise NodeUnavailableError(node, f"answered {method} {path} with a body that is "
                                       "not JSON") from None

    def _error(self, response: Response, node: str) -> Exception:
        try:
            data = response.data  # preloaded, or read now from a stream
        except (HTTPError, OSError):
            data = b""
        finally:
            response.release_conn()
        try:
            body = bounded_json.loads(data)
        except ValueError:
            body = None
        return error_from_body(response.status, body, f"storage node {node}")

    def close(self) -> None:
        with self._lock:
            self._pools = {}
            self._manager.clear()


def finish(response: Response, *, complete: bool) -> None:
    """Hand a streamed response's connection back: read to the end when the body was
    consumed (a chunked body's last marker may be left), else close it, since bytes
    left unread would be taken for the next answer on that connection."""
    try:
        if complete:
            response.drain_conn()
        else:
            response.close()
    except (HTTPError, OSError):
        response.close()
    finally:
        response.release_conn()


def _describe(exc: BaseException) -> str:
    reason = getattr(exc, "reason", None)
    return f"{type(exc).__name__}: {reason or exc}"
