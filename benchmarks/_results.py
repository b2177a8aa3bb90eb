"""Benchmark results as data: one JSON file a benchmark in ``benchmarks/results/``.

docs/BENCHMARKS.md is rendered from these files by ``benchmarks/report.py`` and never
written by hand or by a benchmark, so the page shows exactly the rows kept here. A
benchmark's ``--out`` path builds its headline rows and calls::

    write_results("kv_eviction", rows)   # results/kv_eviction.json, then the page again

Each row is one measure: isolane's value beside its peer or limit measured in the same
run, the ratio between them, the target if there is one, and where it was measured (the
machine, the date and the command). A file holds its benchmark's latest run only:
writing it replaces every row (git keeps the older runs).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"
PAGE = BENCH_DIR.parent / "docs" / "BENCHMARKS.md"

# The page's sections, in this order; a row names one of them.
AREAS = ("Checkpoints", "KV pool", "Isolation", "Cluster and routing", "Integrations",
         "Robustness")
# How a ratio reads: "x" = peer or limit over isolane in the measure's better direction
# (a speedup), "%" = isolane's share of a limit, "points" = a difference of percentages.
RATIO_UNITS = ("x", "%", "points")
_NAME = re.compile(r"[a-z0-9][a-z0-9_-]*")


@dataclass(frozen=True)
class Result:
    """One measured row. ``value`` and ``peer_value`` are in ``unit``."""

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
    # One line: why a number that looks wrong is what it is (shown beside it).
    why: str | None = None

    def __post_init__(self) -> None:
        if self.area not in AREAS:
            raise ValueError(f"result {self.measure!r}: area {self.area!r} is not one of "
                             f"{', '.join(AREAS)}")
        if self.ratio_unit not in RATIO_UNITS:
            raise ValueError(f"result {self.measure!r}: ratio_unit {self.ratio_unit!r} is "
                             f"not one of {', '.join(RATIO_UNITS)}")
        for name in ("measure", "unit", "machine", "date", "command"):
            if not getattr(self, name):
                raise ValueError(f"result {self.measure!r}: {name} is empty")
        if self.peer_value is not None and self.peer is None:
            raise ValueError(f"result {self.measure!r}: peer_value without a peer name")

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> Result:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"result {data.get('measure')!r}: unknown fields {unknown}")
        return cls(**data)  # type: ignore[arg-type]


@dataclass(frozen=True)
class BenchResults:
    bench: str
    rows: tuple[Result, ...]


def is_page(out: Path) -> bool:
    """Whether ``out`` (a benchmark's ``--out``) names the generated page."""
    return Path(out).resolve() == PAGE.resolve()


def results_path(bench: str, results_dir: Path = RESULTS_DIR) -> Path:
    if not _NAME.fullmatch(bench):
        raise ValueError(f"benchmark name {bench!r}: use lower-case letters, digits, "
                         "'-' and '_' (it names the file results/NAME.json)")
    return results_dir / f"{bench}.json"


def write_results(bench: str, rows: Sequence[Result], *, results_dir: Path = RESULTS_DIR,
                  page: Path | None = PAGE) -> Path:
    """Replace ``results/<bench>.json`` with ``rows``, then render ``page`` again from
    every results file (``page=None`` leaves it alone). Returns the results file."""
    if not rows:
        raise ValueError(f"benchmark {bench!r}: no rows to write")
    path = results_path(bench, results_dir)
    text = json.dumps({"bench": bench, "rows": [_row_dict(r) for r in rows]},
                      indent=1, ensure_ascii=False) + "\n"
    _write_atomic(path, text)
    if page is not None:
        # report imports this module, so it is imported here, when a page is asked for.
        import report
        report.write_page(page, results_dir)
    return path


def read_results(results_dir: Path = RESULTS_DIR) -> list[BenchResults]:
    """Every results file, by benchmark name; a damaged file raises naming itself."""
    found = []
    for path in sorted(results_dir.glob("*.json")):
        try:
            data = json.loads(path.read_text())
            rows = tuple(Result.from_dict(r) for r in data["rows"])
            bench = str(data["bench"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}: not a results file ({exc}); rewrite it with "
                             "write_results or restore it from git") from exc
        if path.stem != bench:
            raise ValueError(f"{path}: holds benchmark {bench!r}; the file is named "
                             f"after its benchmark ({bench}.json)")
        found.append(BenchResults(bench, rows))
    return found


def _row_dict(row: Result) -> dict[str, object]:
    # Fields left at their default are left out: the files stay short to read and diff.
    defaults = Result.__dataclass_fields__
    return {k: v for k, v in asdict(row).items()
            if k in ("area", "measure", "value", "unit", "machine", "date", "command")
            or v != defaults[k].default}


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def rows_markdown(rows: Sequence[Result]) -> str:
    """The rows a run records, as the page shows them (printed at the end of a report,
    so a ``--quick`` run shows them too)."""
    import report
    if not rows:
        return "### Recorded rows\n\nnone: a measure or its peer is missing from this run\n"
    return "### Recorded rows\n\n" + report.render_rows(rows) + "\n"
