"""Prompt restores from real nodes under per-block, segment and whole-chain placement
(``bench_cluster.py --locality``): the reason to route by prefix at all, in numbers.

``--locality-nodes`` ``isolane serve`` processes on 127.0.0.1 (their memory tiers hold
everything: restores are served from memory, so the numbers are the cost of requests and
transfers, not of disks). One client (``RemoteKVPool``) per placement, each in its own
namespace, all with the same prompts: ``cluster.segment_blocks`` S = 1 (every block
placed on its own: per-block placement), S = 2, S = the default, and S >= the longest
prompt (whole-chain placement). With chain-affine segments (``chain_segments``, version
3) S only sets where a chain may spill over the load bound: with ``slow_s`` 30 s, as
here, every placement holds a chain on its home node, so the rows measure the request
plan, not the spread of segments over nodes (that placement is gone from the client).
Prompts of 1k, 4k and 16k tokens (256-token blocks of ``BLOCK_BYTES``) are stored with
``put`` and restored with ``get`` by ``--locality-threads`` threads for
``--locality-seconds`` a run; each placement goes first in turn over
``--locality-rounds`` rounds. Reported per prompt size and placement: requests a restore
(batch gets sent, counted by the client: one per node holding some of the prompt's
segments, against ``ceil(n / S)``), p50/p99 restore latency, GB/s (bytes restored / wall
seconds), medians over rounds; every restore is checked (all tokens), and each thread's
first restore byte for byte.
"""

from __future__ import annotations

import argparse
import math
import random
import shutil
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import _common as C
import torch
from _nodes import Nodes

import isolane
from isolane.client.kv_pool import RemoteKVPool
from isolane.cluster.chain_segments import DEFAULT_SEGMENT_BLOCKS
from isolane.cluster.router import ClusterOptions

SECTION = "cluster-locality"
CHUNK_TOKENS = 256
TOKEN_BYTES = 4096  # one float32 row of 1,024 values a token: 1 MiB a block
BLOCK_BYTES = CHUNK_TOKENS * TOKEN_BYTES
PROMPT_TOKENS = (1024, 4096, 16384)
WHOLE = 1 << 20  # S past every prompt: one segment a chain


@dataclass
class Placement:
    name: str
    segment_blocks: int


def placements() -> list[Placement]:
    """Per block, S = 2 (a small segment, close to per-block hit rates), the default S,
    whole chains."""
    sizes = sorted({2, DEFAULT_SEGMENT_BLOCKS} - {1})
    return [Placement("per-block (S = 1)", 1),
            *(Placement(f"segments (S = {s})", s) for s in sizes),
            Placement("whole chain", WHOLE)]


@dataclass
class LocalityRun:
    placement: str
    segment_blocks: int
    tokens: int
    round: int
    restores: int
    nbytes: int
    seconds: float
    requests: int
    p50_ms: float
    p99_ms: float
    errors: list[str] = field(default_factory=list)

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / self.seconds / C.GB

    @property
    def requests_per_restore(self) -> float:
        return self.requests / max(1, self.restores)


def prompt(tokens: int, p: int) -> list[int]:
    return [(tokens * 7919 + p * 104729 + i) % 2_000_000_000 for i in range(tokens)]


def kv_of(tokens: int, p: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(tokens * 1000 + p)
    return torch.randn(tokens, TOKEN_BYTES // 4, generator=gen)


def timed_restores(pool: RemoteKVPool, tokens: int, prompts: int, threads: int,
                   seconds: float, round_no: int, placement: Placement) -> LocalityRun:
    latencies: list[list[float]] = [[] for _ in range(threads)]
    done = [0] * threads
    errors: list[str] = []

    def worker(t: int, wait_start: Callable[[], float]) -> None:
        rng = random.Random(round_no * 100 + t)
        first = True
        stop_at = wait_start()
        while time.perf_counter() < stop_at:
            p = rng.randrange(prompts)
            t0 = time.perf_counter()
            n, kv = pool.get(prompt(tokens, p))
            latencies[t].append(time.perf_counter() - t0)
            if n != tokens or kv is None:
                errors.append(f"{placement.name}: {tokens}-token prompt {p} restored "
                              f"{n} tokens")
                return
            if first:
                first = False
                if not torch.equal(kv, kv_of(tokens, p)):
                    errors.append(f"{placement.name}: prompt {p} came back different")
                    return
            done[t] += 1

    workers = C.TimedThreads(threads, worker)
    before = pool._nodes.get_requests
    wall = workers.run(seconds)
    requests = pool._nodes.get_requests - before
    p50, p99 = C.p50_p99_ms(latencies)
    restores = sum(done)
    return LocalityRun(placement.name, placement.segment_blocks, tokens, round_no, restores,
                       restores * tokens * TOKEN_BYTES, wall, requests, p50, p99,
                       errors[:3])


def run_locality(args: argparse.Namespace, log: Callable[[str], None] = print
                 ) -> tuple[list[LocalityRun], str]:
    """Start the nodes, store the prompts under each placement, time the restores;
    returns the runs and the report section."""
    quick = args.quick
    seconds = args.locality_seconds or (0.5 if quick else 4.0)
    rounds = args.locality_rounds or (1 if quick else 3)
    prompts = 1 if quick else 6
    n_nodes = args.locality_nodes
    folder = args.dir / "locality"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    corpus = prompts * sum(PROMPT_TOKENS) * TOKEN_BYTES
    budget = 3 * corpus // n_nodes * 2 + (64 << 20)  # every placement, with room
    began = time.perf_counter()
    nodes = Nodes(folder, budget, n_nodes)
    runs: list[LocalityRun] = []
    try:
        nodes.wait_ready()
        pools = {}
        for place in placements():
            pool = RemoteKVPool(nodes.urls, namespace=f"locality-{place.segment_blocks}",
                                chunk_tokens=CHUNK_TOKENS, token_dim=0,
                                cluster=ClusterOptions(segment_blocks=place.segment_blocks,
                                                       slow_s=30.0),
                                connections=args.locality_threads + 2, timeout_s=30.0,
                                put_timeout_s=60.0)
            for tokens in PROMPT_TOKENS:
                for p in range(prompts):
                    if pool.put(prompt(tokens, p), kv_of(tokens, p)) != tokens // CHUNK_TOKENS:
                        raise RuntimeError(f"{place.name}: prompt {p} not stored whole")
                    pool.get(prompt(tokens, p))  # warm
            pools[place.name] = (place, pool)
        order = list(pools)
        for r in range(rounds):
            for name in order[r % len(order):] + order[:r % len(order)]:
                place, pool = pools[name]
                for tokens in PROMPT_TOKENS:
                    run = timed_restores(pool, tokens, prompts, args.locality_threads,
                                         seconds, r, place)
                    runs.append(run)
                    log(f"  locality round {r} {name:20} {tokens:6} tokens: "
                        f"{run.requests_per_restore:5.1f} requests/restore, p50 "
                        f"{run.p50_ms:7.1f} ms, p99 {run.p99_ms:7.1f} ms, "
                        f"{run.gb_per_s:5.2f} GB/s" + (f"  ERRORS {run.errors}"
                                                      if run.errors else ""))
        for _, pool in pools.values():
            pool.close()
    finally:
        nodes.stop()
        shutil.rmtree(folder, ignore_errors=True)
    total = time.perf_counter() - began
    return runs, render_locality(runs, args, n_nodes, seconds, rounds, prompts, total)


def render_locality(runs: Sequence[LocalityRun], args: argparse.Namespace, n_nodes: int,
                    seconds: float, rounds: int, prompts: int, total_s: float) -> str:
    def med(values: list[float]) -> float:
        return statistics.median(values) if values else math.nan

    names = list(dict.fromkeys(r.placement for r in runs))
    rows = []
    summary: dict[int, list[str]] = {}
    for tokens in PROMPT_TOKENS:
        blocks = tokens // CHUNK_TOKENS
        base: dict[str, float] = {}
        for name in names:
            rs = [r for r in runs if r.placement == name and r.tokens == tokens]
            if not rs:
                continue
            s = rs[0].segment_blocks
            gb, p50 = med([r.gb_per_s for r in rs]), med([r.p50_ms for r in rs])
            if not base:
                base = {"gb": gb, "p50": p50}
            rows.append([f"{tokens:,} ({blocks} blocks)", f"`{name}`",
                         f"{med([r.requests_per_restore for r in rs]):.1f}",
                         f"{min(blocks, math.ceil(blocks / s))}",
                         f"{p50:.1f}", f"{med([r.p99_ms for r in rs]):.1f}",
                         f"{gb:.2f}", C.fmt_ratio(C.ratio(gb, base["gb"])),
                         ", ".join(f"{r.gb_per_s:.2f}" for r in rs),
                         "ok" if not any(r.errors for r in rs) else "; ".join(
                             e for r in rs for e in r.errors)])
        for s in sorted({r.segment_blocks for r in runs} - {1, WHOLE}):
            seg = [r for r in runs if r.tokens == tokens and r.segment_blocks == s]
            if seg and base:
                gb = med([r.gb_per_s for r in seg])
                summary.setdefault(s, []).append(
                    f"{tokens:,} tokens: {gb:.2f} vs {base['gb']:.2f} GB/s "
                    f"({C.fmt_ratio(C.ratio(gb, base['gb']))}), p50 "
                    f"{med([r.p50_ms for r in seg]):.1f} vs {base['p50']:.1f} ms")
    machine = C.machine_description(args.dir, {"isolane": isolane.__version__,
                                               "torch": torch.__version__})
    lines = [
        "## Cluster on loopback: prompt restores by placement (`benchmarks/bench_cluster.py "
        "--locality`)", "",
        f"Command: `{C.command_line()}`  ", f"Date: {C.now_text()}  ", f"Machine: {machine}",
        "",
        f"{n_nodes} `isolane serve` nodes on 127.0.0.1 with the client on this machine "
        f"({total_s:.0f} s in all). Each placement is a `RemoteKVPool` with its own "
        "`segment_blocks` (S) and namespace, holding the same "
        f"{prompts} prompts of each size (256-token blocks of {BLOCK_BYTES >> 20} MiB, "
        "float32 KV), read once before timing (the nodes' memory tiers hold everything). "
        f"{args.locality_threads} threads restore random prompts with `get` for "
        f"{seconds:g} s a run; medians of {rounds} rounds (each placement first in turn), "
        "runs listed. requests/restore = batch gets the client sent per restore (one per "
        "node holding some of the prompt's segments, the nodes asked at once), against the "
        "bound ceil(n / S); GB/s = KV bytes restored / wall seconds; latency per restore; "
        "`vs per-block` against the first row of the size. Every restore is checked (all "
        f"tokens; each thread's first one byte for byte). With {n_nodes} nodes a per-block "
        f"restore asks at most {n_nodes} nodes too (each once, for all of its blocks): "
        "what segments save is requests to more nodes and the blocks' spread, which grow "
        "with the node count.", "",
        C.markdown_table(["prompt tokens", "placement", "requests/restore", "ceil(n/S)",
                          "p50 ms", "p99 ms", "GB/s", "vs per-block", "runs (GB/s)",
                          "check"], rows),
        *(f"\nSegments (S = {s}) against per-block placement: " + "; ".join(parts) + "."
          for s, parts in summary.items()),
    ]
    return "\n".join(lines)


def runs_json(runs: Sequence[LocalityRun]) -> list[dict[str, Any]]:
    return [asdict(r) for r in runs]
