#!/usr/bin/env python
"""KV block eviction: LRU and S3-FIFO on the Mooncake conversation trace.

    python benchmarks/bench_kv_eviction.py                          # ~15 s, prints the table
    python benchmarks/bench_kv_eviction.py --out docs/BENCHMARKS.md  # and records its rows
    python benchmarks/bench_kv_eviction.py --quick   # smoke test: the first 1,500 requests

The trace (``_trace.py``) is replayed through each policy of
``tests/support/eviction_oracles.py`` with a memory tier holding 1, 10 and 50 % of the
trace's unique blocks: a request's hits are the longest resident prefix of its blocks,
then each of its blocks is touched or admitted, last block first (the order of isolane's
memory tier, so a chain's head is evicted last). Reported: block hit rate = hits /
blocks, per policy and size, beside an unlimited cache's. Pure computation, one core.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Hashable
from pathlib import Path

import _common as C
import _quick
import _results

C.ensure_repo_importable()

from _trace import (  # noqa: E402
    BLOCK_BYTES,
    DEFAULT_TRACE,
    README_CEILING,
    Trace,
    capacity_blocks,
    first_requests,
    load_trace,
    prefix_hits,
    replay_unlimited,
    touch_or_admit,
)

import isolane  # noqa: E402
from tests.support.eviction_oracles import POLICIES, EvictionPolicy, make_policy  # noqa: E402

SIZES = (1.0, 10.0, 50.0)  # % of unique blocks: every policy vs LRU at the first two
QUICK_REQUESTS = 1500
DEFAULT_POLICY = "s3fifo"  # the memory tier's (kvpool.policy)
HitRates = dict[str, dict[float, float]]  # policy -> cache size % -> block hit rate


def replay(trace: Trace, policy: EvictionPolicy[Hashable], capacity: int) -> float:
    hits = 0
    for ids in trace.requests:
        hits += prefix_hits(ids, policy)
        for h in reversed(ids):  # tail first, as the memory tier admits and touches
            touch_or_admit(policy, h, capacity)
        if policy.nbytes > capacity:
            raise RuntimeError(f"policy over budget: {policy.nbytes} > {capacity}")
    return hits / trace.blocks


def render(trace: Trace, ceiling: float, rates: HitRates, sizes: tuple[float, ...],
           args: argparse.Namespace, facts: dict[str, str]) -> str:
    def pct(value: float) -> str:
        return f"{value * 100:.1f} %"

    best = {s: max(round(r[s], 3) for r in rates.values()) for s in sizes}
    rows: list[list[object]] = [[f"`{name}`", *(  # the best of each size in bold, ties too
        f"**{pct(r[s])}**" if round(r[s], 3) == best[s] else pct(r[s]) for s in sizes)]
        for name, r in rates.items()]
    rows += [[f"`{name}` vs `lru` (points)", *(
        f"{round((r[s] - rates['lru'][s]) * 100, 1) + 0.0:+.1f}" for s in sizes)]
        for name, r in rates.items() if name != "lru"]  # + 0.0: no "-0.0"
    rows.append(["unlimited", *(pct(ceiling) for _ in sizes)])
    return "\n".join([
        *C.report_head("KV block eviction (`benchmarks/bench_kv_eviction.py`)", facts),
        f"Trace: `{args.trace.name}` ({len(trace.requests):,} requests, {trace.blocks:,} "
        f"blocks of 512 tokens, {trace.unique_blocks:,} unique). Block hit rate = hits / "
        "blocks; the best policy of each size in bold.", "",
        f"Unlimited cache (ceiling): **{pct(ceiling)}** of blocks are hits (the trace's "
        f"README says ~{README_CEILING * 100:.1f} %).", "",
        C.markdown_table(["policy", *(f"{s:g} %" for s in sizes)], rows), "",
        "Cache sizes in blocks: " + ", ".join(
            f"{s:g} % = {capacity_blocks(trace.unique_blocks, s):,}" for s in sizes) + ".", ""])


def headline_rows(ceiling: float, rates: HitRates, sizes: tuple[float, ...],
                  where: dict[str, str]) -> list[_results.Result]:
    """Each policy against LRU at 1 % and 10 % of the unique blocks, and the memory tier's
    default policy at the largest size against the unlimited cache."""
    def row(size: float, name: str, peer: str, peer_rate: float) -> _results.Result:
        rate = rates[name][size] * 100
        return _results.Result(
            area="KV pool", unit="%", measure=f"block hit rate, Mooncake trace, cache "
            f"{size:g} % of unique blocks, {name}", value=round(rate, 1), peer=peer,
            peer_value=round(peer_rate, 1), ratio=round(rate - peer_rate, 1),
            ratio_unit="points", **where)

    rows = [row(size, name, "lru", rates["lru"][size] * 100) for name in rates
            if name != "lru" for size in sizes[:2]]
    return [*rows, row(sizes[-1], DEFAULT_POLICY, "unlimited cache (ceiling)", ceiling * 100)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake trace (.jsonl)")
    p.add_argument("--out", type=Path, help="markdown file whose section to (re)write")
    _quick.add_argument(p)
    args = p.parse_args(argv)
    if args.quick:  # every policy and size, the trace's first requests
        _quick.enter(args, p, folders=(), files=())
    trace = load_trace(args.trace)
    if args.quick:
        trace = first_requests(trace, QUICK_REQUESTS)
    ceiling = replay_unlimited(trace)
    rates: HitRates = {name: {} for name in POLICIES}
    for name in POLICIES:
        for size in SIZES:
            capacity = capacity_blocks(trace.unique_blocks, size) * BLOCK_BYTES
            rates[name][size] = replay(trace, make_policy(name, capacity), capacity)
    facts = C.run_facts(args.trace.parent, {"isolane": isolane.__version__})
    C.publish("kv_eviction", render(trace, ceiling, rates, SIZES, args, facts),
              headline_rows(ceiling, rates, SIZES, facts), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
