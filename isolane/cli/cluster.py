"""``isolane cluster status``: the members of a cluster of storage nodes, where they come
from, their leases, moves in flight and the reachable share of the cache. A thin
wrapper over ``isolane.client.cluster_status``.

Which cluster: ``--etcd URL`` > the config's ``cluster.etcd`` > its ``cluster.nodes``.
"""

from __future__ import annotations

from typing import Any

import click

from isolane.cli.common import CliError, print_json
from isolane.cli.lanes import lanes_config
from isolane.cli.session import Session


@click.group(short_help="Inspect a cluster of storage nodes.")
def cluster() -> None:
    """Show the members of a cluster of storage nodes (``isolane serve``), static or
    registered in etcd.

    \b
    Examples:
      isolane cluster status --etcd etcd://127.0.0.1:2379/isolane
      isolane --config isolane.yaml cluster status --json
    """


@cluster.command(short_help="Members, membership source, leases, moves, reachable share.")
@click.option("--etcd", "etcd_url", metavar="etcd://HOST:PORT/PREFIX", envvar="ISOLANE_CLUSTER",
              help="The etcd the nodes register in (env ISOLANE_CLUSTER; default "
                   "cluster.etcd.url, else the static cluster.nodes).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object.")
@click.pass_obj
def status(session: Session, etcd_url: str | None, as_json: bool) -> None:
    """Print each member (URL, weight, lease time left by etcd's clock, whether it
    answers a probe), where the membership comes from (static or etcd), moves in
    flight (the etcd move lock) and the share of the cache whose owner answers.
    Exit code 1 when etcd does not answer."""
    from dataclasses import replace

    from isolane.client.cluster_status import etcd_status, probe_nodes, static_status
    from isolane.cluster.etcd_membership import client_for
    from isolane.config import EtcdConfig, check_etcd
    from isolane.errors import IsolaneError
    from isolane.wire.auth import resolve_token

    config = lanes_config(session, echo_warnings=False)
    etcd = config.cluster.etcd
    if etcd_url is not None:
        etcd = replace(etcd or EtcdConfig(), url=etcd_url)
    try:
        if etcd is not None:
            check_etcd(etcd)
            report = etcd_status(client_for(etcd))
        else:
            report = static_status(config.cluster.nodes)
        report = probe_nodes(report, token=resolve_token(config.node.token),
                             placement=config.cluster.placement)
    except IsolaneError as exc:
        raise CliError(str(exc), exit_code=1) from None
    if as_json:
        print_json(report)
    else:
        click.echo(_text(report))


def _text(report: dict[str, Any]) -> str:
    where = report.get("etcd", "cluster.nodes")
    lines = [f"membership: {report['source']} ({where}), {len(report['nodes'])} nodes, "
             f"reachable share of the cache {report['reachable_share']:.0%}"]
    if not report["nodes"]:
        lines.append("  no node registered (yet): start one with 'isolane serve --cluster "
                     f"{where}'")
    for node in report["nodes"]:
        lease = node.get("lease_left_s")
        lines.append(f"  {node['url']:<32} weight {node['weight']:<4g} "
                     f"{'reachable' if node['reachable'] else 'UNREACHABLE'}"
                     + (f"  lease {lease} s left" if lease is not None else ""))
    moves = report["moves"]
    lines.append("moves in flight: " + (f"yes (to ring {moves['ring']})" if moves["in_flight"]
                                        else "none"))
    for item in report["ignored"]:
        lines.append(f"ignored {item['key']}: {item['why']}")
    return "\n".join(lines)
