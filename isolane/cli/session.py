"""Which store the commands act on, and the click context object that opens it.

Which store (precedence flag > environment > default)::

    --store URL   / ISOLANE_STORE    a folder or fsspec URL: one write device, or a
                                     storage node http://HOST:PORT (token: ISOLANE_TOKEN)
    --config FILE / ISOLANE_CONFIG   a YAML config (device groups, mirror, retention)
    neither                          the embedded default under $ISOLANE_HOME (./isolane-data)

The group resolves the target (``resolve_target``) into the root context's ``Session``;
``add_target_options`` gives every command its own ``--store``/``--config``, which
replace the group's. The store is built on first use inside a command, so ``--help``
never imports torch.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, TextIO

import click
from click.core import ParameterSource

from isolane.cli.common import CliError
from isolane.cli.progress import ProgressBar
from isolane.config import is_node_target

if TYPE_CHECKING:
    from isolane.client.snapshot_store import RemoteSnapshotStore
    from isolane.snapshot import SnapshotStore


@dataclass(frozen=True)
class StoreTarget:
    """Which store the commands act on, decided from flags and environment."""

    kind: Literal["default", "store", "config"]
    value: str | None = None
    flag: bool = True  # given as --store/--config (not ISOLANE_STORE/ISOLANE_CONFIG)

    def describe(self) -> str:
        return {"default": "the embedded default store ($ISOLANE_HOME or ./isolane-data)",
                "store": f"store {self.value}", "config": f"config {self.value}"}[self.kind]


EXCLUSIVE_TARGETS = ("--store and --config are mutually exclusive: give a store folder/URL "
                     "or a config file that names its devices")


def resolve_target(store: str | None, store_source: ParameterSource | None,
                   config: str | None, config_source: ParameterSource | None) -> StoreTarget:
    """flag > environment > default; ``--store`` with ``--config`` is a usage error."""
    if store and config:
        store_flag = store_source is ParameterSource.COMMANDLINE
        config_flag = config_source is ParameterSource.COMMANDLINE
        if store_flag and config_flag:
            raise click.UsageError(EXCLUSIVE_TARGETS)
        if not store_flag and not config_flag:
            raise click.UsageError("ISOLANE_STORE and ISOLANE_CONFIG are both set; unset one, "
                                   "or pass --store or --config to choose")
        return StoreTarget("store", store) if store_flag else StoreTarget("config", config)
    if store:
        return StoreTarget("store", store, store_source is ParameterSource.COMMANDLINE)
    if config:
        return StoreTarget("config", config, config_source is ParameterSource.COMMANDLINE)
    return StoreTarget("default")


# -- --store / --config after the command ------------------------------------------------

# flag -> (target kind, metavar, help)
TARGET_FLAGS: dict[str, tuple[Literal["store", "config"], str, str]] = {
    "--store": ("store", "URL", "Store folder or URL, as the global --store; given here it "
                                "wins over the global one."),
    "--config": ("config", "FILE", "Host config, as the global --config; given here it wins "
                                   "over the global one.")}


def _command_target(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    """A command's own --store/--config: replaces the target the group resolved."""
    if value is None:
        return
    given = ctx.meta.setdefault("isolane.command_target", {})
    given[param.opts[0]] = value
    if len(given) > 1:
        raise click.UsageError(EXCLUSIVE_TARGETS)
    # The root's object, not find_object(Session): robust should a module defining the
    # group be loaded twice (``python -m`` runs a module as __main__ beside its import).
    session = ctx.find_root().obj
    if session is not None:
        kind = TARGET_FLAGS[param.opts[0]][0]
        session.target = dataclasses.replace(session.target, kind=kind, value=value,
                                             flag=True)


def add_target_options(group: click.Group) -> None:
    """Give every command under ``group`` its own --store and --config, so that both
    work before the command and after it (users write both)."""
    for command in group.commands.values():
        if isinstance(command, click.Group):
            add_target_options(command)
            continue
        for flag, (kind, metavar, text) in TARGET_FLAGS.items():
            command.params.append(click.Option(
                [flag, f"command_{kind}"], metavar=metavar, expose_value=False,
                callback=_command_target, help=text))


@dataclass
class Session:
    """The click context object: the store (built lazily) and output settings."""

    target: StoreTarget
    quiet: bool = False
    _store: SnapshotStore | None = field(default=None, repr=False)

    @property
    def store(self) -> SnapshotStore:
        if self._store is None:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("default")
                self._store = self._open_store()
            for warning in caught:  # e.g. two device groups on one disk
                click.echo(f"warning: {warning.message}", err=True)
        return self._store

    def _open_store(self) -> SnapshotStore:
        from isolane.config import load_config, store_config
        from isolane.snapshot import SnapshotStore

        if self.target.kind == "config":
            return SnapshotStore(load_config(self.target.value or ""))
        if self.target.kind == "store":
            value = self.target.value or ""
            if is_node_target(value):
                return open_node_store(value)  # type: ignore[return-value]
            return SnapshotStore(store_config(value))
        return SnapshotStore()

    def close(self) -> None:
        """Wait for saves and mirrors in flight and release the store (if one was built)."""
        if self._store is not None:
            self._store.close()
            self._store = None

    def say(self, message: str) -> None:
        """Informational output (stdout); ``--quiet`` silences it."""
        if not self.quiet:
            click.echo(message)

    def progress(self, label: str) -> ProgressBar:
        """A progress bar on stderr when it is a terminal and not ``--quiet``."""
        stream: TextIO | None = sys.stderr
        if self.quiet or stream is None or not stream.isatty():
            stream = None
        return ProgressBar(label, stream)


pass_session = click.make_pass_decorator(Session)


def open_node_store(url: str) -> RemoteSnapshotStore:
    """The snapshots of the node at ``url`` (token from ISOLANE_TOKEN). A URL that is
    not ``http(s)://host:port`` is refused here, not taken for an empty store."""
    from isolane.client.snapshot_store import RemoteSnapshotStore
    from isolane.client.transport import check_node_url
    from isolane.errors import InvalidArgumentError

    try:
        check_node_url(url)
    except InvalidArgumentError:
        raise CliError(f"--store {url}: an http(s) store is a storage node, named "
                       "http://HOST:PORT with no path (e.g. --store http://127.0.0.1:7070, "
                       "token in ISOLANE_TOKEN); for a folder or bucket pass its path or "
                       "s3:// URL") from None
    return RemoteSnapshotStore(url)
