"""Blob store on any fsspec URL: ``s3://bucket/prefix`` (s3fs), ``memory://``, ...

Keys map to ``<root>/<key>``. Every fsspec call goes through ``_call``, the one place
backend errors are translated:

- a missing blob -> ``FileNotFoundError`` naming the URL and key;
- an unreachable endpoint, timeout, refused credentials or any other backend failure ->
  ``StorageError`` saying what to check (``storage_options.client_kwargs.endpoint_url``,
  key/secret ...). ``write``/``write_atomic``/``copy`` calls that hit
  ``FileNotFoundError`` (a missing bucket) become ``StorageError`` too.

Filesystem instances are never shared: ``skip_instance_cache=True`` and no listings cache,
so a listing right after a write sees it. For ``s3://`` the defaults fail fast when the
server is down (``connect_timeout`` 3 s, two attempts in botocore's standard retry mode:
a stopped server is reported in about a second instead of retrying for tens of
seconds); keys given in ``storage_options["config_kwargs"]`` override them.

Thread safety: asynchronous filesystems (s3fs) run every call on fsspec's IO thread, so
calls from many threads interleave there; calls into synchronous filesystems
(``memory://``) are serialized by a lock. Fork safety: a forked child (a DataLoader
worker) opens its own filesystem on first use; the parent's client and IO loop stay
with the parent.

S3 servers that keep real folders (SeaweedFS) list a folder whose blobs were all deleted
for about two minutes afterwards; ``delete_prefix`` removes those folder entries itself
(deepest first, as ``<dir>/`` keys: a no-op on AWS S3), so ``children`` after
``delete_prefix`` does not show the prefix. ``delete`` of a folder's last blob may leave
the folder listed for a while, as an empty folder stays on a local disk.

``memory://`` stores share fsspec's process-wide in-memory store unless
``storage_options={"global_store": False}``.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import logging
import os
import posixpath
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import fsspec

from isolane.errors import ConfigError, IsolaneError, MissingDependencyError, StorageError
from isolane.storage.base import BlobStore, Buffer, ByteRange, check_key
from isolane.storage.s3_listing import list_children, refused
from isolane.storage.s3_ranged import QuerySigner, RangedGetter, local_presigner

log = logging.getLogger(__name__)

_S3_PROTOCOLS = ("s3", "s3a")
# Installed package for each protocol whose implementation lives outside fsspec.
_PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "abfs": "adlfs",
             "az": "adlfs", "hf": "huggingface_hub"}
# botocore.config.Config options for s3:// unless the caller sets them.
S3_CONFIG_DEFAULTS: Mapping[str, Any] = {
    "connect_timeout": 3,
    "read_timeout": 60,
    "retries": {"mode": "standard", "total_max_attempts": 2},
}
SIGNED_URL_SECONDS = 3600  # lifetime of the presigned URL of one read_into
MAX_DIRECT_READ_BYTES = 1 << 30  # a whole-blob read by presigned GET (manifests, packs)
# Operations that create blobs: FileNotFoundError there means a missing bucket/folder.
_WRITE_OPS = frozenset({"write", "write_atomic", "copy"})


class FsspecBlobStore(BlobStore):
    """Blobs below one fsspec URL; see the module docstring for errors and threading."""

    read_part_bytes = 8 << 20  # ``read_into`` fetches ranges of this size concurrently

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        self.url = url.rstrip("/")
        self.protocol = _protocol_of(self.url)
        self._options = _with_defaults(self.protocol, dict(storage_options or {}))
        self._fs, root = self._open()
        self._pid = os.getpid()
        self._inherited: builtins.list[Any] = []  # see _filesystem
        self._root = root.rstrip("/")
        if self.protocol in _S3_PROTOCOLS and not self._root:
            raise ConfigError("url", f"{self.url} names no bucket; use s3://<bucket>/<prefix>")
        self._endpoint = _endpoint_of(self.protocol, self._options)
        self._sweep_folders = self.protocol in _S3_PROTOCOLS
        self._lock = None if getattr(self._fs, "async_impl", False) else threading.Lock()
        self._backend_errors, self._connection_errors = _error_types()
        self._closed = False
        self._getter: RangedGetter | None = None
        self._local_sign: QuerySigner | None = None  # set with _getter when local
        self._getter_pid = 0
        self._getter_lock = threading.Lock()
        # S3: ranged GETs straight into the destination (s3_ranged); False once
        # presigning failed, and reads go through s3fs instead.
        self.ranged_gets = True

    def _open(self) -> tuple[Any, str]:
        try:
            fs, root = fsspec.url_to_fs(self.url, **self._options)
        except ImportError:
            package = _PACKAGES.get(self.protocol, f"fsspec[{self.protocol}]")
            raise MissingDependencyError(package, f"the storage URL {self.url}") from None
        except ValueError as exc:
            raise ConfigError("url", f"{self.url}: {exc}") from None
        return fs, str(root)

    def _filesystem(self) -> Any:
        """The filesystem of this process: a forked child (a DataLoader worker) cannot use
        the parent's client or IO loop, so it opens its own on first use.

        The parent's filesystem stays referenced in the child: freed there, s3fs's
        finalizer would close the inherited connections through the inherited epoll
        instance, which the child shares with the parent, and unregister the parent's
        sockets; the parent's next read would then wait for ``read_timeout``. (Other
        s3fs objects that are garbage at fork time carry the same risk: fsspec's async
        filesystems are not fork-safe. Prefer the spawn/forkserver start methods.)
        """
        if self._pid != os.getpid():
            self._inherited.append(self._fs)
            self._fs, _ = self._open()
            self._pid = os.getpid()
            if self._lock is not None:
                self._lock = threading.Lock()
        return self._fs

    # -- paths and the error seam --------------------------------------------------------
    def _path(self, key: str) -> str:
        return f"{self._root}/{check_key(key)}"

    def _base(self, prefix: str) -> str:
        return self._path(prefix) if prefix else self._root

    def _key_of(self, path: str) -> str | None:
        """Key of a listed path, or None for the root itself and folder markers."""
        head = self._root + "/"
        if not path.startswith(head) or path.endswith("/"):
            return None
        return path[len(head):]

    @contextlib.contextmanager
    def _serialized(self) -> Iterator[None]:
        if self._lock is None:
            yield
        else:
            with self._lock:
                yield

    def _call(self, op: str, key: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run one fsspec call; translate backend errors into isolane's."""
        fn = getattr(self._filesystem(), method)
        try:
            with self._serialized():
                return fn(*args, **kwargs)
        except IsolaneError:
            raise
        except self._backend_errors as exc:
            raise self._translate(op, key, exc) from exc

    def _translate(self, op: str, key: str, exc: BaseException) -> OSError:
        where = f"{self.url}/{key}" if key else self.url
        if isinstance(exc, FileNotFoundError):
            if op in _WRITE_OPS:
                return StorageError(
                    f"{op} {where} failed: {exc}; does the bucket or folder of {self.url} "
                    "exist? create it first")
            return FileNotFoundError(errno.ENOENT, f"no blob {key!r} in {self.url}")
        if isinstance(exc, self._connection_errors):
            hint = ("storage_options.client_kwargs.endpoint_url"
                    if self.protocol in _S3_PROTOCOLS else "the URL and storage_options")
            return StorageError(
                f"{op} {where} failed: cannot reach {self._endpoint} ({exc}); is the server "
                f"at {self._endpoint} running? check {hint}")
        if isinstance(exc, PermissionError):
            return StorageError(
                f"{op} {where} was refused ({exc}); check the credentials in storage_options "
                "(key/secret) and the bucket policy")
        return StorageError(f"{op} {where} failed at {self._endpoint}: {exc!r}")

    # -- reads ---------------------------------------------------------------------------
    def read(self, key: str, byte_range: ByteRange | None = None) -> bytes:
        path = self._path(key)
        if byte_range is None:
            direct = self._direct()
            if direct is not None:  # a presigned GET: no aiobotocore client needed
                getter, sign = direct
                status, body = getter.fetch(sign(path), f"{self.url}/{key}",
                                            MAX_DIRECT_READ_BYTES)
                if status == 404:
                    raise FileNotFoundError(errno.ENOENT, f"no blob {key!r} in {self.url}")
                if status >= 300:
                    raise refused("read", f"{self.url}/{key}", status, body)
                return body
            return bytes(self._call("read", key, "cat_file", path))
        if byte_range.length <= 0:
            self.size(key)  # FileNotFoundError for a missing blob, as a real read gives
            return b""
        try:
            return bytes(self._call("read", key, "cat_file", path,
                                    start=byte_range.start, end=byte_range.end))
        except StorageError as exc:
            if _past_end(exc) and self.size(key) <= byte_range.start:
                return b""  # a range that starts at or after the end, as a local read gives
            raise

    def read_into(self, key: str, out: memoryview, offset: int = 0) -> None:
        """Fill ``out`` from the blob at ``offset``: a big read is cut into ranges of
        ``read_part_bytes`` fetched concurrently (one stream is far from what the server
        gives several). On S3 the ranged GETs receive straight into ``out``
        (``s3_ranged``); elsewhere through ``cat_ranges``. EOFError when the blob is
        shorter."""
        getter = self._ranged_getter()
        if getter is not None and len(out) > 0:
            path = self._path(key)
            try:
                getter.read_into(path, out, offset, self.read_part_bytes,
                                 f"{self.url}/{key}")
            except FileNotFoundError:
                raise FileNotFoundError(errno.ENOENT, f"no blob {key!r} in {self.url}"
                                        ) from None
            return
        n = len(out)
        part = self.read_part_bytes
        if n <= part:
            data = self.read(key, ByteRange(offset, offset + n))
            parts = [(0, data)]
        else:
            starts = list(range(0, n, part))
            got = self.read_ranges([(key, ByteRange(offset + s, offset + min(s + part, n)))
                                    for s in starts])
            parts = list(zip(starts, got, strict=True))
        for start, data in parts:
            want = min(part, n - start)
            if len(data) != want:
                raise EOFError(f"{self.url}/{key}: expected {want} bytes at offset "
                               f"{offset + start}, got {len(data)}")
            out[start:start + want] = data

    def _direct(self) -> tuple[RangedGetter, QuerySigner] | None:
        """The RangedGetter and the local signer when reads and listings can skip s3fs
        (an S3 store with endpoint and key/secret in its options), else None."""
        getter = self._ranged_getter()
        sign = self._local_sign
        return (getter, sign) if getter is not None and sign is not None else None

    def _ranged_getter(self) -> RangedGetter | None:
        """This process's RangedGetter on S3 (None elsewhere, or when s3fs cannot
        presign: then ``cat_ranges`` serves every read)."""
        if not self.ranged_gets or self.protocol not in _S3_PROTOCOLS:
            return None
        with self._getter_lock:
            if self._getter is not None and self._getter_pid == os.getpid():
                return self._getter
            local = local_presigner(self._options, SIGNED_URL_SECONDS)
            if local is None:  # s3fs signs: check that it can, once
                fs = self._filesystem()
                try:
                    fs.sign(self._root, expiration=60)
                except Exception as exc:  # any failure to presign: keep the s3fs path
                    log.info("%s: cannot presign GETs (%r); reads go through s3fs",
                             self.url, exc)
                    self.ranged_gets = False
                    return None
            config = self._options.get("config_kwargs", {})
            client = self._options.get("client_kwargs", {})
            self._local_sign = local
            sign = local or (
                lambda path: str(self._call("read", path, "sign", path,
                                            expiration=SIGNED_URL_SECONDS)))
            self._getter = RangedGetter(
                sign,
                connect_timeout_s=float(config.get("connect_timeout", 3)),
                read_timeout_s=float(config.get("read_timeout", 60)),
                verify=client.get("verify", True))
            self._getter_pid = os.getpid()
            return self._getter

    def read_ranges(self, requests: list[tuple[str, ByteRange]]) -> list[bytes]:
        """Many ranges (of one or many blobs) fetched concurrently, in order.

        Same results and errors as ``read`` for each range; a range that fails in the
        batch is read again alone, which raises the translated error.
        """
        batch = [(self._path(key), rng) for key, rng in requests if rng.length > 0]
        fetched: list[Any] = []
        if batch:
            fetched = self._call(
                "read_ranges", "", "cat_ranges", [p for p, _ in batch],
                [rng.start for _, rng in batch], [rng.end for _, rng in batch],
                on_error="return")
        got = iter(fetched)
        out = []
        for key, rng in requests:
            data = next(got) if rng.length > 0 else None
            if data is None or isinstance(data, BaseException):
                out.append(self.read(key, rng))
            else:
                out.append(bytes(data))
        return out

    def size(self, key: str) -> int:
        info = self._call("size", key, "info", self._path(key))
        if info.get("type") != "file":
            raise FileNotFoundError(
                errno.ENOENT, f"{key!r} in {self.url} is a folder, not a blob")
        return int(info["size"])

    def list(self, prefix: str = "") -> list[str]:
        try:
            paths = self._call("list", prefix, "find", self._base(prefix))
        except FileNotFoundError:
            return []
        keys = (self._key_of(str(p)) for p in paths)
        return sorted(k for k in keys if k is not None)

    def children(self, prefix: str = "") -> builtins.list[str]:
        base = self._base(prefix)
        direct = self._direct()
        if direct is not None:  # a presigned ListObjectsV2: no aiobotocore client needed
            return list_children(*direct, base, self.url)
        try:
            entries = self._call("children", prefix, "ls", base, detail=True)
        except FileNotFoundError:
            return []
        names = set()
        for entry in entries:
            name = str(entry["name"]).rstrip("/")
            if name != base and name.startswith(base + "/"):
                names.add(posixpath.basename(name))
        return sorted(names)

    # -- writes --------------------------------------------------------------------------
    def write(
        self, key: str, data: Buffer, *, length: int | None = None, durable: bool = True
    ) -> None:
        """One PUT, final when it returns (``durable`` changes nothing here)."""
        view = memoryview(data).cast("B")
        body = bytes(view if length is None else view[:length])
        self._call("write", key, "pipe_file", self._path(key), body)

    def write_atomic(self, key: str, data: Buffer) -> None:
        """One PUT: S3 readers see the old object or the new one, never a mix."""
        body = bytes(memoryview(data).cast("B"))
        self._call("write_atomic", key, "pipe_file", self._path(key), body)

    def copy(self, src: str, dst: str) -> None:
        """Server-side copy on S3 (CopyObject); FileNotFoundError when ``src`` is missing."""
        src_path, dst_path = self._path(src), self._path(dst)
        try:
            self._call("copy", dst, "cp_file", src_path, dst_path)
        except StorageError as exc:
            if isinstance(exc.__cause__, FileNotFoundError) and not self.exists(src):
                raise FileNotFoundError(
                    errno.ENOENT, f"no blob {src!r} in {self.url} to copy to {dst!r}") from None
            raise

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._call("delete", key, "rm_file", self._path(key))

    def delete_prefix(self, prefix: str) -> None:
        base = self._path(prefix)
        try:
            paths = self._call("delete_prefix", prefix, "expand_path", base,
                               recursive=True)
            self._call("delete_prefix", prefix, "rm", paths)
        except FileNotFoundError:
            return
        if self._sweep_folders:
            for folder in _folders_deepest_first(base, [str(p) for p in paths]):
                with contextlib.suppress(FileNotFoundError):
                    self._call("delete_prefix", prefix, "rm_file", folder + "/")

    def close(self) -> None:
        """Close the S3 client's connections (s3fs would otherwise wait for GC)."""
        if self._closed:
            return
        self._closed = True
        if self._getter is not None and self._getter_pid == os.getpid():
            self._getter.close()
        if self._pid != os.getpid():
            return  # a forked child never opened the parent's connections
        creator = getattr(self._fs, "_s3creator", None)
        close_session = getattr(self._fs, "close_session", None)
        if creator is not None and close_session is not None:
            close_session(self._fs.loop, creator)


# -- helpers (pure) ----------------------------------------------------------------------
def _protocol_of(url: str) -> str:
    protocol, _ = fsspec.core.split_protocol(url)
    if not protocol:
        raise ConfigError("url", f"{url!r} has no scheme; use s3://bucket/prefix or a path")
    return str(protocol)


def _with_defaults(protocol: str, options: dict[str, Any]) -> dict[str, Any]:
    """Caller options over isolane's: fresh instance, no listings cache, fast S3 failure."""
    options["skip_instance_cache"] = True
    options.setdefault("use_listings_cache", False)
    if protocol in _S3_PROTOCOLS:
        options["config_kwargs"] = {**S3_CONFIG_DEFAULTS, **options.get("config_kwargs", {})}
    return options


def _endpoint_of(protocol: str, options: Mapping[str, Any]) -> str:
    endpoint = options.get("endpoint_url") or options.get("client_kwargs", {}).get(
        "endpoint_url")
    if endpoint:
        return str(endpoint)
    return "the AWS S3 endpoint" if protocol in _S3_PROTOCOLS else f"the {protocol} backend"


def _past_end(exc: StorageError) -> bool:
    """An HTTP 416: the range starts at or after the end of the blob."""
    cause = exc.__cause__
    return isinstance(cause, OSError) and cause.errno == errno.EINVAL and (
        "range" in str(cause).lower())


def _folders_deepest_first(base: str, paths: list[str]) -> list[str]:
    """``base`` and every folder between it and ``paths``, deepest first."""
    folders = {base}
    for path in paths:
        parent = posixpath.dirname(path)
        while parent.startswith(base + "/"):
            folders.add(parent)
            parent = posixpath.dirname(parent)
    return sorted(folders, key=lambda p: (-p.count("/"), p))


def _error_types() -> tuple[tuple[type[BaseException], ...], tuple[type[BaseException], ...]]:
    """(every backend failure, the ones meaning "cannot reach the server")."""
    backend: list[type[BaseException]] = [OSError, TimeoutError]
    connection: list[type[BaseException]] = [ConnectionError, TimeoutError]
    with contextlib.suppress(ImportError):
        import fsspec.exceptions

        connection.append(fsspec.exceptions.FSTimeoutError)
    with contextlib.suppress(ImportError):
        import botocore.exceptions as bx

        backend += [bx.BotoCoreError, bx.ClientError]
        connection += [bx.EndpointConnectionError, bx.ConnectTimeoutError,
                       bx.ReadTimeoutError, bx.ConnectionClosedError]
    with contextlib.suppress(ImportError):
        import aiohttp

        backend.append(aiohttp.ClientError)
        connection.append(aiohttp.ClientConnectionError)
    return tuple(backend), tuple(connection)
