"""Smoke tests of the benchmarks: every entry point's ``--quick`` run, as a real subprocess
(``python benchmarks/X.py --quick``), must exit 0 and print the lines its report is for
(ratios, targets, checks), must leave docs/BENCHMARKS.md alone and must remove its
scratch folder. Benchmarks are otherwise only linted, so this is what catches API drift
in their paths (a renamed module, a changed signature, a newly refused call).

The selected runs start together when the first of them is asked for, at most
``PARALLEL`` at a time (the 2-core machine's time is mostly spent waiting: process
start-up, nodes coming up, fixed-length timed runs), each with ``TMPDIR`` in a pytest
temporary folder of its own, so runs of the suite in parallel cannot collide.

Not here:
- ``vllm_gpu_smoke.py`` (isolane's connector or LMCache's) and ``sglang_gpu_smoke.py``
  need a GPU and a model (``vllm serve``/``sglang.launch_server`` of a real checkpoint):
  they have no ``--quick`` mode and cannot run on this CPU-only machine.
- ``soak.py`` has its smoke test in tests/test_soak.py (its ``--quick`` run, with every
  invariant checked), not repeated here.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PARALLEL = 3
TIMEOUT_S = 420.0
RATIO = r"\d+\.\d\dx"  # a ratio as the reports print it: 1.23x


@dataclass(frozen=True)
class Case:
    script: str
    args: tuple[str, ...] = ()
    # Regular expressions (re.MULTILINE) that must each match the run's stdout.
    expect: tuple[str, ...] = ()
    # Substrings that must not appear in stdout (a row that failed reads ERROR).
    refuse: tuple[str, ...] = ("ERROR",)


CASES: dict[str, Case] = {
    "kv_eviction": Case("bench_kv_eviction.py", expect=(
        r"^\| `s3fifo` vs `lru` \(points\) \| [+-]\d+\.\d \| [+-]\d+\.\d \|",
        r"^Unlimited cache \(ceiling\): \*\*\d+\.\d %\*\*",
        r"^\| `lru` \|( \*?\*?\d+\.\d %\*?\*? \|){2}",
        r"^\| unlimited \| \d+\.\d % \| \d+\.\d % \| \d+\.\d % \|",
        r"^\| block hit rate, Mooncake trace, cache 50 % of unique blocks, s3fifo \| [\d.]+ % \| "
        r"unlimited cache \(ceiling\): ")),
    "kv_memtier": Case("bench_kv_memtier.py", expect=(
        # policy | resident | kept (with ghosts) | B/entry filled | after churn | vs value
        r"^\| s3fifo \| 20,000 \| [\d,]+ \| \d+ \| \d+ \| \d+\.\d % \|",
        r"^\| lru \| 20,000 \| [\d,]+ \| \d+ \| \d+ \| \d+\.\d % \|")),
    "kv_scale": Case("bench_kv_scale.py", expect=(
        r"^- isolane: `.*bench_kv_scale\.py",
        r"^- lmdb: `.*bench_kv_scale\.py",
        r"^\| lookups, 20,000 blocks of 512 B \| [\d,]+ keys/s \| LMDB, same blocks: ",
        r"^\| index memory, 20,000 blocks of 512 B \| [\d.]+ B/block \| LMDB, same blocks: ",
        r"^\| cold reopen, 20,000 blocks of 512 B \| [\d.]+ s per 1M blocks \|")),
    "kv": Case("bench_kv.py", expect=(
        r"^\| prompt restore, 4 blocks of 32 MiB, share of the read limit \| [\d.]+ ms \| "
        r"sequential read of the same bytes: [\d.]+ ms \| \d+ % \|",
        r"^> the isolane pool reopened with its last block read back; a new LMCache ",
        r"^\| reopen a full store \([\d.]+ [MG]B of 64KiB blocks\), cold \| [\d.]+ s \| LMCache ",
        r"^\| prompt restore, 4 blocks of 32 MiB, get_into, cold \| [\d.]+ ms \| LMCache "
        r"LocalDiskBackend: ",
        r"^\| prompt restore, 16 blocks of 64 KiB, get_into, cold \| [\d.]+ ms \| one file "
        r"per block, serial reads: ",
        r"^\| random 64 KiB reads \(Zipf\), warm, 1 thread, p99 \| [\d,]+ µs \| LMDB: ",
        r"^\| random 64 KiB reads \(Zipf\), cold, 1 thread, p99 \| [\d,]+ µs \| LMDB: ")),
    "snapshot": Case("bench_snapshot.py", expect=(
        r"^\| save, [\d.]+ GB training state .*, until durable \| [\d.]+ s \| torch\.save: ",
        r"^\| save, share of the device's write limit \| [\d.]+ s \| simple writer \(pwrite "
        r"loop, 64 MiB O_DIRECT, 4 threads\): ",
        r"^\| save, against DCP \| [\d.]+ s \| DCP FileSystemWriter, thread_count=4: ",
        r"^\| load\(\) into new tensors, cold page cache \| [\d.]+ s \| torch\.load",
        r"^\| load\(into=\.\.\.\) into the model's tensors, cold page cache \| [\d.]+ s \| "
        r"torch\.load\(weights_only=True\): ",
        r"^\| load\(into=\.\.\.\), share of the cold read limit of its chunk files \| ",
        r"^\| save_async, time the training loop is blocked \| [\d.]+ s \| its sync save: ",
        r"^\| LoRA re-save \(adapter changed\) \| [\d.]+ s \| torch\.save re-save: ")),
    "kv_engines": Case("bench_kv_engines.py", expect=(
        r"^\| LMCache: cold restore of a 64-page prompt \(64 KiB pages\), isolane \(plugin\) \| "
        rf"[\d.]+ ms \| LMCache LocalDiskBackend: [\d.]+ ms \| {RATIO} \| ≥ 1\.5x",
        r"^\| LMCache: pages served after a restart, isolane \(plugin\) \| 100 % \| LMCache "
        r"LocalDiskBackend: \d+ % \| [+-]?\d+\.\d points \| 100 %, met \|",
        r"^\| SGLang: cold restore of a 64-page prompt \(64 KiB pages\), isolane \(HiCache "
        rf"backend\) \| [\d.]+ ms \| SGLang HiCacheFile: [\d.]+ ms \| {RATIO} \| ≥ 1\.5x",
        r"^\| SGLang: pages served after a restart, isolane \(HiCache backend\) \| 100 % \| "
        r"SGLang HiCacheFile: \d+ % \| [+-]?\d+\.\d points \| 100 %, met \|")),
    "dcp": Case("bench_dcp.py", expect=(
        r"^\| DCP save, 2 ranks, [\d.]+ GB FSDP2 state, IsolaneStorageWriter \| [\d.]+ s \| "
        r"s3torchconnector S3StorageWriter \(SeaweedFS\): [\d.]+ s \|",
        r"^\| DCP save, 2 ranks, [\d.]+ GB FSDP2 state, IsolaneStorageWriter \| [\d.]+ s \| "
        r"best DCP FileSystemWriter",
        r"^\| DCP load, 2 ranks, .* \| best DCP FileSystemReader",
        r"^\| DCP async_save blocking, 2 ranks, .* \| its sync save: [\d.]+ s \| \d+ % \|",
        r"^\| DCP LoRA re-save \(adapters changed\), 2 ranks, .* \| best DCP FileSystemWriter")),
    "vllm_connector": Case("bench_vllm_connector.py", expect=tuple(
        rf"^\| vLLM forward step with the connector, {what}, {device} \| [\d.]+ ms \| no "
        rf"connector: [\d.]+ ms \| {RATIO} \|"
        for what in ("async loads from a warm pool", "async stores")
        for device in ("no device time", "5 ms of device time"))),
    "routing": Case("bench_routing.py", expect=(
        r"^\| `segment affine spill` \| `mooncake-conversation` \| [+-]?\d+\.\d points",
        r"^\| `segment bounded` \| `agent-loops` \| [+-]?\d+\.\d points",
        r"^\| `per-block mod-N` \| \*?\*?\d+\.\d %",
        r"^### Keys moved on join and leave",
        r"^\| `shared-docs` \| `segment affine spill` \| \d\.\d\dx \(\d\.\d\dx\) \|",
        r"^### Noise of the hit-rate gaps",
        r"^\| `agent-loops` \| [+-]\d+\.\d, [+-]\d+\.\d \| \d+\.\d \| [+-]\d+\.\d, "
        r"[+-]\d+\.\d \| \d+\.\d \| [+-]\d+\.\d \| (within|beyond) noise \|",
        r"^### A lost node",
        r"^\| mooncake-conversation \| 3 \| `segment affine spill` \| \d+\.\d % \| \d+\.\d % ")),
    "cluster": Case("bench_cluster.py", expect=(
        r"^\| batch gets from 3 nodes, 4 blocks of 2 MiB a call, 32 threads \| [\d.]+ GB/s \| "
        rf"redis-server MGET \(redis-py, 1 MiB socket reads\): [\d.]+ GB/s \| {RATIO} \| ≥ 0\.5x",
        r"^\| batch gets from 3 nodes, 16 blocks of 64 KiB a call, 32 threads \| [\d.]+ GB/s \| "
        rf"redis-server MGET \(redis-py, 1 MiB socket reads\): [\d.]+ GB/s \| {RATIO} \|")),
    "cluster_locality": Case("bench_cluster.py", ("--locality",), expect=tuple(
        rf"^\| prompt restore from 4 nodes, {tokens} tokens, segments of S = 4 blocks \| "
        rf"[\d.]+ GB/s \| per-block placement: [\d.]+ GB/s \| {RATIO} \|  \| "
        rf"requests a restore: \d+\.\d with segments, {per_block}\.\d per block \|"
        # per block, the 16 and 64 blocks of the longer prompts spread over the 4 nodes
        for tokens, per_block in (("1,024", r"\d+"), ("4,096", "[2-4]"), ("16,384", "4")))),
    "cluster_node_loss": Case("bench_cluster.py", ("--node-loss",), expect=(
        r"^\| prefix tokens served after 1 of 3 real nodes is SIGKILLed, prompts of 32 blocks \| "
        r"[\d.]+ % \| one copy's limit \(N-1\)/N: [\d.]+ % \| \d+ % \|.*\| segments by their "
        r"own digests \(before\): \d+\.\d % \|",
        r"^\| stored block copies, 3 real nodes \| [\d.]+ x unique blocks \|")),
    "cluster_snapshots": Case("bench_cluster.py", ("--snapshots",), expect=(
        rf"^\| save through a node \([\d.]+ GB, loopback\) \| [\d.]+ s \| embedded save: "
        rf"[\d.]+ s \| {RATIO} \|",
        rf"^\| load through a node \([\d.]+ GB, cold page cache\) \| [\d.]+ s \| embedded "
        rf"load: [\d.]+ s \| {RATIO} \|",
        r"^\| save_async through a node: time until the call returns / sync save \| [\d.]+ s "
        r"\| its sync save through the node: [\d.]+ s \| \d+ % \|",
        r"^\| LoRA re-save through a node vs its first save \| [\d.]+ s \| first save ",
        r"^- the bound of save_async's blocking: copying the same bytes",
        r"^- the floor of the LoRA re-save: the embedded store's re-save",
        r"^- the bound on this machine \(\d+ cores shared by client and server\)",
        r"^\| restore from the S3 mirror \([\d.]+ GB, SeaweedFS on loopback\) \| [\d.]+ s \| "
        r"s3fs, one stream: ")),
    "integrations": Case("bench_integrations.py", expect=(
        r"^\| transformers generate: time to first token, 1,024-token prompt \(768 cached\), "
        rf"warm pool \| [\d.]+ s \| no cache: [\d.]+ s \| {RATIO} \| ≥ 5x",
        r"^\| transformers generate: time to first token, 1,024-token prompt \(768 cached\), "
        r"cold pool \(page cache dropped, pool reopened\) \| [\d.]+ s \| no cache: ",
        r"^\| transformers generate: time to first token, 1,024-token prompt \(768 cached\), "
        r"through an isolane serve node on loopback \| [\d.]+ s \| no cache: ",
        r"^\| training loop blocked per async checkpoint \([\d.]+ GB, every 4 steps\) \| "
        r"[\d.]+ s \| torch\.save \+ fsync: ",
        r"^\| training slowdown from async checkpoints every 4 steps \(estimated\) \| ")),
    "isolation": Case("bench_isolation.py", expect=(
        r"^\| \(a\) same process: KV read p99 under saves / idle, host lane plane \| [\d,.]+ µs"
        r" \| KV reads alone \(idle\): ",
        r"^\| \(c\) 2-rank torchrun job: KV read p99 under saves / idle, host lane plane \| ",
        r"^\| \(a\) same process: KV read p99 under saves, host lane plane \| [\d,.]+ µs \| "
        r"per-process lanes: ",
        # every layout measured (its SLO), (b) and (c) the plane only
        r"SLO = 1\.4 x the layout's idle p99 \(a: [\d.]+ ms, b: [\d.]+ ms, c: [\d.]+ ms\)")),
}


@dataclass
class Run:
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    scratch_left: list[str]
    docs_changed: bool


def _docs_digest() -> str:
    docs = REPO / "docs" / "BENCHMARKS.md"
    return hashlib.sha256(docs.read_bytes()).hexdigest() if docs.exists() else ""


def run_quick(case: Case, tmp: Path) -> Run:
    argv = [sys.executable, str(REPO / "benchmarks" / case.script), "--quick", *case.args]
    env = {**os.environ, "TMPDIR": str(tmp),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                       os.environ.get("PYTHONPATH")]))}
    before = _docs_digest()
    began = time.perf_counter()
    try:
        proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=TIMEOUT_S)
        code, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        code, out, err = -1, str(exc.stdout or ""), f"timed out after {TIMEOUT_S} s"
    return Run(argv, code, out, err, time.perf_counter() - began,
               sorted(p.name for p in tmp.glob("isolane-quick-*")), _docs_digest() != before)


@pytest.fixture(scope="module")
def quick_runs(request: pytest.FixtureRequest,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future[Run]]]:
    """The ``--quick`` runs of the selected cases, started together (``PARALLEL`` at a
    time) so that the slow set takes the time of its longest members, not their sum."""
    names = [item.callspec.params["name"] for item in request.session.items
             if item.module is request.module and hasattr(item, "callspec")
             and "name" in item.callspec.params]
    with ThreadPoolExecutor(max_workers=PARALLEL) as pool:
        yield {name: pool.submit(run_quick, CASES[name], tmp_path_factory.mktemp(name))
               for name in dict.fromkeys(names)}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_quick_run_prints_its_report_and_writes_nothing_it_keeps(
        name: str, quick_runs: dict[str, Future[Run]]) -> None:
    case = CASES[name]
    run = quick_runs[name].result(timeout=2 * TIMEOUT_S)
    where = (f"{' '.join(run.argv)} ({run.seconds:.0f} s)\n--- stdout (end) ---\n"
             f"{run.stdout[-4000:]}\n--- stderr (end) ---\n{run.stderr[-6000:]}")
    assert run.returncode == 0, where
    missing = [p for p in case.expect if not re.search(p, run.stdout, re.MULTILINE)]
    assert not missing, f"report lines not found: {missing}\n{where}"
    found = [s for s in case.refuse if s in run.stdout]
    assert not found, f"{found} in the report\n{where}"
    assert not run.docs_changed, f"--quick rewrote docs/BENCHMARKS.md\n{where}"
    assert not run.scratch_left, f"scratch folders left behind: {run.scratch_left}\n{where}"


def test_every_benchmark_entry_point_has_a_smoke_test_here_or_a_reason() -> None:
    scripts = {p.name for p in (REPO / "benchmarks").glob("*.py") if not p.name.startswith("_")}
    covered = {c.script for c in CASES.values()}
    # see the module docstring; report.py renders docs/BENCHMARKS.md from the results
    # files (tests/test_benchmark_results.py); the GPU smoke scripts need a GPU
    elsewhere = {"soak.py", "vllm_gpu_smoke.py", "sglang_gpu_smoke.py", "report.py"}
    assert scripts - elsewhere == covered, (scripts - elsewhere) ^ covered


@pytest.mark.parametrize("script", ["bench_kv_eviction.py", "bench_dcp.py",
                                    "bench_kv_engines.py"])
def test_quick_refuses_out_and_writes_no_section(tmp_path: Path, script: str) -> None:
    out = tmp_path / "BENCHMARKS.md"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), "--quick",
         "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**os.environ, "TMPDIR": str(tmp_path)})
    assert proc.returncode == 2, proc.stderr
    assert "--quick prints its report and writes no file: drop --out" in proc.stderr
    assert not out.exists()
