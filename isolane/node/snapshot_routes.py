"""Snapshot endpoints of a node (aiohttp handlers): the routes, and list, info,
manifest, verify, delete, gc and mirror. The streamed upload (save) and its plan are
``isolane.node.snapshot_upload``'s, the streamed download (restore)
``isolane.node.snapshot_download``'s. Formats: ``isolane.wire.snapshot_stream``.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from isolane.errors import InvalidArgumentError
from isolane.node.resources import NODE, Node
from isolane.node.snapshot_download import download, download_chunks
from isolane.node.snapshot_parts import abandon_expired, add_part_routes
from isolane.node.snapshot_upload import plan, upload
from isolane.snapshot.store import SnapshotStore
from isolane.wire import snapshot_stream as ss
from isolane.wire.names import check_snapshot_name


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
    app.router.add_post("/v1/snapshots/{name}/chunks", download_chunks)
    add_part_routes(app)


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
                        headers={ss.PATH_HEADER: path})


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
    """Retention (``?keep_last=N``, else the node's config) and sweeping of leftovers,
    abandoned multi-rank saves (``snapshot_parts.abandon_expired``) first."""
    node = request.app[NODE]
    keep = _int_query(request, "keep_last")
    store = node.require_store()
    abandoned = await node.run(abandon_expired, node)
    report = await node.run(store.gc, keep_last=keep)
    return web.json_response({"deleted_snapshots": list(report.deleted_snapshots),
                              "swept_generations": abandoned + list(report.swept_generations)})


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


