"""The snapshot commands (``save``, ``restore``, ``ls``, ``show``, ``verify``, ``rm``,
``gc``, ``mirror``) and ``demo``: each a thin wrapper over one SnapshotStore call on the
session's store. Imports nothing heavy at module level (torch loads inside commands).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from isolane.cli.common import EXIT_INTEGRITY, CliError, print_json
from isolane.cli.progress import human_bytes, rate_text
from isolane.cli.session import Session, pass_session
from isolane.errors import IntegrityError

if TYPE_CHECKING:
    from isolane.snapshot import SnapshotInfo
    from isolane.snapshot.catalog import DamagedSnapshot

@click.command(short_help="Save a .pt/.safetensors file or model folder.")
@click.argument("src", type=click.Path(path_type=Path))
@click.argument("name")
@click.option("--overwrite", is_flag=True, help="Replace a snapshot of the same name.")
@click.option("--metadata", "metadata_json", metavar="JSON",
              help='User metadata stored with the snapshot, a JSON object, e.g. '
                   '\'{"step": 100}\'.')
@click.option("--async", "async_", is_flag=True,
              help="Use save_async: report how long the caller was blocked (staging copy) "
                   "apart from the time to commit.")
@pass_session
def save(session: Session, src: Path, name: str, overwrite: bool, metadata_json: str | None,
         async_: bool) -> None:
    """Save SRC as snapshot NAME.

    SRC is a .pt/.pth/.bin torch file (read with weights_only=True: plain tensors and
    containers only, never arbitrary objects), a .safetensors file, or a Hugging Face
    model folder (all its *.safetensors, else its pytorch_model*.bin/*.pt files, merged
    into one dict). Chunks unchanged since the newest snapshot are linked, not written
    again.
    """
    from isolane.cli.formats import read_source
    from isolane.errors import SnapshotExistsError, SnapshotNotFoundError
    from isolane.snapshot.names import check_snapshot_name

    metadata = parse_metadata(metadata_json)
    check_snapshot_name(name)
    store = session.store
    if not overwrite:  # fail before reading a large SRC
        try:
            store.info(name)
        except SnapshotNotFoundError:
            pass
        else:
            raise SnapshotExistsError(name, store.url)
    t0 = time.perf_counter()
    source = read_source(src)
    read_s = time.perf_counter() - t0
    files = f"{len(source.files)} files" if len(source.files) > 1 else source.files[0].name
    session.say(f"read {src} ({files}) in {read_s:.2f} s")
    with session.progress(f"saving {name}") as bar:
        t0 = time.perf_counter()
        if async_:
            handle = store.save_async(source.state, name, metadata, overwrite=overwrite,
                                      progress=bar)
            blocked_s = time.perf_counter() - t0
            info = handle.result()
        else:
            info = store.save(source.state, name, metadata, overwrite=overwrite, progress=bar)
        save_s = time.perf_counter() - t0
    session.say(f"saved '{info.name}': {info.tensors} tensors, "
                f"{human_bytes(info.logical_bytes)} in {save_s:.2f} s "
                f"({rate_text(info.logical_bytes, save_s)}) to {store.url}")
    session.say(f"  written {human_bytes(info.written_bytes)}, linked "
                f"{human_bytes(info.linked_bytes)}" + incremental_note(info))
    if async_:
        session.say(f"  async: the caller was blocked {blocked_s:.3f} s (staging copy); "
                    f"committed after {save_s:.2f} s")


def incremental_note(info: SnapshotInfo) -> str:
    if info.parent and info.linked_bytes:
        return f" (incremental: unchanged chunks linked from '{info.parent['name']}')"
    return ""


def parse_metadata(text: str | None) -> dict[str, Any] | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise CliError(f"--metadata is not valid JSON ({exc}); pass an object, e.g. "
                       '--metadata \'{"step": 100}\'') from None
    if not isinstance(value, dict):
        raise CliError(f"--metadata must be a JSON object, got {type(value).__name__}; e.g. "
                       '--metadata \'{"step": 100}\'')
    return value


def parse_keys(text: str | None) -> list[str] | None:
    """``"a,b.c"`` -> ``["a", "b.c"]``; no option -> None (every key)."""
    if text is None:
        return None
    keys = [k.strip() for k in text.split(",") if k.strip()]
    if not keys:
        raise CliError("--keys needs at least one key, e.g. --keys model,optimizer.state")
    return keys


@click.command(short_help="Restore a snapshot to .pt or .safetensors.")
@click.argument("name")
@click.argument("dest", type=click.Path(path_type=Path))
@click.option("--keys", metavar="K1,K2",
              help="Only these dotted keys and what lies below them, e.g. "
                   "--keys model,optimizer.state (see 'isolane show NAME').")
@click.option("--overwrite", is_flag=True, help="Replace DEST if it exists.")
@pass_session
def restore(session: Session, name: str, dest: Path, keys: str | None,
            overwrite: bool) -> None:
    """Restore snapshot NAME into the file DEST (.pt or .safetensors).

    .pt gets the state dict exactly as saved (torch.save). .safetensors gets a flat
    tensor map: nested keys joined with '.', tied tensors copied apart; a non-tensor
    leaf (step count, learning rate ...) is refused with its key — restore to .pt, or
    select tensor subtrees with --keys. DEST is written to a temporary file and renamed.
    """
    from isolane.cli.formats import check_dest, tensor_bytes, write_state

    wanted = parse_keys(keys)
    check_dest(dest, overwrite=overwrite)  # before reading any snapshot bytes
    store = session.store
    with session.progress(f"restoring {name}") as bar:
        t0 = time.perf_counter()
        state = store.load(name, keys=wanted, progress=bar)
        load_s = time.perf_counter() - t0
    nbytes = tensor_bytes(state)
    t0 = time.perf_counter()
    size = write_state(state, dest, overwrite=overwrite)
    write_s = time.perf_counter() - t0
    session.say(f"read '{name}': {human_bytes(nbytes)} in {load_s:.2f} s "
                f"({rate_text(nbytes, load_s)})")
    session.say(f"wrote {dest}: {human_bytes(size)} in {write_s:.2f} s "
                f"({rate_text(size, write_s)})")


@click.command(name="ls", short_help="List snapshots.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list.")
@pass_session
def list_snapshots(session: Session, as_json: bool) -> None:
    """List snapshots, oldest first (local and mirror-only ones)."""
    from isolane.cli.render import info_dict, snapshot_table

    store = session.store
    infos = store.list()
    damaged = store.damaged() if hasattr(store, "damaged") else []
    if as_json:
        print_json([info_dict(i) for i in infos] + [
            {"name": d.name, "generation": d.generation, "where": d.location,
             "damaged": d.problem} for d in damaged])
    elif infos or damaged:
        click.echo(snapshot_table(infos, damaged))
    else:
        session.say(f"no snapshots in {store.url}; create one with 'isolane save SRC NAME' "
                    "or try 'isolane demo'")
    if damaged:
        raise_damaged(damaged)


def raise_damaged(damaged: Sequence[DamagedSnapshot]) -> None:
    """Exit 2 naming each damaged snapshot and the way out."""
    lines = [f"{len(damaged)} snapshot(s) damaged (kept, never swept):"]
    lines += [f"  {d.name} ({d.location}, generation {d.generation}): {d.problem}"
              for d in damaged]
    lines.append("run 'isolane rm NAME' to drop one, or save it again with --overwrite")
    raise CliError("\n".join(lines), EXIT_INTEGRITY)


@click.command(short_help="Show a snapshot's details and tensors.")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object.")
@pass_session
def show(session: Session, name: str, as_json: bool) -> None:
    """Show a snapshot: sizes, parent, metadata, path and every tensor's dtype and shape."""
    from isolane.cli.render import info_dict, show_text, tensor_dicts

    store = session.store
    info = store.info(name)
    records = store.manifest(name).tensors
    path = store.path(name)
    if as_json:
        print_json({**info_dict(info), "path": path, "keys": tensor_dicts(records)})
    else:
        click.echo(show_text(info, path, records))


@click.command(short_help="Check a snapshot's stored bytes.")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object (also on failure).")
@pass_session
def verify(session: Session, name: str, as_json: bool) -> None:
    """Read back every chunk of NAME and check its hash: exit 0 intact, 2 damaged."""
    store = session.store
    t0 = time.perf_counter()
    try:
        with session.progress(f"verifying {name}") as bar:
            info = store.verify(name, progress=bar)
    except IntegrityError as exc:
        if as_json:
            print_json({"name": name, "ok": False, "error": str(exc)})
        raise
    seconds = time.perf_counter() - t0
    if as_json:
        print_json({"name": name, "ok": True, "bytes": info.stored_bytes,
                    "seconds": seconds, "gb_per_s": info.stored_bytes / seconds / 1e9
                    if seconds > 0 else 0.0})
    else:
        session.say(f"ok '{name}': {human_bytes(info.stored_bytes)} checked in "
                    f"{seconds:.2f} s ({rate_text(info.stored_bytes, seconds)})")


@click.command(short_help="Remove a snapshot.")
@click.argument("name")
@click.option("-y", "--yes", is_flag=True, help="Do not ask (never asked without a terminal).")
@pass_session
def rm(session: Session, name: str, yes: bool) -> None:
    """Remove snapshot NAME everywhere (local devices and mirror)."""
    store = session.store
    info = store.info(name)  # an unknown name fails before the question
    if not yes and sys.stdin.isatty():
        click.confirm(f"remove snapshot '{name}' ({human_bytes(info.logical_bytes)}) from "
                      f"{store.url}?", abort=True)
    store.delete(name)
    session.say(f"removed '{name}'")


@click.command(short_help="Apply retention, sweep failed saves.")
@click.option("--keep-last", type=click.IntRange(min=1), metavar="N",
              help="Keep only the N most recent snapshots (default: the config's "
                   "snapshot.keep_last; none removed without one).")
@pass_session
def gc(session: Session, keep_last: int | None) -> None:
    """Apply retention and sweep leftovers of failed or killed saves."""
    report = session.store.gc(keep_last=keep_last)
    for name in report.deleted_snapshots:
        click.echo(f"removed snapshot '{name}'")
    for generation in report.swept_generations:
        click.echo(f"swept leftover {generation}")
    if not report.deleted_snapshots and not report.swept_generations:
        session.say("nothing to remove")
    if report.damaged:
        raise_damaged(report.damaged)


@click.command(short_help="Copy snapshots to the capacity group.")
@pass_session
def mirror(session: Session) -> None:
    """Copy every local snapshot the capacity group lacks to it, and wait."""
    store = session.store
    remote = getattr(store, "mirror_urls", None)
    if remote is None and store.mirror_store is None:
        raise CliError(f"{session.target.describe()} has no capacity group to mirror to; "
                       "pass --config FILE whose device_groups include one with role "
                       "'capacity' (e.g. devices: [s3://bucket/prefix])")
    started = store.sync_mirrors()  # a node without a capacity group says so
    if remote is not None:
        target = ", ".join(u for u in remote().values() if u) or "the node's capacity group"
    else:
        target = store.mirror_store.url if store.mirror_store is not None else "?"
    if not started:
        session.say(f"every snapshot is already mirrored to {target}")
        return
    t0 = time.perf_counter()
    results = store.wait_for_mirrors()
    seconds = time.perf_counter() - t0
    failed = []
    for name in started:
        error = results.get(name)
        if error is None:
            click.echo(f"mirrored '{name}'")
        else:
            failed.append(name)
            click.echo(f"failed '{name}': {error}", err=True)
    session.say(f"{len(started) - len(failed)} of {len(started)} mirrored to {target} in "
                f"{seconds:.2f} s")
    if failed:
        raise CliError(f"{len(failed)} snapshot(s) were not mirrored ({', '.join(failed)}); "
                       "fix the cause above and run 'isolane mirror' again")


@click.command(short_help="Run an end-to-end demo on the store.")
@click.option("--size-mb", type=click.IntRange(min=1, max=1 << 20), default=64,
              show_default=True, help="Approximate size of model + optimizer state, in MiB.")
@click.option("--isolation-seconds", type=click.FloatRange(min=0, max=600), default=8.0,
              show_default=True, help="Length of each run of the isolation part (0: skip).")
@pass_session
def demo(session: Session, size_mb: int, isolation_seconds: float) -> None:
    """Save, incrementally re-save (async), list, verify, restore, export and gc a small
    fine-tune on the current store, printing GB/s at each step. Safe to re-run.

    Then the isolation part (on a host config or the embedded default): an inference
    process restores KV prefixes while a trainer process saves incremental checkpoints,
    with the host lane plane off and on; it prints the KV read p99 and the save
    throughput of each run."""
    from isolane.cli.demo import run_demo

    run_demo(session.store, size_mb, say=session.say, progress=session.progress)
    if not isolation_seconds:
        return
    if session.target.kind == "store":
        session.say("isolation part skipped: it needs a host config with a read group "
                    "(--config FILE, or no --store for the embedded default)")
        return
    from isolane.cli.demo_isolation import run_isolation_demo
    from isolane.config import default_home

    target = session.target.value if session.target.kind == "config" else default_home()
    run_isolation_demo(os.path.abspath(target or default_home()), isolation_seconds,
                       say=session.say)



SNAPSHOT_COMMANDS = (save, restore, list_snapshots, show, verify, rm, gc, mirror, demo)
