"""A node's streamed snapshot upload (``PUT /v1/snapshots/<name>``) and its plan
(``POST .../plan``).

An upload goes straight into the writer (``SnapshotStore.begin_save``, a save of the
store's one save driver, ``isolane.snapshot.transaction``, fed chunk by chunk:
``isolane.snapshot.feed``): each chunk's bytes are received into a staging buffer and
handed to the write lane, which hashes and writes it once (O_DIRECT where the disk
allows) while the next chunk arrives. Chunks the client sent as hashes are linked from
the parent snapshot. The plan request's plan is kept for its upload
(``isolane.node.upload_plans``): an upload that sends its ``plan_token`` back with the
header planned is neither planned nor decoded again. The manifest is the commit,
written only once the end marker checked out: a client that goes away mid-upload, a
chunk whose hash differs, or a disk that fills commits nothing, and the save's discard
removes the generation (what it cannot remove, gc sweeps). Formats:
``isolane.wire.snapshot_stream``.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import xxhash
from aiohttp import web

from isolane.errors import (
    PayloadTooLargeError,
    SnapshotExistsError,
    SnapshotNotFoundError,
    WireFormatError,
)
from isolane.node.bodies import BodyReader, check_length, read_all
from isolane.node.resources import NODE, Node
from isolane.node.upload_plans import check_plan_token, owner_of
from isolane.snapshot.dtypes import dtype_from_name
from isolane.snapshot.feed import FedSave, UploadPlan
from isolane.snapshot.store import SnapshotStore
from isolane.snapshot.tree import TensorLeaf, tensor_paths
from isolane.wire import snapshot_stream as ss
from isolane.wire.names import check_snapshot_name
from isolane.wire.stream_limits import StreamLimits


@dataclass(frozen=True)
class KeptPlan:
    """A plan request's answer as a node keeps it for the upload: the stream header
    the upload is to send (the plan's chunks in it), its encoding's digest, the plan."""

    header: ss.StreamHeader
    digest: str
    planned: UploadPlan


def stream_limits(node: Node) -> StreamLimits:
    """What a stream header sent to this node may declare (its ``node.*`` caps)."""
    caps = node.config.node
    return StreamLimits(caps.max_snapshot_tensors, caps.max_snapshot_chunks,
                           caps.max_snapshot_pieces, caps.max_json_depth)


def _owner(request: web.Request, name: str, overwrite: bool) -> str:
    return owner_of(request.headers.get("Authorization"),
                    request.headers.get(ss.CLIENT_HEADER), request.remote, name,
                    overwrite=overwrite)


def _digest(encoded: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(encoded)


def meta_leaves(header: ss.StreamHeader) -> list[TensorLeaf]:
    """Leaves for ``begin_save``: each tensor's first key path in the tree, with a meta
    tensor of its dtype and shape (no memory)."""
    paths = tensor_paths(header.tree)
    return [TensorLeaf(e.id, paths[e.id], torch.empty(
        e.shape, dtype=dtype_from_name(e.dtype), device="meta")) for e in header.tensors]


async def _refuse_existing(node: Node, store: SnapshotStore, name: str, overwrite: bool
                           ) -> None:
    if overwrite:
        return
    try:
        await node.run(store.info, name)
    except SnapshotNotFoundError:
        return
    raise SnapshotExistsError(name, store.url)


async def plan(request: web.Request) -> web.Response:
    """The chunks a save of this stream header (its ``chunks`` empty) would write, and
    the hashes of the chunks the node already holds and can link: the client hashes
    its chunks, sends those as hashes only, and the rest as bytes. The plan is kept
    for the upload that sends ``plan_token`` back (``isolane.node.upload_plans``)."""
    node = request.app[NODE]
    store = node.require_store()
    name = check_snapshot_name(request.match_info["name"])
    overwrite = request.query.get("overwrite") in ("1", "true")
    await _refuse_existing(node, store, name, overwrite)
    caps = node.config.node
    header = ss.decode_header(await read_all(request, caps.max_header_bytes, "the header",
                                             "node.max_header_bytes"),
                              need_chunks=False, limits=stream_limits(node))
    check_header(node, header, name)
    planned = await node.run(store.plan_upload, meta_leaves(header), name)
    node.plan_counts.plans += 1
    full = header.with_chunks(ss.plan_chunks(planned.plan))
    token = node.upload_plans.keep(_owner(request, name, overwrite),
                                   KeptPlan(full, _digest(full.encode()), planned))
    return web.json_response({"chunks": [c.to_dict() for c in full.chunks],
                              "known": sorted(planned.parent_hashes),
                              "parent": planned.parent, "plan_token": token})


def check_header(node: Node, header: ss.StreamHeader, name: str) -> None:
    if header.name != name:
        raise WireFormatError(f"the stream is for snapshot '{header.name}', the URL names "
                              f"'{name}'")
    limit = node.limits.max_upload_bytes
    if limit is not None and header.data_bytes > limit:
        raise PayloadTooLargeError("the upload", header.data_bytes, limit,
                                   field="node.max_upload_bytes")


async def upload(request: web.Request) -> web.Response:
    node = request.app[NODE]
    store = node.require_store()
    name = check_snapshot_name(request.match_info["name"])
    overwrite = request.query.get("overwrite") in ("1", "true")
    mirror = {"1": True, "0": False}.get(request.query.get("mirror", ""))
    limit = node.limits.max_upload_bytes
    if limit is not None:
        check_length(request, limit + node.config.node.max_header_bytes, "the upload",
                     "node.max_upload_bytes")
    token = request.headers.get(ss.PLAN_HEADER)
    kept = node.upload_plans.take(None if token is None else check_plan_token(token),
                                  _owner(request, name, overwrite))
    await _refuse_existing(node, store, name, overwrite)  # before receiving gigabytes
    body = BodyReader(request, stall_timeout_s=node.limits.upload_stall_s)
    length = ss.decode_preamble(await body.read_exactly(ss.PREAMBLE.size, "the preamble"),
                                node.config.node.max_header_bytes)
    encoded = await body.read_exactly(length, "the stream header")
    planned: UploadPlan | None = None
    if kept is not None and _digest(encoded) == kept.digest:
        header, planned = kept.header, kept.planned  # checked when it was planned
    else:
        header = ss.decode_header(encoded, limits=stream_limits(node))
    check_header(node, header, name)
    tx = await node.run(store.begin_save, header.tree, meta_leaves(header), name,
                        header.metadata, overwrite=overwrite, mirror=mirror, plan=planned)
    node.plan_counts.plans_reused += tx.plan_reused
    node.plan_counts.plans += not tx.plan_reused
    saved = await receive_and_commit(body, node, tx, header)
    return web.json_response(saved.to_dict(), status=201)


async def ended(future: Future[Any]) -> Any:
    """The transaction's outcome; the writer's own error (a full disk) wins over the
    one that made the stream stop."""
    return await asyncio.wrap_future(future)


async def receive_and_commit(body: BodyReader, node: Node, tx: FedSave,
                             header: ss.StreamHeader) -> Any:
    """Feed the stream's chunks into ``tx`` and commit it; any failure aborts it."""
    try:
        await receive_chunks(body, node, tx, header)
    except BaseException as exc:
        await ended(tx.abort(exc))
        raise
    return await ended(tx.commit())


async def receive_chunks(body: BodyReader, node: Node, tx: FedSave,
                          header: ss.StreamHeader) -> None:
    if ss.plan_chunks(tx.plan) != header.chunks:
        raise WireFormatError("the stream's chunks are not this node's plan for these "
                              f"tensors; ask for one (POST /v1/snapshots/{header.name}/plan) "
                              "and send its chunks")
    sent = 0

    def received(n: int) -> None:
        node.load.received(n, time.time())

    for index, chunk in enumerate(header.chunks):
        what = f"chunk {chunk.key}"
        linked = ss.check_chunk_header(await body.read_exactly(
            ss.CHUNK_HEADER.size, f"the header of {what}"), index, chunk)
        if linked:
            tx.link(index, ss.hash_hex(await body.read_exactly(ss.HASH_BYTES,
                                                               f"the hash of {what}")))
            continue
        staged = await node.run(tx.acquire, chunk.stored)
        try:
            await body.readinto(staged.view[:chunk.nbytes], what, received)
            if chunk.stored > chunk.nbytes:  # a reused buffer: the padding must be zeros
                staged.view[chunk.nbytes:chunk.stored] = bytes(chunk.stored - chunk.nbytes)
            digest = ss.hash_hex(await body.read_exactly(ss.HASH_BYTES, f"the hash of {what}"))
        except BaseException:
            tx.release(staged)
            raise
        tx.put(index, staged, digest)
        sent += chunk.nbytes
    ss.check_end(await body.read_exactly(ss.END.size, "the end marker"),
                 len(header.chunks), sent)
    await body.expect_end("the end marker")


