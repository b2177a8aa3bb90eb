"""The ``isolane`` command group, assembled: the group's options build the Session
(``isolane.cli.session``), then each command module registers its commands — the
snapshot commands (``isolane.cli.snapshots``), ``kv``, ``lanes`` and ``serve`` — and
every command gets its own ``--store``/``--config``. The commands import nothing from
here (``python -m isolane.cli.main`` loads this module once, as ``__main__``).
"""

from __future__ import annotations

import click

from isolane.cli.cluster import cluster
from isolane.cli.common import IsolaneGroup
from isolane.cli.kv import kv
from isolane.cli.lanes import lanes
from isolane.cli.serve import serve
from isolane.cli.session import Session, add_target_options, resolve_target
from isolane.cli.snapshots import SNAPSHOT_COMMANDS


@click.group(cls=IsolaneGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--store", "store_url", metavar="URL", envvar="ISOLANE_STORE",
              help="Store folder or fsspec URL, or a storage node http://HOST:PORT (token "
                   "from ISOLANE_TOKEN) (env ISOLANE_STORE). Default: the embedded store "
                   "under $ISOLANE_HOME or ./isolane-data.")
@click.option("--config", "config_path", metavar="FILE", envvar="ISOLANE_CONFIG",
              help="YAML config naming device groups, mirror and retention "
                   "(env ISOLANE_CONFIG). Not together with --store.")
@click.option("-q", "--quiet", is_flag=True,
              help="No progress bars or informational lines; errors and requested data "
                   "(ls, show, --json) still print.")
@click.version_option(package_name="isolane", prog_name="isolane")
@click.pass_context
def cli(ctx: click.Context, store_url: str | None, config_path: str | None,
        quiet: bool) -> None:
    """Checkpoint snapshots: save, restore, list, verify, mirror and collect them.

    \b
    Examples:
      isolane --store /mnt/nvme/ckpt save model.safetensors step-100
      isolane restore step-100 model.pt --keys model
      isolane ls
      isolane verify step-100
      isolane demo
    """
    target = resolve_target(store_url, ctx.get_parameter_source("store_url"),
                            config_path, ctx.get_parameter_source("config_path"))
    session = Session(target, quiet=quiet)
    ctx.obj = session
    ctx.call_on_close(session.close)


for command in (*SNAPSHOT_COMMANDS, kv, lanes, cluster, serve):
    cli.add_command(command)
add_target_options(cli)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point (``isolane``)."""
    cli.main(args=argv, prog_name="isolane")


if __name__ == "__main__":
    main()
