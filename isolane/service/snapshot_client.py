"""RemoteSnapshotStore: the SnapshotStore API against a storage node or a cluster.

``SnapshotStore("http://host:port")`` returns one (``SnapshotStore.__new__`` dispatches
by URL), so a training loop switches between a local store and a node by the URL
alone; ``RemoteSnapshotStore([url, ...])`` spreads snapshots over several nodes.

Cluster rule: a snapshot lives whole on one node, the owner of its name on the
consistent-hash ring of the nodes (``HashRing.owner(utf8(name))``, the KV ring's layout),
or the next node along the ring when the owner cannot be reached. Snapshots are not
moved when nodes join or leave (a checkpoint is large and read rarely): reads try the
owner, then every other node in ring order, so a snapshot saved before a join is found
where it was saved. ``list`` merges every node's list; a save without ``overwrite``
refuses a name stored on any node, one with ``overwrite`` removes the other copies.

``save`` streams the state dict (tensors as dtype/shape plus raw bytes, the rest as the
manifest's JSON tree; ``snapstream.py``) and returns once the node has committed it;
``load`` streams it back, writing each tensor's bytes straight into its destination
(``into=`` tensors where they match).
Errors are the embedded store's (``SnapshotNotFoundError``, ``SnapshotExistsError``,
``IntegrityError`` ...); a node that cannot be reached is a ``NodeUnavailableError``.

Thread-safe (one transport; each call is one request per node tried).
"""

from __future__ import annotations

import builtins
import dataclasses
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar
from urllib.parse import quote, urlencode

import torch
import xxhash
from urllib3.exceptions import HTTPError

from isolane.errors import (
    InvalidArgumentError,
    NodeUnavailableError,
    SnapshotExistsError,
    SnapshotNotFoundError,
    WireFormatError,
)
from isolane.kvpool.ring import HashRing
from isolane.service import snapstream as ss
from isolane.service.auth import resolve_token
from isolane.service.names import check_snapshot_name
from isolane.service.transport import ClientOptions, Transport, check_node_url, finish
from isolane.snapshot.dtypes import dtype_name
from isolane.snapshot.store import SnapshotInfo, check_metadata
from isolane.snapshot.tree import dotted_key, flatten_state, key_filter, unflatten_state

log = logging.getLogger(__name__)
Progress = Callable[[int, int], None]
STREAM_TYPE = "application/x-isolane-snapshot-stream"
T = TypeVar("T")


class RemoteSnapshotStore:
    """Snapshots on the node at ``url``, or on the nodes of a list of URLs (module
    docstring). ``timeout_s`` bounds each wait for bytes (a save's commit included: the
    node answers once the manifest is written)."""

    def __init__(self, url: str | Sequence[str], *, token: str | None = None,
                 timeout_s: float = 600.0, connect_timeout_s: float = 5.0, retries: int = 2,
                 backoff_s: float = 0.2) -> None:
        urls = [url] if isinstance(url, str) else list(url)
        if not urls:
            raise InvalidArgumentError("a RemoteSnapshotStore needs at least one node URL")
        self._nodes = tuple(check_node_url(u) for u in urls)
        self._ring = HashRing(self._nodes)  # refuses a node listed twice
        self._url = self._nodes[0]
        self._transport = Transport(ClientOptions(
            token=resolve_token(token), timeout_s=timeout_s,
            connect_timeout_s=connect_timeout_s, retries=retries, backoff_s=backoff_s))

    @property
    def url(self) -> str:
        """The first node's URL (the only one of a single-node store)."""
        return self._url

    @property
    def nodes(self) -> tuple[str, ...]:
        return self._nodes

    def home(self, name: str) -> builtins.list[str]:
        """The nodes for snapshot ``name`` in the order they are tried: its owner on the
        ring first."""
        return list(self._ring.walk(name.encode()))

    def _first(self, name: str, call: Callable[[str], T]) -> T:
        """``call(node)`` on the first node (in ``home`` order) that holds ``name``."""
        unavailable: NodeUnavailableError | None = None
        missing: SnapshotNotFoundError | None = None
        for node in self.home(name):
            try:
                return call(node)
            except SnapshotNotFoundError as exc:
                missing = exc
            except NodeUnavailableError as exc:
                unavailable = exc
        if unavailable is not None:  # it may be on the node that did not answer
            raise unavailable
        if len(self._nodes) == 1 and missing is not None:
            raise missing
        raise SnapshotNotFoundError(name, f"the cluster {list(self._nodes)}")

    # -- saving ------------------------------------------------------------------------------
    def save(self, state_dict: Any, name: str, metadata: Mapping[str, Any] | None = None, *,
             overwrite: bool = False, progress: Progress | None = None) -> SnapshotInfo:
        """Upload and return once a node has committed the snapshot: the name's owner,
        or the next node that answers. A save that breaks off (client or network)
        commits nothing."""
        check_snapshot_name(name)
        if len(self._nodes) == 1:
            return self._save_on(self._url, state_dict, name, metadata, overwrite, progress)
        holders = self._holders(name)
        if holders and not overwrite:
            raise SnapshotExistsError(name, holders[0])
        failure: NodeUnavailableError | None = None
        for node in self.home(name):
            try:
                info = self._save_on(node, state_dict, name, metadata, overwrite, progress)
            except NodeUnavailableError as exc:
                failure = exc
                log.warning("snapshot '%s' not saved on %s, trying the next node: %s",
                            name, node, exc)
                continue
            for other in holders:  # the copies an overwrite replaces
                if other != node:
                    self._delete_on(other, name)
            return info
        assert failure is not None  # the loop ran at least once
        raise failure

    def _holders(self, name: str) -> builtins.list[str]:
        """Nodes that answer that they hold ``name`` (nodes that do not answer skipped)."""
        out = []
        for node in self.home(name):
            try:
                self._info_on(node, name)
            except (SnapshotNotFoundError, NodeUnavailableError):
                continue
            out.append(node)
        return out

    def _save_on(self, node: str, state_dict: Any, name: str,
                 metadata: Mapping[str, Any] | None, overwrite: bool,
                 progress: Progress | None) -> SnapshotInfo:
        tree, leaves = flatten_state(state_dict)
        header = ss.header_for(name, tree, leaves, check_metadata(metadata))
        encoded = header.encode()
        total = header.data_bytes

        def body() -> Iterator[bytes | memoryview]:
            yield ss.encode_preamble(encoded) + encoded
            sent = 0
            for leaf, entry in zip(leaves, header.tensors, strict=True):
                yield ss.encode_tensor_header(entry)
                digest = xxhash.xxh3_64()
                for piece in ss.pieces(ss.tensor_bytes(leaf.tensor)):
                    digest.update(piece)
                    yield piece
                    sent += len(piece)
                    if progress is not None:
                        progress(sent, total)
                yield ss.CHECKSUM.pack(digest.intdigest())
            yield ss.encode_end(header)

        query = "?overwrite=1" if overwrite else ""
        response = self._transport.request(
            "PUT", node, f"/v1/snapshots/{quote(name)}{query}", body=body(),
            headers={"Content-Type": STREAM_TYPE, "Content-Length": str(header.stream_bytes())},
            idempotent=False)
        return _info(_json(response.data))

    # -- reading -----------------------------------------------------------------------------
    def load(self, name: str, map_location: str | torch.device = "cpu",
             keys: builtins.list[str] | None = None, progress: Progress | None = None, *,
             into: Any = None) -> Any:
        """The state dict as saved (or the subtrees under ``keys``). ``into``: tensors
        filled in place where key, dtype and shape match (as ``SnapshotStore.load``)."""
        check_snapshot_name(name)
        query = "?" + urlencode([("keys", k) for k in keys]) if keys else ""
        targets = _targets(into)

        def load_from(node: str) -> tuple[ss.StreamHeader, dict[int, torch.Tensor]]:
            response = self._transport.request("GET", node,
                                               f"/v1/snapshots/{quote(name)}/data{query}",
                                               idempotent=True, stream=True)
            complete = False
            try:
                received = _receive(response, targets, progress, node)
                complete = True
            finally:
                finish(response, complete=complete)
            return received

        header, tensors = self._first(name, load_from)
        if str(map_location) != "cpu":
            tensors = {tid: t if any(t is v for v in targets.values()) else t.to(map_location)
                       for tid, t in tensors.items()}
        wanted = key_filter(keys)
        return unflatten_state(header.tree, tensors.__getitem__, wanted)

    def info(self, name: str) -> SnapshotInfo:
        check_snapshot_name(name)
        return self._first(name, lambda node: self._info_on(node, name))

    def _info_on(self, node: str, name: str) -> SnapshotInfo:
        return _info(self._transport.json("GET", node, f"/v1/snapshots/{quote(name)}",
                                          idempotent=True))

    def list(self) -> builtins.list[SnapshotInfo]:
        """Committed snapshots, oldest first: every node's, merged (a name on two nodes
        once, the newer). Nodes that do not answer are skipped (logged) unless none does."""
        found: dict[str, SnapshotInfo] = {}
        failure: NodeUnavailableError | None = None
        answered = False
        for node in self._nodes:
            try:
                answer = self._transport.json("GET", node, "/v1/snapshots", idempotent=True)
            except NodeUnavailableError as exc:
                if len(self._nodes) == 1:
                    raise
                failure = exc
                log.warning("snapshots of %s not listed: %s", node, exc)
                continue
            answered = True
            for item in answer["snapshots"]:
                info = _info(item)
                known = found.get(info.name)
                if known is None or info.committed_at > known.committed_at:
                    found[info.name] = info
        if not answered and failure is not None:
            raise failure
        return sorted(found.values(), key=lambda i: (i.committed_at, i.name))

    def verify(self, name: str) -> SnapshotInfo:
        """The node reads back every chunk and checks it; raises IntegrityError."""
        check_snapshot_name(name)
        return self._first(name, lambda node: _info(self._transport.json(
            "POST", node, f"/v1/snapshots/{quote(name)}/verify", idempotent=True)))

    def delete(self, name: str) -> None:
        """Delete ``name`` from every node that holds it; SnapshotNotFoundError if none
        does."""
        check_snapshot_name(name)
        if len(self._nodes) == 1:
            self._delete_on(self._url, name)
            return
        holders = self._holders(name)
        if not holders:
            self._first(name, lambda node: self._info_on(node, name))  # raises the reason
        for node in holders:
            self._delete_on(node, name)

    def _delete_on(self, node: str, name: str) -> None:
        self._transport.json("DELETE", node, f"/v1/snapshots/{quote(name)}",
                             idempotent=True)

    def close(self) -> None:
        self._transport.close()

    def __enter__(self) -> RemoteSnapshotStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        shown = self._url if len(self._nodes) == 1 else list(self._nodes)
        return f"RemoteSnapshotStore({shown!r})"


def _receive(response: Any, targets: Mapping[str, torch.Tensor], progress: Progress | None,
             where: str) -> tuple[ss.StreamHeader, dict[int, torch.Tensor]]:
    """Read a whole download; NodeUnavailableError if it breaks off, WireFormatError if
    it does not check out."""

    def read(n: int) -> bytes:
        data = b""
        while len(data) < n:
            try:
                more = response.read(n - len(data))
            except (HTTPError, OSError) as exc:
                raise NodeUnavailableError(where, f"the download broke off: {exc}") from None
            if not more:
                raise NodeUnavailableError(where, "the download broke off")
            data += more
        return data

    header = ss.decode_header(read(ss.decode_preamble(read(ss.PREAMBLE.size))))
    tensors: dict[int, torch.Tensor] = {}
    done = 0
    for entry in header.tensors:
        ss.check_tensor_header(read(ss.TENSOR_HEADER.size), entry)
        target = _target(entry, targets)
        direct = (target is not None and target.device.type == "cpu"
                  and target.is_contiguous())
        tensor = target.detach() if direct and target is not None else ss.empty_tensor(entry)
        view = ss.writable_bytes(tensor)
        digest = xxhash.xxh3_64()
        for start in range(0, entry.nbytes, ss.PIECE_BYTES):
            piece = read(min(ss.PIECE_BYTES, entry.nbytes - start))
            view[start:start + len(piece)] = piece
            digest.update(piece)
            done += len(piece)
            if progress is not None:
                progress(done, header.data_bytes)
        if ss.CHECKSUM.unpack(read(ss.CHECKSUM.size))[0] != digest.intdigest():
            raise WireFormatError(f"tensor '{entry.key}' arrived damaged (checksum mismatch)")
        if target is not None and not direct:
            with torch.no_grad():
                target.copy_(tensor)
            tensor = target
        elif target is not None:
            tensor = target
        tensors[entry.id] = tensor
    ss.check_end(read(ss.END.size), header)
    return header, tensors


def _targets(into: Any) -> dict[str, torch.Tensor]:
    if into is None:
        return {}
    _tree, leaves = flatten_state(into)
    return {dotted_key(leaf.path): leaf.tensor for leaf in leaves}


def _target(entry: ss.TensorEntry, targets: Mapping[str, torch.Tensor]
            ) -> torch.Tensor | None:
    """The ``into`` tensor for ``entry``; as SnapshotStore.load, one of another dtype or
    shape is an error (raised before any byte is written into it)."""
    target = targets.get(entry.key)
    if target is not None and (tuple(target.shape) != entry.shape
                               or dtype_name(target.dtype) != entry.dtype):
        raise InvalidArgumentError(
            f"into['{entry.key}'] is {dtype_name(target.dtype)}{list(target.shape)} but the "
            f"snapshot holds {entry.dtype}{list(entry.shape)}; load without into= or give "
            "a matching tensor")
    return target


def _info(data: Any) -> SnapshotInfo:
    if not isinstance(data, dict):
        raise WireFormatError("a storage node described a snapshot with something other "
                              "than a JSON object")
    known = {f.name for f in dataclasses.fields(SnapshotInfo)}
    try:
        return SnapshotInfo(**{k: v for k, v in data.items() if k in known})
    except TypeError as exc:
        raise WireFormatError(f"a storage node's snapshot description lacks fields: {exc}"
                              ) from None


def _json(data: bytes) -> Any:
    import json

    return json.loads(data)


