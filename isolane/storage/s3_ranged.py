"""Parallel ranged GETs of one S3 object straight into the caller's memory.

``FsspecBlobStore.read_into`` on ``s3://`` uses this instead of s3fs's ``cat_ranges``:
s3fs reads every range on fsspec's one IO thread into a new ``bytes`` (aiobotocore
joins the body's pieces: a copy), which the store then copies into place, so a restore
from the mirror spent ~1.8 CPU-s per GB in the client against ~0.5 s here (benchmarks:
bench_cluster.py --snapshots). Here the object's URL is presigned once (by s3fs, with
its credentials: SigV4 query auth, so the unsigned ``Range`` header may vary), and
``RANGE_THREADS`` threads each send ``GET`` with one ``Range`` over a keep-alive
connection of their own and ``readinto`` the response body straight into its slice of
the destination (one copy, kernel to the final tensor, the GIL released in ``recv``).

Presigning through s3fs (``S3FileSystem.sign``) costs ~7 ms of GIL-held botocore
event machinery per URL on its IO thread; with an explicit endpoint and key/secret in
the storage options, ``local_presigner`` signs with botocore's SigV4 query signer
directly (path-style URL, ~50 µs), else s3fs signs. The local signer also signs query
strings (a ListObjectsV2 request): ``FsspecBlobStore`` then lists folders and reads
whole small blobs (manifests, packs) by ``fetch`` on the same connections, so a store
that only restores never creates s3fs's aiobotocore client (its first call cost a
fresh store ~0.05 s of CPU, most of the time a restore spent finding its manifest).

Errors: 404 -> ``FileNotFoundError``; a body shorter than asked (the object is shorter)
or 416 -> ``EOFError``; any other status or a broken connection -> ``StorageError``
naming the URL and status. Thread-safe: connections are per thread.
"""

from __future__ import annotations

import builtins
import errno
import http.client
import ssl
import threading
import urllib.parse
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from isolane.errors import StorageError

RANGE_THREADS = 4  # concurrent ranged GETs per store
_ERROR_BODY_BYTES = 2048  # of an error answer, kept for the message
Signer = Callable[[str], str]


class QuerySigner(Protocol):
    def __call__(self, path: str, query: Mapping[str, str] | None = None) -> str: ...


def local_presigner(options: Mapping[str, Any], expires_s: int) -> QuerySigner | None:
    """A SigV4 query-string signer of GET URLs for ``bucket/key`` paths on the endpoint
    and credentials given in s3fs ``options`` (None unless ``endpoint_url``, ``key`` and
    ``secret`` are all there: credentials from elsewhere are s3fs's to find)."""
    client = options.get("client_kwargs") or {}
    config = options.get("config_kwargs") or {}
    endpoint = client.get("endpoint_url") or options.get("endpoint_url")
    key, secret = options.get("key"), options.get("secret")
    if not (isinstance(endpoint, str) and isinstance(key, str) and isinstance(secret, str)):
        return None
    from botocore.auth import S3SigV4QueryAuth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    region = str(client.get("region_name") or config.get("region_name") or "us-east-1")
    token = options.get("token")
    credentials = Credentials(key, secret, token if isinstance(token, str) else None)
    base = endpoint.rstrip("/")

    def sign(path: str, query: Mapping[str, str] | None = None) -> str:
        request = AWSRequest(method="GET", url=f"{base}/{urllib.parse.quote(path, safe='/~')}",
                             params=dict(query or {}))
        S3SigV4QueryAuth(credentials, "s3", region, expires=expires_s).add_auth(request)
        return str(request.url)

    return sign


class RangedGetter:
    """Ranged GETs of presigned URLs on ``RANGE_THREADS`` threads (module docstring).
    ``verify``: botocore's meaning (True, False, or a CA bundle path) for https."""

    def __init__(self, sign: Signer, *, connect_timeout_s: float, read_timeout_s: float,
                 verify: bool | str = True) -> None:
        self._sign = sign
        self._connect_timeout_s = connect_timeout_s
        self._read_timeout_s = read_timeout_s
        self._verify = verify
        self._local = threading.local()
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._closed = False

    def read_into(self, path: str, out: memoryview, offset: int, part_bytes: int,
                  what: str) -> None:
        """Fill ``out`` with the object ``path``'s bytes from ``offset`` on, in ranges
        of ``part_bytes`` fetched concurrently. ``what`` names the object in errors."""
        url = urllib.parse.urlsplit(self._sign(path))
        if url.scheme not in ("http", "https") or not url.hostname:
            raise StorageError(f"cannot GET {what}: the presigned URL {url.scheme}://"
                               f"{url.hostname} is not http(s)")
        target = url.path + (f"?{url.query}" if url.query else "")
        starts = builtins.list(range(0, len(out), part_bytes))

        def get(start: int) -> None:
            n = min(part_bytes, len(out) - start)
            self._get(url, target, out[start:start + n], offset + start, what)

        if len(starts) == 1:
            get(0)
            return
        for future in [self._executor().submit(get, s) for s in starts]:
            future.result()

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._closed:
                raise StorageError("the S3 store was closed; open a new one to read")
            if self._pool is None:
                self._pool = ThreadPoolExecutor(RANGE_THREADS,
                                                thread_name_prefix="isolane-s3get")
            return self._pool

    def _connection(self, url: urllib.parse.SplitResult, fresh: bool = False
                    ) -> http.client.HTTPConnection:
        conns: dict[tuple[str, str, int | None], http.client.HTTPConnection] = getattr(
            self._local, "conns", None) or {}
        self._local.conns = conns
        slot = (url.scheme, url.hostname or "", url.port)
        conn = conns.get(slot)
        if conn is not None and not fresh:
            return conn
        if conn is not None:
            conn.close()
        if url.scheme == "https":
            context = ssl.create_default_context(
                cafile=self._verify if isinstance(self._verify, str) else None)
            if self._verify is False:
                context.check_hostname = False
                context.verify_mode = ssl.CERT_NONE
            conn = http.client.HTTPSConnection(url.hostname or "", url.port,
                                               timeout=self._connect_timeout_s,
                                               context=context)
        else:
            conn = http.client.HTTPConnection(url.hostname or "", url.port,
                                              timeout=self._connect_timeout_s)
        conns[slot] = conn
        return conn

    def fetch(self, signed: str, what: str, limit: int) -> tuple[int, bytes]:
        """One GET of the presigned URL ``signed`` on this thread's connection:
        (status, body). A 2xx body longer than ``limit`` bytes is a StorageError (so is
        an unreachable server); other answers keep the first 2 KiB of their body."""
        url = urllib.parse.urlsplit(signed)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise StorageError(f"cannot GET {what}: the presigned URL {url.scheme}://"
                               f"{url.hostname} is not http(s)")
        target = url.path + (f"?{url.query}" if url.query else "")
        conn, response = self._request(url, target, {}, what)
        try:
            if not 200 <= response.status < 300:
                head = response.read(_ERROR_BODY_BYTES)
                conn.close()  # the rest of the answer is unread
                return response.status, head
            if response.length is not None and response.length > limit:
                raise StorageError(f"GET {what} answered {response.length} bytes, more "
                                   f"than the {limit} expected")
            body = response.read(limit + 1)
            if len(body) > limit:
                raise StorageError(f"GET {what} answered more than the {limit} bytes "
                                   "expected")
            if response.length:  # the rest of a body cut short
                raise StorageError(f"GET {what} broke off {response.length} bytes early")
        except (http.client.IncompleteRead, OSError) as exc:
            conn.close()
            raise StorageError(f"GET {what} broke off ({exc})") from exc
        except BaseException:
            conn.close()
            raise
        if response.will_close:
            conn.close()
        return response.status, body

    def _get(self, url: urllib.parse.SplitResult, target: str, view: memoryview,
             start: int, what: str) -> None:
        headers = {"Range": f"bytes={start}-{start + len(view) - 1}"}
        conn, response = self._request(url, target, headers, what)
        try:
            self._receive(response, view, start, what)
        except BaseException:
            conn.close()  # the rest of the body is unread: the connection is spent
            raise
        if response.will_close:
            conn.close()

    def _request(self, url: urllib.parse.SplitResult, target: str,
                 headers: Mapping[str, str], what: str
                 ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """Send GET ``target`` and read the answer's head (once more on a fresh
        connection when a kept-alive one was closed by the server)."""
        for attempt in (0, 1):  # a keep-alive connection the server closed: once more
            conn = self._connection(url, fresh=attempt > 0)
            try:
                conn.request("GET", target, headers=dict(headers))
                if conn.sock is not None:
                    conn.sock.settimeout(self._read_timeout_s)
                response = conn.getresponse()
            except (http.client.RemoteDisconnected, BrokenPipeError,
                    ConnectionResetError) as exc:
                conn.close()
                if attempt == 0:
                    continue
                raise StorageError(f"GET {what} failed: {_origin(url)} closed the "
                                   f"connection ({exc}); is the server at {_origin(url)} "
                                   "running?") from exc
            except OSError as exc:
                conn.close()
                raise StorageError(f"GET {what} failed: cannot reach {_origin(url)} ({exc}); "
                                   f"is the server at {_origin(url)} running?") from exc
            return conn, response
        raise AssertionError("unreachable: the second attempt returns or raises")

    @staticmethod
    def _receive(response: http.client.HTTPResponse, view: memoryview, start: int,
                 what: str) -> None:
        if response.status == 404:
            response.read(_ERROR_BODY_BYTES)
            raise FileNotFoundError(errno.ENOENT, f"no object {what}")
        if response.status == 416:
            response.read(_ERROR_BODY_BYTES)
            raise EOFError(f"{what}: expected {len(view)} bytes at offset {start}, the "
                           "object ends before")
        if response.status not in (200, 206):
            body = response.read(_ERROR_BODY_BYTES).decode("utf-8", "replace")
            raise StorageError(f"GET {what} (bytes {start}-{start + len(view) - 1}) "
                               f"answered HTTP {response.status}: {body.strip()[:300]}")
        if response.status == 200 and (start > 0 or response.length != len(view)):
            raise StorageError(f"GET {what} ignored the Range header (HTTP 200 for bytes "
                               f"{start}-{start + len(view) - 1}): the server does not "
                               "support ranged GETs")
        got = 0
        try:
            while got < len(view):
                n = response.readinto(view[got:])
                if not n:
                    raise EOFError(f"{what}: expected {len(view)} bytes at offset {start}, "
                                   f"got {got}")
                got += n
        except (http.client.IncompleteRead, OSError) as exc:
            raise StorageError(f"GET {what} broke off after {got} of {len(view)} bytes "
                               f"({exc})") from exc

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


def _origin(url: urllib.parse.SplitResult) -> str:
    return f"{url.scheme}://{url.netloc}"
