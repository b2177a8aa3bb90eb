#!/usr/bin/env python
"""Batch gets from a 3-node isolane cluster on loopback vs Redis (MGET), same payloads.

    python benchmarks/bench_cluster.py --quick                      # smoke test, seconds
    python benchmarks/bench_cluster.py --locality --quick           # (each mode has one)
    python benchmarks/bench_cluster.py --snapshots --quick
    python benchmarks/bench_cluster.py --out docs/BENCHMARKS.md     # full run, ~4.5 min
    python benchmarks/bench_cluster.py --locality --out docs/BENCHMARKS.md  # ~2 min
    python benchmarks/bench_cluster.py --node-loss --quick          # a lost node
    python benchmarks/bench_cluster.py --node-loss --out docs/BENCHMARKS.md
    python benchmarks/bench_cluster.py --snapshots --out docs/BENCHMARKS.md

``--locality`` runs the other measurement instead (``_cluster_locality.py``): prompt
restores from 3-8 nodes under per-block, segment and whole-chain placement.
``--node-loss`` runs another (``_cluster_loss.py``): the share of cached prefix tokens
clients still serve after one of ``--loss-nodes`` (3) nodes is SIGKILLed, under
chain-affine segments, whole chains and segments by their own digests.
``--snapshots`` runs snapshots through a node and restores from the S3 mirror
(``_snap_node.py``, ``_snap_mirror.py``, its own section) in three parts, each short
enough for one exclusive run: ``--parts node``, ``--parts lora``, ``--parts mirror``;
each run stores its part in ``--snap-json`` and the report holds every stored part.

Real processes on 127.0.0.1: three ``isolane serve`` nodes (each a read group under
``--dir``, a memory tier large enough for its share of the corpus) and one
``redis-server`` (``--save '' --appendonly no``). One client process runs
``--concurrency`` threads; each thread, for ``--seconds``, picks a random chain and
reads its blocks in one call (``--batch``: 16 of 64 KiB, 4 of 2 MiB), timing the call:

- ``isolane``: ``RemoteKVPool.get_blocks(keys)`` (the chain's node by the cluster router,
  one ``POST /v1/kv/{ns}/get`` answered as a stream of checked frames);
- ``redis``: ``MGET`` of the same keys (redis-py with hiredis, a connection per thread),
  at redis-py's defaults (it reads the socket 32 KiB at a time) and with
  ``socket_read_size`` 1 MiB (``redis 1MiB-reads``), which large values need: the target
  is checked against the faster of the two.

Both systems hold the same blocks under the same 16-byte keys (random bytes, a corpus of
``--corpus-mib`` per block size, written before the timing and read once to warm up).
Every call's answer is checked: every block present and of the right size, and the
first answer of each thread compared byte for byte. Throughput = bytes received / wall
seconds of the run; latency = per call (one batch); CPU = user + system seconds of the
client and of the server processes during the run. Each system goes first in turn;
medians of ``--repeats`` rounds, all runs listed.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import random
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C
import _quick
import _results

C.ensure_repo_importable()

import _kv_latency as L  # noqa: E402
import _snap_node as SN  # noqa: E402
import redis as redis_module  # noqa: E402
from _nodes import NODES, Nodes  # noqa: E402

import isolane  # noqa: E402
from isolane.client.kv_pool import RemoteKVPool  # noqa: E402
from isolane.wire.layout import NamespaceLayout  # noqa: E402

SECTION = "cluster"
SIZES = {"64KiB": 64 << 10, "2MiB": 2 << 20}
SYSTEMS = ("isolane", "redis", "redis 1MiB-reads")
LABELS = {"isolane": "`isolane` (`RemoteKVPool.get_blocks`)", "redis": "`redis` (`MGET`)",
          "redis 1MiB-reads": "`redis` (`MGET`, `socket_read_size` 1 MiB)"}
BATCH = {"64KiB": 16, "2MiB": 4}  # blocks per call: 1 MiB and 8 MiB
TARGET_2MIB = 0.5  # issue 5: loopback batch-get throughput >= 0.5x Redis for 2 MiB


@dataclass
class Run:
    system: str
    size: str
    batch: int
    round: int
    calls: int
    nbytes: int
    seconds: float
    p50_ms: float
    p99_ms: float
    client_cpu_s: float = 0.0  # this process, every thread
    server_cpu_s: float = 0.0  # the nodes, or redis-server
    errors: list[str] = field(default_factory=list)

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / self.seconds / C.GB

    def cpu_ms_per_mib(self, seconds: float) -> float:
        return seconds * 1000 / max(self.nbytes / (1 << 20), 1e-9)


def package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def parser_name(versions: dict[str, str]) -> str:
    """redis-py's reply parser: hiredis when installed, else its Python one."""
    return ("its Python parser (hiredis not installed)"
            if versions.get("hiredis", "not installed") == "not installed" else "hiredis")


# -- the corpus ------------------------------------------------------------------------------
@dataclass
class Corpus:
    size: str
    block_bytes: int
    batch: int  # blocks a chain, read in one call
    chains: list[list[bytes]]  # keys, chain by chain
    data: bytes  # every block back to back, in chain order

    def value(self, chain: int, i: int) -> memoryview:
        at = (chain * self.batch + i) * self.block_bytes
        return memoryview(self.data)[at:at + self.block_bytes]

    @property
    def nbytes(self) -> int:
        return len(self.data)


def make_corpus(size: str, block_bytes: int, batch: int, total_bytes: int) -> Corpus:
    n_chains = max(4, total_bytes // (block_bytes * batch))
    rng = np.random.default_rng(block_bytes)
    data = rng.integers(0, 256, n_chains * batch * block_bytes, dtype=np.uint8).tobytes()
    chains = [[hashlib.blake2b(f"{size}/{c}/{i}".encode(), digest_size=16).digest()
               for i in range(batch)] for c in range(n_chains)]
    return Corpus(size, block_bytes, batch, chains, data)


# -- one timed run ---------------------------------------------------------------------------
Getter = Callable[[list[bytes]], Sequence[Any]]


def timed_run(system: str, corpus: Corpus, round_no: int, make_getter: Callable[[], Getter],
              concurrency: int, seconds: float, server_pids: Sequence[int] = ()) -> Run:
    latencies: list[list[float]] = [[] for _ in range(concurrency)]
    received = [0] * concurrency
    errors: list[str] = []

    def worker(t: int, wait_start: Callable[[], float]) -> None:
        get = make_getter()
        rng = random.Random(round_no * 1000 + t)
        first = True
        stop_at = wait_start()
        while time.perf_counter() < stop_at:
            c = rng.randrange(len(corpus.chains))
            keys = corpus.chains[c]
            t0 = time.perf_counter()
            values = get(keys)
            latencies[t].append(time.perf_counter() - t0)
            if len(values) != len(keys) or any(
                    v is None or len(v) != corpus.block_bytes for v in values):
                errors.append(f"{system}: chain {c} came back incomplete")
                return
            if first:
                first = False
                if any(bytes(v) != corpus.value(c, i) for i, v in enumerate(values)):
                    errors.append(f"{system}: chain {c} came back different")
                    return
            received[t] += len(keys) * corpus.block_bytes

    threads = C.TimedThreads(concurrency, worker)
    client_cpu, server_cpu = C.own_cpu_s(), C.process_cpu_s(server_pids)
    wall = threads.run(seconds)
    client_cpu, server_cpu = C.own_cpu_s() - client_cpu, C.process_cpu_s(server_pids) - server_cpu
    p50, p99 = C.p50_p99_ms(latencies)
    return Run(system, corpus.size, corpus.batch, round_no, sum(map(len, latencies)),
               sum(received), wall, p50, p99, client_cpu, server_cpu, errors[:3])


# -- the benchmark ---------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _quick.add_argument(parser)
    parser.add_argument("--sizes", default="64KiB,2MiB")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--batch", type=int, default=None,
                        help="blocks per batch get (default 16 of 64 KiB, 4 of 2 MiB)")
    parser.add_argument("--seconds", type=float, default=None, help="per timed run")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--corpus-mib", type=int, default=None, help="per block size")
    parser.add_argument("--dir", type=Path, default=C.REPO_ROOT / ".bench" / "cluster")
    parser.add_argument("--out", type=Path, help="rewrite this file's bench:cluster section")
    parser.add_argument("--json", type=Path, default=C.REPO_ROOT / ".bench" / "cluster.json")
    parser.add_argument("--locality", action="store_true",
                        help="measure prompt restores by placement instead (own section)")
    parser.add_argument("--locality-nodes", type=int, default=4, help="3 to 8 nodes")
    parser.add_argument("--locality-threads", type=int, default=4)
    parser.add_argument("--locality-seconds", type=float, default=None)
    parser.add_argument("--locality-rounds", type=int, default=None)
    parser.add_argument("--node-loss", action="store_true",
                        help="measure what one lost node costs instead (own section)")
    parser.add_argument("--loss-nodes", type=int, default=3, help="3 or 4 nodes")
    SN.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.quick:
        _quick.enter(args, parser)
    if args.locality:
        return locality_main(args)
    if args.node_loss:
        return node_loss_main(args)
    if args.snapshots:  # a section of its own (benchmarks/_snap_node.py)
        return SN.main(args)
    seconds = args.seconds or (1.0 if args.quick else 8.0)
    repeats = args.repeats or (1 if args.quick else 5)
    corpus_mib = args.corpus_mib or (16 if args.quick else 384)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    command = C.command_line()
    revision = C.isolane_revision()
    began = time.perf_counter()

    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    budget = 2 * corpus_mib * len(sizes) // NODES + 64
    nodes = Nodes(args.dir, budget << 20)
    redis_server = L.RedisServer(args.dir / "redis")
    runs: list[Run] = []
    versions: dict[str, str] = {}
    try:
        redis_server.start()
        nodes.wait_ready()
        versions = {"isolane": isolane.__version__,
                    "redis-server": redis_server.version,
                    "redis-py": importlib.metadata.version("redis"),
                    "hiredis": package_version("hiredis"),
                    "urllib3": importlib.metadata.version("urllib3"),
                    "aiohttp": importlib.metadata.version("aiohttp")}
        redis = L.redis_client(redis_server.port, max_connections=args.concurrency + 4)
        redis_big = redis_module.Redis(connection_pool=redis_module.BlockingConnectionPool(
            host="127.0.0.1", port=redis_server.port, max_connections=args.concurrency + 4,
            timeout=30, socket_read_size=1 << 20))
        for size in sizes:
            batch = args.batch or BATCH[size]
            corpus = make_corpus(size, SIZES[size], batch, corpus_mib << 20)
            print(f"{size}: {len(corpus.chains)} chains x {batch} blocks, "
                  f"{C.fmt_gb(corpus.nbytes)}", flush=True)
            layout = NamespaceLayout("uint8", (corpus.block_bytes,), chunk_tokens=1,
                                     token_dim=0)
            pool = RemoteKVPool(nodes.urls, namespace=f"bench-{size}", layout=layout,
                                connections=args.concurrency, timeout_s=30.0,
                                put_timeout_s=60.0)
            for c, keys in enumerate(corpus.chains):
                values = [corpus.value(c, i) for i in range(batch)]
                if pool.put_blocks(keys, values) != len(keys):
                    raise RuntimeError(f"isolane stored fewer blocks of chain {c}")
                pipe = redis.pipeline(transaction=False)
                for key, value in zip(keys, values, strict=True):
                    pipe.set(key, bytes(value))
                pipe.execute()
            for keys in corpus.chains:  # warm: every block read once from each
                pool.get_blocks(keys)
                redis.mget(keys)
            getters: dict[str, Callable[[], Getter]] = {
                "isolane": lambda pool=pool: pool.get_blocks,  # type: ignore[misc]
                "redis": lambda: redis.mget, "redis 1MiB-reads": lambda: redis_big.mget}
            assert redis_server.proc is not None
            servers = {"isolane": [p.pid for p in nodes.procs],
                       "redis": [redis_server.proc.pid],
                       "redis 1MiB-reads": [redis_server.proc.pid]}
            for r in range(repeats):
                for system in SYSTEMS[r % 3:] + SYSTEMS[:r % 3]:  # each goes first in turn
                    run = timed_run(system, corpus, r, getters[system], args.concurrency,
                                    seconds, servers[system])
                    runs.append(run)
                    problems = f"  ERRORS {run.errors}" if run.errors else ""
                    print(f"  round {r} {system:8} {run.gb_per_s:6.2f} GB/s  p50 "
                          f"{run.p50_ms:7.1f} ms  p99 {run.p99_ms:7.1f} ms  "
                          f"({run.calls} calls){problems}", flush=True)
            pool.close()
            redis.flushall()
    finally:
        nodes.stop()
        redis_server.stop()
    total = time.perf_counter() - began
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps([asdict(r) for r in runs], indent=1))
    text = report(runs, sizes, args, seconds, repeats, corpus_mib, command, versions, total,
                  revision)
    C.print_report(text, args.out, SECTION)
    shutil.rmtree(args.dir, ignore_errors=True)
    return 0 if not any(r.errors for r in runs) else 1


def locality_main(args: argparse.Namespace) -> int:
    """``--locality``: restores by placement (``_cluster_locality``), its own section."""
    import _cluster_locality as CL

    if not 3 <= args.locality_nodes <= 8:
        raise SystemExit("--locality-nodes must be 3 to 8")
    runs, text = CL.run_locality(args)
    path = args.json.with_name("cluster-locality.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(CL.runs_json(runs), indent=1))
    C.print_report(text, args.out, CL.SECTION)
    return 0 if not any(r.errors for r in runs) else 1


def node_loss_main(args: argparse.Namespace) -> int:
    """``--node-loss``: served share after a node dies (``_cluster_loss``), own section."""
    import _cluster_loss as CL

    if args.loss_nodes not in (3, 4):
        raise SystemExit("--loss-nodes must be 3 or 4")
    runs, text = CL.run_loss(args)
    path = args.json.with_name("cluster-node-loss.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(CL.runs_json(runs), indent=1))
    C.print_report(text, args.out, CL.SECTION)
    if args.out and _results.is_page(args.out):
        where = {"machine": C.machine_description(args.dir, {"isolane": isolane.__version__}),
                 "date": C.now_text(), "command": C.command_line()}
        _results.write_results("cluster_node_loss", CL.headline_rows(runs, where))
    return 0 if not any(r.errors for r in runs) else 1


def cpu_note(runs: list[Run], sizes: list[str]) -> str:
    """Where the CPU went, client + servers, per size and system (medians)."""
    parts = []
    for size in sizes:
        cells = []
        for name in SYSTEMS:
            rs = [r for r in runs if r.system == name and r.size == size]
            if not rs:
                continue
            client = statistics.median(r.cpu_ms_per_mib(r.client_cpu_s) for r in rs)
            server = statistics.median(r.cpu_ms_per_mib(r.server_cpu_s) for r in rs)
            cells.append(f"{name} {client:.2f} + {server:.2f}")
        parts.append(f"{size}: " + ", ".join(cells))
    return ("Where the CPU goes (ms of CPU per MiB received, client + servers, medians): "
            + "; ".join(parts) + ". The client, the three nodes and redis-server share the "
            "machine's 2 CPUs, so a system's throughput here is bounded by its client and "
            "server CPU per MiB together. isolane's nodes are Python (aiohttp) where "
            "redis-server is C; isolane's client cuts small frames out of 256 KiB reads and "
            "reads each large value in one piece.")


def report(runs: list[Run], sizes: list[str], args: argparse.Namespace, seconds: float,
           repeats: int, corpus_mib: int, command: str, versions: dict[str, str],
           total_s: float, revision: str) -> str:
    def pick(system: str, size: str) -> list[Run]:
        return [r for r in runs if r.system == system and r.size == size]

    def med(values: list[float]) -> float:
        return statistics.median(values) if values else float("nan")

    rows = []
    verdict = []
    for size in sizes:
        red_gb = med([r.gb_per_s for r in pick("redis", size)])
        for name in SYSTEMS:
            rs = pick(name, size)
            gb = med([r.gb_per_s for r in rs])
            batch = rs[0].batch if rs else 0
            rows.append([
                LABELS[name], size, f"{batch} ({batch * SIZES[size] >> 20} MiB)",
                f"{med([r.calls / r.seconds for r in rs]):.0f}", f"{gb:.2f}",
                f"{med([r.p50_ms for r in rs]):.1f}", f"{med([r.p99_ms for r in rs]):.1f}",
                C.fmt_ratio(C.ratio(gb, red_gb)),
                f"{med([r.cpu_ms_per_mib(r.client_cpu_s) for r in rs]):.2f}",
                f"{med([r.cpu_ms_per_mib(r.server_cpu_s) for r in rs]):.2f}",
                ", ".join(f"{r.gb_per_s:.2f}" for r in rs),
                "ok" if not any(r.errors for r in rs) else "; ".join(
                    e for r in rs for e in r.errors)])
        iso_gb = med([r.gb_per_s for r in pick("isolane", size)])
        best_name, best_gb = max(((n, med([r.gb_per_s for r in pick(n, size)]))
                                  for n in SYSTEMS[1:]), key=lambda x: x[1])
        ratio = C.ratio(iso_gb, best_gb)
        met = "met" if ratio is not None and ratio >= TARGET_2MIB else "not met"
        target = f"≥ {TARGET_2MIB}x Redis" if size == "2MiB" else "(no target; recorded)"
        verdict.append(f"| isolane batch-get throughput, {size} blocks, {target} | "
                       f"{C.fmt_ratio(ratio)} of the faster Redis client ({iso_gb:.2f} vs "
                       f"{best_gb:.2f} GB/s, {LABELS[best_name]}) | "
                       f"{met if size == '2MiB' else '-'} |")
    machine = C.machine_description(args.dir, versions)
    lines = [
        "## Cluster on loopback: batch gets vs Redis (`benchmarks/bench_cluster.py`)",
        "",
        f"Command: `{command}`  ",
        f"Date: {C.now_text()}  ",
        f"Machine: {machine}  ",
        f"isolane: {revision} (when the run started)",
        "",
        f"Three `isolane serve` nodes and one `redis-server` (`--save '' --appendonly no`) "
        f"on 127.0.0.1, all on this machine with the client ({total_s:.0f} s in all). The "
        f"client runs {args.concurrency} threads; each reads a random chain of blocks per "
        "call (isolane: `RemoteKVPool.get_blocks`, routed to the chain's node; Redis: "
        f"`MGET` through redis-py with {parser_name(versions)}, at its defaults, which read "
        "the socket 32 KiB "
        "at a time, and with `socket_read_size` 1 MiB), "
        f"for {seconds:g} s a run. Both hold the same "
        f"{corpus_mib} MiB of random blocks per size under the same keys, read once before "
        "timing (isolane's memory tier holds its share, as Redis holds everything in "
        "memory). Every answer is checked (all blocks, right sizes; each thread's first "
        "answer byte for byte). GB/s = bytes received / wall seconds; latency per call. "
        f"Medians of {repeats} rounds (each system goes first in turn), runs listed; "
        "`vs Redis` is against redis-py at its defaults. CPU ms/MiB = CPU seconds (user + "
        "system) of the client process and of the server processes (the three nodes, or "
        "redis-server) during the run, per MiB received.",
        "",
        C.markdown_table(["system", "block", "blocks a call", "calls/s", "GB/s", "p50 ms",
                          "p99 ms", "vs Redis", "client CPU ms/MiB", "server CPU ms/MiB",
                          "runs (GB/s)", "check"], rows),
        "",
        "Target (issue 5):",
        "",
        "| target | reached | verdict |",
        "|---|---|---|",
        *verdict,
        "",
        cpu_note(runs, sizes),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
