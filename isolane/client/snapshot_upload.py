"""A save streamed to a storage node (``PUT /v1/snapshots/<name>``).

First the node plans the save (``POST .../plan`` with the stream header, its chunks
empty): the chunks it will write and the hashes of its parent's chunks it can link.
Then the stream (``isolane.wire.snapshot_stream``): the header with the node's chunks,
then every chunk, as a hash alone when the node holds those bytes already (hashed
just before it would be sent, so that hashing overlaps the node's work on the chunks
before it; with ``change_detection="version"`` tensors untouched since this client
uploaded the parent are not even hashed), else its bytes and their hash; then the end
marker. The node answers once it has committed the manifest. The upload sends the
``plan_token`` of the plan answer back, so the node follows the plan it made.
"""

from __future__ import annotations

import builtins
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any
from urllib.parse import quote, urlencode

import xxhash

from isolane import bounded_json
from isolane.client.transport import Transport
from isolane.errors import WireFormatError
from isolane.snapshot.names import ChangeDetection, check_metadata
from isolane.snapshot.plan import PACKS_GROUP
from isolane.snapshot.results import SnapshotInfo
from isolane.snapshot.tree import TensorLeaf, flatten_state
from isolane.snapshot.versions import Signature, TensorVersions, signature
from isolane.wire import snapshot_stream as ss

Progress = Callable[[int, int], None]
FLUSH_BYTES = 64 << 10  # stream records and small chunks are sent in batches of this


def upload(transport: Transport, versions: TensorVersions, node: str, state_dict: Any,
           name: str, metadata: Mapping[str, Any] | None, *, overwrite: bool,
           mirror: bool | None, progress: Progress | None,
           change_detection: ChangeDetection = "hash", client_id: str = "") -> SnapshotInfo:
    """Save ``state_dict`` as ``name`` on ``node`` (module docstring); ``versions``
    holds the chunk hashes of the tensors as this client last uploaded them;
    ``client_id``: this client's id, which the node binds its kept plan to."""
    query = {"overwrite": "1"} if overwrite else {}
    if mirror is not None:
        query["mirror"] = "1" if mirror else "0"
    sent = send(transport, versions, node, f"/v1/snapshots/{quote(name)}", state_dict, name,
                metadata, query=query, progress=progress, change_detection=change_detection,
                client_id=client_id)
    info = read_info(sent.answer)
    for leaf in sent.leaves:
        versions.remember(leaf.tensor, sent.signatures[leaf.id],
                          f"{node} {info.generation}",
                          tuple(sent.digests[i] for i in sent.slices.get(leaf.id, ())))
    return info


@dataclasses.dataclass(frozen=True)
class Sent:
    """An upload's JSON answer, and the chunk hashes of the tensors it sent."""

    answer: Any
    leaves: builtins.list[TensorLeaf]
    signatures: dict[int, Signature | None]
    digests: dict[int, str]
    slices: dict[int, builtins.list[int]]


def send(transport: Transport, versions: TensorVersions, node: str, route: str,
         state_dict: Any, name: str, metadata: Mapping[str, Any] | None, *,
         query: Mapping[str, str], progress: Progress | None,
         change_detection: ChangeDetection = "hash", client_id: str = "") -> Sent:
    """The plan request (``POST <route>/plan``) and the stream (``PUT <route>``) of
    ``state_dict`` saved as (a part of) ``name``: a whole snapshot, or one rank's part
    of a multi-rank save (``isolane.client.snapshot_parts``)."""
    tree, leaves = flatten_state(state_dict)
    bare = ss.header_for(name, tree, leaves, check_metadata(metadata))
    who = {ss.CLIENT_HEADER: client_id} if client_id else {}
    answer = read_json(transport.request(
        "POST", node, f"{route}/plan?{urlencode(query)}",
        body=bare.encode(), headers={"Content-Type": "application/json", **who},
        idempotent=True).data)
    header = _planned(bare, answer)
    token = answer.get("plan_token")
    if isinstance(token, str):  # the node keeps its plan for this upload
        who[ss.PLAN_HEADER] = token
    views = {leaf.id: ss.tensor_bytes(leaf.tensor) for leaf in leaves}
    known = set(answer.get("known", ()))
    slices = _tensor_slices(header)
    signatures = {leaf.id: signature(leaf.tensor) for leaf in leaves}
    digests: dict[int, str] = {}
    parent = answer.get("parent")
    if known and change_detection == "version" and isinstance(parent, dict):
        for leaf in leaves:  # untouched since this client saved the parent: no hashing
            seen = versions.unchanged(leaf.tensor, signatures[leaf.id],
                                            f"{node} {parent.get('generation')}")
            mine = slices.get(leaf.id, [])
            if seen is not None and mine and len(seen) == len(mine):
                digests.update(zip(mine, seen, strict=True))
    # With hashes the node holds, a chunk's hash decides whether its bytes go: each
    # chunk is hashed just before it is sent, so hashing overlaps the node's work on
    # the chunks before it (the body's length is then unknown up front: it goes in
    # HTTP chunks). Without, every chunk goes as bytes, hashed as it is sent.
    pipelined = bool(known)
    total = header.wire_bytes()
    encoded = header.encode()

    def body() -> Iterator[bytes | memoryview]:
        small = bytearray(ss.encode_preamble(encoded) + encoded)  # records, coalesced
        done = sent = 0
        for index, chunk in enumerate(header.chunks):
            view = ss.chunk_view(chunk, views)
            if pipelined and index not in digests:
                digests[index] = ss.chunk_digest(view, chunk.stored)
            if pipelined and digests[index] in known:
                small += ss.encode_chunk_header(index, 0, linked=True)
                small += ss.hash_bytes(digests[index])
                done += chunk.nbytes
                if progress is not None:
                    progress(done, total)
                if len(small) >= FLUSH_BYTES:
                    yield bytes(small)
                    small.clear()
                continue
            small += ss.encode_chunk_header(index, chunk.nbytes)
            digest = xxhash.xxh3_128() if index not in digests else None
            for piece in ss.pieces(view):
                if digest is not None:
                    digest.update(piece)
                if len(piece) < FLUSH_BYTES:
                    small += piece
                else:
                    if small:
                        yield bytes(small)
                        small.clear()
                    yield piece
                done += len(piece)
                if progress is not None:
                    progress(done, total)
            sent += chunk.nbytes
            if digest is not None:
                pad = chunk.stored - chunk.nbytes
                if pad:
                    digest.update(bytes(pad))
                digests[index] = digest.hexdigest()
            small += ss.hash_bytes(digests[index])
        small += ss.encode_end(len(header.chunks), sent)
        yield bytes(small)

    framing = {} if pipelined else {"Content-Length": str(header.stream_bytes())}
    response = transport.request(
        "PUT", node, f"{route}?{urlencode(query)}", body=body(),
        headers={"Content-Type": ss.CONTENT_TYPE, **framing, **who}, idempotent=False)
    return Sent(read_json(response.data), leaves, signatures, digests, slices)


def read_info(data: Any) -> SnapshotInfo:
    if not isinstance(data, dict):
        raise WireFormatError("a storage node described a snapshot with something other "
                              "than a JSON object")
    known = {f.name for f in dataclasses.fields(SnapshotInfo)}
    try:
        return SnapshotInfo(**{k: v for k, v in data.items() if k in known})
    except TypeError as exc:
        raise WireFormatError(f"a storage node's snapshot description lacks fields: {exc}"
                              ) from None


def read_json(data: bytes) -> Any:
    try:
        return bounded_json.loads(data)
    except ValueError:
        raise WireFormatError("a storage node answered with a body that is not JSON") from None


def _tensor_slices(header: ss.StreamHeader) -> dict[int, builtins.list[int]]:
    """Indexes of the chunks that are plain slices of one tensor, by tensor id."""
    out: dict[int, builtins.list[int]] = {}
    for index, chunk in enumerate(header.chunks):
        piece = chunk.single
        if piece is not None and piece.nbytes == chunk.nbytes and not chunk.key.startswith(
                PACKS_GROUP + "/"):
            out.setdefault(piece.tensor, []).append(index)
    return out


def _planned(bare: ss.StreamHeader, answer: Any) -> ss.StreamHeader:
    """The header with the chunks the node planned (checked like any stream header:
    every tensor byte in exactly one chunk)."""
    if not isinstance(answer, dict) or not isinstance(answer.get("chunks"), list):
        raise WireFormatError("a storage node answered a plan request without chunks")
    header = bare.with_chunks(ss.decode_chunks(answer["chunks"]))
    ss.check_coverage(header)
    return header
