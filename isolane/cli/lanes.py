"""``isolane lanes``: the I/O lanes, their governor, and whether the disks isolate them.

``stats`` -> ``LaneScheduler.stats`` (of this process's scheduler for the configured
host) and ``isolane.lanes.host_view.read_host_view`` (every process's),
``check`` -> ``isolane.lanes.disks.check_isolation``.

Which host: ``--config FILE`` / ``ISOLANE_CONFIG``, ``--store URL`` / ``ISOLANE_STORE``
(one write device), or the embedded default, as for every other command.

Imports nothing heavy at module level (no torch).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import click

from isolane.cli.common import print_json
from isolane.cli.progress import human_bytes
from isolane.cli.render import table

if TYPE_CHECKING:
    from isolane.cli.session import Session
    from isolane.config import Config


def lanes_config(session: Session, *, echo_warnings: bool = True) -> Config:
    """The host config named by --config/--store, or the embedded default."""
    from isolane.config import default_config, load_config, store_config

    target = session.target
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        if target.kind == "config":
            config = load_config(target.value or "")
        elif target.kind == "store":
            config = store_config(target.value or "")
        else:
            config = default_config()
    if echo_warnings:
        for warning in caught:  # e.g. two device groups on one disk
            click.echo(f"warning: {warning.message}", err=True)
    return config


def rate_text(rate: float | None) -> str:
    return "unlimited" if rate is None else f"{human_bytes(rate)}/s"


def cap_text(cap: float | None) -> str:
    return "none" if cap is None else f"{human_bytes(cap)}/s"


def ms_text(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} ms"


def stats_text(stats: dict[str, Any], names: Sequence[str], source: str) -> str:
    mode = "isolated lanes" if stats["isolation"] else "no isolation: one shared pool"
    lines = [f"lanes of {source} ({mode})"]
    rows = []
    for name in names:
        lane = stats[name]
        latency = lane["latency_ms"]
        rows.append([name, str(lane["threads"]), human_bytes(lane["inflight_limit"]),
                     str(lane["ops"]), human_bytes(lane["bytes"]), str(lane["failed"]),
                     str(lane["queue_depth"]), human_bytes(lane["in_flight_bytes"]),
                     ms_text(latency["p50"]), ms_text(latency["p99"]),
                     ms_text(latency["p999"]), rate_text(lane["rate_limit_bytes_per_s"])])
    lines.append(table(["LANE", "THREADS", "BUDGET", "OPS", "BYTES", "FAILED", "QUEUED",
                        "IN FLIGHT", "P50", "P99", "P999", "RATE LIMIT"], rows,
                       right=range(1, 11)))
    gov = stats["governor"]
    if gov["enabled"]:
        lines += [
            f"governor: on; read p99 SLO {gov['slo_ms']:g} ms over {gov['window_s']:g} s, "
            f"checked every {gov['period_s']:g} s; last read p99 {ms_text(gov['read_p99_ms'])}",
            f"  checkpoint writes  {rate_text(gov['write_rate_bytes_per_s'])} (floor "
            f"{rate_text(gov['floor_bytes_per_s'])}, cap {cap_text(gov['cap_bytes_per_s'])})"
            f": {gov['write_state']}",
            f"  background         {rate_text(gov['background_rate_bytes_per_s'])} (floor "
            f"{rate_text(gov['background_floor_bytes_per_s'])}): {gov['background_state']}",
            f"  {gov['cuts']} cuts, {gov['increases']} increases",
        ]
        lines += [f"  {d['age_s']:.1f} s ago  {d['lane']}: {rate_text(d['old_rate_bytes_per_s'])}"
                  f" -> {rate_text(d['new_rate_bytes_per_s'])}  ({d['reason']})"
                  for d in gov["decisions"][-10:]]
    else:
        lines.append(f"governor: off; checkpoint writes capped at "
                     f"{cap_text(gov['cap_bytes_per_s'])}")
    lines.append("(the lane counters above belong to this process: a fresh CLI shows zeros)")
    return "\n".join(lines)


def host_text(host: dict[str, Any]) -> str:
    """The host lane plane: every member process, host read percentiles, decisions."""
    if not host["available"]:
        return f"host lane plane: none ({host['reason']})"
    members = host["members"]
    lines = [f"host lane plane {host['plane']}: {len(members)} member(s)"]
    rows = [[str(m["pid"]), ",".join(m["roles"]) or "-",
             f"{m['threads']['read']}/{m['threads']['write']}/{m['threads']['background']}",
             f"{human_bytes(m['write_bytes_per_s'])}/s",
             rate_text(m["write_limit_bytes_per_s"]), human_bytes(m["write_demand_bytes"]),
             str(m["kv_gets"]), f"{m['heartbeat_age_s']:.2f} s ago"
             + ("" if m["fresh"] else " (stale)")] for m in members]
    if rows:
        lines.append(table(["PID", "ROLES", "LANES R/W/B", "WRITING", "WRITE LIMIT",
                            "DEMAND", "KV GETS", "HEARTBEAT"], rows, right=range(2, 7)))
    latency = host["read_latency_ms"]
    lines.append(f"host read p50 {ms_text(latency['p50'])}, p99 {ms_text(latency['p99'])}, "
                 f"p999 {ms_text(latency['p999'])} over {host['window_s']:g} s "
                 f"({latency['count']} KV gets, all members)")
    if host["elected_pid"] is not None:
        lines.append(f"host governor (elected: pid {host['elected_pid']}): checkpoint writes "
                     f"{rate_text(host['write_rate_bytes_per_s'])} for the host "
                     f"({host['write_state']}); background "
                     f"{rate_text(host['background_rate_bytes_per_s'])}")
        lines += [f"  {d['age_s']:.1f} s ago  {d.get('lane')}: {rate_text(d.get('old'))} -> "
                  f"{rate_text(d.get('new'))}  ({d.get('reason')}; pid {d.get('pid')})"
                  for d in host["decisions"][-10:]]
    return "\n".join(lines)


def check_text(report: dict[str, Any]) -> str:
    lines = []
    for group in report["groups"]:
        lines.append(f"{group['role']} group '{group['name']}':")
        rows = [[d["device"], d["where"]] for d in group["devices"]]
        lines += ["  " + line for line in table(["DEVICE", "DISK"], rows).splitlines()]
    lines += report["notes"] + report["warnings"]
    if report["ok"]:
        lines.append("ok: the write and read groups are on separate disks"
                     if _has_both(report) else
                     "ok: no write and read group to compare (one of them is missing)")
    return "\n".join(lines)


def _has_both(report: dict[str, Any]) -> bool:
    return {"write", "read"} <= {g["role"] for g in report["groups"]}


@click.group(short_help="Inspect the I/O lanes, the governor and disk isolation.")
def lanes() -> None:
    """Show the lanes' counters and the governor's state, and check that the write and
    read groups sit on separate physical disks.

    \b
    Examples:
      isolane --config isolane.yaml lanes check
      isolane lanes stats --json
    """


@lanes.command(short_help="Lane counters, latencies and the governor's state.")
@click.option("--lane", "lane_name", metavar="NAME",
              help="Only this lane (write, read or background).")
@click.option("--json", "as_json", is_flag=True,
              help="Print LaneScheduler.stats() as JSON.")
@click.pass_obj
def stats(session: Session, lane_name: str | None, as_json: bool) -> None:
    """Show each lane's threads, in-flight budget, ops, bytes, queue depth, in-flight
    bytes, p50/p99/p999 latency and rate limit, and the governor's settings, current
    rates and recent decisions.

    Then the host lane plane: every process on this config (pid, roles, lane
    threads, write rate, limit and demand, KV gets, last heartbeat), the host's KV
    read p50/p99/p999 over all of them, and the elected governor's host rates and
    recent decisions (``host`` in the JSON).

    The lane counters belong to the process that runs the lanes; this command opens
    the host's scheduler afresh, so those are zero here — the host part is live.
    """
    from isolane.lanes.host_view import read_host_view
    from isolane.lanes.scheduler import shared_registry

    config = lanes_config(session)
    scheduler = shared_registry.get(config)  # in this process: shared with its users
    names = list(scheduler.LANES)
    if lane_name is not None:
        names = [scheduler.lane_named(lane_name).name]  # unknown: names the valid ones
    data = scheduler.stats()
    host = read_host_view(config)  # every process on this config, read without joining
    if as_json:
        print_json({**{n: data[n] for n in names}, "governor": data["governor"],
                    "isolation": data["isolation"], "host": host})
    else:
        click.echo(stats_text(data, names, config.source))
        click.echo(host_text(host))


@lanes.command(short_help="Check that write and read groups use separate disks.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object.")
@click.pass_obj
def check(session: Session, as_json: bool) -> None:
    """Print each device group's devices and the physical disk under each (st_dev,
    mount point, filesystem and the whole disk under a partition); print a WARNING
    when a write and a read group share a disk, since the lanes then isolate only
    threads and budgets. Exits 0 either way: it is advice, not an error."""
    from isolane.lanes.disks import check_isolation

    config = lanes_config(session, echo_warnings=False)  # the report says it better
    report = check_isolation(config).as_dict()
    if as_json:
        print_json(report)
    else:
        click.echo(check_text(report))
