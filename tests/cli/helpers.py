"""Shared helpers of the CLI tests: invoke with a clean environment, check exits."""

from __future__ import annotations

from click.testing import CliRunner, Result

from isolane.cli.main import cli

CLEAN_ENV: dict[str, str | None] = {"ISOLANE_STORE": None, "ISOLANE_CONFIG": None}


def run(*args: str, env: dict[str, str | None] | None = None, input: str | None = None
        ) -> Result:
    return CliRunner().invoke(cli, list(args), env={**CLEAN_ENV, **(env or {})}, input=input)


def ok(result: Result) -> Result:
    assert result.exit_code == 0, (result.output, result.stderr, result.exception)
    return result


def fails(result: Result, code: int, *needles: str) -> Result:
    """Exited with ``code`` on purpose (not a stray traceback), naming ``needles``."""
    assert result.exit_code == code, (result.output, result.stderr, result.exception)
    assert isinstance(result.exception, SystemExit), result.exception
    for needle in needles:
        assert needle in result.stderr, (needle, result.stderr)
    return result
