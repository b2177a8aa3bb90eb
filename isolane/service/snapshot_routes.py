"""Snapshot endpoints of a node: streamed upload (save), streamed download (restore),
list, info, verify, delete (aiohttp handlers).

An upload is received into a spool file through the write lane (``spool.py``), checked
to the last byte (every tensor's length and checksum, then the end marker), and only
then saved with ``SnapshotStore.save``, whose manifest is the commit: a client that
goes away mid-upload, or a stream that does not check out, commits nothing.
A download loads the snapshot (big tensors as mappings of their chunk files, where
local) and streams it in the same format. Formats: ``isolane.service.snapstream``.
"""

from __future__ import annotations

import time

import xxhash
from aiohttp import web

from isolane.errors import (
    PayloadTooLargeError,
    SnapshotExistsError,
    SnapshotNotFoundError,
    WireFormatError,
)
from isolane.lanes.assignment import JobKind
from isolane.service import snapstream as ss
from isolane.service.bodies import check_length, expect_end, read_exactly
from isolane.service.names import check_snapshot_name
from isolane.service.node import NODE, STREAMING
from isolane.service.spool import UploadSpool, plan_offsets
from isolane.snapshot.tree import flatten_state, unflatten_state

STREAM_TYPE = "application/x-isolane-snapshot-stream"


def add_snapshot_routes(app: web.Application) -> None:
    app.router.add_get("/v1/snapshots", list_snapshots)
    app.router.add_get("/v1/snapshots/{name}", info)
    app.router.add_delete("/v1/snapshots/{name}", delete)
    app.router.add_post("/v1/snapshots/{name}/verify", verify)
    app.router.add_put("/v1/snapshots/{name}", upload)
    app.router.add_get("/v1/snapshots/{name}/data", download)


async def list_snapshots(request: web.Request) -> web.Response:
    node = request.app[NODE]
    store = node.require_store()
    infos = await node.run(store.list)
    return web.json_response({"snapshots": [i.to_dict() for i in infos]})


async def info(request: web.Request) -> web.Response:
    node = request.app[NODE]
    name = check_snapshot_name(request.match_info["name"])
    found = await node.run(node.require_store().info, name)
    return web.json_response(found.to_dict())


async def verify(request: web.Request) -> web.Response:
    node = request.app[NODE]
    name = check_snapshot_name(request.match_info["name"])
    checked = await node.run(node.require_store().verify, name)
    return web.json_response(checked.to_dict())


async def delete(request: web.Request) -> web.Response:
    node = request.app[NODE]
    name = check_snapshot_name(request.match_info["name"])
    await node.run(node.require_store().delete, name)
    return web.json_response({"deleted": name})


async def upload(request: web.Request) -> web.Response:
    node = request.app[NODE]
    store = node.require_store()
    name = check_snapshot_name(request.match_info["name"])
    overwrite = request.query.get("overwrite") in ("1", "true")
    limit = node.limits.max_upload_bytes
    if limit is not None:
        check_length(request, limit, "the upload")
    if not overwrite:  # refuse before receiving gigabytes
        try:
            await node.run(store.info, name)
        except SnapshotNotFoundError:
            pass
        else:
            raise SnapshotExistsError(name, store.url)
    length = ss.decode_preamble(await read_exactly(request, ss.PREAMBLE.size, "the preamble"))
    header = ss.decode_header(await read_exactly(request, length, "the stream header"))
    if header.name != name:
        raise WireFormatError(f"the stream is for snapshot '{header.name}', the URL names "
                                 f"'{name}'")
    if limit is not None and header.data_bytes > limit:
        raise PayloadTooLargeError("the upload", header.data_bytes, limit)
    offsets, size = plan_offsets(header.tensors)
    spool = UploadSpool(node.spool_dir, size, store.scheduler.lane(JobKind.CHECKPOINT_WRITE),
                        node.executor)
    try:
        for entry in header.tensors:
            ss.check_tensor_header(await read_exactly(
                request, ss.TENSOR_HEADER.size, f"the header of tensor '{entry.key}'"),
                entry)
            digest = xxhash.xxh3_64()
            offset, left = offsets[entry.id], entry.nbytes
            while left:
                piece = await read_exactly(request, min(left, ss.PIECE_BYTES),
                                           f"tensor '{entry.key}'")
                await spool.write(offset, piece, digest)
                node.load.received(len(piece), time.time())
                offset, left = offset + len(piece), left - len(piece)
            trailer = await read_exactly(request, ss.CHECKSUM.size,
                                         f"the checksum of tensor '{entry.key}'")
            await spool.flush()  # the digest has seen every piece
            if ss.CHECKSUM.unpack(trailer)[0] != digest.intdigest():
                raise WireFormatError(f"checksum mismatch in tensor '{entry.key}': damaged "
                                         "in transit; nothing was committed")
        ss.check_end(await read_exactly(request, ss.END.size, "the end marker"), header)
        await expect_end(request, "the end marker")
        await spool.flush()
    except BaseException:
        await spool.abort()
        raise
    buffer = spool.map()
    tensors = {e.id: ss.tensor_from_buffer(buffer, offsets[e.id], e) for e in header.tensors}
    state = unflatten_state(header.tree, tensors.__getitem__)
    saved = await node.run(store.save, state, name, header.metadata, overwrite=overwrite)
    return web.json_response(saved.to_dict(), status=201)


async def download(request: web.Request) -> web.StreamResponse:
    node = request.app[NODE]
    store = node.require_store()
    name = check_snapshot_name(request.match_info["name"])
    keys = request.query.getall("keys", None)
    state = await node.run(store.load, name, keys=keys, mmap=True)
    found = await node.run(store.info, name)
    tree, leaves = flatten_state(state)
    header = ss.header_for(name, tree, leaves, found.metadata)
    encoded = header.encode()
    response = web.StreamResponse(headers={"Content-Type": STREAM_TYPE})
    response.content_length = header.stream_bytes()
    await response.prepare(request)
    request[STREAMING] = True
    await response.write(ss.encode_preamble(encoded) + encoded)
    for leaf, entry in zip(leaves, header.tensors, strict=True):
        await response.write(ss.encode_tensor_header(entry))
        digest = xxhash.xxh3_64()
        for piece in ss.pieces(ss.tensor_bytes(leaf.tensor)):
            digest.update(piece)
            await response.write(piece)
            node.load.sent(len(piece), time.time())
        await response.write(ss.CHECKSUM.pack(digest.intdigest()))
    await response.write(ss.encode_end(header))
    await response.write_eof()
    return response
