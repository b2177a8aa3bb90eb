"""What every ``isolane`` command shares: exit codes, how errors print, JSON output.

Exit codes (one table, ``EXIT_CODES``): 0 ok; 1 user error (bad input, unknown or
existing snapshot, usage errors); 2 integrity failure (stored bytes do not match their
checksums). Errors print as ``error: <message>`` on stderr. Imports nothing heavy.
"""

from __future__ import annotations

import json
from typing import IO, Any

import click

from isolane.errors import IntegrityError, IsolaneError

EXIT_OK = 0
EXIT_USER = 1
EXIT_INTEGRITY = 2

# Exception class -> exit code, first match wins (IntegrityError is also an IsolaneError).
# Anything not listed is a bug in isolane and keeps its traceback.
EXIT_CODES: tuple[tuple[type[BaseException], int], ...] = (
    (IntegrityError, EXIT_INTEGRITY),
    (IsolaneError, EXIT_USER),
    (KeyError, EXIT_USER),  # SnapshotStore.load(keys=...) names a key the snapshot lacks
    (OSError, EXIT_USER),  # SRC/DEST unreadable or unwritable, disk full, permission
)


def exit_code_for(exc: BaseException) -> int | None:
    for cls, code in EXIT_CODES:
        if isinstance(exc, cls):
            return code
    return None


def error_message(exc: BaseException) -> str:
    if isinstance(exc, KeyError) and exc.args:
        return str(exc.args[0])
    if (isinstance(exc, OSError) and not isinstance(exc, IsolaneError) and exc.strerror
            and exc.filename):
        return f"{exc.filename}: {exc.strerror}"
    return str(exc)


class CliError(click.ClickException):
    """An error shown as ``error: <message>`` that exits with ``exit_code``."""

    def __init__(self, message: str, exit_code: int = EXIT_USER) -> None:
        super().__init__(message)
        self.exit_code = exit_code  # type: ignore[misc]  # click declares a ClassVar

    def show(self, file: IO[Any] | None = None) -> None:
        click.echo(f"error: {self.format_message()}", file=file, err=file is None)


class IsolaneGroup(click.Group):
    """Maps library errors through ``EXIT_CODES`` and makes usage errors exit 1."""

    def make_context(self, info_name: str | None, args: list[str],
                     parent: click.Context | None = None, **extra: Any) -> click.Context:
        try:
            return super().make_context(info_name, args, parent, **extra)
        except click.UsageError as exc:
            exc.exit_code = EXIT_USER  # type: ignore[misc]  # click declares a ClassVar
            raise

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.UsageError as exc:
            exc.exit_code = EXIT_USER  # type: ignore[misc]
            raise
        except click.ClickException:
            raise
        except Exception as exc:
            code = exit_code_for(exc)
            if code is None:
                raise
            raise CliError(error_message(exc), code) from exc



def print_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))
