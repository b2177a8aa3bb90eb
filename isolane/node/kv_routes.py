"""KV endpoints of a node: namespaces, single blocks, framed batches (aiohttp handlers).

Order of checks in every handler: namespace and key syntax, then size limits, then the
namespace's existence, then the body; nothing is stored before the whole body has been
read and every frame checked. Bodies: ``isolane.wire.frames``; endpoints:
``docs/API.md``.

Puts carry their chain's routing digest (``?chain=``, default: the digest of the keys
sent, right when they start the chain): it picks the device and is recorded in the
namespace's chain index (``chains.py``), which ``GET .../chains`` lists for moves. A
put with ``?move=1`` (a cluster moving or copying chains) first waits for the
background lane's tokens, so moves go at the rate the governor gives background work.
"""

from __future__ import annotations

import time
import urllib.parse

from aiohttp import web

from isolane.cluster.ring import prefix_digest
from isolane.errors import (
    InvalidArgumentError,
    KeyNotFoundError,
    PayloadTooLargeError,
    WireFormatError,
)
from isolane.kvpool.api import Block
from isolane.kvpool.keys import KEY_BYTES
from isolane.kvpool.pool import KVPool
from isolane.lanes.assignment import JobKind
from isolane.node.bodies import check_length, expect_end, read_all, read_exactly, read_json
from isolane.node.resources import NODE, STREAMING, Node
from isolane.wire import frames
from isolane.wire.chain_list import encode_chain_list
from isolane.wire.layout import NamespaceLayout
from isolane.wire.names import check_key, check_namespace

BATCH_TYPE = "application/x-isolane-kv-batch"
CHAIN_LIST_TYPE = "application/x-isolane-chain-list"
GET_GROUP_BYTES = 32 << 20  # a batch get reads and sends this much at a time
JOIN_BELOW = 256 << 10  # smaller values are sent joined with the frames around them
WRITE_BYTES = 256 << 10  # joined frames are written about this much at a time


def add_kv_routes(app: web.Application) -> None:
    app.router.add_get("/v1/kv", list_namespaces)
    app.router.add_put("/v1/kv/{ns}", put_namespace)
    app.router.add_get("/v1/kv/{ns}", get_namespace)
    app.router.add_get("/v1/kv/{ns}/stats", namespace_stats)
    app.router.add_get("/v1/kv/{ns}/blocks/{key}", get_block)
    app.router.add_put("/v1/kv/{ns}/blocks/{key}", put_block)
    app.router.add_delete("/v1/kv/{ns}/blocks/{key}", delete_block)
    app.router.add_post("/v1/kv/{ns}/get", batch_get)
    app.router.add_post("/v1/kv/{ns}/put", batch_put)
    app.router.add_post("/v1/kv/{ns}/lookup", lookup)
    app.router.add_post("/v1/kv/{ns}/delete", batch_delete)
    app.router.add_get("/v1/kv/{ns}/chains", list_chains)


def _namespace(request: web.Request) -> str:
    return check_namespace(request.match_info["ns"])


def _chain(request: web.Request) -> bytes | None:
    """The routing digest of ``?chain=`` (32 hex characters, as a key), or None."""
    text = request.query.get("chain")
    return None if text is None else check_key(text)


def _flag(request: web.Request, name: str) -> bool:
    return request.query.get(name) in ("1", "true")


def _store(node: Node, namespace: str, pool: KVPool, keys: list[bytes],
           values: list[bytes], chain: bytes | None, *, move: bool) -> int:
    """Store a put's blocks and record their chain (in a node thread)."""
    if not keys:
        return 0
    digest = chain or prefix_digest(keys)
    if move:  # moves are background work: the governor paces them
        size = sum(len(v) for v in values)
        node.scheduler.lane(JobKind.MIGRATE).submit_sized(size, _paid).result()
    stored = pool.put_blocks(keys, values, chain=digest)
    node.kv.chains(namespace, pool).add(digest, keys)
    return stored


def _paid() -> None:
    """A job that only waits for its bytes' tokens (charged when it ends)."""


async def _pool(node: Node, namespace: str) -> tuple[KVPool, NamespaceLayout]:
    pool = node.kv.peek(namespace)
    if pool is None:
        pool = await node.run(node.kv.get, namespace)
    layout = node.kv.layout_of(pool)
    if layout is None:  # created by hand with no put yet: same as not registered
        raise KeyNotFoundError(f"KV namespace '{namespace}' has no layout yet; register it "
                               f"with PUT /v1/kv/{urllib.parse.quote(namespace, safe='')}")
    return pool, layout


async def list_namespaces(request: web.Request) -> web.Response:
    node = request.app[NODE]
    return web.json_response({"namespaces": await node.run(node.kv.stored_names)})


async def put_namespace(request: web.Request) -> web.Response:
    node = request.app[NODE]
    namespace = _namespace(request)
    layout = NamespaceLayout.from_dict(await read_json(request, node.limits.max_json_bytes,
                                                         node.config.node.max_json_depth))
    if layout.block_bytes > node.limits.max_block_bytes:
        raise InvalidArgumentError(
            f"a block of this layout is {layout.block_bytes} bytes, over this node's limit "
            f"of {node.limits.max_block_bytes} bytes; use fewer chunk_tokens or raise "
            "node.max_block_bytes in the node's config")
    _, created = await node.run(node.kv.register, namespace, layout)
    return web.json_response({"namespace": namespace, "layout": layout.to_dict()},
                             status=201 if created else 200)


async def get_namespace(request: web.Request) -> web.Response:
    node = request.app[NODE]
    namespace = _namespace(request)
    _p, layout = await _pool(node, namespace)
    return web.json_response({"namespace": namespace, "layout": layout.to_dict()})


async def namespace_stats(request: web.Request) -> web.Response:
    node = request.app[NODE]
    pool, _layout = await _pool(node, _namespace(request))
    return web.json_response(await node.run(pool.stats))


async def get_block(request: web.Request) -> web.Response:
    node = request.app[NODE]
    namespace = _namespace(request)
    key = check_key(request.match_info["key"])
    pool, _layout = await _pool(node, namespace)
    (value,) = await node.run(pool.get_blocks, [key])
    if value is None:
        raise KeyNotFoundError(f"block {key.hex()} is not stored in namespace '{namespace}'")
    node.load.sent(len(value), time.time())
    return web.Response(body=bytes(value), content_type="application/octet-stream",
                        headers={"X-Isolane-Checksum": f"{frames.checksum(value):016x}"})


async def put_block(request: web.Request) -> web.Response:
    node = request.app[NODE]
    namespace = _namespace(request)
    key = check_key(request.match_info["key"])
    check_length(request, node.limits.max_block_bytes, "a block", "node.max_block_bytes")
    pool, layout = await _pool(node, namespace)
    value = await read_all(request, node.limits.max_block_bytes, "a block",
                           "node.max_block_bytes")
    node.load.received(len(value), time.time())
    _check_size(layout, len(value), key)
    claimed = request.headers.get("X-Isolane-Checksum")
    if claimed is not None and claimed != f"{frames.checksum(value):016x}":
        raise WireFormatError(f"X-Isolane-Checksum does not match the body of block "
                              f"{key.hex()}: damaged in transit, nothing stored")
    stored = await node.run(_store, node, namespace, pool, [key], [value], _chain(request),
                            move=_flag(request, "move"))
    return web.json_response({"stored": stored})


async def delete_block(request: web.Request) -> web.Response:
    node = request.app[NODE]
    namespace = _namespace(request)
    key = check_key(request.match_info["key"])
    pool, _layout = await _pool(node, namespace)
    return web.json_response({"deleted": await node.run(pool.delete_blocks, [key])})


async def _key_list_request(request: web.Request
                            ) -> tuple[Node, KVPool, NamespaceLayout, list[bytes]]:
    """The node, the namespace's pool and layout, and the request's key list (its
    length checked before anything is opened or read)."""
    node = request.app[NODE]
    namespace = _namespace(request)
    limit = node.limits.max_batch_blocks * KEY_BYTES
    check_length(request, limit, "the key list", "node.max_batch_blocks")
    pool, layout = await _pool(node, namespace)
    keys = frames.decode_keys(await read_all(request, limit, "the key list",
                                             "node.max_batch_blocks"))
    return node, pool, layout, keys


async def lookup(request: web.Request) -> web.Response:
    node, pool, _layout, keys = await _key_list_request(request)
    return web.json_response({"blocks": await node.run(pool.lookup_blocks, keys)})


async def batch_delete(request: web.Request) -> web.Response:
    node, pool, _layout, keys = await _key_list_request(request)
    return web.json_response({"deleted": await node.run(pool.delete_blocks, keys)})


async def batch_get(request: web.Request) -> web.StreamResponse:
    """Frames for every key, in order (``?prefix=1``: only the leading stored ones)."""
    node, pool, layout, keys = await _key_list_request(request)
    memory = pool.memory
    if _flag(request, "prefix") and not all(k in memory for k in keys):
        keys = keys[:await node.run(pool.lookup_blocks, keys)]
    response = web.StreamResponse(headers={"Content-Type": BATCH_TYPE})
    await response.prepare(request)
    request[STREAMING] = True
    # Small frames go out joined, up to WRITE_BYTES a write (one chunk, one send, one
    # copy); a large value goes out as it is, between the joined bytes around it.
    pending: list[frames.Buffer] = [frames.encode_batch_header(len(keys))]
    pending_bytes = 0
    group = max(1, GET_GROUP_BYTES // max(layout.block_bytes, 1))
    for start in range(0, len(keys), group):
        chunk = keys[start:start + group]
        # Blocks all in the memory tier are taken on the loop: no thread hop, no I/O.
        values: list[Block | None]
        if all(k in memory for k in chunk):
            values = [memory.get(k) for k in chunk]
            if any(v is None for v in values):  # evicted meanwhile: the pool reads them
                values = await node.run(pool.get_blocks, chunk)
        else:
            values = await node.run(pool.get_blocks, chunk)
        held = sum(len(v) for v in values if v is not None)
        node.load.hold(held)
        try:
            for key, value in zip(chunk, values, strict=True):
                head, body, tail = frames.encode_frame(key, value)
                if len(body) < JOIN_BELOW:
                    pending += (head, body, tail)
                    pending_bytes += len(body)
                    if pending_bytes >= WRITE_BYTES:
                        await response.write(b"".join(pending))
                        pending, pending_bytes = [], 0
                else:
                    pending.append(head)
                    await response.write(b"".join(pending))
                    await response.write(body)
                    pending, pending_bytes = [tail], 0
            if pending_bytes:  # what this group read goes out before the next is read
                await response.write(b"".join(pending))
                pending, pending_bytes = [], 0
        finally:
            node.load.release(held)
        node.load.sent(held, time.time())
    if pending:
        await response.write(b"".join(pending))
    await response.write_eof()
    return response


async def batch_put(request: web.Request) -> web.Response:
    """Store a batch of blocks; all or nothing as far as the body goes (a body cut
    short or a damaged frame stores no block of it)."""
    node = request.app[NODE]
    limits = node.limits
    namespace = _namespace(request)
    check_length(request, limits.max_request_bytes, "the batch", "node.max_request_bytes")
    chain = _chain(request)
    pool, layout = await _pool(node, namespace)
    count = frames.decode_batch_header(
        await read_exactly(request, frames.BATCH_HEADER.size, "the batch header"),
        limits.max_batch_blocks, "node.max_batch_blocks")
    keys: list[bytes] = []
    values: list[bytes] = []
    total = frames.BATCH_HEADER.size
    try:
        for i in range(count):
            header = frames.decode_frame_header(
                await read_exactly(request, frames.FRAME_HEADER.size, f"frame {i}'s header"),
                limits.max_block_bytes, "node.max_block_bytes")
            if header.status != frames.STATUS_VALUE:
                raise WireFormatError(f"frame {i} of a put is a miss; a put carries values")
            total += frames.FRAME_HEADER.size + header.length + frames.CHECKSUM.size
            if total > limits.max_request_bytes:
                raise PayloadTooLargeError("the batch", total, limits.max_request_bytes,
                                           field="node.max_request_bytes")
            _check_size(layout, header.length, header.key)
            value = await read_exactly(request, header.length, f"frame {i}'s value")
            node.load.hold(len(value))
            values.append(value)
            frames.check_value(header, value, await read_exactly(
                request, frames.CHECKSUM.size, f"frame {i}'s checksum"))
            keys.append(header.key)
        await expect_end(request, f"{count} frames")
        node.load.received(total, time.time())
        stored = await node.run(_store, node, namespace, pool, keys, values, chain,
                                move=_flag(request, "move"))
    finally:
        node.load.release(sum(len(v) for v in values))
    return web.json_response({"stored": stored})


async def list_chains(request: web.Request) -> web.Response:
    """The chains this node holds in the namespace, with their keys still stored."""
    node = request.app[NODE]
    namespace = _namespace(request)
    pool, _layout = await _pool(node, namespace)

    def listing() -> bytes:
        index = node.kv.chains(namespace, pool)
        return encode_chain_list(index.chains(lambda key: pool.lookup_blocks([key]) == 1))

    return web.Response(body=await node.run(listing), content_type=CHAIN_LIST_TYPE)


def _check_size(layout: NamespaceLayout, size: int, key: bytes) -> None:
    if size != layout.block_bytes:
        raise InvalidArgumentError(
            f"block {key.hex()} is {size} bytes; a block of this namespace is "
            f"{layout.block_bytes} bytes ({layout.chunk_tokens} tokens of {layout.dtype} "
            f"{list(layout.shape)})")


