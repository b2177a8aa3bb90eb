"""RemoteSnapshotStore: the SnapshotStore API against a storage node.

``SnapshotStore("http://host:port")`` returns one (``SnapshotStore.__new__`` dispatches
by URL), so a training loop switches between a local store and a node by the URL
alone. ``save`` streams the state dict (tensors as dtype/shape plus raw bytes, the rest
as the manifest's JSON tree; ``snapstream.py``) and returns once the node has
committed it; ``load`` streams it back, writing each
tensor's bytes straight into its destination (``into=`` tensors where they match).
Errors are the embedded store's (``SnapshotNotFoundError``, ``SnapshotExistsError``,
``IntegrityError`` ...); a node that cannot be reached is a ``NodeUnavailableError``.

Thread-safe (one transport; each call is one request).
"""

from __future__ import annotations

import builtins
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any
from urllib.parse import quote, urlencode

import torch
import xxhash
from urllib3.exceptions import HTTPError

from isolane.errors import (
    InvalidArgumentError,
    NodeUnavailableError,
    WireFormatError,
)
from isolane.service import snapstream as ss
from isolane.service.auth import resolve_token
from isolane.service.names import check_snapshot_name
from isolane.service.transport import ClientOptions, Transport, check_node_url, finish
from isolane.snapshot.dtypes import dtype_name
from isolane.snapshot.store import SnapshotInfo
from isolane.snapshot.tree import dotted_key, flatten_state, key_filter, unflatten_state

Progress = Callable[[int, int], None]
STREAM_TYPE = "application/x-isolane-snapshot-stream"


class RemoteSnapshotStore:
    """Snapshots on the node at ``url``. ``timeout_s`` bounds each wait for bytes (a
    save's commit included: the node answers once the manifest is written)."""

    def __init__(self, url: str, *, token: str | None = None, timeout_s: float = 600.0,
                 connect_timeout_s: float = 5.0, retries: int = 2,
                 backoff_s: float = 0.2) -> None:
        self._url = check_node_url(url)
        self._transport = Transport(ClientOptions(
            token=resolve_token(token), timeout_s=timeout_s,
            connect_timeout_s=connect_timeout_s, retries=retries, backoff_s=backoff_s))

    @property
    def url(self) -> str:
        return self._url

    # -- saving ------------------------------------------------------------------------------
    def save(self, state_dict: Any, name: str, metadata: Mapping[str, Any] | None = None, *,
             overwrite: bool = False, progress: Progress | None = None) -> SnapshotInfo:
        """Upload and return once the node has committed the snapshot. A save that
        breaks off (client or network) commits nothing."""
        check_snapshot_name(name)
        tree, leaves = flatten_state(state_dict)
        header = ss.header_for(name, tree, leaves, _json_metadata(metadata))
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
            "PUT", self._url, f"/v1/snapshots/{quote(name)}{query}", body=body(),
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
        response = self._transport.request("GET", self._url,
                                           f"/v1/snapshots/{quote(name)}/data{query}",
                                           idempotent=True, stream=True)
        targets = _targets(into)
        complete = False
        try:
            header, tensors = _receive(response, targets, progress, self._url)
            complete = True
        finally:
            finish(response, complete=complete)
        if str(map_location) != "cpu":
            tensors = {tid: t if any(t is v for v in targets.values()) else t.to(map_location)
                       for tid, t in tensors.items()}
        wanted = key_filter(keys)
        return unflatten_state(header.tree, tensors.__getitem__, wanted)

    def info(self, name: str) -> SnapshotInfo:
        check_snapshot_name(name)
        return _info(self._transport.json("GET", self._url, f"/v1/snapshots/{quote(name)}",
                                          idempotent=True))

    def list(self) -> builtins.list[SnapshotInfo]:
        """Committed snapshots on the node, oldest first."""
        answer = self._transport.json("GET", self._url, "/v1/snapshots", idempotent=True)
        return [_info(item) for item in answer["snapshots"]]

    def verify(self, name: str) -> SnapshotInfo:
        """The node reads back every chunk and checks it; raises IntegrityError."""
        check_snapshot_name(name)
        return _info(self._transport.json("POST", self._url,
                                          f"/v1/snapshots/{quote(name)}/verify",
                                          idempotent=True))

    def delete(self, name: str) -> None:
        check_snapshot_name(name)
        self._transport.json("DELETE", self._url, f"/v1/snapshots/{quote(name)}",
                             idempotent=True)

    def close(self) -> None:
        self._transport.close()

    def __enter__(self) -> RemoteSnapshotStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RemoteSnapshotStore({self._url!r})"


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


def _json_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    import json

    if metadata is None:
        return {}
    try:
        return dict(json.loads(json.dumps(dict(metadata), allow_nan=False)))
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"metadata must be JSON-serialisable (str keys; numbers, "
                                   f"strings, lists, dicts): {exc}") from None


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


