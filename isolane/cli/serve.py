"""``isolane serve``: run this host's storage node (``isolane.service``) over HTTP.

A thin wrapper over ``isolane.node.app.run_node``. Which config (flag > environment
> default): ``serve --config FILE``, the group's ``--config`` / ``ISOLANE_CONFIG``, a
``--store`` folder (snapshots only, no KV pool), or the embedded default. Host and port:
``--host``/``--port`` > ``ISOLANE_NODE_HOST``/``ISOLANE_NODE_PORT`` > ``node.host``/
``node.port`` (127.0.0.1:7070). Request caps: ``--max-*`` flags > the config's
``node.max_*`` fields (docs/API.md, "Limits and caps"). Token: ``ISOLANE_TOKEN`` >
``node.token``; a node without a token binds only to a loopback address.

Imports nothing heavy at module level, so ``isolane serve --help`` stays fast.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import click

from isolane.cli.common import CliError

if TYPE_CHECKING:
    from isolane.cluster.etcd_membership import NodeRegistration
    from isolane.config import Config

    IntParam = click.ParamType[int]
else:  # click < 8.2 has no generic ParamType at run time
    IntParam = click.ParamType


class SizeType(IntParam):
    """``256MiB``, ``4GiB`` or plain bytes."""

    name = "size"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> int:
        from isolane.units import parse_size

        try:
            return parse_size(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


SIZE = SizeType()


@click.command(short_help="Run this host's storage node (KV + snapshots over HTTP).")
@click.option("--host", envvar="ISOLANE_NODE_HOST", metavar="ADDR",
              help="Address to bind (env ISOLANE_NODE_HOST; default node.host, 127.0.0.1).")
@click.option("--port", envvar="ISOLANE_NODE_PORT", type=click.IntRange(1, 65535),
              help="Port (env ISOLANE_NODE_PORT; default node.port, 7070).")
@click.option("--max-request-bytes", type=SIZE, default=None,
              help="Largest KV batch body (default node.max_request_bytes, 256MiB).")
@click.option("--max-block-bytes", type=SIZE, default=None,
              help="Largest KV block value (default node.max_block_bytes, 64MiB).")
@click.option("--max-batch-blocks", type=click.IntRange(min=1), default=None,
              help="Most keys or frames in one KV request (default node.max_batch_blocks, "
                   "65536).")
@click.option("--max-upload-bytes", type=SIZE, default=None,
              help="Largest snapshot upload, in tensor bytes (default "
                   "node.max_upload_bytes: no cap; a full disk fails the upload with 507 "
                   "and commits nothing).")
@click.option("--upload-stall-timeout", type=click.FloatRange(min=0.1), default=120.0,
              show_default=True,
              help="Seconds a snapshot upload may send nothing before it is dropped "
                   "(uncommitted; it holds the store's save slot meanwhile).")
@click.option("--shutdown-timeout", type=click.FloatRange(min=0), default=30.0,
              show_default=True, help="Seconds requests in flight get to finish on SIGTERM.")
@click.option("--cluster", "cluster_url", metavar="etcd://HOST:PORT/PREFIX",
              envvar="ISOLANE_CLUSTER",
              help="Register this node in etcd under PREFIX (env ISOLANE_CLUSTER; default "
                   "cluster.etcd.url); clients given the same URL find it. Auth and TLS: "
                   "cluster.etcd in the config.")
@click.option("--advertise-url", metavar="URL",
              help="The URL clients reach this node at, as registered in etcd (default "
                   "http://HOST:PORT; required when binding 0.0.0.0).")
@click.option("--access-log", is_flag=True, help="Log every request (stderr).")
@click.option("--debug-delay-ms", type=click.FloatRange(min=0), default=0.0, hidden=True,
              help="Fault tests: delay every KV request this long (a slow node).")
@click.pass_context
def serve(ctx: click.Context, host: str | None, port: int | None,
          max_request_bytes: int | None, max_block_bytes: int | None,
          max_batch_blocks: int | None, max_upload_bytes: int | None,
          upload_stall_timeout: float, shutdown_timeout: float, cluster_url: str | None,
          advertise_url: str | None, access_log: bool, debug_delay_ms: float) -> None:
    """Serve this host's SnapshotStore, KV pools and lanes over HTTP until SIGTERM or
    SIGINT, then finish the requests in flight and close everything (KV indexes are
    flushed). Endpoints: docs/API.md; clients: RemoteKVPool, RemoteSnapshotStore.

    \b
    Examples:
      isolane serve --config isolane.yaml
      ISOLANE_TOKEN=secret isolane serve --config isolane.yaml --host 0.0.0.0 --port 7070
      isolane serve --port 7071 --cluster etcd://127.0.0.1:2379/isolane
    """
    from isolane.node.resources import Node, NodeLimits
    from isolane.wire.auth import is_loopback, resolve_token

    config = _config(ctx)
    host = host or config.node.host
    port = port or config.node.port
    token = resolve_token(config.node.token)
    if token is None and not is_loopback(host):
        raise CliError(f"refusing to serve on {host} without a token: anyone who reaches the "
                       "port could read and write every snapshot and KV block; set "
                       "ISOLANE_TOKEN (or node.token in the config), or bind 127.0.0.1")
    limits = NodeLimits.from_config(
        config.node, max_request_bytes=max_request_bytes, max_block_bytes=max_block_bytes,
        max_batch_blocks=max_batch_blocks, max_upload_bytes=max_upload_bytes,
        upload_stall_s=upload_stall_timeout)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: "
                        "%(message)s")

    def open_node() -> Node:
        return Node(config, token=token, limits=limits,
                    debug_delay_s=debug_delay_ms / 1000)

    def ready(url: str) -> None:
        click.echo(f"isolane node serving {url} (pid {os.getpid()}, config {config.source}, "
                   f"token {'required' if token else 'not required'})", err=True)

    from isolane.node.app import run_node

    run_node(open_node, host, port, shutdown_timeout_s=shutdown_timeout,
             access_log=access_log, on_ready=ready,
             registration=_registration(config, cluster_url, advertise_url, host, port))
    click.echo("isolane node stopped", err=True)


def _registration(config: Config, cluster_url: str | None, advertise_url: str | None,
                  host: str, port: int) -> NodeRegistration | None:
    """The node's etcd registration (``--cluster`` > ``cluster.etcd``), or None."""
    from dataclasses import replace

    from isolane.client.transport import check_node_url
    from isolane.cluster.etcd_membership import NodeRegistration, client_for
    from isolane.config import EtcdConfig, check_etcd
    from isolane.errors import IsolaneError

    etcd = config.cluster.etcd
    if cluster_url is not None:
        etcd = replace(etcd or EtcdConfig(), url=cluster_url)
    if etcd is None:
        return None
    if advertise_url is None and host in ("0.0.0.0", "::", ""):
        raise CliError(f"binding {host or 'all addresses'} says nothing of where clients "
                       "reach this node; pass --advertise-url http://THIS-HOST:PORT")
    try:
        check_etcd(etcd)
        url = check_node_url(advertise_url or f"http://{host}:{port}")
    except IsolaneError as exc:
        raise CliError(str(exc)) from None
    return NodeRegistration(client_for(etcd), url, ttl_s=etcd.lease_ttl_s)


def _config(ctx: click.Context) -> Config:
    from isolane.config import default_config, load_config, store_config

    # The root's object (the group's Session), found without its class: robust should
    # the module defining the group be loaded twice (``python -m`` beside an import).
    session = ctx.find_root().obj
    target = session.target if session is not None else None
    if target is not None and target.kind == "config":
        return load_config(target.value or "")
    if target is not None and target.kind == "store":
        return store_config(target.value or "")
    return default_config()
