"""docs/BENCHMARKS.md is rendered from benchmarks/results/*.json and nothing else: the
committed page must equal the generator's output, and the results files must read back.
Pure file work, well under a second."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import _results  # noqa: E402
import report  # noqa: E402
from _results import Result, read_results, write_results  # noqa: E402


def _row(**overrides: object) -> Result:
    fields: dict[str, object] = dict(
        area="KV pool", measure="prompt restore", value=2.0, unit="ms",
        machine="2 CPUs", date="2026-12-04 10:00 UTC", command="python benchmarks/x.py",
        peer="one file per block", peer_value=5.0, ratio=2.5, target="≥ 3x", met=False,
        why="the device's own limit is 2.8x here")
    fields.update(overrides)
    return Result(**fields)  # type: ignore[arg-type]


def test_committed_page_equals_the_generators_output() -> None:
    committed = (REPO / "docs" / "BENCHMARKS.md").read_text()
    assert committed == report.page_text(), (
        "docs/BENCHMARKS.md differs from benchmarks/results/: run "
        "python benchmarks/report.py (never edit the page by hand)")


def test_check_mode_reports_a_page_that_drifted(tmp_path: Path) -> None:
    page = tmp_path / "BENCHMARKS.md"
    page.write_text(report.page_text() + "a line written by hand\n")
    argv = [sys.executable, str(REPO / "benchmarks" / "report.py"), "--check", "--page",
            str(page)]
    drifted = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert drifted.returncode == 1 and "differs" in drifted.stderr
    page.write_text(report.page_text())
    assert subprocess.run(argv, capture_output=True, timeout=60).returncode == 0


def test_every_committed_results_file_reads_back_and_the_page_stays_small() -> None:
    results = read_results()
    assert {r.bench for r in results} >= {"snapshot", "kv", "isolation", "routing",
                                          "integrations"}
    areas = {row.area for bench in results for row in bench.rows}
    assert areas >= {"Checkpoints", "KV pool", "Isolation", "Cluster and routing",
                     "Integrations"}
    assert len(report.page_text().encode()) < 50_000


def test_write_results_replaces_the_file_and_renders_the_page(tmp_path: Path) -> None:
    page = tmp_path / "BENCHMARKS.md"
    write_results("kv", [_row(), _row(measure="old row")], results_dir=tmp_path, page=page)
    write_results("kv", [_row(measure="restore, 16 blocks")], results_dir=tmp_path, page=page)
    [bench] = read_results(tmp_path)
    assert [r.measure for r in bench.rows] == ["restore, 16 blocks"]
    text = page.read_text()
    assert "| restore, 16 blocks | 2 ms | one file per block: 5 ms | 2.50x | ≥ 3x, **not met** " \
           "| the device's own limit is 2.8x here | 1 |" in text
    assert "old row" not in text
    assert "1. 2026-12-04 10:00 UTC: `python benchmarks/x.py`; 2 CPUs" in text


def test_rows_of_one_run_share_its_number_and_areas_keep_their_order(tmp_path: Path) -> None:
    write_results("isolation", [_row(area="Isolation", measure="p99 a"),
                                _row(area="Isolation", measure="p99 b", date="2026-12-05")],
                  results_dir=tmp_path, page=None)
    write_results("snapshot", [_row(area="Checkpoints", measure="save")],
                  results_dir=tmp_path, page=None)
    text = report.page_text(tmp_path)
    assert text.index("## Checkpoints") < text.index("## Isolation")
    assert "| p99 a |" in text and text.split("| p99 a |")[1].split("\n")[0].endswith("| 1 |")
    assert text.split("| p99 b |")[1].split("\n")[0].endswith("| 2 |")


def test_a_file_keeps_only_fields_off_their_defaults(tmp_path: Path) -> None:
    path = write_results("kv", [_row(peer=None, peer_value=None, ratio=None, target=None,
                                     met=None, why=None)], results_dir=tmp_path, page=None)
    [row] = json.loads(path.read_text())["rows"]
    assert set(row) == {"area", "measure", "value", "unit", "machine", "date", "command"}


@pytest.mark.parametrize("bad, message", [
    (dict(area="Disks"), "area 'Disks' is not one of"),
    (dict(ratio_unit="times"), "ratio_unit 'times'"),
    (dict(command=""), "command is empty"),
    (dict(peer=None), "peer_value without a peer name"),
])
def test_a_bad_row_is_refused_naming_its_field(bad: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _row(**bad)


def test_bad_names_and_damaged_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="lower-case letters"):
        write_results("../escape", [_row()], results_dir=tmp_path, page=None)
    with pytest.raises(ValueError, match="no rows"):
        write_results("kv", [], results_dir=tmp_path, page=None)
    (tmp_path / "kv.json").write_text('{"bench": "kv", "rows": [{"measure": "x"}]}')
    with pytest.raises(ValueError, match=r"kv\.json: not a results file"):
        read_results(tmp_path)
    (tmp_path / "kv.json").write_text(json.dumps({"bench": "other", "rows": []}))
    with pytest.raises(ValueError, match="holds benchmark 'other'"):
        read_results(tmp_path)


def test_results_live_beside_the_benchmarks() -> None:
    assert _results.RESULTS_DIR == REPO / "benchmarks" / "results"
    assert _results.PAGE == REPO / "docs" / "BENCHMARKS.md"


def test_a_benchmark_writing_a_section_leaves_the_page_alone(
        capsys: pytest.CaptureFixture[str]) -> None:
    import _common
    before = _results.PAGE.read_bytes()
    try:
        _common.print_report("## a report", _results.PAGE, "soak")
        _common.replace_section(_results.PAGE, "kv", "## another")
        assert _results.PAGE.read_bytes() == before
    finally:
        _results.PAGE.write_bytes(before)
    assert "is rendered from benchmarks/results/" in capsys.readouterr().err
