"""``isolane kv``: inspect and maintain the KV-cache pool (``isolane.kvpool.pool``).

Each command is a thin wrapper over one pool call: ``ls`` -> ``list_namespaces``,
``stats`` -> ``KVPool.stats``, ``verify`` -> ``KVPool.verify``, ``compact`` ->
``KVPool.compact``, ``evict`` -> ``drop_namespace``.

Which pool: the read group of ``--config FILE`` / ``ISOLANE_CONFIG``, or with neither
the embedded default (``$ISOLANE_HOME/kv``). ``--store`` / ``ISOLANE_STORE`` names a
snapshot store (a write group only) and is refused here with a pointer to ``--config``.

Imports nothing heavy at module level: the pool (and torch) load inside the command
bodies, so ``isolane kv ... --help`` stays fast.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import click

from isolane.cli.common import EXIT_INTEGRITY, CliError, print_json
from isolane.cli.progress import human_bytes
from isolane.cli.render import shape_text, table
from isolane.errors import IntegrityError, IsolaneError

if TYPE_CHECKING:
    from isolane.cli.session import Session
    from isolane.config import Config
    from isolane.kvpool.pool import KVPool
    from isolane.lanes.scheduler import LaneScheduler

NAMESPACE_HELP = "Only this namespace (default: every namespace; see 'isolane kv ls')."


# -- which pool -------------------------------------------------------------------------

def kv_config(session: Session) -> Config:
    """The config whose read group holds the KV pool: ``--config`` or the default."""
    from isolane.config import default_config, load_config

    target = session.target
    if target.kind == "store":
        if target.flag:
            given, way_out = "--store", "drop --store and pass"
        else:
            given, way_out = "ISOLANE_STORE", "unset ISOLANE_STORE and pass"
        raise CliError(f"{given} names a snapshot store, which has no KV pool: the KV pool "
                       f"lives on a config's read group; {way_out} --config FILE whose "
                       "device_groups include one with role 'read' (e.g. 'kv: {role: read, "
                       "devices: [/mnt/nvme2/isolane]}'), or no option at all for the "
                       "embedded default ($ISOLANE_HOME/kv)")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        config = (load_config(target.value or "") if target.kind == "config"
                  else default_config())
    for warning in caught:  # e.g. two device groups on one disk
        click.echo(f"warning: {warning.message}", err=True)
    config.require_group("read")  # no read group: fail now, naming the config
    return config


def devices_text(config: Config) -> str:
    return ", ".join(config.require_group("read").devices)


def open_pool(config: Config, namespace: str, *, memory_budget: int | None = None,
              scheduler: LaneScheduler | None = None) -> KVPool:
    """Open an existing namespace (unknown: KeyNotFoundError, nothing created)."""
    from isolane.kvpool.catalog import open_namespace

    return open_namespace(config, namespace, memory_budget=memory_budget,
                          scheduler=scheduler)


def namespace_names(config: Config, namespace: str | None,
                    problems: list[IsolaneError] | None = None) -> list[str]:
    """``[namespace]`` if given (checked), else every stored namespace (sorted); folders
    that are not readable namespaces go to ``problems`` (else: warnings on stderr)."""
    from isolane.kvpool.catalog import list_namespaces
    from isolane.kvpool.namespaces import check_namespace

    if namespace is not None:
        return [check_namespace(namespace)]
    found: list[IsolaneError] = []
    names = [n["namespace"] for n in list_namespaces(config, found)]
    if problems is None:
        warn_problems(found)
    else:
        problems.extend(found)
    return names


def warn_problems(problems: list[IsolaneError]) -> None:
    for problem in problems:
        click.echo(f"warning: {problem}", err=True)


@contextmanager
def opened(config: Config, namespace: str, **kwargs: Any) -> Iterator[KVPool]:
    pool = open_pool(config, namespace, **kwargs)
    try:
        yield pool
    finally:
        pool.close()


def interactive() -> bool:
    """Whether to ask before destructive commands (stdin is a terminal)."""
    return sys.stdin.isatty()


def say_no_namespaces(session: Session, config: Config) -> None:
    session.say(f"no KV namespaces in {devices_text(config)}; one appears with the first "
                "put of a KVPool(config, namespace=...) on this read group")


# -- rendering --------------------------------------------------------------------------

def namespaces_table(entries: list[dict[str, Any]]) -> str:
    """One row a namespace; with several devices, one bytes column per device and a
    legend line naming them."""
    n_devices = max(len(e["devices"]) for e in entries)
    headers = ["NAMESPACE", "DTYPE", "BLOCK SHAPE", "BLOCKS", "DISK"]
    if n_devices > 1:
        headers += [f"DEV{i}" for i in range(n_devices)]
    rows = []
    for e in entries:
        row = [e["namespace"], e["dtype"], shape_text(e["block_shape"]), str(e["blocks"]),
               human_bytes(e["disk_bytes"])]
        if n_devices > 1:
            row += [human_bytes(d["bytes"]) for d in e["devices"]]
        rows.append(row)
    text = table(headers, rows, right=range(3, len(headers)))
    if n_devices > 1:
        text += "\n\n" + "\n".join(f"DEV{i} = {d['device']}"
                                   for i, d in enumerate(entries[0]["devices"]))
    return text


def stats_text(stats: dict[str, Any]) -> str:
    mem = stats["memory"]
    lines = [f"namespace '{stats['namespace']}': chunk_tokens {stats['chunk_tokens']}, "
             f"policy {mem['policy']}",
             f"  memory  {mem['blocks']} blocks, {human_bytes(mem['bytes'])} of "
             f"{human_bytes(mem['budget'])} budget (this process only: empty in the CLI)"]
    lines += [f"  disk    {d['blocks']} blocks, {human_bytes(d['bytes'])} on {d['device']}"
              for d in stats["disk"]]
    capacity = stats.get("capacity")  # None without a capacity group
    if capacity:
        lines.append(f"  capacity {capacity['blocks']} blocks, "
                     f"{human_bytes(capacity['bytes'])} on {capacity['url']}")
    return "\n".join(lines)


# -- commands ---------------------------------------------------------------------------

@click.group(short_help="Inspect and maintain the KV-cache pool.")
def kv() -> None:
    """List, inspect, verify, compact and evict the namespaces of the KV-cache pool.

    The pool lives on the read group of --config FILE (env ISOLANE_CONFIG), or with
    neither, the embedded default under $ISOLANE_HOME/kv. --store names a snapshot store
    and is refused here.

    Each command opens the namespaces' segment logs, which only one process at a time
    may hold: it fails (exit 1) on a namespace a running node has open.

    \b
    Examples:
      isolane --config isolane.yaml kv ls
      isolane kv stats --namespace llama-3-8b --json
      isolane kv verify
      isolane kv evict --namespace old-model --yes
    """


@kv.command(name="ls", short_help="List namespaces: blocks and bytes per device.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list.")
@click.pass_obj
def list_kv(session: Session, as_json: bool) -> None:
    """List the pool's namespaces: dtype, block shape (with chunk_tokens on the token
    dimension), blocks and disk bytes (per device when the read group has several).

    A folder that is not a readable namespace (a damaged namespace.json, a foreign
    folder, a symbolic link) is left out and named on stderr; a damaged one makes the
    exit code 2.
    """
    from isolane.kvpool.catalog import list_namespaces

    config = kv_config(session)
    problems: list[IsolaneError] = []
    entries = list_namespaces(config, problems)
    if as_json:
        print_json(entries)
    elif entries:
        click.echo(namespaces_table(entries))
    elif not problems:
        say_no_namespaces(session, config)
    warn_problems(problems)
    damaged = [p for p in problems if isinstance(p, IntegrityError)]
    if damaged:
        raise CliError(f"{len(damaged)} KV namespace(s) in {devices_text(config)} are "
                       "damaged (named above); drop each with 'isolane kv evict --namespace "
                       "NS'", EXIT_INTEGRITY)


@kv.command(short_help="Show a namespace's tiers and settings.")
@click.option("--namespace", metavar="NS", help=NAMESPACE_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list (one object a "
              "namespace, as KVPool.stats() returns it).")
@click.pass_obj
def stats(session: Session, namespace: str | None, as_json: bool) -> None:
    """Show KVPool.stats() of one namespace or of each: chunk_tokens, eviction policy,
    the memory tier and the disk tier's blocks and bytes per device.

    The memory tier belongs to the process that serves the pool; this command opens the
    namespace afresh, so its memory tier is always empty (0 blocks, no hits) — read the
    disk numbers.
    """
    config = kv_config(session)
    names = namespace_names(config, namespace)
    results = []
    for name in names:
        with opened(config, name) as pool:
            results.append(pool.stats())
    if as_json:
        print_json(results)
    elif results:
        click.echo("\n\n".join(stats_text(s) for s in results))
    else:
        say_no_namespaces(session, config)


@kv.command(short_help="Check every stored block's checksum.")
@click.option("--namespace", metavar="NS", help=NAMESPACE_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object (also on failure).")
@click.pass_obj
def verify(session: Session, namespace: str | None, as_json: bool) -> None:
    """Read back every block on disk and check its checksum: exit 0 intact, 2 damaged.

    Records dropped earlier, by whichever process opened or read the segments (a node
    too): damaged bytes skipped, a torn tail cut, a block that failed its checksum on a
    read, count as damaged too, and are named once.

    Damaged blocks are dropped from the pool (a get reads them as misses; the next put
    of those tokens stores them again), so a second run finds no damage.
    """
    config = kv_config(session)
    names = namespace_names(config, namespace)
    results: list[dict[str, Any]] = []
    for name in names:
        with opened(config, name, memory_budget=0) as pool:
            counts = pool.verify()
        results.append({"namespace": name, **counts})
        if not as_json:
            dropped = counts["dropped_earlier"]
            failed = counts["damaged"] - len(dropped)
            if failed:
                click.echo(f"damaged '{name}': {failed} of {counts['checked'] + len(dropped)} "
                           "blocks failed their checksum and were dropped")
            if dropped:
                where = "; ".join(f"segment {d['segment_id']} at offset {d['offset']}, "
                                  f"{d['nbytes']} bytes: {d['reason']}" for d in dropped[:5])
                more = f"; and {len(dropped) - 5} more" if len(dropped) > 5 else ""
                click.echo(f"damaged '{name}': {len(dropped)} record(s) dropped earlier, "
                           f"when the segments were opened or read ({where}{more})")
            if not counts["damaged"]:
                session.say(f"ok '{name}': {counts['checked']} blocks checked")
    damaged: int = sum(r["damaged"] for r in results)
    if as_json:
        print_json({"ok": not damaged, "checked": sum(r["checked"] for r in results),
                    "damaged": damaged, "namespaces": results})
    elif not results:
        say_no_namespaces(session, config)
    if damaged:
        raise CliError(f"{damaged} damaged KV block(s) found in {devices_text(config)}; they "
                       "were dropped and read as misses (the pool stays usable); if this "
                       "repeats, check the device (dmesg, smartctl)", EXIT_INTEGRITY)


@kv.command(short_help="Compact sealed segments with little live data.")
@click.option("--namespace", metavar="NS", help=NAMESPACE_HELP)
@click.option("--min-live-ratio", type=click.FloatRange(0.0, 1.0), default=0.5,
              show_default=True,
              help="Compact a sealed segment when its live bytes fall below this share.")
@click.pass_obj
def compact(session: Session, namespace: str | None, min_live_ratio: float) -> None:
    """Copy the live blocks of sparse sealed segments forward and delete the old files
    (KVPool.compact), reclaiming the space of deleted and overwritten blocks."""
    from isolane.lanes.scheduler import LaneScheduler

    config = kv_config(session)
    names = namespace_names(config, namespace)
    if not names:
        say_no_namespaces(session, config)
        return
    scheduler = LaneScheduler(config)  # ours alone: its threads end with the command
    try:
        for name in names:
            with opened(config, name, memory_budget=0, scheduler=scheduler) as pool:
                before = sum(d["bytes"] for d in pool.stats()["disk"])
                done = pool.compact(min_live_ratio)
                after = sum(d["bytes"] for d in pool.stats()["disk"])
            if done:
                session.say(f"compacted '{name}': {done} segment(s), "
                            f"{human_bytes(before)} -> {human_bytes(after)}")
            else:
                session.say(f"nothing to compact in '{name}'")
    finally:
        scheduler.close()


@kv.command(short_help="Drop a namespace and all its blocks.")
@click.option("--namespace", metavar="NS", required=True,
              help="The namespace to drop (see 'isolane kv ls').")
@click.option("-y", "--yes", is_flag=True, help="Do not ask (never asked without a terminal).")
@click.pass_obj
def evict(session: Session, namespace: str, yes: bool) -> None:
    """Drop namespace NS: delete every block of it on every device of the read group
    (drop_namespace). Refused while a running node has the namespace open."""
    from isolane.kvpool.catalog import count_blocks, drop_namespace
    from isolane.kvpool.namespaces import check_namespace

    config = kv_config(session)
    check_namespace(namespace)
    if not yes and interactive():
        blocks = count_blocks(config, namespace)  # unknown: fails here
        click.confirm(f"drop KV namespace '{namespace}' ({blocks} blocks) from "
                      f"{devices_text(config)}?", abort=True)
    blocks = drop_namespace(config, namespace)
    session.say(f"dropped KV namespace '{namespace}': {blocks} blocks")
