"""What the KV benchmarks share: the run's facts, the report's head and where a report
goes (printed, a section of ``--out``, the results file of the page)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import _common as C
import _results


def run_facts(folder: Path, packages: dict[str, str]) -> dict[str, str]:
    """The machine, date and command every recorded row carries."""
    return {"machine": C.machine_description(folder, packages), "date": C.now_text(),
            "command": C.command_line()}


def head(title: str, script: str, facts: dict[str, str]) -> list[str]:
    return [f"## {title} (`benchmarks/{script}`)", "", f"Command: `{facts['command']}`  ",
            f"Date: {facts['date']}  ", f"Machine: {facts['machine']}", ""]


def publish(body: str, out: Path | None, section: str, bench: str,
            rows: Sequence[_results.Result], show_rows: bool = False) -> None:
    """Print the report (``show_rows``: ending with the rows it records) and write it as a
    section of ``out``; when ``out`` is the page, record ``rows`` in results/<bench>.json."""
    if show_rows:
        body += "\n" + _results.rows_markdown(rows)
    C.print_report(body, out, section)
    if rows and out and _results.is_page(out):
        _results.write_results(bench, rows)
