"""Snapshot endpoints of a node: plan, streamed upload (save), streamed download
(restore), list, info, manifest, verify, delete, gc and mirror (aiohttp handlers).

An upload goes straight into the writer (``SnapshotStore.begin_save``): each chunk's
bytes are received into a staging buffer and handed to the write lane, which hashes
and writes it once (O_DIRECT where the disk allows) while the next chunk arrives.
Chunks the client sent as hashes are linked from the parent snapshot. The manifest is
the commit, written only once the end marker checked out: a client that goes away
mid-upload, a chunk whose hash differs, or a disk that fills commits nothing, and
the writer removes the generation (what it cannot remove, gc sweeps).
A download sends every wanted chunk file as stored, with the manifest's hash: the client
checks each chunk as it lands. Local chunk files go by ``sendfile`` (page cache to
socket), each read into the page cache on the read lane a few chunks early; other
media are read into buffers on the read lane, a few chunks ahead.
Formats: ``isolane.wire.snapshot_stream``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch
from aiohttp import web

from isolane.errors import (
    ConflictError,
    InvalidArgumentError,
    KeyNotFoundError,
    PayloadTooLargeError,
    SnapshotExistsError,
    SnapshotNotFoundError,
    WireFormatError,
)
from isolane.lanes.assignment import JobKind
from isolane.lanes.scheduler import LaneHandle
from isolane.node.bodies import BodyReader, check_length, read_all
from isolane.node.resources import NODE, STREAMING, Node
from isolane.snapshot.dtypes import dtype_from_name
from isolane.snapshot.manifest import Manifest
from isolane.snapshot.store import SnapshotStore
from isolane.snapshot.transaction import SaveTransaction
from isolane.snapshot.tree import (
    TensorLeaf,
    flatten_state,
    key_filter,
    tensor_ids,
    tensor_paths,
    unflatten_state,
)
from isolane.storage.aligned import AlignedBuffer
from isolane.storage.mapped import populate_file_cache
from isolane.wire import snapshot_stream as ss
from isolane.wire.names import check_snapshot_name

STREAM_TYPE = "application/x-isolane-snapshot-stream"
READ_AHEAD = 3  # chunks read ahead of the one being sent
# Writes of about a socket buffer: asyncio copies what the socket does not take into its
# own buffer and cuts sent bytes off that buffer's front, which costs a move of the
# rest each time (quadratic for a 32 MiB chunk written at once).
SEND_BYTES = 1 << 20
PATH_HEADER = "X-Isolane-Path"  # where a manifest's snapshot lies on the node
# A download's generation (the client asks for the other parts of that one) and the
# number of parts the node splits it into (1: this stream carries every chunk).
GENERATION_HEADER = "X-Isolane-Generation"
PARTS_HEADER = "X-Isolane-Parts"
MAX_PARTS = 16


def add_snapshot_routes(app: web.Application) -> None:
    app.router.add_get("/v1/snapshots", list_snapshots)
    app.router.add_post("/v1/snapshots/_gc", gc)
    app.router.add_post("/v1/snapshots/_mirror", sync_mirrors)
    app.router.add_post("/v1/snapshots/_mirror/wait", wait_for_mirrors)
    app.router.add_get("/v1/snapshots/{name}", info)
    app.router.add_get("/v1/snapshots/{name}/manifest", manifest)
    app.router.add_delete("/v1/snapshots/{name}", delete)
    app.router.add_post("/v1/snapshots/{name}/verify", verify)
    app.router.add_post("/v1/snapshots/{name}/plan", plan)
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


async def manifest(request: web.Request) -> web.Response:
    """The committed manifest (``isolane.json``) and where it lies (``isolane show``)."""
    node = request.app[NODE]
    name = check_snapshot_name(request.match_info["name"])
    store = node.require_store()
    found = await node.run(store.manifest, name)
    path = await node.run(store.path, name)
    return web.Response(body=found.to_json(), content_type="application/json",
                        headers={PATH_HEADER: path})


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


async def gc(request: web.Request) -> web.Response:
    """Retention (``?keep_last=N``, else the node's config) and sweeping of leftovers."""
    node = request.app[NODE]
    keep = _int_query(request, "keep_last")
    report = await node.run(node.require_store().gc, keep_last=keep)
    return web.json_response({"deleted_snapshots": list(report.deleted_snapshots),
                              "swept_generations": list(report.swept_generations)})


async def sync_mirrors(request: web.Request) -> web.Response:
    """Start mirroring every snapshot the capacity group lacks; with ``?wait=1`` answer
    once they are mirrored (or failed)."""
    node = request.app[NODE]
    store = _mirrored_store(node)
    started = await node.run(store.sync_mirrors)
    body: dict[str, Any] = {"started": started, "mirror": _mirror_url(store)}
    if request.query.get("wait") in ("1", "true"):
        results = await node.run(store.wait_for_mirrors)
        body["results"] = {name: results.get(name) for name in started}
    return web.json_response(body)


async def wait_for_mirrors(request: web.Request) -> web.Response:
    node = request.app[NODE]
    store = _mirrored_store(node)
    timeout = _int_query(request, "timeout_s")
    results = await node.run(store.wait_for_mirrors, timeout)
    return web.json_response({"results": results, "mirror": _mirror_url(store)})


def _mirrored_store(node: Node) -> SnapshotStore:
    store = node.require_store()
    if store.mirror_store is None:
        raise InvalidArgumentError(f"this node has no capacity group to mirror to: its config "
                                   f"({node.config.source}) needs a device group with role "
                                   "'capacity' (e.g. devices: [s3://bucket/prefix])")
    return store


def _mirror_url(store: SnapshotStore) -> str | None:
    return store.mirror_store.url if store.mirror_store is not None else None


def _int_query(request: web.Request, field: str) -> int | None:
    raw = request.query.get(field)
    if raw is None:
        return None
    if not raw.isdigit() or int(raw) < 1 or len(raw) > 12:
        raise InvalidArgumentError(f"?{field}= takes a whole number of at least 1, got "
                                   f"{raw!r:.40}")
    return int(raw)


# -- upload ------------------------------------------------------------------------------
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
    its chunks, sends those as hashes only, and the rest as bytes."""
    node = request.app[NODE]
    store = node.require_store()
    name = check_snapshot_name(request.match_info["name"])
    overwrite = request.query.get("overwrite") in ("1", "true")
    await _refuse_existing(node, store, name, overwrite)
    header = ss.decode_header(await read_all(request, ss.MAX_HEADER_BYTES, "the header"),
                              need_chunks=False)
    _check_header(node, header, name)
    planned = await node.run(store.plan_upload, meta_leaves(header), name)
    return web.json_response({"chunks": [c.to_dict() for c in ss.plan_chunks(planned.plan)],
                              "known": sorted(planned.parent_hashes),
                              "parent": planned.parent})


def _check_header(node: Node, header: ss.StreamHeader, name: str) -> None:
    if header.name != name:
        raise WireFormatError(f"the stream is for snapshot '{header.name}', the URL names "
                              f"'{name}'")
    limit = node.limits.max_upload_bytes
    if limit is not None and header.data_bytes > limit:
        raise PayloadTooLargeError("the upload", header.data_bytes, limit)


async def upload(request: web.Request) -> web.Response:
    node = request.app[NODE]
    store = node.require_store()
    name = check_snapshot_name(request.match_info["name"])
    overwrite = request.query.get("overwrite") in ("1", "true")
    mirror = {"1": True, "0": False}.get(request.query.get("mirror", ""))
    limit = node.limits.max_upload_bytes
    if limit is not None:
        check_length(request, limit + ss.MAX_HEADER_BYTES, "the upload")
    await _refuse_existing(node, store, name, overwrite)  # before receiving gigabytes
    body = BodyReader(request, stall_timeout_s=node.limits.upload_stall_s)
    length = ss.decode_preamble(await body.read_exactly(ss.PREAMBLE.size, "the preamble"))
    header = ss.decode_header(await body.read_exactly(length, "the stream header"))
    _check_header(node, header, name)
    tx = await node.run(store.begin_save, header.tree, meta_leaves(header), name,
                        header.metadata, overwrite=overwrite, mirror=mirror)
    try:
        await _receive_chunks(body, node, tx, header)
    except BaseException as exc:
        await _ended(tx.abort(exc))
        raise
    saved = await _ended(tx.commit())
    return web.json_response(saved.to_dict(), status=201)


async def _ended(future: Future[Any]) -> Any:
    """The transaction's outcome; the writer's own error (a full disk) wins over the
    one that made the stream stop."""
    return await asyncio.wrap_future(future)


async def _receive_chunks(body: BodyReader, node: Node, tx: SaveTransaction,
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


# -- download ----------------------------------------------------------------------------
async def download(request: web.Request) -> web.StreamResponse:
    node = request.app[NODE]
    store = node.require_store()
    name = check_snapshot_name(request.match_info["name"])
    keys = request.query.getall("keys", None)
    part, parts = _part_query(request)
    located = await node.run(store.snapshot_files, name)
    generation = request.query.get("generation")
    if generation is not None and generation != located.manifest.generation:
        raise ConflictError(f"snapshot '{name}' was overwritten while it downloaded (its "
                            f"generation {generation} is gone, {located.manifest.generation}"
                            " is live): load it again")
    if located.manifest.ranks:  # resharded for one process: tensors, not chunk files
        if part:
            raise InvalidArgumentError(f"snapshot '{name}' was saved by several ranks and "
                                       "is sent whole: load it without part=")
        return await _send_tensors(request, node, store, name, keys)
    found = located.manifest
    ids = tensor_ids(found.tree, key_filter(keys))
    if keys:
        _check_keys(found, keys)
    entries = tuple(ss.TensorEntry(t.id, t.key, t.dtype, t.shape, _nbytes(t.dtype, t.shape))
                    for t in found.tensors if t.id in ids)
    header = ss.StreamHeader(name, found.tree, entries, dict(found.metadata),
                             ss.manifest_chunks(found, ids))
    records = {c.key: c for c in found.chunks}
    lane = store.scheduler.lane(JobKind.CHECKPOINT_READ)
    hashes = [ss.hash_bytes(records[c.key].hash) for c in header.chunks]
    paths = [located.stores[records[c.key].device].local_path(f"{located.prefix}/{c.key}")
             for c in header.chunks]
    indexes = ss.part_indexes(len(header.chunks), part, parts)
    extra = {GENERATION_HEADER: found.generation, PARTS_HEADER: str(parts)}
    if header.chunks and all(paths) and request.transport is not None:
        response = await _start(request, header, indexes, extra)
        await _sendfile_chunks(request, response, node, lane, header, indexes,
                               [p or "" for p in paths], hashes)
        return response
    biggest = max((c.nbytes for c in header.chunks), default=1)
    free = [AlignedBuffer(biggest) for _ in range(min(READ_AHEAD, len(indexes)) or 1)]

    def read(index: int) -> Future[AlignedBuffer]:
        chunk = header.chunks[index]
        record = records[chunk.key]
        buf = free.pop()

        def job() -> AlignedBuffer:
            view = buf.view[:chunk.nbytes]
            try:
                located.stores[record.device].read_into(f"{located.prefix}/{chunk.key}", view)
            except (FileNotFoundError, EOFError):
                # A chunk file gone or cut short: sent as zeros, which fail the client's
                # hash check, so the client raises IntegrityError naming the tensor.
                view[:] = bytes(len(view))
            return buf
        return lane.submit_sized(chunk.nbytes, job)

    try:
        response = await _start(request, header, indexes, extra)
        await _send_read_ahead(response, node, header, indexes, read, hashes, free)
    finally:
        for buf in free:
            buf.close()
    return response


_SCRATCH = threading.local()
WARM_BYTES = 8 << 20  # reads that bring a chunk file into the page cache
# Chunk files go into the page cache by a populated mapping (no copy) rather than reads
# into a scratch buffer (a copy of every byte).
WARM_BY_MAPPING = True


def _open_ahead(path: str, nbytes: int) -> int:
    """Open a chunk file (never through a link) and read it into the page cache (on the
    read lane, ahead of its turn, several chunks at once: large reads in parallel, as
    a local restore does; ``sendfile`` then sends from memory): -1 when it is missing."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return -1
    if WARM_BY_MAPPING and _warm_mapped(fd, nbytes):
        return fd
    scratch = getattr(_SCRATCH, "buffer", None)
    if scratch is None:
        scratch = _SCRATCH.buffer = bytearray(WARM_BYTES)
    view = memoryview(scratch)
    with contextlib.suppress(OSError):
        done = 0
        while done < nbytes:
            n = os.preadv(fd, [view[:min(WARM_BYTES, nbytes - done)]], done)
            if n <= 0:
                break
            done += n
    return fd


def _warm_mapped(fd: int, nbytes: int) -> bool:
    """Page cache filled through a populated mapping (no copy); False: read it."""
    try:
        size = min(nbytes, os.fstat(fd).st_size)
    except OSError:
        return False
    return populate_file_cache(fd, size)


async def _sendfile_chunks(request: web.Request, response: web.StreamResponse, node: Node,
                           lane: LaneHandle, header: ss.StreamHeader, indexes: Sequence[int],
                           paths: Sequence[str], hashes: Sequence[bytes]) -> None:
    """The chunk files at ``indexes`` sent by ``sendfile`` (page cache to socket, no
    copy through this process), each opened and read ahead on the read lane a few
    chunks early."""
    loop = asyncio.get_running_loop()
    pending: list[asyncio.Future[int]] = []
    total = 0
    try:
        for n, index in enumerate(indexes):
            chunk = header.chunks[index]
            while len(pending) < READ_AHEAD and n + len(pending) < len(indexes):
                ahead = indexes[n + len(pending)]
                pending.append(asyncio.wrap_future(lane.submit_sized(
                    header.chunks[ahead].nbytes, _open_ahead, paths[ahead],
                    header.chunks[ahead].nbytes)))
            fd = await pending.pop(0)
            await response.write(ss.encode_chunk_header(index, chunk.nbytes))
            sent = 0
            if fd >= 0:
                transport = request.transport
                if transport is None:
                    os.close(fd)
                    raise ConnectionResetError("the client went away mid-download")
                with open(fd, "rb", buffering=0) as file:
                    sent = await loop.sendfile(transport, file, 0, chunk.nbytes)
            # A chunk file gone or cut short: the rest as zeros, which fail the client's
            # hash check, so the client raises IntegrityError naming the tensor.
            for start in range(sent, chunk.nbytes, SEND_BYTES):
                await response.write(bytes(min(SEND_BYTES, chunk.nbytes - start)))
            await response.write(hashes[index])
            total += chunk.nbytes
            node.load.sent(chunk.nbytes, time.time())
        await response.write(ss.encode_end(len(indexes), total))
        await response.write_eof()
    finally:
        for rest in pending:
            with contextlib.suppress(OSError):
                fd = await rest
                if fd >= 0:
                    os.close(fd)


async def _send_read_ahead(response: web.StreamResponse, node: Node,
                           header: ss.StreamHeader, indexes: Sequence[int],
                           read: Callable[[int], Future[AlignedBuffer]],
                           hashes: Sequence[bytes], free: list[AlignedBuffer]) -> None:
    pending: list[Awaitable[AlignedBuffer]] = []
    total = 0
    try:
        for n, index in enumerate(indexes):
            chunk = header.chunks[index]
            while len(pending) < READ_AHEAD and n + len(pending) < len(indexes):
                pending.append(asyncio.wrap_future(read(indexes[n + len(pending)])))
            buf = await pending.pop(0)
            await response.write(ss.encode_chunk_header(index, chunk.nbytes))
            for piece in ss.pieces(buf.view[:chunk.nbytes], SEND_BYTES):
                await response.write(piece)
            await response.write(hashes[index])
            free.append(buf)
            total += chunk.nbytes
            node.load.sent(chunk.nbytes, time.time())
        await response.write(ss.encode_end(len(indexes), total))
        await response.write_eof()
    finally:
        for rest in pending:  # reads still in flight return their buffers when done
            with contextlib.suppress(OSError):
                free.append(await rest)


async def _start(request: web.Request, header: ss.StreamHeader,
                 indexes: Sequence[int] | None = None,
                 extra: dict[str, str] | None = None) -> web.StreamResponse:
    encoded = header.encode()
    response = web.StreamResponse(headers={"Content-Type": STREAM_TYPE, **(extra or {})})
    response.content_length = header.stream_bytes(only=indexes)
    await response.prepare(request)
    request[STREAMING] = True
    await response.write(ss.encode_preamble(encoded) + encoded)
    return response


async def _send_tensors(request: web.Request, node: Node, store: SnapshotStore, name: str,
                        keys: list[str] | None) -> web.StreamResponse:
    """A multi-rank snapshot loaded as one process sees it, its tensors sent as chunks."""
    state = await node.run(store.load, name, keys=keys)
    found = await node.run(store.info, name)
    tree, leaves = flatten_state(state)
    plain = ss.header_for(name, tree, leaves, found.metadata)
    header = plain.with_chunks(ss.tensor_chunks(plain.tensors))
    views = {leaf.id: ss.tensor_bytes(leaf.tensor) for leaf in leaves}
    response = await _start(request, header)
    total = 0
    for index, chunk in enumerate(header.chunks):
        view = ss.chunk_view(chunk, views)
        digest = await node.run(ss.chunk_digest, view, chunk.stored)
        await response.write(ss.encode_chunk_header(index, chunk.nbytes))
        await response.write(view)
        await response.write(ss.hash_bytes(digest))
        total += chunk.nbytes
        node.load.sent(chunk.nbytes, time.time())
    await response.write(ss.encode_end(len(header.chunks), total))
    await response.write_eof()
    return response


def _part_query(request: web.Request) -> tuple[int, int]:
    """``part`` and ``parts`` of a download over several connections (0 and 1: the
    whole stream)."""
    try:
        parts = int(request.query.get("parts", "1"))
        part = int(request.query.get("part", "0"))
    except ValueError:
        raise InvalidArgumentError("part and parts must be whole numbers") from None
    if not 1 <= parts <= MAX_PARTS or not 0 <= part < parts:
        raise InvalidArgumentError(f"a download has 1 to {MAX_PARTS} parts and part is "
                                   f"0 to parts - 1; got part={part}, parts={parts}")
    return part, parts


def _check_keys(found: Manifest, keys: list[str]) -> None:
    known: set[str] = set()

    def visit(path: tuple[object, ...]) -> bool:
        known.add(".".join(str(x) for x in path))
        return False

    unflatten_state(found.tree, lambda _i: torch.empty(0), visit)
    known.update(t.key for t in found.tensors)
    missing = [k for k in keys if not any(kk == k or kk.startswith(k + ".") for kk in known)]
    if missing:
        raise KeyNotFoundError(f"snapshot '{found.name}' has no key {missing[0]!r}; run "
                               f"'isolane show {found.name}' to list its keys")


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return torch.empty(shape, dtype=dtype_from_name(dtype), device="meta").nbytes
