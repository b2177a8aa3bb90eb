"""The storage node as an aiohttp application, and ``run_node`` behind ``isolane serve``.

Middlewares, outermost first: accounting (in-flight requests, Prometheus counters),
authentication (a node with a token answers 401 before any handler runs: nothing is
read or written), error translation (``statuses.STATUS_OF``: one JSON error body for
every isolane error), and the test-only delay of a deliberately slow node. The ``Node``
is opened and closed by ``cleanup_ctx``.

Shutdown (SIGTERM or SIGINT): stop listening, let requests in flight finish, bodies
still arriving included (up to ``shutdown_timeout_s``), then close the connections and
the node: KV pools flush their indexes, the snapshot store waits for saves in flight,
the lanes stop.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from isolane.cluster.etcd_membership import NodeRegistration
from isolane.errors import IsolaneError
from isolane.node.kv_routes import add_kv_routes
from isolane.node.metrics import CONTENT_TYPE, NodeMetrics
from isolane.node.resources import NODE, STREAMING, Node
from isolane.node.snapshot_parts import sweep_abandoned
from isolane.node.snapshot_routes import add_snapshot_routes
from isolane.wire.auth import authorized
from isolane.wire.statuses import error_body, status_for

log = logging.getLogger(__name__)
METRICS = web.AppKey("isolane_metrics", NodeMetrics)
REGISTRATION = web.AppKey("isolane_registration", NodeRegistration)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def build_app(node_factory: Callable[[], Node],
              registration: NodeRegistration | None = None) -> web.Application:
    """An app serving the node that ``node_factory`` opens (called at startup, so the
    node's threads start in the serving process and its resources close at cleanup).
    ``registration``: the node's membership in etcd, registered once the node is open
    and withdrawn first at shutdown."""
    app = web.Application(middlewares=[_accounting, _authentication, _errors, _debug_delay],
                          client_max_size=1 << 20)  # bodies are read by the handlers

    async def node_context(app: web.Application) -> AsyncIterator[None]:
        node = node_factory()
        app[NODE] = node
        app[METRICS] = NodeMetrics(node)
        try:
            yield
        finally:
            node.close()

    async def registration_context(app: web.Application) -> AsyncIterator[None]:
        if registration is None:
            yield
            return
        await asyncio.get_running_loop().run_in_executor(None, registration.start)
        app[REGISTRATION] = registration
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, registration.close)

    app.cleanup_ctx.append(node_context)
    app.cleanup_ctx.append(sweep_abandoned)  # needs the node: after it, stopped before
    app.cleanup_ctx.append(registration_context)  # cleaned up first: withdraw, then close
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/v1/stats", stats)
    app.router.add_get("/metrics", metrics)
    add_kv_routes(app)
    add_snapshot_routes(app)
    return app


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def stats(request: web.Request) -> web.Response:
    node = request.app[NODE]
    report = await node.run(node.stats)
    registration = request.app.get(REGISTRATION)
    report["cluster"] = ({"source": "static"} if registration is None
                         else registration.describe())
    return web.json_response(report)


async def metrics(request: web.Request) -> web.Response:
    node = request.app[NODE]
    body = await node.run(request.app[METRICS].render)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


def _route(request: web.Request) -> str:
    info = request.match_info.route.resource
    return info.canonical if info is not None else "other"


@web.middleware
async def _accounting(request: web.Request, handler: Handler) -> web.StreamResponse:
    node = request.app[NODE]
    started = time.perf_counter()
    node.load.request_started()
    status = 500
    try:
        response = await handler(request)
        status = response.status
        if node.draining and not response.prepared:
            response.force_close()  # shutting down: no more requests on this connection
        return response
    except web.HTTPException as exc:
        status = exc.status
        raise
    finally:
        node.load.request_finished()
        request.app[METRICS].observe(request.method, _route(request), status,
                                     time.perf_counter() - started)


@web.middleware
async def _authentication(request: web.Request, handler: Handler) -> web.StreamResponse:
    node = request.app[NODE]
    if not authorized(node.token, request.headers.get("Authorization")):
        response = web.json_response(
            {"error": "AuthenticationError", "fields": {},
             "message": "missing or wrong bearer token: send 'Authorization: Bearer <token>' "
                        "with the node's token (ISOLANE_TOKEN or node.token)"},
            status=401, headers={"WWW-Authenticate": 'Bearer realm="isolane"'})
        response.force_close()  # do not drain a body we will never read
        return response
    return await handler(request)


CLIENT_GONE = 499
"""The status recorded (metrics) for a request whose client hung up (nginx's code)."""


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    peer = _peer(request)  # before the handler: a closed transport no longer knows it
    try:
        return await handler(request)
    except ConnectionResetError as exc:
        # The client went away (mid-body or mid-response): an everyday event, one line;
        # nothing was stored from a body that did not arrive whole.
        where = "mid-response" if request.get(STREAMING) else "before its request ended"
        log.info("client %s disconnected %s: %s %s (%s)", peer, where, request.method,
                 request.path, exc)
        response = web.Response(status=CLIENT_GONE)
        response.force_close()  # nobody reads it: aiohttp drops it quietly
        return response
    except (IsolaneError, OSError) as exc:
        if request.get(STREAMING):
            # Headers are out: end the connection; the client sees a truncated body
            # (its missing frames read as misses, a truncated download as an error).
            log.warning("%s %s failed mid-response: %s", request.method, request.path, exc)
            raise
        return _error_response(request, exc)


@web.middleware
async def _debug_delay(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A slow node for fault tests: KV requests wait, as behind a slow disk (probes and
    load reports do not, so the node stays up and reports its requests in flight)."""
    delay = request.app[NODE].debug_delay_s
    if delay > 0 and request.path.startswith("/v1/kv/"):
        await asyncio.sleep(delay)
    return await handler(request)


def _peer(request: web.Request) -> str:
    transport = request.transport
    peername = transport.get_extra_info("peername") if transport is not None else None
    if isinstance(peername, tuple) and len(peername) >= 2:
        return f"{peername[0]}:{peername[1]}"
    return str(request.remote)


def _error_response(request: web.Request, exc: BaseException) -> web.Response:
    status = status_for(exc)
    if status >= 500:
        log.warning("%s %s failed: %s", request.method, request.path, exc)
    response = web.json_response(error_body(exc), status=status)
    if request.body_exists and not request.content.at_eof():
        response.force_close()  # the rest of the body is not read: end the connection
    return response


def run_node(node_factory: Callable[[], Node], host: str, port: int, *,
             shutdown_timeout_s: float = 30.0, access_log: bool = False,
             on_ready: Callable[[str], object] | None = None,
             registration: NodeRegistration | None = None) -> None:
    """Serve until SIGTERM/SIGINT, then shut down gracefully (module docstring)."""
    app = build_app(node_factory, registration)
    asyncio.run(_serve(app, host, port, shutdown_timeout_s=shutdown_timeout_s,
                       access_log=access_log, on_ready=on_ready))


async def _serve(app: web.Application, host: str, port: int, *, shutdown_timeout_s: float,
                 access_log: bool, on_ready: Callable[[str], object] | None) -> None:
    # Not web.run_app's own signal handling: on SIGTERM it stops reading from every
    # connection at once, so an upload whose body is still arriving could never finish.
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=shutdown_timeout_s,
                           access_log=logging.getLogger("aiohttp.access") if access_log
                           else None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        if on_ready is not None:
            on_ready(f"http://{host}:{port}")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        node = app[NODE]
        node.draining = True  # answers from now on close their connections
        await site.stop()  # no new connections
        deadline = loop.time() + shutdown_timeout_s
        while node.load.snapshot(time.time()).requests and loop.time() < deadline:
            await asyncio.sleep(0.02)  # requests in flight finish, bodies still arrive
    finally:
        await runner.cleanup()  # idle connections closed, then the node (cleanup_ctx)
