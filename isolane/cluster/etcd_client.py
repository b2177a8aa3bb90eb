"""EtcdClient: the few etcd v3 calls cluster membership needs, over etcd's JSON gateway.

etcd (3.4 and later) serves its gRPC API as JSON under ``/v3/`` on the client port:
``kv/range``, ``kv/put``, ``kv/txn``, ``kv/deleterange``, ``lease/grant``,
``lease/keepalive``, ``lease/revoke``, ``lease/timetolive``, ``watch`` (a stream of
JSON objects, one a line) and ``auth/authenticate``. Keys and values are base64 in the
JSON; 64-bit numbers are strings. The gateway is used instead of a gRPC client library
because the Python ones pin protobuf/grpc versions that clash with the rest of the
stack (``etcd3``) or are async-only (``aetcd``); this needs only the standard library.

Target URLs: ``etcd://HOST:PORT/PREFIX`` (plain HTTP) or ``etcds://HOST:PORT/PREFIX``
(TLS, verified against ``ca_file`` or the system store; ``cert_file``/``key_file`` for
client certificates). With ``user``/``password`` the client authenticates once and
again whenever etcd says the token is no longer valid (a restart forgets tokens).

Thread-safe: every call opens its own connection (etcd is a control plane here: a few
calls a second).
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import socket
import ssl
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from isolane import bounded_json
from isolane.errors import AuthenticationError, EtcdUnavailableError, InvalidArgumentError

SCHEMES = {"etcd": "http", "etcds": "https"}
DEFAULT_PORT = 2379
DEFAULT_PREFIX = "/isolane"
MAX_ANSWER_BYTES = 64 << 20  # a range of the membership prefix is a few KiB


class EtcdRequestError(InvalidArgumentError):
    """etcd answered with an error (bad request, permission denied)."""


@dataclass(frozen=True)
class EtcdTarget:
    """Where etcd is and the key prefix under which a cluster keeps its membership."""

    scheme: str  # "http" or "https"
    host: str
    port: int
    prefix: str  # starts with "/", no trailing "/"

    @property
    def url(self) -> str:
        """The target as given (without credentials): ``etcd://host:port/prefix``."""
        scheme = "etcds" if self.scheme == "https" else "etcd"
        return f"{scheme}://{self.host}:{self.port}{self.prefix}"


def parse_etcd_url(url: str) -> EtcdTarget:
    """``etcd://HOST[:PORT][/PREFIX]`` (or ``etcds://``) as an :class:`EtcdTarget`;
    the port defaults to 2379 and the prefix to ``/isolane``."""
    if not isinstance(url, str):
        raise InvalidArgumentError(f"an etcd URL is a string, got {url!r}")
    parts = urlsplit(url.strip())
    if parts.scheme not in SCHEMES or not parts.hostname:
        raise InvalidArgumentError(
            f"{url!r} is not an etcd URL; write etcd://HOST:PORT/PREFIX (etcds:// for TLS), "
            "e.g. etcd://127.0.0.1:2379/isolane")
    if parts.username or parts.password:
        raise InvalidArgumentError(
            f"{parts.scheme}://{parts.hostname}: credentials do not go in the etcd URL; set "
            "cluster.etcd.user and cluster.etcd.password")
    try:
        port = parts.port or DEFAULT_PORT
    except ValueError:
        raise InvalidArgumentError(f"{url!r} has an invalid port") from None
    prefix = "/" + parts.path.strip("/") if parts.path.strip("/") else DEFAULT_PREFIX
    return EtcdTarget(SCHEMES[parts.scheme], parts.hostname, port, prefix)


@dataclass(frozen=True)
class EtcdAuth:
    """How to prove who we are to etcd: user/password and/or TLS files."""

    user: str | None = None
    password: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None


@dataclass(frozen=True)
class KeyValue:
    """One key of a range or a watch event (``value`` empty for a delete)."""

    key: str
    value: bytes
    mod_revision: int
    lease: int


@dataclass(frozen=True)
class WatchEvent:
    kind: str  # "put" or "delete"
    kv: KeyValue


def _b64(text: str | bytes) -> str:
    raw = text.encode() if isinstance(text, str) else text
    return base64.b64encode(raw).decode()


def prefix_end(prefix: str) -> str:
    """The range end that covers every key starting with ``prefix`` (etcd convention:
    the prefix with its last byte incremented)."""
    raw = bytearray(prefix.encode())
    raw[-1] += 1
    return bytes(raw).decode()


def _kv(item: dict[str, Any]) -> KeyValue:
    return KeyValue(key=base64.b64decode(item.get("key", "")).decode(errors="replace"),
                    value=base64.b64decode(item.get("value", "")),
                    mod_revision=int(item.get("mod_revision", 0)),
                    lease=int(item.get("lease", 0)))


class EtcdClient:
    """Calls to one etcd endpoint (module docstring). ``timeout_s``: the longest wait
    for an answer (a watch waits for its next event without limit, see ``watch``)."""

    def __init__(self, target: EtcdTarget, auth: EtcdAuth | None = None, *,
                 timeout_s: float = 2.0) -> None:
        self.target = target
        self.auth = auth or EtcdAuth()
        self.timeout_s = timeout_s
        self._token: str | None = None
        self._lock = threading.Lock()
        self._ssl: ssl.SSLContext | None = None
        if target.scheme == "https":
            self._ssl = ssl.create_default_context(cafile=self.auth.ca_file)
            if self.auth.cert_file:
                self._ssl.load_cert_chain(self.auth.cert_file, self.auth.key_file)

    # -- plumbing --------------------------------------------------------------------------
    def _connection(self, timeout_s: float | None) -> http.client.HTTPConnection:
        if self._ssl is not None:
            return http.client.HTTPSConnection(self.target.host, self.target.port,
                                               timeout=timeout_s, context=self._ssl)
        return http.client.HTTPConnection(self.target.host, self.target.port,
                                          timeout=timeout_s)

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.auth.user is not None:
            with self._lock:
                token = self._token
            if token is None:
                token = self._authenticate()
            headers["Authorization"] = token
        return headers

    def _authenticate(self) -> str:
        answer = self._post("/v3/auth/authenticate", {"name": self.auth.user,
                                                       "password": self.auth.password or ""},
                            {"Content-Type": "application/json"})
        token = answer.get("token")
        if not isinstance(token, str):
            raise AuthenticationError(f"etcd {self.target.url} gave no token to user "
                                      f"{self.auth.user!r}")
        with self._lock:
            self._token = token
        return token

    def _post(self, path: str, body: dict[str, Any], headers: dict[str, str]
              ) -> dict[str, Any]:
        conn = self._connection(self.timeout_s)
        try:
            conn.request("POST", path, json.dumps(body).encode(), headers)
            response = conn.getresponse()
            raw = response.read(MAX_ANSWER_BYTES)
        except (OSError, http.client.HTTPException) as exc:
            raise EtcdUnavailableError(self.target.url, f"{path}: {exc}") from None
        finally:
            conn.close()
        return self._answer(path, raw)

    def _answer(self, path: str, raw: bytes) -> dict[str, Any]:
        try:
            answer = bounded_json.loads(raw, what="etcd answer")
        except ValueError:
            raise EtcdUnavailableError(self.target.url, f"{path} answered with something "
                                       f"that is not JSON: {raw[:120]!r}") from None
        if not isinstance(answer, dict):
            raise EtcdUnavailableError(self.target.url, f"{path} answered {raw[:120]!r}")
        error = answer.get("error")
        if error is not None:
            message = str(answer.get("message") or error)
            if "authentication failed" in message or "user name" in message \
                    or "permission denied" in message:
                raise AuthenticationError(
                    f"etcd {self.target.url} refused {path}: {message}; check "
                    "cluster.etcd.user/password and the user's role")
            raise EtcdRequestError(f"etcd {self.target.url} refused {path}: {message}")
        return answer

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``body`` to ``/v3/{path}``; the answer (``result`` unwrapped). Raises
        ``EtcdUnavailableError`` when etcd does not answer."""
        try:
            answer = self._post("/v3/" + path, body, self._headers())
        except EtcdRequestError as exc:
            if "token" not in str(exc) or self.auth.user is None:
                raise
            # A restarted etcd forgets tokens: authenticate again, once.
            with self._lock:
                self._token = None
            answer = self._post("/v3/" + path, body, self._headers())
        result = answer.get("result", answer)
        return result if isinstance(result, dict) else {}

    # -- kv --------------------------------------------------------------------------------
    def range_prefix(self, prefix: str) -> tuple[int, list[KeyValue]]:
        """Every key under ``prefix``, and the store revision they were read at."""
        answer = self.call("kv/range", {"key": _b64(prefix),
                                        "range_end": _b64(prefix_end(prefix))})
        revision = int(answer.get("header", {}).get("revision", 0))
        return revision, [_kv(item) for item in answer.get("kvs", [])]

    def get(self, key: str) -> KeyValue | None:
        answer = self.call("kv/range", {"key": _b64(key)})
        kvs = answer.get("kvs", [])
        return _kv(kvs[0]) if kvs else None

    def put(self, key: str, value: bytes, *, lease: int = 0) -> None:
        self.call("kv/put", {"key": _b64(key), "value": _b64(value), "lease": str(lease)})

    def create(self, key: str, value: bytes, *, lease: int = 0) -> KeyValue | None:
        """Put ``key`` only if it does not exist (one transaction); None when created,
        else the key as it is."""
        answer = self.call("kv/txn", {
            "compare": [{"key": _b64(key), "target": "CREATE", "result": "EQUAL",
                         "create_revision": "0"}],
            "success": [{"request_put": {"key": _b64(key), "value": _b64(value),
                                         "lease": str(lease)}}],
            "failure": [{"request_range": {"key": _b64(key)}}]})
        if answer.get("succeeded"):
            return None
        for response in answer.get("responses", []):
            kvs = response.get("response_range", {}).get("kvs", [])
            if kvs:
                return _kv(kvs[0])
        return KeyValue(key, b"", 0, 0)  # deleted between the compare and the range

    def delete(self, key: str) -> None:
        self.call("kv/deleterange", {"key": _b64(key)})

    # -- leases ----------------------------------------------------------------------------
    def grant(self, ttl_s: int) -> int:
        answer = self.call("lease/grant", {"TTL": str(ttl_s)})
        return int(answer["ID"])

    def keepalive(self, lease: int) -> int:
        """Refresh ``lease``; its TTL in seconds, 0 when etcd no longer knows it."""
        answer = self.call("lease/keepalive", {"ID": str(lease)})
        return int(answer.get("TTL", 0))

    def time_to_live(self, lease: int) -> int:
        """Seconds ``lease`` has left (by etcd's clock), -1 when it is gone."""
        answer = self.call("lease/timetolive", {"ID": str(lease)})
        return int(answer.get("TTL", -1))

    def revoke(self, lease: int) -> None:
        """Drop ``lease`` and every key attached to it."""
        self.call("lease/revoke", {"ID": str(lease)})

    # -- watch ----------------------------------------------------------------------------
    def watch(self, prefix: str, start_revision: int) -> WatchStream:
        """A stream of the changes under ``prefix`` from ``start_revision`` on (see
        :class:`WatchStream`)."""
        body = {"create_request": {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix)),
                                   "start_revision": str(start_revision)}}
        conn = self._connection(self.timeout_s)
        try:
            conn.request("POST", "/v3/watch", json.dumps(body).encode(), self._headers())
            response = conn.getresponse()
            if conn.sock is not None:
                conn.sock.settimeout(None)  # events come when they come; close() ends it
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise EtcdUnavailableError(self.target.url, f"watch: {exc}") from None
        return WatchStream(self, conn, response, prefix)


class WatchStream:
    """One open watch: ``events()`` yields a list of events per etcd answer and raises
    ``EtcdUnavailableError`` when the stream breaks (etcd restarted or gone: the caller
    reads the prefix again and watches from there). ``close`` (from any thread) ends
    it; ``events()`` then returns."""

    def __init__(self, client: EtcdClient, conn: http.client.HTTPConnection,
                 response: http.client.HTTPResponse, prefix: str) -> None:
        self._client = client
        self._conn = conn
        self._response = response
        self._prefix = prefix
        self._closed = False

    def events(self) -> Iterator[list[WatchEvent]]:
        url = self._client.target.url
        try:
            while not self._closed:
                line = self._response.readline(MAX_ANSWER_BYTES)
                if not line:
                    if self._closed:
                        return
                    raise EtcdUnavailableError(url, f"it ended the watch of {self._prefix}")
                answer = self._client._answer("/v3/watch", line)
                result = answer.get("result", answer)
                if not isinstance(result, dict):
                    continue
                if result.get("canceled"):
                    raise EtcdUnavailableError(url, f"it cancelled the watch of {self._prefix}: "
                                               f"{result.get('cancel_reason', 'compacted')}")
                events = [WatchEvent("delete" if e.get("type") == "DELETE" else "put",
                                     _kv(e.get("kv", {})))
                          for e in result.get("events", [])]
                if events:
                    yield events
        except EtcdUnavailableError:
            if self._closed:
                return
            raise
        except (OSError, ValueError, http.client.HTTPException) as exc:
            if self._closed:
                return
            raise EtcdUnavailableError(url, f"the watch broke: {exc}") from None
        finally:
            self._conn.close()

    def close(self) -> None:
        self._closed = True
        sock = self._conn.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

