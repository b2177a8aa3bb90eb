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


# -- benchmarks' row builders: pure functions of a run's raw results ---------------------
WHERE = {"machine": "2 CPUs", "date": "2026-12-04 18:00 UTC",
         "command": "python benchmarks/x.py --out docs/BENCHMARKS.md"}


def _dcp_raw(**world_overrides: object) -> dict[str, object]:
    """The shape and numbers of a real ``bench_dcp.py --quick`` run (2 ranks)."""
    world: dict[str, object] = {
        "world": 2, "nbytes": 7864352, "lora_bytes": 9764928,
        "written": [9768109], "linked": [0],
        "runs": {
            "isolane": {"save": [0.2355], "load": [0.1491], "async_block": [0.1716],
                        "resave": [0.4122]},
            "fs1": {"save": [0.1285], "load": [0.2307], "async_block": [0.2022],
                    "resave": [0.3402]},
            "fs4": {"save": [0.1607], "load": [0.2496], "async_block": [0.0450],
                    "resave": [0.1921]},
            "s3tc": {"save": [1.1743], "load": [0.4379], "resave": [0.6291]},
            "limit": {"save": [0.4993]}, "noop": {"resave": [0.1181]}},
        "checks": {"isolane": [True], "fs1": [True], "fs4": [True], "s3tc": [True]},
        "dropped": True}
    world.update(world_overrides)
    return {"results": [world], "skipped": {}}


def _by_measure_and_peer(rows: list[Result]) -> dict[tuple[str, str | None], Result]:
    return {(row.measure.split(",")[0], row.peer): row for row in rows}


def test_dcp_rows_put_each_measure_beside_its_same_run_peer_and_target(
        tmp_path: Path) -> None:
    import bench_dcp
    rows = bench_dcp.headline_rows(_dcp_raw(), WHERE)
    got = _by_measure_and_peer(rows)
    assert len(rows) == 5 and {r.area for r in rows} == {"Checkpoints"}
    save = got["DCP save", "best DCP FileSystemWriter (1 thread)"]
    assert (save.value, save.peer_value, save.ratio, save.target, save.met) == (
        0.235, 0.129, 0.55, "≥ 1.3x", False)
    assert "2 ranks, 0.01 GB FSDP2 state" in save.measure
    # the writer beat the pwrite loop here (page-cache writes overlapping their fsyncs):
    # that measurement bounds nothing, and the why says so instead of citing a ceiling
    assert save.why == ("this run's pwrite loop, 64 MiB O_DIRECT, 4 threads wrote the same "
                        "bytes in 0.50 s: slower than DCP FileSystemWriter (1 thread), so "
                        "it bounds nothing here")
    s3 = got["DCP save", "s3torchconnector S3StorageWriter (SeaweedFS)"]
    assert (s3.ratio, s3.target, s3.met, s3.why) == (4.99, None, None, None)
    load = got["DCP load", "best DCP FileSystemReader (1 thread)"]
    assert (load.ratio, load.met, load.why) == (1.55, True, None)
    blocking = got["DCP async_save blocking", "its sync save"]
    assert (blocking.ratio, blocking.ratio_unit, blocking.target, blocking.met) == (
        72.9, "%", "≤ 10 %", False)
    assert blocking.why == ("async_save with DCP FileSystemWriter (4 threads) blocks 28 % of "
                            "its sync save in this run")
    lora = got["DCP LoRA re-save (adapters changed)", "best DCP FileSystemWriter (4 threads)"]
    assert (lora.ratio, lora.target, lora.met) == (0.47, "≥ 10x", False)
    assert lora.why == ("isolane wrote 0.010 GB and linked 0.000 GB of the 0.01 GB state; "
                        "DCP's own floor (the same dcp.save through a no-op StorageWriter) "
                        "is 0.118 s: at most 1.63x")
    page = tmp_path / "BENCHMARKS.md"
    write_results("dcp", rows, results_dir=tmp_path, page=page)
    assert "| DCP save, 2 ranks, 0.01 GB FSDP2 state, IsolaneStorageWriter | 0.235 s | " \
           "best DCP FileSystemWriter (1 thread): 0.129 s | 0.55x | ≥ 1.3x, **not met** |" \
           in page.read_text()


def test_dcp_why_states_the_ceiling_of_the_runs_limit_and_the_page_cache() -> None:
    import bench_dcp
    raw = _dcp_raw(dropped=False)
    runs = raw["results"][0]["runs"]  # type: ignore[index]
    runs["limit"]["save"] = [0.05]
    runs["isolane"]["load"] = [0.3]
    got = _by_measure_and_peer(bench_dcp.headline_rows(raw, WHERE))
    save = got["DCP save", "best DCP FileSystemWriter (1 thread)"]
    assert save.why == ("this run's pwrite loop, 64 MiB O_DIRECT, 4 threads wrote the same "
                        "bytes in 0.05 s: at most 2.57x over DCP FileSystemWriter (1 thread);"
                        " isolane reached 21 % of that bound")
    runs["limit"]["save"] = [0.11]
    got = _by_measure_and_peer(bench_dcp.headline_rows(raw, WHERE))
    assert got["DCP save", "best DCP FileSystemWriter (1 thread)"].why.endswith(
        "at most 1.17x over DCP FileSystemWriter (1 thread), below the 1.3x target")
    load = got["DCP load", "best DCP FileSystemReader (1 thread)"]
    assert load.met is False and load.why is not None and "not dropped" in load.why


def test_dcp_save_bound_adds_dcps_own_floor_to_the_write_limit() -> None:
    import bench_dcp
    raw = _dcp_raw()
    runs = raw["results"][0]["runs"]  # type: ignore[index]
    runs["limit"]["save"] = [0.10]
    runs["noop"]["save"] = [0.02]
    save = _by_measure_and_peer(bench_dcp.headline_rows(raw, WHERE))[
        "DCP save", "best DCP FileSystemWriter (1 thread)"]
    assert save.why is not None and save.why.endswith(
        "at most 1.28x over DCP FileSystemWriter (1 thread); DCP's own floor (the same "
        "dcp.save through a no-op StorageWriter), which every writer pays besides its "
        "writes, took 0.020 s: with it, at most 1.07x, below the 1.3x target")


def test_dcp_async_why_gives_the_same_runs_copying_floor() -> None:
    import bench_dcp
    raw = _dcp_raw()
    runs = raw["results"][0]["runs"]  # type: ignore[index]
    runs["isolane"]["async_block"] = [0.05]
    runs["copy"] = {"async_block": [0.02]}
    blocked = _by_measure_and_peer(bench_dcp.headline_rows(raw, WHERE))[
        "DCP async_save blocking", "its sync save"]
    assert blocked.met is False and blocked.why is not None and blocked.why.endswith(
        "; copying every rank's state once, all ranks at once (no I/O), as staging must, "
        "took 0.020 s: 8 % of the sync save")


def test_dcp_lora_why_gives_the_same_runs_hashing_floor() -> None:
    import bench_dcp
    raw = _dcp_raw()
    raw["results"][0]["runs"]["hash"] = {"resave": [0.05]}  # type: ignore[index]
    got = _by_measure_and_peer(bench_dcp.headline_rows(raw, WHERE))
    lora = got["DCP LoRA re-save (adapters changed)", "best DCP FileSystemWriter (4 threads)"]
    assert lora.why is not None and lora.why.endswith(
        "; hashing every byte on all ranks at once (xxh3-128, no I/O), as finding what "
        "changed needs, took 0.050 s; with DCP's floor at most 1.14x")


def test_dcp_records_nothing_from_a_run_that_misread_or_left_isolane_out() -> None:
    import bench_dcp
    with pytest.raises(ValueError, match="fs4 did not read back bit for bit"):
        bench_dcp.headline_rows(_dcp_raw(checks={"isolane": [True], "fs4": [False]}), WHERE)
    raw = _dcp_raw()
    del raw["results"][0]["runs"]["isolane"]  # type: ignore[index]
    raw["skipped"] = {"isolane": "no module"}
    with pytest.raises(ValueError, match=r"isolane was not run.*\(no module\)"):
        bench_dcp.headline_rows(raw, WHERE)


def _kv_engines_raw(cold: bool = True, sglang: bool = True) -> dict[str, object]:
    """The shape and numbers of the runs a real ``bench_kv_engines.py --quick`` gathers."""
    def path(name: str, engine: str, restore_s: float, after: int) -> dict[str, object]:
        return {"name": name, "engine": engine, "store_s": 0.1, "restore_s": [restore_s],
                "exact": [True], "after_restart": after}
    results = [path("isolane (plugin)", "LMCache", 0.04648, 64),
               path("LMCache LocalDiskBackend", "LMCache", 0.04633, 0)]
    if sglang:
        results += [path("isolane (HiCache backend)", "SGLang", 0.03135, 64),
                    path("SGLang HiCacheFile", "SGLang", 0.08395, 64)]
    return {"pages": 64, "page_bytes": 65536, "cold": cold, "results": results}


def test_kv_engines_rows_compare_each_engines_own_backend(tmp_path: Path) -> None:
    import bench_kv_engines
    rows = bench_kv_engines.headline_rows(_kv_engines_raw(), WHERE)
    assert [(r.measure, r.peer, r.ratio, r.met) for r in rows] == [
        ("LMCache: cold restore of a 64-page prompt (64 KiB pages), isolane (plugin)",
         "LMCache LocalDiskBackend", 1.0, False),
        ("LMCache: pages served after a restart, isolane (plugin)",
         "LMCache LocalDiskBackend", 100.0, True),
        ("SGLang: cold restore of a 64-page prompt (64 KiB pages), isolane (HiCache backend)",
         "SGLang HiCacheFile", 2.68, True),
        ("SGLang: pages served after a restart, isolane (HiCache backend)",
         "SGLang HiCacheFile", 0.0, True)]
    assert (rows[0].value, rows[0].peer_value, rows[0].target, rows[0].why) == (
        46.48, 46.33, "≥ 1.5x", None)
    assert (rows[1].value, rows[1].peer_value, rows[1].ratio_unit, rows[1].target) == (
        100.0, 0.0, "points", "100 %")
    write_results("kv_engines", rows, results_dir=tmp_path, page=tmp_path / "B.md")
    assert "| SGLang: pages served after a restart, isolane (HiCache backend) | 100 % | " \
           "SGLang HiCacheFile: 100 % | +0.0 points | 100 %, met |" \
           in (tmp_path / "B.md").read_text()


def test_kv_engines_warm_misses_say_so_and_missing_engines_are_left_out() -> None:
    import bench_kv_engines
    rows = bench_kv_engines.headline_rows(_kv_engines_raw(cold=False, sglang=False), WHERE)
    assert [r.measure.split(":")[0] for r in rows] == ["LMCache", "LMCache"]
    assert rows[0].why is not None and "warm" in rows[0].why
    raw = _kv_engines_raw()
    raw["results"][3]["exact"] = [False]  # type: ignore[index]
    with pytest.raises(ValueError, match="SGLang HiCacheFile were not byte-exact"):
        bench_kv_engines.headline_rows(raw, WHERE)


def _iso_run(p99_us: float, gbps: float | None = None, rate_mb: float | None = None
             ) -> dict[str, object]:
    """One run of ``bench_isolation.py`` as its layout file keeps it: 98 fast reads and 2
    at ``p99_us`` (so the run's p99 is ``p99_us``); none for a saves-only run."""
    reads = [p99_us / 2] * 98 + [p99_us] * 2 if p99_us else []
    return {"latencies_us": reads, "lane_latencies_us": reads, "save_gbps": gbps,
            "rate_median_mb": rate_mb, "saver_cpu_s": None, "written_bytes": 0}


def test_isolation_rows_judge_the_plane_against_idle_and_the_oracle_cap() -> None:
    import bench_isolation
    data = {"layout": "b", "slo_ms": 7.0, "caps_mb": [200.0, 400.0], **WHERE,
            "rows": {"idle": [_iso_run(5000)], "solo": [_iso_run(0, 0.5)],
                     "none": [_iso_run(50000, 0.4)], "lanes": [_iso_run(40000, 0.3)],
                     "plane": [_iso_run(6000, 0.1, 150.0)],
                     "cap 200": [_iso_run(6500, 0.18)], "cap 400": [_iso_run(9000, 0.3)]}}
    rows = bench_isolation.headline_rows([data])
    got = {(r.measure, r.peer): r for r in rows}
    idle = got["(b) another process: KV read p99 under saves / idle, host lane plane",
               "KV reads alone (idle)"]
    assert (idle.value, idle.peer_value, idle.ratio, idle.target, idle.met) == (
        6000, 5000, 1.2, "≤ 1.5x", True)
    none = got["(b) another process: KV read p99 under saves, host lane plane", "no isolation"]
    assert (none.peer_value, none.ratio) == (50000, 8.33)
    # cap 400 is over the SLO (7 ms): the oracle is cap 200
    share = got["(b) another process: save throughput within the SLO / the oracle cap",
                "best static cap meeting the SLO (200 MB/s)"]
    assert (share.value, share.peer_value, share.ratio, share.ratio_unit, share.met) == (
        0.1, 0.18, 56, "%", False)
    assert share.why is not None and share.why.startswith(
        "the host write limit held a median 150 MB/s against the oracle's 200: the law ")
    assert {r.area for r in rows} == {"Isolation"} and len(rows) == 4


def _scale_row(store: str, puts_s: float, lookups_s: float, index: float, cold: float
               ) -> dict[str, object]:
    return {"store": store, "blocks": 1_000_000, "block_bytes": 4096, "put_s": puts_s * 2,
            "head_s": puts_s, "head_n": 500_000, "lookups": 400_000, "lookup_s": lookups_s,
            "single_get_s": [40e-6] * 99 + [90e-6], "when": WHERE["date"],
            "machine": WHERE["machine"], "command": WHERE["command"],
            "reopen": {"index_bytes": index * 1_000_000, "cold": cold, "cold_first": cold,
                       "warm": 0.1}}


def test_kv_scale_rows_put_each_isolane_measure_beside_lmdb_on_the_same_blocks() -> None:
    import bench_kv_scale
    rows = bench_kv_scale.headline_rows([_scale_row("isolane", 2.0, 0.2, 58.0, 0.15),
                                         _scale_row("lmdb", 5.0, 0.1, 20.0, 0.01)])
    got = {r.measure.split(",")[0]: r for r in rows}
    puts = got["puts into the page cache (first 2 GiB)"]
    assert (puts.value, puts.peer, puts.peer_value, puts.ratio, puts.met) == (
        250_000, "LMDB, same blocks", 100_000, 2.5, True)
    lookups = got["lookups"]
    assert (lookups.value, lookups.ratio, lookups.target, lookups.met) == (
        2_000_000, 0.5, "≥ 300,000 keys/s", True)
    index = got["index memory"]
    assert (index.value, index.peer_value, index.ratio, index.met) == (58.0, 20.0, 0.34, True)
    cold = got["cold reopen"]
    assert (cold.value, cold.unit, cold.met) == (0.15, "s per 1M blocks", True)
    assert got["single get"].unit == "µs"
    alone = bench_kv_scale.headline_rows([_scale_row("isolane", 2.0, 0.2, 70.0, 0.3)])
    assert all(r.peer is None for r in alone)
    assert [r.met for r in alone if r.target] == [True, True, False, False]


def test_the_node_loss_hit_rate_row_shows_both_hit_rates_in_percent() -> None:
    import _route_loss

    where = {"machine": "m", "date": "d", "command": "c"}
    runs = [_route_loss.LossResult(_route_loss.HEADLINE_TRACE, router, 3, 4, share=0.66,
                                   share_long=0.66, stored=1.0, block_hits=hits)
            for router, hits in ((_route_loss.CLIENT_ROUTER, 0.245),
                                 (_route_loss.BASELINE_ROUTER, 0.241))]
    row = next(r for r in _route_loss.headline_rows(runs, where) if "hit rate" in r.measure)
    assert (row.value, row.unit, row.peer_value) == (24.5, "%", 24.1)
    assert row.ratio == pytest.approx(24.5 / 24.1, abs=0.01)


def test_routing_rows_judge_the_client_placement_with_the_one_before_beside_it() -> None:
    import argparse

    import _route_report
    import _route_sim as sim

    where = {"machine": "m", "date": "d", "command": "c"}
    args = argparse.Namespace(nodes=(4, 8), labels=(("s3fifo", 10.0), ("lru", None)))

    def res(router: str, n: int, hit: float, load: float) -> sim.CaseResult:
        r = sim.CaseResult("t", router, n, 4, max_over_mean=load)
        r.block_hits = {"s3fifo 10": hit, "lru inf": 0.9}  # unlimited: not judged
        return r

    results = [res("per-block ring", n, 0.500, 1.1) for n in (4, 8)] + [
        res("per-block mod-N", 4, 0.502, 1.0), res("per-block mod-N", 8, 0.498, 1.0),
        res(sim.CLIENT_ROUTER, 4, 0.5015, 1.12), res(sim.CLIENT_ROUTER, 8, 0.493, 1.2),
        res(sim.BEFORE, 4, 0.490, 1.3), res(sim.BEFORE, 8, 0.499, 1.1)]
    moves = [sim.MoveResult("t", sim.CLIENT_ROUTER, 4, 5, [0.2, 0.21, 0.25]),
             sim.MoveResult("t", sim.CLIENT_ROUTER, 4, 3, [0.9]),  # a leave: not a join
             sim.MoveResult("t", sim.BEFORE, 4, 5, [0.3, 0.3, 0.3])]
    rows = _route_report.headline_rows(args, ["t"], results, moves, where)
    hits, load, join = rows
    assert {r.area for r in rows} == {"Cluster and routing"}
    assert "N = 4/8" in hits.measure and "t trace" in hits.measure
    # worst gap: N = 8, 49.3 % against ring's 50.0 %; before: N = 4, 49.0 vs mod-N 50.2
    assert (hits.value, hits.unit, hits.peer_value, hits.met) == (-0.7, "points", -1.2,
                                                                   False)
    assert hits.why is not None and "N = 8" in hits.why and "N = 4" in hits.why
    assert (load.value, load.peer_value, load.met) == (1.2, 1.3, True)
    # the median of the join trials over the ideal 1/5
    assert (join.value, join.peer_value, join.met) == (pytest.approx(1.05), 1.5, True)
    assert join.unit == "x ideal 1/N"
    assert join.why is not None and "1.25x" in join.why  # the worst trial, 0.25 / 0.2


def test_routing_rows_say_where_the_gap_and_the_join_moves_come_from() -> None:
    import argparse

    import _route_report
    import _route_sim as sim

    where = {"machine": "m", "date": "d", "command": "c"}
    args = argparse.Namespace(nodes=(64,), labels=(("s3fifo", 5.0),))

    def res(router: str, hit: float, long_hit: float | None = None) -> sim.CaseResult:
        r = sim.CaseResult("t", router, 64, 4, max_over_mean=1.2)
        r.block_hits = {"s3fifo 5": hit}
        if long_hit is not None:
            r.node_cache = {"s3fifo 5": 143}
            r.long_hits = {"s3fifo 5": long_hit}
            r.long_blocks = {"s3fifo 5": 0.42}
        return r

    results = [res("per-block ring", 0.180), res("per-block mod-N", 0.178),
               res(sim.CLIENT_ROUTER, 0.166, 0.038), res(sim.BEFORE, 0.1736, 0.0438)]
    moves = [sim.MoveResult("t", sim.CLIENT_ROUTER, 64, 65, [0.017, 0.018, 0.02],
                            [0.001, 0.0008, 0.002]),
             sim.MoveResult("t", sim.BEFORE, 64, 65, [0.0155, 0.0155, 0.0155])]
    hits, _, join = _route_report.headline_rows(args, ["t"], results, moves, where)
    # 0.58 of the 0.76 points below before are requests of >= 72 blocks
    assert hits.why is not None and "caches 143 blocks" in hits.why
    assert "the client's placement is 0.76 points below the placement before" in hits.why
    assert ">= 72 blocks (42 % of blocks)" in hits.why and "make 0.58 of them" in hits.why
    # median join 0.018 x 65 = 1.17x; its spilled-with-the-home part 0.001 x 65 = 0.07x
    assert join.value == pytest.approx(1.17)
    assert join.why is not None and "0.07x of the worst median" in join.why


def test_routing_note_says_above_when_the_client_is_ahead_of_before() -> None:
    import _route_report
    import _route_sim as sim

    label = "s3fifo 5"

    def cell(router: str, hits: float, long_hits: float) -> sim.CaseResult:
        return sim.CaseResult(trace="t", router=router, nodes=64, s=4,
                              block_hits={label: hits}, long_hits={label: long_hits},
                              node_cache={label: 45}, long_blocks={label: 0.86})

    mine = cell(_route_report.CLIENT_ROUTER, 0.2434, 0.1548)
    targets = _route_report.Targets(gap=-0.1, gap_where="", load=1.0, join=1.0,
                                    join_worst=1.0, over_bound=0, gap_case=mine,
                                    gap_label=label)
    text = _route_report.long_request_note(
        targets, [mine, cell(_route_report.BEFORE, 0.20, 0.11)])
    assert "the client's placement is 4.34 points above the placement before" in text
    assert "make 4.48 of them" in text and "below" not in text
    assert "-" not in text.split("caches")[1]  # no negative "points below"
