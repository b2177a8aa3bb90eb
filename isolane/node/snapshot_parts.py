"""A multi-rank save on a node: each rank streams its own part, one rank commits.

The save transaction's steps (``isolane.snapshot.transaction``) as separate requests,
so that the ranks of a torch.distributed.checkpoint save (``isolane.client.dcp_parts``)
write through the node in parallel and the coordinator commits once:

- ``POST /v1/snapshots/<name>/parts`` (coordinator): the transaction begins (name
  checked, parent chosen, generation named, the node's ``_writing.json`` marker
  written); answers ``{generation, parent}``;
- ``POST .../parts/<generation>/<rank>/plan`` and ``PUT .../parts/<generation>/<rank>``
  (every rank): a streamed upload (``isolane.wire.snapshot_stream``, as a whole
  snapshot's, ``isolane.node.snapshot_upload``) of the rank's items into the folder
  ``rank-<r>/``, chunks the parent holds linked; answers the part's manifest. Planned
  the same way twice (the plan is a pure function of the tensors and the parent);
- ``POST .../parts/<generation>/commit`` (coordinator, once every rank answered): the
  node reads the parts' manifests from its own disk (never the client's word for what
  it stored), merges them and writes the manifest, last, with the body's ``dcp``
  metadata (checked by decoding it). A part that fails removes its folder.

A save that never commits (a rank failed or died: DCP never calls ``finish``) is
abandoned once its lease runs out (``isolane.node.part_leases``: ``node.part_save_lease_s``
after its last request, none in flight); ``abandon_expired`` (the node's sweeper, and
its gc route) then removes its generation, only while it still has no manifest and
carries the node's writing marker. One begun by an earlier node process is swept by
``isolane gc`` (its marker names a dead process).

The parent travels as ``parent`` and ``parent_generation`` (query) or ``parent``
(``[name, generation]``, commit body), as the coordinator's begin answered it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from isolane.errors import (
    ConflictError,
    IntegrityError,
    InvalidArgumentError,
    WireFormatError,
)
from isolane.node.bodies import BodyReader, read_all, read_json
from isolane.node.resources import NODE, Node
from isolane.node.snapshot_upload import (
    check_header,
    meta_leaves,
    receive_and_commit,
    stream_limits,
)
from isolane.snapshot.dcp_metadata import decode_metadata
from isolane.snapshot.distributed import commit_parts
from isolane.snapshot.feed import ChunkFeed, FedSave
from isolane.snapshot.manifest import MANIFEST, PART_MANIFEST, WRITING_MARKER
from isolane.snapshot.names import GENERATION, check_metadata, prefix_of
from isolane.snapshot.sharding import part_prefix
from isolane.snapshot.store import SnapshotStore
from isolane.snapshot.transaction import SaveTransaction, linkable
from isolane.wire import snapshot_stream as ss
from isolane.wire.names import check_snapshot_name

log = logging.getLogger(__name__)
MAX_RANKS = 1 << 16


def add_part_routes(app: web.Application) -> None:
    app.router.add_post("/v1/snapshots/{name}/parts", begin)
    app.router.add_post("/v1/snapshots/{name}/parts/{generation}/commit", commit)
    app.router.add_post("/v1/snapshots/{name}/parts/{generation}/{rank}/plan", plan_part)
    app.router.add_put("/v1/snapshots/{name}/parts/{generation}/{rank}", upload_part)


def _flag(request: web.Request, key: str) -> bool:
    return request.query.get(key) in ("1", "true")


def _generation(text: str) -> str:
    if GENERATION.fullmatch(text) is None:
        raise InvalidArgumentError(f"{text!r:.60} is not a generation; use the one the "
                                   "save's begin request answered")
    return text


def _rank(text: str) -> int:
    if not text.isdigit() or int(text) >= MAX_RANKS:
        raise InvalidArgumentError(f"rank {text!r:.20} is not a number below {MAX_RANKS}")
    return int(text)


def _parent_ref(name: Any, generation: Any) -> list[str] | None:
    if name is None and generation is None:
        return None
    if not isinstance(name, str) or not isinstance(generation, str):
        raise InvalidArgumentError("a parent is a snapshot name and its generation")
    return [check_snapshot_name(name), _generation(generation)]


async def begin(request: web.Request) -> web.Response:
    node = request.app[NODE]
    store = node.require_store()
    name = check_snapshot_name(request.match_info["name"])
    parent: str | bool | None = None
    if _flag(request, "no_parent"):
        parent = False
    elif "parent" in request.query:
        parent = check_snapshot_name(request.query["parent"])
    tx = await node.run(_begin, store, name, overwrite=_flag(request, "overwrite"),
                        parent=parent)
    node.part_leases.grant(name, tx.generation)
    return web.json_response({"generation": tx.generation, "parent": tx.parent_ref},
                             status=201)


def _begin(store: SnapshotStore, name: str, *, overwrite: bool,
           parent: str | bool | None) -> SaveTransaction:
    store.saves.claim()
    try:
        return store.saves.begin(name, overwrite=overwrite, parent=parent, mark=True)
    finally:
        store.saves.release()


def _join(request: web.Request, store: SnapshotStore) -> tuple[str, SaveTransaction, int]:
    name = check_snapshot_name(request.match_info["name"])
    parent = _parent_ref(request.query.get("parent"), request.query.get("parent_generation"))
    tx = _begun(store, name, _generation(request.match_info["generation"]), parent,
                overwrite=_flag(request, "overwrite"))
    return name, tx, _rank(request.match_info["rank"])


def _begun(store: SnapshotStore, name: str, generation: str, parent: list[str] | None, *,
           overwrite: bool) -> SaveTransaction:
    """The transaction of a save begun here and not yet committed: parts and a commit go
    only into a generation that still carries the node's writing marker, never into a
    committed one (whose chunks they would replace)."""
    tx = store.saves.join(name, generation, parent, overwrite=overwrite)
    if not store.saves.stores[0].exists(f"{tx.prefix}/{WRITING_MARKER}"):
        raise ConflictError(f"generation {generation} of '{name}' is not a save in progress "
                            "on this node (committed, discarded or never begun): begin one "
                            f"with POST /v1/snapshots/{name}/parts")
    return tx


async def _header(request: web.Request, node: Node, name: str, encoded: bytes, *,
                  need_chunks: bool) -> ss.StreamHeader:
    header = ss.decode_header(encoded, need_chunks=need_chunks, limits=stream_limits(node))
    check_header(node, header, name)
    return header


def _lease_key(request: web.Request) -> tuple[str, str]:
    return (check_snapshot_name(request.match_info["name"]),
            _generation(request.match_info["generation"]))


async def plan_part(request: web.Request) -> web.Response:
    """The chunks of rank ``<rank>``'s part and the parent's chunk hashes it can link."""
    node = request.app[NODE]
    with node.part_leases.hold(*_lease_key(request)):
        return await _plan_part(request, node)


async def _plan_part(request: web.Request, node: Node) -> web.Response:
    store = node.require_store()
    name, tx, rank = await node.run(_join, request, store)
    caps = node.config.node
    header = await _header(request, node, name, await read_all(
        request, caps.max_header_bytes, "the header", "node.max_header_bytes"),
        need_chunks=False)
    leaves = meta_leaves(header)
    planned = await node.run(tx.request, header.tree, leaves, {leaf.id: None for leaf in leaves},
                             {}, stage_all=False, part=part_prefix(rank))
    full = header.with_chunks(ss.plan_chunks(planned.plan))
    return web.json_response({"chunks": [c.to_dict() for c in full.chunks],
                              "known": sorted(linkable(planned)), "parent": planned.parent})


async def upload_part(request: web.Request) -> web.Response:
    """Rank ``<rank>``'s part, streamed; answers its partial manifest once written."""
    node = request.app[NODE]
    with node.part_leases.hold(*_lease_key(request)):
        return await _upload_part(request, node)


async def _upload_part(request: web.Request, node: Node) -> web.Response:
    store = node.require_store()
    name, tx, rank = await node.run(_join, request, store)
    body = BodyReader(request, stall_timeout_s=node.limits.upload_stall_s)
    length = ss.decode_preamble(await body.read_exactly(ss.PREAMBLE.size, "the preamble"),
                                node.config.node.max_header_bytes)
    header = await _header(request, node, name,
                           await body.read_exactly(length, "the stream header"),
                           need_chunks=True)
    leaves = meta_leaves(header)
    feed = ChunkFeed(store.staging)
    request_ = await node.run(tx.request, header.tree, leaves,
                              {leaf.id: None for leaf in leaves}, {}, stage_all=False,
                              part=part_prefix(rank), feed=feed)
    job = await node.run(tx.write, request_)
    fed = FedSave(name, request_.plan, linkable(request_), feed, store.staging, job.future)
    part = await receive_and_commit(body, node, fed, header)
    return web.Response(body=part.to_json(), content_type="application/json", status=201)


async def commit(request: web.Request) -> web.Response:
    """The manifest of the save, from the parts on this node's disk; ``SnapshotInfo``."""
    node = request.app[NODE]
    store = node.require_store()
    name = check_snapshot_name(request.match_info["name"])
    generation = _generation(request.match_info["generation"])
    caps = node.config.node
    body = await read_json(request, caps.max_header_bytes, caps.max_json_depth)
    if not isinstance(body, dict):
        raise WireFormatError("a commit body is a JSON object")
    world, seconds, dcp = body.get("world"), body.get("seconds", 0.0), body.get("dcp")
    if not isinstance(world, int) or not 0 < world <= MAX_RANKS:
        raise WireFormatError(f"a commit names its world size (1 to {MAX_RANKS})")
    if not isinstance(seconds, int | float) or not isinstance(dcp, dict):
        raise WireFormatError("a commit carries 'seconds' (a number) and 'dcp' (an object)")
    parent = body.get("parent")
    ref = _parent_ref(*parent) if isinstance(parent, list) and len(parent) == 2 else None
    if parent is not None and ref is None:
        raise WireFormatError("a commit's 'parent' is [name, generation] or null")
    mirror = body.get("mirror")
    if mirror is not None and not isinstance(mirror, bool):
        raise WireFormatError("a commit's 'mirror' is true, false or null")
    metadata = check_metadata(body.get("metadata"))
    with node.part_leases.hold(name, generation):
        try:
            info = await node.run(_commit, store, name, generation, ref, world, dcp,
                                  metadata, overwrite=body.get("overwrite") is True,
                                  mirror=mirror, started=time.perf_counter() - float(seconds))
        except WireFormatError:
            raise  # refused before anything changed: the save may still commit
        except BaseException:
            node.part_leases.end(name, generation)  # discarded
            raise
    node.part_leases.end(name, generation)
    return web.json_response(info.to_dict(), status=201)


def _commit(store: SnapshotStore, name: str, generation: str, parent: list[str] | None,
            world: int, dcp: dict[str, Any], metadata: dict[str, Any], *, overwrite: bool,
            mirror: bool | None, started: float) -> Any:
    saves = store.saves
    saves.claim()
    try:
        tx = _begun(store, name, generation, parent, overwrite=overwrite)
        try:  # refused here, not when the checkpoint is loaded
            decode_metadata(dcp, f"the commit of '{name}'")
        except IntegrityError as exc:
            raise WireFormatError(f"the commit's 'dcp' is not DCP metadata: {exc}") from None
        parts = []
        for rank in range(world):
            key = f"{tx.prefix}/{part_prefix(rank)}/{PART_MANIFEST}"
            try:
                parts.append(saves.stores[0].read(key).decode())
            except FileNotFoundError:
                tx.discard()
                raise InvalidArgumentError(
                    f"'{name}': rank {rank} of {world} has no part in generation "
                    f"{generation}; nothing was committed") from None
        return commit_parts(tx, parts, [{} for _ in range(world)], metadata, mirror=mirror,
                            started=started, encode_dcp=lambda: dcp)
    finally:
        saves.release()


def abandon_expired(node: Node) -> list[str]:
    """Discard the saves whose lease ran out (``part_leases``), each only while it has
    no manifest and still carries the writing marker; ``local:<name>/<generation>`` of
    each discarded, as gc reports a sweep."""
    store = node.store
    expired = node.part_leases.expired()
    if store is None or not expired:
        return []
    saves = store.saves
    swept = []
    for name, generation in expired:
        prefix = prefix_of(name, generation)
        saves.claim()  # not while a commit of the name is being written
        try:
            primary = saves.stores[0]
            if primary.exists(f"{prefix}/{MANIFEST}") or not primary.exists(
                    f"{prefix}/{WRITING_MARKER}"):
                continue
            saves.catalog.discard(name, generation)
        except OSError as exc:  # left to gc, which sweeps it once the node restarts
            log.warning("cannot remove abandoned generation %s of '%s': %s", generation,
                        name, exc)
            continue
        finally:
            saves.release()
        log.info("removed generation %s of '%s': its save was abandoned (no request for "
                 "node.part_save_lease_s = %ss)", generation, name, node.part_leases.lease_s)
        swept.append(f"local:{name}/{generation}")
    return swept


async def sweep_abandoned(app: web.Application) -> AsyncIterator[None]:
    """``cleanup_ctx``: the node's sweeper of abandoned saves (``abandon_expired``,
    every ``PartLeases.sweep_period_s``), stopped before the node closes."""
    node = app[NODE]

    async def sweep() -> None:
        while True:
            await asyncio.sleep(node.part_leases.sweep_period_s)
            await node.run(abandon_expired, node)

    task = asyncio.create_task(sweep())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
