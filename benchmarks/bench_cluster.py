#!/usr/bin/env python
"""The cluster on loopback: ``isolane serve`` nodes against their peers, real processes on
127.0.0.1, taking turns to go first; medians of rounds, runs listed, every answer checked.

    python benchmarks/bench_cluster.py --out docs/BENCHMARKS.md              # ~4.5 min
    python benchmarks/bench_cluster.py --locality --out docs/BENCHMARKS.md   # ~2 min
    python benchmarks/bench_cluster.py --node-loss --out docs/BENCHMARKS.md
    python benchmarks/bench_cluster.py --snapshots --parts node,lora,mirror --out docs/BENCHMARKS.md

- Batch gets: 3 nodes (memory tiers) and ``redis-server`` hold the same random blocks;
  threads read a random chain a call (16 of 64 KiB, 4 of 2 MiB) by ``get_blocks`` vs
  ``MGET`` (redis-py, hiredis) with 32 KiB and 1 MiB socket reads; CPU of every process.
- ``--locality``: prompt restores (``get``, 1k-16k tokens of 1 MiB blocks) from 3-8 nodes
  by clients with ``segment_blocks`` S = 1, 2, the default and whole chains.
- ``--node-loss``: prefix tokens still served after one node is SIGKILLed (each in turn),
  for chain-affine segments, whole chains and segments by their own digests (the earlier
  placement, ``OwnDigestRouter``); stored copies from the nodes' chain indexes.
- ``--snapshots``: ``RemoteSnapshotStore`` through a node vs the embedded store, in
  ``--parts`` kept in ``--snap-json``: ``node`` (save, cold load, ``save_async`` vs the
  copy alone), ``lora`` (re-save of changed adapters), ``mirror`` (``load`` from the S3
  mirror on SeaweedFS vs s3fs one object at a time and raw presigned 8 MiB ranged GETs;
  the weed server's CPU a GB bounds every client on the shared cores)."""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
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
import _statedicts as S  # noqa: E402
import redis as redis_module  # noqa: E402
import torch  # noqa: E402
from _nodes import NODES, Nodes, _die_with_parent  # noqa: E402

import isolane  # noqa: E402
from isolane.client.kv_pool import RemoteKVPool  # noqa: E402
from isolane.cluster.chain_segments import DEFAULT_SEGMENT_BLOCKS  # noqa: E402
from isolane.cluster.router import ClusterOptions, ClusterRouter  # noqa: E402
from isolane.cluster.routing import RendezvousRouter  # noqa: E402
from isolane.wire.layout import NamespaceLayout  # noqa: E402

AREA = "Cluster and routing"
SIZES = {"64KiB": 64 << 10, "2MiB": 2 << 20}
BATCH = {"64KiB": 16, "2MiB": 4}  # blocks per call: 1 MiB and 8 MiB
SYSTEMS = ("isolane", "redis", "redis 1MiB-reads")
LABELS = {"isolane": "`isolane` (`RemoteKVPool.get_blocks`)", "redis": "`redis` (`MGET`)",
          "redis 1MiB-reads": "`redis` (`MGET`, `socket_read_size` 1 MiB)"}
TARGET_2MIB = 0.5  # batch-get throughput >= 0.5x Redis for 2 MiB blocks
LOC_CHUNK, LOC_WIDTH = 256, 1024  # float32 values a token: 1 MiB blocks
PROMPT_TOKENS = (1024, 4096, 16384)
WHOLE = 1 << 20  # S past every prompt: one segment a chain
LOSS_CHUNK, LOSS_BLOCKS, LOSS_SEGMENT, LOSS_ROW = 16, 32, 4, 256  # 16 KiB blocks
LOSS_TOKENS = LOSS_CHUNK * LOSS_BLOCKS
LOSS_TARGET = 0.9
PLACEMENTS = ("chain-affine segments", "whole chain", "segments by own digest")


Outcome = tuple[Any, str, list[_results.Result], bool]  # runs (JSON), report, rows, all ok


def med(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def report(title: str, machine: str, began: float, facts: str, *body: str) -> str:
    return "\n".join([
        f"## Cluster on loopback: {title}", "", f"Command: `{C.command_line()}`  ",
        f"Date: {C.now_text()}  ", f"Machine: {machine}  ", f"isolane: {C.isolane_revision()}",
        "", f"{facts} ({time.perf_counter() - began:.0f} s in all; the method is in the "
        "script's docstring).", "", *body])


def where(machine: str) -> dict[str, Any]:
    return {"area": AREA, "machine": machine, "date": C.now_text(), "command": C.command_line()}


def checked(runs: Sequence[Run]) -> str:
    return "ok" if not any(r.errors for r in runs) else "; ".join(
        e for r in runs for e in r.errors)


@dataclass
class Run:
    """A timed run of a system (or placement) on a case (block size or prompt tokens)."""
    name: str
    case: str
    round: int
    calls: int
    nbytes: int
    seconds: float
    p50_ms: float
    p99_ms: float
    client_cpu_s: float = 0.0  # this process, every thread
    server_cpu_s: float = 0.0  # the nodes, or redis-server
    requests: int = 0  # batch gets the client sent
    errors: list[str] = field(default_factory=list)

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / self.seconds / C.GB

    def cpu_ms_per_mib(self, seconds: float) -> float:
        return seconds * 1000 / max(self.nbytes / (1 << 20), 1e-9)


def timed_calls(name: str, case: str, round_no: int, threads: int, seconds: float,
                seed: int, items: int, get: Callable[[int], Any],
                check: Callable[[int, Any, bool], tuple[int, str | None]],
                server_pids: Sequence[int] = ()) -> Run:
    """``threads`` threads calling ``get(i)`` on random items for ``seconds``, each
    answer checked by ``check(i, answer, first)`` -> (bytes received, error)."""
    latencies: list[list[float]] = [[] for _ in range(threads)]
    received = [0] * threads
    errors: list[str] = []

    def worker(t: int, wait_start: Callable[[], float]) -> None:
        rng, first = random.Random(seed + t), True
        stop_at = wait_start()
        while time.perf_counter() < stop_at:
            i = rng.randrange(items)
            t0 = time.perf_counter()
            answer = get(i)
            latencies[t].append(time.perf_counter() - t0)
            nbytes, error = check(i, answer, first)
            if error:
                errors.append(f"{name}: {error}")
                return
            received[t] += nbytes
            first = False

    workers = C.TimedThreads(threads, worker)
    cpu = C.own_cpu_s(), C.process_cpu_s(server_pids)
    wall = workers.run(seconds)
    run = Run(name, case, round_no, sum(map(len, latencies)), sum(received), wall,
              *C.p50_p99_ms(latencies), C.own_cpu_s() - cpu[0],
              C.process_cpu_s(server_pids) - cpu[1], errors=errors[:3])
    print(f"  round {round_no} {name} {case}: {run.gb_per_s:.2f} GB/s, p50 {run.p50_ms:.1f} "
          f"ms, p99 {run.p99_ms:.1f} ms" + (f"  ERRORS {run.errors}" if run.errors else ""),
          flush=True)
    return run


# -- batch gets vs Redis ---------------------------------------------------------------------
def gets_of_size(size: str, args: argparse.Namespace, urls: list[str], redis: Any,
                 pids: dict[str, list[int]]) -> list[Run]:
    block, batch = SIZES[size], args.batch or BATCH[size]
    chains = max(4, (args.corpus_mib << 20) // (block * batch))
    data = memoryview(np.random.default_rng(block).integers(
        0, 256, chains * batch * block, dtype=np.uint8).tobytes())
    keys = [[hashlib.blake2b(f"{size}/{c}/{i}".encode(), digest_size=16).digest()
             for i in range(batch)] for c in range(chains)]

    def value(c: int, i: int) -> memoryview:
        return data[(c * batch + i) * block:(c * batch + i + 1) * block]

    def check(c: int, values: Any, first: bool) -> tuple[int, str | None]:
        if len(values) != batch or any(v is None or len(v) != block for v in values):
            return 0, f"chain {c} came back incomplete"
        if first and any(bytes(v) != value(c, i) for i, v in enumerate(values)):
            return 0, f"chain {c} came back different"
        return batch * block, None

    pool = RemoteKVPool(urls, namespace=f"bench-{size}", connections=args.concurrency,
                        layout=NamespaceLayout("uint8", (block,), chunk_tokens=1, token_dim=0),
                        timeout_s=30.0, put_timeout_s=60.0)
    for c, chain in enumerate(keys):
        values = [value(c, i) for i in range(batch)]
        if pool.put_blocks(chain, values) != batch:
            raise RuntimeError(f"isolane stored fewer blocks of chain {c}")
        redis["redis"].mset({k: bytes(v) for k, v in zip(chain, values, strict=True)})
    for chain in keys:  # warm: every block read once from each
        pool.get_blocks(chain)
        redis["redis"].mget(chain)
    getters = {"isolane": pool.get_blocks, **{n: r.mget for n, r in redis.items()}}
    runs = [timed_calls(system, size, r, args.concurrency, args.seconds, r * 1000, chains,
                        lambda c, get=getters[system]: get(keys[c]), check, pids[system])
            for r in range(args.repeats)
            for system in SYSTEMS[r % 3:] + SYSTEMS[:r % 3]]  # each goes first in turn
    pool.close()
    redis["redis"].flushall()
    return runs


def run_gets(args: argparse.Namespace) -> Outcome:
    args.seconds = args.seconds or (1.0 if args.quick else 8.0)
    args.repeats = args.repeats or (1 if args.quick else 5)
    args.corpus_mib = args.corpus_mib or (16 if args.quick else 384)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    began = time.perf_counter()
    nodes = Nodes(args.dir / "gets", (2 * args.corpus_mib * len(sizes) // NODES + 64) << 20)
    server = L.RedisServer(args.dir / "redis")
    runs: list[Run] = []
    try:
        server.start()
        nodes.wait_ready()
        hiredis = importlib.util.find_spec("hiredis") and importlib.metadata.version("hiredis")
        versions = {"isolane": isolane.__version__, "redis-server": server.version,
                    "redis-py": importlib.metadata.version("redis"),
                    "hiredis": hiredis or "not installed",
                    "urllib3": importlib.metadata.version("urllib3"),
                    "aiohttp": importlib.metadata.version("aiohttp")}
        redis = {"redis": L.redis_client(server.port, max_connections=args.concurrency + 4),
                 "redis 1MiB-reads": redis_module.Redis(
                     connection_pool=redis_module.BlockingConnectionPool(
                         host="127.0.0.1", port=server.port, timeout=30,
                         max_connections=args.concurrency + 4, socket_read_size=1 << 20))}
        pids = {"isolane": [p.pid for p in nodes.procs],
                **{name: [server.proc.pid if server.proc else 0] for name in redis}}
        for size in sizes:
            runs += gets_of_size(size, args, nodes.urls, redis, pids)
    finally:
        nodes.stop()
        server.stop()
    machine = C.machine_description(args.dir, versions)
    rows, recorded = [], []
    for size in sizes:
        def pick(system: str, size: str = size) -> list[Run]:
            return [r for r in runs if r.name == system and r.case == size]

        gb = {n: med([r.gb_per_s for r in pick(n)]) for n in SYSTEMS}
        cpu = {n: med([r.cpu_ms_per_mib(r.client_cpu_s + r.server_cpu_s) for r in pick(n)])
               for n in SYSTEMS}
        batch = args.batch or BATCH[size]
        for name in SYSTEMS:
            rs = pick(name)
            rows.append([
                LABELS[name], size, f"{batch} ({batch * SIZES[size] >> 20} MiB)",
                f"{med([r.calls / r.seconds for r in rs]):.0f}", f"{gb[name]:.2f}",
                f"{med([r.p50_ms for r in rs]):.1f}", f"{med([r.p99_ms for r in rs]):.1f}",
                C.fmt_ratio(C.ratio(gb[name], gb["redis"])),
                f"{med([r.cpu_ms_per_mib(r.client_cpu_s) for r in rs]):.2f}",
                f"{med([r.cpu_ms_per_mib(r.server_cpu_s) for r in rs]):.2f}",
                ", ".join(f"{r.gb_per_s:.2f}" for r in rs), checked(rs)])
        peer = gb["redis 1MiB-reads"]
        vs = gb["isolane"] / peer
        recorded.append(_results.Result(
            measure=f"batch gets from {NODES} nodes, {batch} blocks of "
            f"{size[:-3]} {size[-3:]} a call, {args.concurrency} threads",
            value=round(gb["isolane"], 2), unit="GB/s",
            peer="redis-server MGET (redis-py, 1 MiB socket reads)",
            peer_value=round(peer, 2), ratio=round(vs, 2),
            target=f"≥ {TARGET_2MIB}x" if size == "2MiB" else None,
            met=vs >= TARGET_2MIB if size == "2MiB" else None,
            why=None if vs >= 1 else f"CPU-bound: Python nodes (aiohttp) against C, sharing "
            f"{os.cpu_count()} cores ({cpu['isolane']:.1f} against "
            f"{cpu['redis 1MiB-reads']:.1f} ms of CPU a MiB, client + servers)",
            **where(machine)))
    text = report(
        "batch gets vs Redis (`benchmarks/bench_cluster.py`)", machine, began,
        f"{NODES} nodes and redis-server, {args.concurrency} client threads, {args.seconds:g} s "
        f"a run, {args.corpus_mib} MiB a size, medians of {args.repeats} rounds; `vs Redis`: "
        "redis-py at its defaults; CPU ms/MiB: per MiB received",
        C.markdown_table(["system", "block", "blocks a call", "calls/s", "GB/s", "p50 ms",
                          "p99 ms", "vs Redis", "client CPU ms/MiB", "server CPU ms/MiB",
                          "runs (GB/s)", "check"], rows))
    return [asdict(r) for r in runs], text, recorded, not any(r.errors for r in runs)


# -- prompt restores by placement ------------------------------------------------------------
def prompt(tokens: int, p: int) -> list[int]:
    return [(tokens * 7919 + p * 104729 + i) % 2_000_000_000 for i in range(tokens)]


def prompt_kv(tokens: int, p: int, width: int) -> torch.Tensor:
    return torch.randn(tokens, width, generator=torch.Generator().manual_seed(tokens * 1000 + p))


def run_locality(args: argparse.Namespace) -> Outcome:
    if not 3 <= args.locality_nodes <= 8:
        raise SystemExit("--locality-nodes must be 3 to 8")
    seconds = args.locality_seconds or (0.5 if args.quick else 4.0)
    rounds = args.locality_rounds or (1 if args.quick else 3)
    prompts, n_nodes, threads = 1 if args.quick else 6, args.locality_nodes, args.locality_threads
    budget = 3 * prompts * sum(PROMPT_TOKENS) * LOC_WIDTH * 4 // n_nodes * 2 + (64 << 20)
    began = time.perf_counter()
    nodes = Nodes(args.dir / "locality", budget, n_nodes)
    placements = {"per-block (S = 1)": 1, **{f"segments (S = {s})": s for s in sorted(
        {2, DEFAULT_SEGMENT_BLOCKS} - {1})}, "whole chain": WHOLE}
    runs: list[Run] = []

    def check(tokens: int, p: int, answer: Any, first: bool) -> tuple[int, str | None]:
        n, kv = answer
        if n != tokens or kv is None:
            return 0, f"{tokens}-token prompt {p} restored {n} tokens"
        if first and not torch.equal(kv, prompt_kv(tokens, p, LOC_WIDTH)):
            return 0, f"prompt {p} came back different"
        return tokens * LOC_WIDTH * 4, None

    try:
        nodes.wait_ready()
        pools = {name: RemoteKVPool(
            nodes.urls, namespace=f"locality-{s}", chunk_tokens=LOC_CHUNK, token_dim=0,
            cluster=ClusterOptions(segment_blocks=s, slow_s=30.0), connections=threads + 2,
            timeout_s=30.0, put_timeout_s=60.0) for name, s in placements.items()}
        for name, pool in pools.items():
            for tokens in PROMPT_TOKENS:
                for p in range(prompts):
                    if pool.put(prompt(tokens, p), prompt_kv(tokens, p, LOC_WIDTH)) != \
                            tokens // LOC_CHUNK:
                        raise RuntimeError(f"{name}: prompt {p} not stored whole")
                    pool.get(prompt(tokens, p))  # warm
        order = list(pools)
        for r in range(rounds):
            for name in order[r % len(order):] + order[:r % len(order)]:
                pool = pools[name]
                for tokens in PROMPT_TOKENS:
                    before = pool._nodes.get_requests
                    runs.append(timed_calls(
                        name, str(tokens), r, threads, seconds, r * 100, prompts,
                        lambda p, pool=pool, t=tokens: pool.get(prompt(t, p)),
                        lambda p, answer, first, t=tokens: check(t, p, answer, first)))
                    runs[-1].requests = pool._nodes.get_requests - before
        for pool in pools.values():
            pool.close()
    finally:
        nodes.stop()
    machine = C.machine_description(args.dir, {"isolane": isolane.__version__,
                                               "torch": torch.__version__})
    rows, recorded = [], []
    for tokens in PROMPT_TOKENS:
        blocks = tokens // LOC_CHUNK
        at = {name: [r for r in runs if r.name == name and r.case == str(tokens)]
              for name in placements}
        gb = {name: med([r.gb_per_s for r in rs]) for name, rs in at.items()}
        req = {name: med([r.requests / max(1, r.calls) for r in rs]) for name, rs in at.items()}
        base = next(iter(placements))
        for name, s in placements.items():
            rows.append([f"{tokens:,} ({blocks} blocks)", f"`{name}`", f"{req[name]:.1f}",
                         f"{min(blocks, math.ceil(blocks / s))}",
                         f"{med([r.p50_ms for r in at[name]]):.1f}",
                         f"{med([r.p99_ms for r in at[name]]):.1f}", f"{gb[name]:.2f}",
                         C.fmt_ratio(C.ratio(gb[name], gb[base])),
                         ", ".join(f"{r.gb_per_s:.2f}" for r in at[name]), checked(at[name])])
            if s == DEFAULT_SEGMENT_BLOCKS:
                vs = gb[name] / gb[base]
                recorded.append(_results.Result(
                    measure=f"prompt restore from {n_nodes} nodes, {tokens:,} "
                    f"tokens, segments of S = {s} blocks", value=round(gb[name], 2),
                    unit="GB/s", peer="per-block placement", peer_value=round(gb[base], 2),
                    ratio=round(vs, 2), why=None if vs >= 1.1 else (
                        f"requests a restore: {req[name]:.1f} with segments, "
                        f"{req[base]:.1f} per block"),
                    **where(machine)))
    text = report(
        "prompt restores by placement (`benchmarks/bench_cluster.py --locality`)", machine,
        began, f"{n_nodes} nodes, {prompts} prompts of each size, {threads} threads, "
        f"{seconds:g} s a run, medians of {rounds} rounds; `vs per-block`: the size's first row",
        C.markdown_table(["prompt tokens", "placement", "requests/restore", "ceil(n/S)",
                          "p50 ms", "p99 ms", "GB/s", "vs per-block", "runs (GB/s)",
                          "check"], rows))
    return [asdict(r) for r in runs], text, recorded, not any(r.errors for r in runs)


# -- a lost node -----------------------------------------------------------------------------
class OwnDigestRouter(ClusterRouter):
    """The placement before chain-affine segments: every segment at its own digest."""

    def place_segment(self, digest: bytes, home: bytes | None = None, start: int = 0
                      ) -> tuple[str, bytes]:
        return super().place_segment(digest, digest, start)

    def read_candidates(self, digest: bytes, home: bytes | None = None, start: int = 0
                        ) -> list[str]:
        return super().read_candidates(digest, digest, start)


def loss_pool(placement: str, urls: list[str]) -> RemoteKVPool:
    common: dict[str, Any] = {"namespace": "loss-" + placement.replace(" ", "-"),
                              "chunk_tokens": LOSS_CHUNK, "token_dim": 0}
    options = ClusterOptions(segment_blocks=LOSS_SEGMENT)
    if placement == "whole chain":
        return RemoteKVPool(urls, router=RendezvousRouter(urls), **common)
    pool = RemoteKVPool(urls, cluster=options, **common)
    if placement == "segments by own digest":  # the same client, the earlier placement
        pool.cluster = pool.router = pool._nodes.cluster = OwnDigestRouter(urls, options)
    return pool


def run_loss(args: argparse.Namespace) -> Outcome:
    if args.loss_nodes not in (3, 4):
        raise SystemExit("--loss-nodes must be 3 or 4")
    n_nodes, prompts = args.loss_nodes, 6 if args.quick else 30
    began = time.perf_counter()
    nodes = Nodes(args.dir / "node-loss", 3 * prompts * LOSS_TOKENS * LOSS_ROW * 4 + (64 << 20),
                  n_nodes)
    runs: list[dict[str, Any]] = [
        {"placement": name, "before": 0, "after": [], "stored": 0.0, "errors": []}
        for name in PLACEMENTS]
    pools: list[RemoteKVPool] = []
    ids = [[p * 100_000 + i for i in range(LOSS_TOKENS)] for p in range(prompts)]
    kvs = [torch.randn(LOSS_TOKENS, LOSS_ROW, generator=torch.Generator().manual_seed(p))
           for p in range(prompts)]

    def served(pool: RemoteKVPool, run: dict[str, Any]) -> int:
        total = 0
        for p in range(prompts):
            n, kv = pool.get(ids[p])
            if n and (kv is None or not torch.equal(kv, kvs[p][:n])):
                run["errors"].append(f"{run['placement']}: prompt {p} came back different")
            total += n
        return total

    try:
        nodes.wait_ready()
        pools = [loss_pool(name, nodes.urls) for name in PLACEMENTS]
        for run, pool in zip(runs, pools, strict=True):
            for p in range(prompts):
                if pool.put(ids[p], kvs[p]) != LOSS_BLOCKS:
                    raise RuntimeError(f"{run['placement']}: prompt {p} not stored whole")
            run["before"] = served(pool, run)
            run["stored"] = sum(len(keys) for u in nodes.urls  # in the nodes' chain indexes
                                for _, keys in pool._nodes.list_chains(u) or []) / (
                prompts * LOSS_BLOCKS)
        for i in range(1 if args.quick else n_nodes):  # quick: one loss, one restart
            os.kill(nodes.procs[i].pid, signal.SIGKILL)
            nodes.procs[i].wait()
            for run, pool in zip(runs, pools, strict=True):
                run["after"].append(served(pool, run))
            with open(nodes.folder / f"node-{i}" / "node.log", "ab") as log:  # same port
                nodes.procs[i] = subprocess.Popen(
                    nodes.procs[i].args, stdin=subprocess.DEVNULL, stdout=log,
                    stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
            nodes.wait_ready(120)
            for run, pool in zip(runs, pools, strict=True):  # back before the next loss
                deadline = time.monotonic() + 30
                while served(pool, run) < run["before"]:
                    if time.monotonic() > deadline:
                        run["errors"].append(f"{run['placement']}: not served whole after "
                                             f"node {i} came back")
                        break
                    time.sleep(0.5)
    finally:
        for pool in pools:
            pool.close()
        nodes.stop()
    ideal = (n_nodes - 1) / n_nodes
    for run in runs:
        run["share"] = statistics.mean(run["after"]) / run["before"] if run["before"] else 0.0
    machine = C.machine_description(args.dir, {"isolane": isolane.__version__,
                                               "torch": torch.__version__})
    rows = [[f"`{r['placement']}`", f"{r['before']:,}", ", ".join(f"{a:,}" for a in r["after"]),
             f"{r['share'] * 100:.1f} %", f"{LOSS_TARGET * ideal * 100:.1f} % "
             + ("met" if r["share"] >= LOSS_TARGET * ideal else "not met"),
             f"{r['stored']:.3f}x", "ok" if not r["errors"] else "; ".join(r["errors"][:3])]
            for r in runs]
    mine, earlier = runs[0], runs[2]
    recorded = [
        _results.Result(
            measure=f"prefix tokens served after 1 of {n_nodes} real nodes is SIGKILLed, "
                    f"prompts of {LOSS_BLOCKS} blocks", value=round(mine["share"] * 100, 1),
            unit="%", peer="one copy's limit (N-1)/N", peer_value=round(ideal * 100, 1),
            ratio=round(mine["share"] / ideal * 100, 1), ratio_unit="%",
            target=f">= {LOSS_TARGET * 100:g} %", met=mine["share"] >= LOSS_TARGET * ideal,
            why=f"segments by their own digests (before): {earlier['share'] * 100:.1f} %",
            **where(machine)),
        _results.Result(measure=f"stored block copies, {n_nodes} real nodes",
                        value=round(mine["stored"], 3), unit="x unique blocks",
                        target="<= 1.1x", met=mine["stored"] <= 1.1, **where(machine))]
    text = report(
        "a lost node (`benchmarks/bench_cluster.py --node-loss`)", machine, began,
        f"{n_nodes} nodes, {prompts} prompts of {LOSS_BLOCKS} blocks ({LOSS_CHUNK} tokens a "
        f"block, S = {LOSS_SEGMENT}) per placement; share: mean served after a loss / served "
        f"before; target {LOSS_TARGET:g} x (N - 1) / N",
        C.markdown_table(["placement", "tokens served, all up", "served, each node dead",
                          "share after a loss", "target", "stored copies", "check"], rows))
    return runs, text, recorded, not any(r["errors"] for r in runs)


# -- snapshots through a node, restores from the S3 mirror -------------------------------------
PARTS = ("node", "lora", "mirror")
MIRROR_PEERS = ("isolane", "s3fs, one stream", "raw ranged GETs")
MIRROR_PART = 8 << 20  # bytes per ranged GET of the raw peer (FsspecBlobStore's)
FRESH: dict[str, dict[str, Any]] = {"embedded": {"parent": False}, "node": {}}  # no parent


def snap_timed(runs: dict[str, list[float]], name: str, fn: Callable[[], Any],
               touch: bool = False) -> Any:
    """``fn()`` timed into ``runs[name]`` (``touch``: and every page of what it returns)."""
    t0 = time.perf_counter()
    value = fn()
    if touch:
        S.touch_pages(value)
    runs.setdefault(name, []).append(time.perf_counter() - t0)
    print(f"[snapshots] {name}: {runs[name][-1]:.3f} s", flush=True)
    return value


def run_node_part(args: argparse.Namespace, part: str) -> dict[str, Any]:
    """``node``: save, cold load and save_async through a node vs embedded; ``lora``: a
    LoRA first save and re-save of changed adapters, through a node vs embedded."""
    from isolane.client.snapshot_staging import ClientStaging
    from isolane.client.snapshot_store import RemoteSnapshotStore
    from isolane.snapshot import SnapshotStore
    from tests.support.node import NodeProcess, write_node_config

    plan = S.plan_lora(1.0, base_bytes=int(args.lora_gb * 1e9)) if part == "lora" else \
        S.plan_mixed(1.0, total_bytes=int(args.gb * 1e9))
    state = S.build_state_dict(plan)
    runs: dict[str, list[float]] = {}
    cold = part == "node" and C.drop_page_cache()
    base = args.dir / f"snapshots-{part}"
    node = NodeProcess(write_node_config(base / "node", device_groups={"checkpoint": {
        "role": "write", "devices": [str(base / "node" / "ckpt")]}}, snapshot={}),
        token="bench").start()
    try:
        remote = RemoteSnapshotStore(node.url, token="bench")
        if part == "node":  # steady state: one save_async warms the client's staging memory
            remote.save_async(state, "warm-up").result()
            remote.delete("warm-up")
        for rnd in range(args.repeats):
            embedded = SnapshotStore(str(base / f"embedded-{rnd}"))
            stores: dict[str, Any] = {"embedded": embedded, "node": remote}
            order = ["embedded", "node"] if rnd % 2 == 0 else ["node", "embedded"]
            if part == "lora":
                for who in order:
                    snap_timed(runs, f"{who} LoRA first save", lambda s=stores[who],
                               n=f"l{rnd}-0", o=FRESH[who]: s.save(state, n, **o))
                    with torch.no_grad():
                        for path in S.adapter_paths(plan):  # the adapters train, not the base
                            S.get_path(state, path).add_(0.5)
                    snap_timed(runs, f"{who} LoRA re-save",
                               lambda s=stores[who], n=f"l{rnd}-1": s.save(state, n))
                    S.check_equal(state, stores[who].load(f"l{rnd}-1"))
                    for name in (f"l{rnd}-0", f"l{rnd}-1"):
                        stores[who].delete(name)
                embedded.close()
                continue
            embedded.save_async(state, "warm-up", parent=False).result()
            embedded.delete("warm-up")
            for who in order:
                snap_timed(runs, f"{who} save", lambda s=stores[who], n=f"r{rnd}",
                           o=FRESH[who]: s.save(state, n, **o))
            for who in order:
                if cold:
                    C.drop_page_cache()
                back = snap_timed(runs, f"{who} load", lambda s=stores[who], n=f"r{rnd}":
                                  s.load(n), touch=True)
                S.check_equal(state, back)
                del back
            probe = ClientStaging()  # the copy alone, into warm memory (the bound)
            probe.stage(state)
            snap_timed(runs, "copy alone", lambda p=probe: p.stage(state))
            probe.clear()
            for who in order:
                os.sync()
                handle = snap_timed(runs, f"{who} save_async", lambda s=stores[who],
                                    n=f"r{rnd}-async", o=FRESH[who]: s.save_async(state, n, **o))
                handle.result()
                S.check_equal(state, stores[who].load(f"r{rnd}-async"))
                stores[who].delete(f"r{rnd}-async")
            remote.delete(f"r{rnd}")  # no parent for the next round's save
            embedded.close()
            shutil.rmtree(base / f"embedded-{rnd}")
        remote.close()
    finally:
        node.stop()
        shutil.rmtree(base, ignore_errors=True)
    return {"nbytes": S.state_bytes(state), "cold": cold, "runs": runs}


def run_mirror_part(args: argparse.Namespace) -> dict[str, Any]:
    """``mirror``: a mirrored snapshot restored by ``load`` vs s3fs and raw ranged GETs."""
    import http.client
    import threading
    import urllib.parse
    from concurrent.futures import ThreadPoolExecutor

    import s3fs

    from isolane.config import config_from_dict
    from isolane.snapshot import SnapshotStore
    from isolane.storage.s3_ranged import RANGE_THREADS
    from tests.support.seaweedfs import SeaweedServer

    state = S.build_state_dict(S.plan_mixed(1.0, total_bytes=int(args.mirror_gb * 1e9)))
    folder = args.dir / "mirror"
    folder.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"seconds": {p: [] for p in MIRROR_PEERS},
                           "cpu": {p: [] for p in MIRROR_PEERS}}
    with SeaweedServer(folder / "weed") as server:
        bucket = server.create_bucket("bench")
        options = server.storage_options
        config = config_from_dict({"device_groups": {
            "ckpt": {"role": "write", "devices": [str(folder / "local")]},
            "cold": {"role": "capacity", "devices": [f"s3://{bucket}/snapshots"],
                     "storage_options": options}}})
        store = SnapshotStore(config)
        store.save(state, "m", mirror=True)
        if (errors := store.wait_for_mirrors()) != {"m": None}:
            raise RuntimeError(f"mirror failed: {errors}")
        manifest = store.manifest("m")
        store.close()
        shutil.rmtree(folder / "local")
        sizes = [c.stored for c in manifest.chunks]
        out["nbytes"] = sum(sizes)
        keys = [f"{bucket}/snapshots/snapshots/m/{manifest.generation}/{c.key}"
                for c in manifest.chunks]
        ranges = [(k, s, min(MIRROR_PART, size - s))
                  for k, size in zip(keys, sizes, strict=True)
                  for s in range(0, size, MIRROR_PART)]
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
        view = memoryview(np.zeros(max(sizes), dtype=np.uint8))  # the raw loop's memory
        local = threading.local()
        endpoint = urllib.parse.urlsplit(options["client_kwargs"]["endpoint_url"])

        def get_into(item: tuple[str, int, int]) -> int:
            target, start, n = item
            if getattr(local, "conn", None) is None:
                local.conn = http.client.HTTPConnection(endpoint.hostname or "", endpoint.port)
            local.conn.request("GET", target, headers={"Range": f"bytes={start}-{start + n - 1}"})
            response, got = local.conn.getresponse(), 0
            while got < n:
                if not (m := response.readinto(view[start + got:start + n])):
                    raise EOFError(f"{target}: {got} of {n} bytes")
                got += m
            return got

        with ThreadPoolExecutor(RANGE_THREADS) as pool:
            for rnd in range(args.repeats):
                for who in MIRROR_PEERS if rnd % 2 == 0 else MIRROR_PEERS[::-1]:
                    cpu0 = (C.own_cpu_s(), C.process_cpu_s([server.pid]))
                    t0 = time.perf_counter()
                    if who == "isolane":
                        fresh = SnapshotStore(config)
                        back = fresh.load("m")
                        S.touch_pages(back)
                        got = out["nbytes"]
                    elif who == "s3fs, one stream":
                        got = sum(len(fs.cat_file(k)) for k in keys)
                    else:
                        urls = {k: "{0.path}?{0.query}".format(urllib.parse.urlsplit(
                            fs.sign(k, expiration=3600))) for k in keys}  # once, as isolane
                        got = sum(pool.map(get_into, [(urls[k], s, n) for k, s, n in ranges]))
                    seconds = time.perf_counter() - t0
                    used = [C.own_cpu_s() - cpu0[0], C.process_cpu_s([server.pid]) - cpu0[1]]
                    if who == "isolane":
                        S.check_equal(state, back)
                        del back
                        fresh.close()
                    if got != out["nbytes"]:
                        raise AssertionError(f"{who} read {got} of {out['nbytes']} bytes")
                    out["seconds"][who].append(seconds)
                    out["cpu"][who].append(used)
    return out


def run_snapshots(args: argparse.Namespace) -> Outcome:
    args.repeats = args.repeats or (1 if args.quick else 5)
    args.dir = args.dir.resolve()
    if args.quick:
        args.gb, args.lora_gb, args.mirror_gb = (min(g, 0.05) for g in (
            args.gb, args.lora_gb, args.mirror_gb))
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if unknown := set(parts) - set(PARTS):
        raise SystemExit(f"--parts: unknown {sorted(unknown)}; use {', '.join(PARTS)}")
    stored: dict[str, Any] = {}
    if not args.quick and args.snap_json.exists():
        stored = json.loads(args.snap_json.read_text())
    for part in parts:
        stored[part] = {"command": C.command_line(), "at": C.now_text(), "data": (
            run_mirror_part(args) if part == "mirror" else run_node_part(args, part))}
    if not args.quick:
        args.snap_json.parent.mkdir(parents=True, exist_ok=True)
        args.snap_json.write_text(json.dumps(stored))
    stored = {p: stored[p] for p in PARTS if p in stored}
    machine = C.machine_description(args.dir, {"isolane": isolane.__version__})
    table, mirror_table, bullets, recorded = [], [], [], []

    def record(part: str, measure: str, value: float, peer: str, peer_value: float,
               ratio: float, target: str, met: bool, **extra: Any) -> None:
        recorded.append(_results.Result(
            area="Checkpoints", measure=measure, value=round(value, 3), unit="s",
            machine=machine, date=stored[part]["at"], command=stored[part]["command"],
            peer=peer, peer_value=round(peer_value, 3), target=target, met=met,
            ratio=ratio, **extra))

    for part in ("node", "lora"):
        if part in stored:
            data = stored[part]["data"]
            size = data.get("nbytes") or data["lora_bytes"]  # (as earlier runs kept it)
            table += [[name, C.fmt_seconds(med(v)), C.fmt_rate(size, med(v)),
                       ", ".join(f"{x:.3f}" for x in v)] for name, v in data["runs"].items()]
    if "node" in stored:
        d = stored["node"]["data"]
        n = {name: med(v) for name, v in d["runs"].items()}
        bullets.append(
            f"the bound of save_async's blocking: copying the same bytes into warm memory "
            f"with nothing else running took {C.fmt_seconds(n['copy alone'])} s, "
            f"{n['copy alone'] / n['node save']:.0%} of the node's sync save; the node's "
            f"save_async blocked {n['node save_async'] / n['node save']:.0%} (target 10 %).")
        for what, note in (("save", "loopback"), ("load", "cold page cache")):
            node, embedded = n[f"node {what}"], n[f"embedded {what}"]
            record("node", f"{what} through a node ({d['nbytes'] / 1e9:.2f} GB, {note})", node,
                   f"embedded {what}", embedded, round(embedded / node, 2), "≥ 0.7x",
                   embedded / node >= 0.7, why=None if d["cold"] or what == "save" else
                   "warm: no root to drop the page cache")
        blocked, sync = n["node save_async"], n["node save"]
        record("node", "save_async through a node: time until the call returns / sync save",
               blocked, "its sync save through the node", sync, round(blocked / sync * 100),
               "≤ 10 %", blocked / sync <= 0.10, ratio_unit="%")
    if "lora" in stored:
        n = {name: med(v) for name, v in stored["lora"]["data"]["runs"].items()}
        again, first = n["node LoRA re-save"], n["node LoRA first save"]
        bullets.append(
            f"the floor of the LoRA re-save: the embedded store's re-save of the same dict "
            f"took {C.fmt_seconds(n['embedded LoRA re-save'])} s; the node's "
            f"{C.fmt_seconds(again)} s, {first / again:.1f}x faster than its first save "
            "(target 10x).")
        record("lora", "LoRA re-save through a node vs its first save", again,
               "first save through the node", first, round(first / again, 2), "≥ 10x",
               first / again >= 10)
    if "mirror" in stored:
        d = stored["mirror"]["data"]
        n = {name: med(v) for name, v in d["seconds"].items() if v}
        gb, cores, single = d["nbytes"] / 1e9, os.cpu_count() or 1, n["s3fs, one stream"]
        cpu = {p: [med([c[i] for c in v]) / gb for i in (0, 1)] for p, v in d["cpu"].items()}
        weed, speedup = min(c[1] for c in cpu.values()), {p: single / s for p, s in n.items()}
        bound = cores / weed / (gb / single)
        mirror_table = [[f"S3 mirror: {p}", C.fmt_seconds(n[p]), C.fmt_rate(d["nbytes"], n[p]),
                         f"{speedup[p]:.2f}x", f"{cpu[p][0]:.2f} + {cpu[p][1]:.2f}",
                         ", ".join(f"{v:.3f}" for v in d["seconds"][p])] for p in n]
        bullets.append(
            f"the bound on this machine ({cores} cores shared by client and server): the "
            f"weed server itself takes {weed:.2f} CPU-s per GB served, so no client can "
            f"pass {bound:.2f}x the single stream even at zero CPU of its own.")
        iso = speedup["isolane"]
        record("mirror", f"restore from the S3 mirror ({gb:.2f} GB, SeaweedFS on loopback)",
               n["isolane"], "s3fs, one stream", single, round(iso, 2), "≥ 3x", iso >= 3,
               why=None if iso >= 3 else (
                   f"the S3 server itself takes {weed:.2f} CPU-s a GB on the {cores} shared "
                   f"cores, so no client passes {bound:.1f}x here; the fastest measured (raw "
                   f"ranged GETs) reached {speedup['raw ranged GETs']:.2f}x"))
    text = "\n".join([
        "### Snapshots through a node, and restores from the S3 mirror", "",
        "Commands (one exclusive run per part): " + "; ".join(
            f"`{stored[p]['command']}` ({stored[p]['at']})" for p in stored) + ".", "",
        machine, "", "One `isolane serve` on loopback, write group on the same disk as the "
        "embedded store; every restore compared bit for bit; peers alternate who goes first.",
        "", C.markdown_table(["run", "median s", "GB/s", "runs (s)"], table), "",
        *([C.markdown_table(["run", "median", "rate", "vs single stream",
                             "CPU-s/GB client + weed", "runs (s)"], mirror_table), ""]
          if mirror_table else []),
        *(f"- {b}" for b in bullets)])
    return stored, text, recorded, True


# -- the command line ------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _quick.add_argument(parser)
    add = parser.add_argument
    add("--sizes", default="64KiB,2MiB")
    add("--concurrency", type=int, default=32)
    add("--batch", type=int, help="blocks a batch get (default 16 of 64 KiB, 4 of 2 MiB)")
    add("--seconds", type=float, help="a timed run")
    add("--repeats", type=int)
    add("--corpus-mib", type=int, help="a block size")
    add("--dir", type=Path, default=C.REPO_ROOT / ".bench" / "cluster")
    add("--out", type=Path, help="docs/BENCHMARKS.md records the rows; another file the section")
    add("--json", type=Path, default=C.REPO_ROOT / ".bench" / "cluster.json",
        help="the runs (--locality and --node-loss: cluster-<mode>.json beside it)")
    add("--locality", action="store_true", help="measure prompt restores by placement")
    add("--locality-nodes", type=int, default=4, help="3 to 8 nodes")
    add("--locality-threads", type=int, default=4)
    add("--locality-seconds", type=float)
    add("--locality-rounds", type=int)
    add("--node-loss", action="store_true", help="measure what one lost node costs")
    add("--loss-nodes", type=int, default=3, help="3 or 4 nodes")
    add("--snapshots", action="store_true", help="measure snapshots through a node")
    add("--gb", type=float, default=1.0, help="--snapshots: the state dict")
    add("--lora-gb", type=float, default=3.0, help="--snapshots: the LoRA base")
    add("--mirror-gb", type=float, default=0.5, help="--snapshots: the mirrored snapshot")
    add("--parts", default=",".join(PARTS), help="--snapshots: which parts to run")
    add("--snap-json", type=Path, default=C.REPO_ROOT / ".bench" / "cluster-snapshots.json",
        help="--snapshots: every part's latest results, which the report shows")
    args = parser.parse_args(argv)
    if args.quick:
        _quick.enter(args, parser)
    section, run = (("cluster-locality", run_locality) if args.locality else
                    ("cluster-node-loss", run_loss) if args.node_loss else
                    ("cluster-snapshots", run_snapshots) if args.snapshots else
                    ("cluster", run_gets))
    shutil.rmtree(args.dir, ignore_errors=True)
    try:
        runs, text, rows, ok = run(args)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    if not args.snapshots:  # (the parts are kept in --snap-json)
        path = args.json.with_name(f"{section}.json") if section != "cluster" else args.json
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(runs, indent=1))
    C.print_report(text + "\n\n" + _results.rows_markdown(rows), args.out, section)
    if args.out and _results.is_page(args.out) and rows:
        _results.write_results(section.replace("-", "_"), rows)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
