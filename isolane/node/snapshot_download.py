"""A node's streamed snapshot download (``GET /v1/snapshots/<name>/data``).

Every wanted chunk file is sent as stored, with the manifest's hash: the client checks
each chunk as it lands. Local chunk files go by ``sendfile`` (page cache to socket),
each read into the page cache on the read lane a few chunks early; other media are
read into buffers on the read lane, a few chunks ahead. A download may be split into
parts over several connections (``?part=&parts=``, every ``parts``-th chunk); a
multi-rank snapshot is sent whole, as one process loads it.

``POST /v1/snapshots/<name>/chunks`` (``{"generation", "chunks": [key, ...]}``) sends
the named chunk files of the live generation, whole, as stored and with their hashes,
in that order, for a client that reads only part of a snapshot (a DCP rank's share,
``isolane.integrations.dcp_node_reads``): the client knows from the manifest which
bytes each holds, and checks each against the manifest's hash.
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

import torch
from aiohttp import web

from isolane.errors import ConflictError, InvalidArgumentError, WireFormatError
from isolane.lanes.assignment import JobKind
from isolane.lanes.scheduler import LaneHandle
from isolane.node.bodies import read_json
from isolane.node.resources import NODE, STREAMING, Node
from isolane.snapshot.catalog import Located
from isolane.snapshot.dtypes import dtype_from_name
from isolane.snapshot.restore import check_keys
from isolane.snapshot.store import SnapshotStore
from isolane.snapshot.tree import flatten_state, key_filter, tensor_ids
from isolane.storage.aligned import AlignedBuffer
from isolane.storage.mapped import populate_file_cache
from isolane.wire import snapshot_stream as ss
from isolane.wire.names import check_snapshot_name

READ_AHEAD = 3  # chunks read ahead of the one being sent
# Writes of about a socket buffer: asyncio copies what the socket does not take into its
# own buffer and cuts sent bytes off that buffer's front, which costs a move of the
# rest each time (quadratic for a 32 MiB chunk written at once).
SEND_BYTES = 1 << 20
MAX_PARTS = 16


async def download(request: web.Request) -> web.StreamResponse:
    node = request.app[NODE]
    store = node.require_store()
    name = check_snapshot_name(request.match_info["name"])
    keys = request.query.getall("keys", None)
    part, parts = _part_query(request)
    located = await node.run(store.snapshot_files, name)
    _check_generation(name, request.query.get("generation"), located)
    if located.manifest.ranks:  # resharded for one process: tensors, not chunk files
        if part:
            raise InvalidArgumentError(f"snapshot '{name}' was saved by several ranks and "
                                       "is sent whole: load it without part=")
        return await _send_tensors(request, node, store, name, keys)
    found = located.manifest
    ids = tensor_ids(found.tree, key_filter(keys))
    if keys:
        check_keys(found, keys)
    entries = tuple(ss.TensorEntry(t.id, t.key, t.dtype, t.shape, _nbytes(t.dtype, t.shape))
                    for t in found.tensors if t.id in ids)
    header = ss.StreamHeader(name, found.tree, entries, dict(found.metadata),
                             ss.manifest_chunks(found, ids))
    indexes = ss.part_indexes(len(header.chunks), part, parts)
    extra = {ss.GENERATION_HEADER: found.generation, ss.PARTS_HEADER: str(parts)}
    return await _send_stored(request, node, store, located, header, indexes, extra)


async def download_chunks(request: web.Request) -> web.StreamResponse:
    """The chunk files a client names, of the generation it names (module docstring)."""
    node = request.app[NODE]
    store = node.require_store()
    name = check_snapshot_name(request.match_info["name"])
    caps = node.config.node
    body = await read_json(request, caps.max_header_bytes, caps.max_json_depth)
    keys = body.get("chunks") if isinstance(body, dict) else None
    generation = body.get("generation") if isinstance(body, dict) else None
    if not isinstance(generation, str) or not isinstance(keys, list) or not all(
            isinstance(k, str) for k in keys):
        raise WireFormatError('a chunks request is {"generation": text, "chunks": [chunk '
                              'key, ...]}')
    if len(keys) > caps.max_snapshot_chunks:
        raise InvalidArgumentError(f"{len(keys)} chunks asked at once; at most "
                                   f"node.max_snapshot_chunks = {caps.max_snapshot_chunks}")
    located = await node.run(store.snapshot_files, name)
    _check_generation(name, generation, located)
    records = {c.key: c for c in located.manifest.chunks}
    missing = next((k for k in keys if k not in records), None)
    if missing is not None:
        raise InvalidArgumentError(f"snapshot '{name}' has no chunk {missing!r:.120}: ask "
                                   "for keys its manifest lists")
    chunks = tuple(ss.ChunkEntry(k, records[k].stored, ss.wire_bytes(records[k]), ())
                   for k in keys)
    header = ss.StreamHeader(name, flatten_state({})[0], (), {}, chunks)  # chunks alone
    return await _send_stored(request, node, store, located, header, range(len(chunks)),
                              {ss.GENERATION_HEADER: generation})



def _check_generation(name: str, generation: str | None, located: Located) -> None:
    if generation is not None and generation != located.manifest.generation:
        raise ConflictError(f"snapshot '{name}' was overwritten while it downloaded (its "
                            f"generation {generation} is gone, {located.manifest.generation}"
                            " is live): load it again")


async def _send_stored(request: web.Request, node: Node, store: SnapshotStore,
                       located: Located, header: ss.StreamHeader, indexes: Sequence[int],
                       extra: dict[str, str]) -> web.StreamResponse:
    """The chunk files of ``header`` at ``indexes``, as stored, with their hashes."""
    records = {c.key: c for c in located.manifest.chunks}
    lane = store.scheduler.lane(JobKind.CHECKPOINT_READ)
    hashes = [ss.hash_bytes(records[c.key].hash) for c in header.chunks]
    paths = [located.stores[records[c.key].device].local_path(f"{located.prefix}/{c.key}")
             for c in header.chunks]
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


def _open_ahead(path: str, nbytes: int) -> int:
    """Open a chunk file (never through a link) and read it into the page cache (on the
    read lane, ahead of its turn, several chunks at once: large reads in parallel, as
    a local restore does; ``sendfile`` then sends from memory): -1 when it is missing.

    A populated mapping fills the cache without copying; reads into a scratch buffer
    (a copy of every byte) only where the mapping cannot be made."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return -1
    if _warm_mapped(fd, nbytes):
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
    response = web.StreamResponse(headers={"Content-Type": ss.CONTENT_TYPE, **(extra or {})})
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


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return torch.empty(shape, dtype=dtype_from_name(dtype), device="meta").nbytes
