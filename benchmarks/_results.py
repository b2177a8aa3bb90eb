"""Benchmark results as data: one JSON file a benchmark in ``benchmarks/results/``.

docs/BENCHMARKS.md is rendered from these files by ``report.py``, never by hand. A
benchmark run with ``--out docs/BENCHMARKS.md`` calls ``write_results(bench, rows)``:
each row is one measure, isolane's value beside its same-run peer or limit, the ratio,
the target and where it was measured. A file holds its benchmark's latest run only.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
PAGE = RESULTS_DIR.parent.parent / "docs" / "BENCHMARKS.md"

# The page's sections, in this order; a row names one of them.
AREAS = ("Checkpoints", "KV pool", "Isolation", "Cluster and routing", "Integrations",
         "Robustness")
# "x": peer over isolane in the better direction (a speedup); "%": isolane's share of a
# limit; "points": a difference of percentages.
RATIO_UNITS = ("x", "%", "points")
_ALWAYS = ("area", "measure", "value", "unit", "machine", "date", "command")


@dataclass(frozen=True)
class Result:
    """One measured row. ``value`` and ``peer_value`` are in ``unit``; ``why`` says in a
    line why a number that looks wrong is what it is."""

    area: str
    measure: str
    value: float
    unit: str
    machine: str
    date: str
    command: str
    peer: str | None = None
    peer_value: float | None = None
    ratio: float | None = None
    ratio_unit: str = "x"
    target: str | None = None
    met: bool | None = None
    why: str | None = None

    def __post_init__(self) -> None:
        def refuse(problem: str) -> None:
            raise ValueError(f"result {self.measure!r}: {problem}")

        if self.area not in AREAS:
            refuse(f"area {self.area!r} is not one of {', '.join(AREAS)}")
        if self.ratio_unit not in RATIO_UNITS:
            refuse(f"ratio_unit {self.ratio_unit!r} is not one of {', '.join(RATIO_UNITS)}")
        for name in ("measure", "unit", "machine", "date", "command"):
            if not getattr(self, name):
                refuse(f"{name} is empty")
        if self.peer_value is not None and self.peer is None:
            refuse("peer_value without a peer name")


@dataclass(frozen=True)
class BenchResults:
    bench: str
    rows: tuple[Result, ...]


def is_page(out: Path) -> bool:
    """Whether ``out`` (a benchmark's ``--out``) names the generated page."""
    return Path(out).resolve() == PAGE.resolve()


def write_results(bench: str, rows: Sequence[Result], *, results_dir: Path = RESULTS_DIR,
                  page: Path | None = PAGE) -> Path:
    """Replace ``results/<bench>.json`` with ``rows``, then render ``page`` again from
    every results file (``page=None`` leaves it alone). Returns the results file."""
    if not re.fullmatch(r"[a-z0-9][a-z0-9_-]*", bench):
        raise ValueError(f"benchmark name {bench!r}: use lower-case letters, digits, "
                         "'-' and '_' (it names the file results/NAME.json)")
    if not rows:
        raise ValueError(f"benchmark {bench!r}: no rows to write")
    defaults = {f.name: f.default for f in fields(Result)}
    # fields left at their default are left out: the files stay short to read and diff
    data = [{k: v for k, v in asdict(r).items() if k in _ALWAYS or v != defaults[k]}
            for r in rows]
    path = results_dir / f"{bench}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"bench": bench, "rows": data}, indent=1,
                              ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    if page is not None:
        import report  # report imports this module
        report.write_page(page, results_dir)
    return path


def read_results(results_dir: Path = RESULTS_DIR) -> list[BenchResults]:
    """Every results file, by benchmark name; a damaged file raises naming itself."""
    found = []
    for path in sorted(results_dir.glob("*.json")):
        try:
            data = json.loads(path.read_text())
            rows = tuple(Result(**r) for r in data["rows"])  # unknown fields: TypeError
            bench = str(data["bench"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}: not a results file ({exc}); rewrite it with "
                             "write_results or restore it from git") from exc
        if path.stem != bench:
            raise ValueError(f"{path}: holds benchmark {bench!r}; the file is named "
                             f"after its benchmark ({bench}.json)")
        found.append(BenchResults(bench, rows))
    return found


def rows_markdown(rows: Sequence[Result]) -> str:
    """The rows a run records, as the page shows them (the end of every report)."""
    import report
    if not rows:
        return "### Recorded rows\n\nnone: a measure or its peer is missing from this run\n"
    return "### Recorded rows\n\n" + report.render_rows(rows) + "\n"
