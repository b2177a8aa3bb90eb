"""RemoteKVPool: the KVPool API over one or more storage nodes.

``KVPool.connect(urls or config)`` returns one; an engine switches between the embedded
pool and a cluster by what it opens, nothing else. Keys are computed here, exactly as
the embedded pool computes them (same namespace, dtype, layout, tp rank); a prompt's
chain of blocks goes to the node its router picks for the chain (``routing.py``), so
all of a prompt's blocks live on one node.

Failures never reach the engine as exceptions: a node that cannot be reached, or that
breaks off mid-response, makes its blocks read as misses (``get_blocks`` returns None
for them, ``get`` the prefix that did arrive), and a put to it is logged and dropped.
Such a node is skipped for ``down_s`` seconds, so a dead node costs one failed
connection, not one per call. Mistakes (a malformed key, a layout that contradicts
the namespace's) are raised as on the embedded pool.

Thread-safe (the transport is; the layout is set once under a lock).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote

import torch
from urllib3.exceptions import HTTPError

from isolane.config import Config, load_config
from isolane.errors import (
    ConfigError,
    InvalidArgumentError,
    KeyNotFoundError,
    NodeUnavailableError,
    WireFormatError,
)
from isolane.kvpool.keys import KEY_BYTES, KVNamespace, TokenIds, block_keys, token_bytes
from isolane.service import frames
from isolane.service.auth import resolve_token
from isolane.service.layout import NamespaceLayout
from isolane.service.names import check_namespace
from isolane.service.routing import RendezvousRouter, Router
from isolane.service.snapstream import tensor_bytes
from isolane.service.transport import ClientOptions, Transport, check_node_url, finish

log = logging.getLogger(__name__)
DEFAULT_CHUNK_TOKENS = 256
BATCH_TYPE = "application/x-isolane-kv-batch"


class Readable(Protocol):
    def read(self, amt: int) -> bytes: ...


def connect(target: str | os.PathLike[str] | Sequence[str] | Config, **kwargs: Any
            ) -> RemoteKVPool:
    """A RemoteKVPool on ``target``: a node URL, a list of them, a ``Config`` or a YAML
    config file (its ``cluster.nodes``, ``kvpool`` and ``node.token``)."""
    if isinstance(target, Config):
        return RemoteKVPool.from_config(target, **kwargs)
    if isinstance(target, str | os.PathLike):
        text = os.fspath(target)
        if text.endswith((".yaml", ".yml")) and Path(text).is_file():
            return RemoteKVPool.from_config(load_config(text), **kwargs)
        return RemoteKVPool([text], **kwargs)
    return RemoteKVPool(list(target), **kwargs)


class RemoteKVPool:
    """The public API of ``KVPool`` over storage nodes (see the module docstring).

    ``nodes``: node URLs (``http://host:port``). ``layout``: the namespace's layout
    for engines that use only the block API (token-level ``put`` fixes it otherwise,
    as on the embedded pool). ``router``: how chains are placed (default: rendezvous
    hashing of the chain's first key over ``nodes``). ``batch_bytes``: a larger put is
    sent as several requests. Other options: ``ClientOptions``.
    """

    def __init__(self, nodes: Sequence[str], *, namespace: str = "default",
                 chunk_tokens: int | None = None, token_dim: int = 2, tp_rank: int = 0,
                 tp_size: int = 1, layout: NamespaceLayout | None = None,
                 token: str | None = None, router: Router | None = None,
                 timeout_s: float = 30.0, connect_timeout_s: float = 2.0, retries: int = 2,
                 backoff_s: float = 0.05, down_s: float = 1.0,
                 batch_bytes: int = 64 << 20) -> None:
        if isinstance(nodes, str):
            nodes = [nodes]
        self.nodes = [check_node_url(n) for n in nodes]
        self.namespace = check_namespace(namespace)
        if isinstance(token_dim, bool) or not isinstance(token_dim, int) or token_dim < 0:
            raise InvalidArgumentError(f"token_dim must be a whole number >= 0 for a remote "
                                       f"pool, got {token_dim!r}")
        if chunk_tokens is not None and chunk_tokens < 1:
            raise InvalidArgumentError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self._requested_chunk_tokens = chunk_tokens
        self.chunk_tokens = chunk_tokens or (layout.chunk_tokens if layout else
                                             DEFAULT_CHUNK_TOKENS)
        self.token_dim = layout.token_dim if layout else token_dim
        self.tp_rank, self.tp_size = tp_rank, tp_size
        if layout is not None and (layout.chunk_tokens != self.chunk_tokens):
            raise InvalidArgumentError(f"chunk_tokens={chunk_tokens} contradicts the given "
                                       f"layout's {layout.chunk_tokens}")
        self.router: Router = router or RendezvousRouter(self.nodes)
        self.down_s = down_s
        self.batch_bytes = batch_bytes
        self._transport = Transport(ClientOptions(
            token=resolve_token(token), timeout_s=timeout_s,
            connect_timeout_s=connect_timeout_s, retries=retries, backoff_s=backoff_s))
        self._path = f"/v1/kv/{quote(self.namespace, safe='')}"
        self._lock = threading.Lock()
        self._layout = layout
        self._keyspace: KVNamespace | None = None
        self._unknown_until = 0.0  # no node knew the namespace: do not ask again before
        self._registered: set[str] = set()
        self._down_until: dict[str, float] = {}

    @classmethod
    def from_config(cls, config: Config, **kwargs: Any) -> RemoteKVPool:
        """On ``cluster.nodes``, with ``kvpool.namespace``/``chunk_tokens`` and
        ``node.token`` as defaults (keyword arguments win)."""
        kwargs.setdefault("namespace", config.kvpool.namespace)
        kwargs.setdefault("chunk_tokens", config.kvpool.chunk_tokens)
        kwargs.setdefault("token", config.node.token)
        return cls(list(config.cluster.nodes), **kwargs)

    # -- namespace and layout -----------------------------------------------------------
    @property
    def layout(self) -> tuple[str, tuple[int, ...]] | None:
        """``(dtype, shape without the token dimension)``, as ``KVPool.layout``."""
        found = self._known_layout()
        return None if found is None else (found.dtype, found.shape)

    def _known_layout(self) -> NamespaceLayout | None:
        if self._layout is not None or time.monotonic() < self._unknown_until:
            return self._layout
        for node in self._live(self.nodes):
            try:
                answer = self._transport.json("GET", node, self._path, idempotent=True)
            except KeyNotFoundError:
                continue
            except NodeUnavailableError as exc:
                self._mark_down(node, exc)
                continue
            self._adopt(NamespaceLayout.from_dict(answer.get("layout")))
            return self._layout
        self._unknown_until = time.monotonic() + self.down_s
        return None

    def _adopt(self, layout: NamespaceLayout) -> None:
        with self._lock:
            if self._layout is not None:
                return
            wanted = self._requested_chunk_tokens
            if (wanted is not None and wanted != layout.chunk_tokens) or (
                    layout.token_dim != self.token_dim):
                raise ConfigError("kvpool.chunk_tokens", (
                    f"namespace '{self.namespace}' was stored with chunk_tokens="
                    f"{layout.chunk_tokens} and token_dim={layout.token_dim}; open it with "
                    "the same values or use another namespace"))
            self.chunk_tokens = layout.chunk_tokens
            self._layout = layout

    def _layout_for(self, kv: torch.Tensor) -> NamespaceLayout:
        dim = self.token_dim
        dtype = str(kv.dtype).removeprefix("torch.")
        shape = tuple(int(s) for i, s in enumerate(kv.shape) if i != dim)
        wanted = NamespaceLayout(dtype, shape, self.chunk_tokens, dim)
        if self._known_layout() is None:
            self._adopt(wanted)  # the first put fixes the layout, as on the embedded pool
        known = self._layout or wanted  # set by _adopt, or by another thread before it
        if known != wanted:
            raise InvalidArgumentError(
                f"KV tensor of dtype {dtype} and shape {list(kv.shape)} does not match "
                f"namespace '{self.namespace}' (dtype {known.dtype}, shape {known.text()}); "
                "use another namespace for another model or layout")
        return known

    def _namespace(self) -> KVNamespace | None:
        layout = self._known_layout()
        if layout is None:
            return None
        if self._keyspace is None:
            self._keyspace = KVNamespace(model=self.namespace, dtype=layout.dtype,
                                         layout=layout.text(), tp_rank=self.tp_rank,
                                         tp_size=self.tp_size)
        return self._keyspace

    def block_keys(self, token_ids: TokenIds) -> list[bytes]:
        """Keys of the full blocks of ``token_ids`` ([] while no layout is known)."""
        keyspace = self._namespace()
        if keyspace is None:
            return []
        return block_keys(token_ids, self.chunk_tokens, keyspace)

    # -- block-level API -------------------------------------------------------------------
    def put_blocks(self, keys: Sequence[bytes], buffers: Sequence[Any], *,
                   chain: Sequence[bytes] | None = None) -> int:
        """Store blocks on the node of their chain; returns how many were new. ``chain``:
        the leading keys of the chain these blocks belong to, when ``keys`` does not
        start it (routing needs the chain's first key). Unreachable node: logged, 0."""
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
        node = self.router.owner(chain or keys)
        if not self._live([node]):
            return 0
        stored = 0
        try:
            self._register(node, layout)
            for batch in self._batches(keys, views):
                stored += self._put_batch(node, layout, *batch)
        except NodeUnavailableError as exc:
            self._mark_down(node, exc)
            log.warning("KV blocks not stored on %s (dropped): %s", node, exc)
        return stored

    def _batches(self, keys: Sequence[bytes], views: list[memoryview]
                 ) -> list[tuple[list[bytes], list[memoryview]]]:
        out: list[tuple[list[bytes], list[memoryview]]] = []
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
                   views: list[memoryview]) -> int:
        body: list[frames.Buffer] = [frames.encode_batch_header(len(keys))]
        for key, view in zip(keys, views, strict=True):
            body.extend(frames.encode_frame(key, view))
        length = sum(len(part) for part in body)
        headers = {"Content-Type": BATCH_TYPE, "Content-Length": str(length)}
        try:
            response = self._transport.request("POST", node, f"{self._path}/put", body=body,
                                               headers=headers, idempotent=True)
        except KeyNotFoundError:  # the node lost the namespace (wiped, evicted): again
            self._registered.discard(node)
            self._register(node, layout)
            response = self._transport.request("POST", node, f"{self._path}/put", body=body,
                                               headers=headers, idempotent=True)
        return int(_json(response.data)["stored"])

    def _register(self, node: str, layout: NamespaceLayout) -> None:
        if node in self._registered:
            return
        self._transport.json("PUT", node, self._path, body=layout.to_dict(), idempotent=True)
        self._registered.add(node)

    def get_blocks(self, keys: Sequence[bytes], *, chain: Sequence[bytes] | None = None
                   ) -> list[bytes | None]:
        """Each block's bytes, or None for a miss (also for blocks of a node that is
        down or broke off). ``chain``: as for ``put_blocks``."""
        if not keys:
            return []
        return self._fetch(self.router.owner(chain or keys), list(keys), prefix=False)

    def lookup_blocks(self, keys: Sequence[bytes], *, chain: Sequence[bytes] | None = None
                      ) -> int:
        """How many leading ``keys`` are stored (0 when their node is down)."""
        if not keys:
            return 0
        node = self.router.owner(chain or keys)
        answer = self._keys_call(node, "lookup", keys)
        return 0 if answer is None else int(answer["blocks"])

    def delete_blocks(self, keys: Sequence[bytes], *, chain: Sequence[bytes] | None = None
                      ) -> int:
        """Drop these blocks; returns how many were stored (0 when their node is down:
        logged, the blocks stay there)."""
        if not keys:
            return 0
        node = self.router.owner(chain or keys)
        answer = self._keys_call(node, "delete", keys)
        if answer is None:
            log.warning("KV blocks not deleted on %s: node unavailable", node)
            return 0
        return int(answer["deleted"])

    def _keys_call(self, node: str, verb: str, keys: Sequence[bytes]) -> dict[str, Any] | None:
        if not self._live([node]):
            return None
        try:
            response = self._transport.request(
                "POST", node, f"{self._path}/{verb}", body=frames.encode_keys(keys),
                headers={"Content-Type": "application/octet-stream"}, idempotent=True)
        except NodeUnavailableError as exc:
            self._mark_down(node, exc)
            return None
        except KeyNotFoundError:  # the node has no such namespace: nothing stored there
            return {"blocks": 0, "deleted": 0}
        return _json(response.data)

    def _fetch(self, node: str, keys: list[bytes], *, prefix: bool) -> list[bytes | None]:
        misses: list[bytes | None] = [None] * len(keys)
        if not self._live([node]):
            return misses
        layout = self._known_layout()
        limit = layout.block_bytes if layout else 1 << 30
        try:
            response = self._transport.request(
                "POST", node, f"{self._path}/get" + ("?prefix=1" if prefix else ""),
                body=frames.encode_keys(keys), headers={"Content-Type":
                                                        "application/octet-stream"},
                idempotent=True, stream=True)
        except NodeUnavailableError as exc:
            self._mark_down(node, exc)
            return misses
        except KeyNotFoundError:
            return misses
        complete = False
        try:
            values, complete = read_batch(response, keys, limit)
        finally:
            finish(response, complete=complete)
        if not complete:
            self._mark_down(node, NodeUnavailableError(node, "the response broke off"))
        return values

    # -- token-level API -------------------------------------------------------------------
    def put(self, token_ids: TokenIds, kv: torch.Tensor) -> int:
        """Store the KV of ``token_ids`` (full blocks only); returns new blocks stored."""
        n_tokens = len(token_bytes(token_ids)) // 4
        if not isinstance(kv, torch.Tensor):
            raise InvalidArgumentError(f"kv must be a torch.Tensor, got {type(kv).__name__}")
        dim = self.token_dim
        if kv.dim() <= dim or kv.shape[dim] != n_tokens:
            raise InvalidArgumentError(
                f"kv has shape {list(kv.shape)}; its dimension {dim} (token_dim) must equal "
                f"the number of tokens, {n_tokens}")
        self._layout_for(kv)
        keys = self.block_keys(token_ids)
        if not keys:
            return 0
        ct = self.chunk_tokens
        blocks = [tensor_bytes(kv.narrow(dim, i * ct, ct))
                  for i in range(len(keys))]
        return self.put_blocks(keys, blocks)

    def lookup(self, token_ids: TokenIds) -> int:
        """Tokens of the longest cached prefix (no data read)."""
        return self.lookup_blocks(self.block_keys(token_ids)) * self.chunk_tokens

    def get(self, token_ids: TokenIds) -> tuple[int, torch.Tensor | None]:
        """``(n_tokens, kv)`` of the longest cached prefix; ``(0, None)`` on a miss."""
        keys = self.block_keys(token_ids)
        layout = self._layout
        if not keys or layout is None:
            return 0, None
        blocks = self._prefix(keys)
        if not blocks:
            return 0, None
        ct, dim = self.chunk_tokens, self.token_dim
        out = torch.empty(layout.full_shape(len(blocks) * ct),
                          dtype=getattr(torch, layout.dtype))
        for i, block in enumerate(blocks):
            out.narrow(dim, i * ct, ct).copy_(self._block_tensor(layout, block))
        return len(blocks) * ct, out

    def get_into(self, token_ids: TokenIds, out: torch.Tensor) -> int:
        """Fill the first cached-prefix tokens of ``out`` and return how many."""
        layout = self._known_layout()
        if layout is None:
            return 0
        self._check_out(layout, out)
        keys = self.block_keys(token_ids)
        ct, dim = self.chunk_tokens, self.token_dim
        blocks = self._prefix(keys[:max(0, out.shape[dim] // ct) + 1])
        if len(blocks) * ct > out.shape[dim]:
            raise InvalidArgumentError(f"out holds {out.shape[dim]} tokens, the cached prefix "
                                       f"has more; pass a tensor with room for the whole "
                                       "prompt")
        for i, block in enumerate(blocks):
            out.narrow(dim, i * ct, ct).copy_(self._block_tensor(layout, block))
        return len(blocks) * ct

    def delete(self, token_ids: TokenIds) -> int:
        """Drop every full block of ``token_ids``; returns how many were stored."""
        return self.delete_blocks(self.block_keys(token_ids))

    def _prefix(self, keys: list[bytes]) -> list[bytes]:
        if not keys:
            return []
        out: list[bytes] = []
        for value in self._fetch(self.router.owner(keys), keys, prefix=True):
            if value is None:
                break
            out.append(value)
        return out

    def _block_tensor(self, layout: NamespaceLayout, block: bytes) -> torch.Tensor:
        with warnings.catch_warnings():  # read-only bytes: the view is only copied from
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(block, dtype=torch.uint8)
        return raw.view(getattr(torch, layout.dtype)).view(layout.full_shape(self.chunk_tokens))

    def _check_out(self, layout: NamespaceLayout, out: torch.Tensor) -> None:
        if not isinstance(out, torch.Tensor):
            raise InvalidArgumentError(f"out must be a torch.Tensor, got {type(out).__name__}")
        dtype = str(out.dtype).removeprefix("torch.")
        got = tuple(s for i, s in enumerate(out.shape) if i != self.token_dim)
        if dtype != layout.dtype or out.dim() != len(layout.shape) + 1 or got != layout.shape:
            raise InvalidArgumentError(
                f"out has dtype {dtype} and shape {list(out.shape)}; namespace "
                f"'{self.namespace}' stores dtype {layout.dtype}, shape {layout.text()}: "
                "allocate out with that dtype and shape")

    # -- the rest ---------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Each node's stats of this namespace (or the error that node gave)."""
        nodes: dict[str, Any] = {}
        for node in self.nodes:
            try:
                nodes[node] = self._transport.json("GET", node, f"{self._path}/stats",
                                                   idempotent=True)
            except (NodeUnavailableError, KeyNotFoundError) as exc:
                nodes[node] = {"error": str(exc)}
        return {"namespace": self.namespace, "chunk_tokens": self.chunk_tokens,
                "nodes": nodes}

    def close(self) -> None:
        self._transport.close()

    def __enter__(self) -> RemoteKVPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RemoteKVPool({self.nodes!r}, namespace={self.namespace!r})"

    # -- node health ---------------------------------------------------------------------------
    def _live(self, nodes: Sequence[str]) -> list[str]:
        now = time.monotonic()
        return [n for n in nodes if self._down_until.get(n, 0.0) <= now]

    def _mark_down(self, node: str, exc: Exception) -> None:
        if self._down_until.get(node, 0.0) <= time.monotonic():
            log.warning("KV node %s unavailable for %.1f s, reading its blocks as misses: %s",
                        node, self.down_s, exc)
        self._down_until[node] = time.monotonic() + self.down_s


def read_batch(stream: Readable, keys: Sequence[bytes], max_value_bytes: int
               ) -> tuple[list[bytes | None], bool]:
    """Parse a batch-get response (``frames``) for ``keys``: each key's value or None,
    and whether the body was complete. Frames before a cut are whole and checked; the
    rest read as misses. A body that answers other keys than asked is a WireFormatError."""
    values: list[bytes | None] = [None] * len(keys)
    read = _exact_reader(stream)
    try:
        count = frames.decode_batch_header(read(frames.BATCH_HEADER.size), len(keys))
        for i in range(count):
            header = frames.decode_frame_header(read(frames.FRAME_HEADER.size),
                                                max_value_bytes)
            if header.key != keys[i]:
                raise WireFormatError(f"frame {i} answers key {header.key.hex()}, asked for "
                                      f"{bytes(keys[i]).hex()}")
            value = read(header.length)
            frames.check_value(header, value, read(frames.CHECKSUM.size))
            if header.status == frames.STATUS_VALUE:
                values[i] = value
    except _Cut:
        return values, False
    return values, True


class _Cut(Exception):
    """The body ended early (node killed, connection reset)."""


def _exact_reader(stream: Readable) -> Callable[[int], bytes]:
    def read(n: int) -> bytes:
        if n == 0:
            return b""
        try:
            data = stream.read(n)
        except (HTTPError, OSError) as exc:
            raise _Cut(str(exc)) from None
        while len(data) < n:
            try:
                more = stream.read(n - len(data))
            except (HTTPError, OSError) as exc:
                raise _Cut(str(exc)) from None
            if not more:
                raise _Cut(f"{len(data)} of {n} bytes")
            data += more
        return data
    return read


def _json(data: bytes) -> dict[str, Any]:
    import json

    parsed = json.loads(data)
    if not isinstance(parsed, dict):
        raise WireFormatError("a storage node answered with JSON that is not an object")
    return parsed
