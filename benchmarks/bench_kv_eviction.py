#!/usr/bin/env python
"""KV block eviction: LRU and S3-FIFO on the Mooncake conversation trace.

    python benchmarks/bench_kv_eviction.py                          # ~15 s, prints the table
    python benchmarks/bench_kv_eviction.py --out docs/BENCHMARKS.md  # and records its rows
    python benchmarks/bench_kv_eviction.py --quick   # smoke test: the first 1,500 requests

The trace (``/work/shared/data/mooncake_conversation_trace.jsonl``, see the README beside
it) lists 12,031 requests of one hour; each request's ``hash_ids`` are its 512-token
prefix blocks. Requests are replayed in timestamp order through each policy of
``tests/support/eviction_oracles.py`` with a memory tier holding 0.1/0.5/1/2/5/10/20/50 % of the
trace's unique blocks (all blocks the same size):

- **hits** of a request: the longest prefix of its blocks that is resident (prefix
  caching: a block after a miss cannot be used, its attention depends on the miss);
- then every block of the request is touched if resident, else admitted after evicting
  enough bytes to stay in budget, last block first (the order of isolane's memory tier,
  ``MemoryTier.put_many``/``get_many``, so a chain's head is evicted last).

Reported: block hit rate = hits / blocks, per policy and size, next to the ceiling of an
unlimited cache (the trace's README says ~36.6 %). Pure computation: no disk, one core.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Hashable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

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

SECTION = "kv-eviction"
DEFAULT_SIZES = (0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0)
QUICK_REQUESTS = 1500
HEADLINE_SIZES = (1.0, 10.0)  # cache sizes (% of unique blocks) the results page shows
DEFAULT_POLICY = "s3fifo"  # the memory tier's (kvpool.policy)


@dataclass
class Result:
    policy: str
    hit_rates: dict[float, float] = field(default_factory=dict)  # size % -> hit rate


def replay(trace: Trace, policy: EvictionPolicy[Hashable], capacity_bytes: int) -> float:
    hits = 0
    for ids in trace.requests:
        hits += prefix_hits(ids, policy)
        for h in reversed(ids):  # tail first, as the memory tier admits and touches
            touch_or_admit(policy, h, capacity_bytes)
        if policy.nbytes > capacity_bytes:
            raise RuntimeError(f"policy over budget: {policy.nbytes} > {capacity_bytes}")
    return hits / trace.blocks


def capacity_for(trace: Trace, percent: float) -> int:
    return capacity_blocks(trace.unique_blocks, percent) * BLOCK_BYTES


def run(trace: Trace, policies: list[str], sizes: list[float]) -> list[Result]:
    results = []
    for name in policies:
        res = Result(name)
        for percent in sizes:
            capacity = capacity_for(trace, percent)
            policy = make_policy(name, capacity)
            seconds, rate = C.timed(partial(replay, trace, policy, capacity))
            res.hit_rates[percent] = rate
            print(f"  {name:9} {percent:5g} % ({capacity} blocks): "
                  f"{rate * 100:.2f} % hits, {seconds:.2f} s", file=sys.stderr, flush=True)
        results.append(res)
    return results


# -- the report --------------------------------------------------------------------------
def pct(value: float) -> str:
    return f"{value * 100:.1f} %"


def points(delta: float) -> str:
    return f"{round(delta * 100, 1) + 0.0:+.1f}"  # + 0.0: no "-0.0"


def render(trace: Trace, ceiling: float, results: list[Result], sizes: list[float],
           args: argparse.Namespace) -> str:
    out = ["## KV block eviction (`benchmarks/bench_kv_eviction.py`)", ""]
    out += [f"Command: `{C.command_line()}`  ", f"Date: {C.now_text()}  ",
            "Machine: " + C.machine_description(args.trace.parent,
                                                {"isolane": isolane.__version__}), ""]
    out += [f"Trace: `{args.trace.name}` ({len(trace.requests):,} requests, "
            f"{trace.blocks:,} blocks of 512 tokens, {trace.unique_blocks:,} unique). Block "
            "hit rate = hits / blocks; the best policy of each size in bold.", "",
            f"Unlimited cache (ceiling): **{pct(ceiling)}** of blocks are hits "
            f"(the trace's README says ~{README_CEILING * 100:.1f} %).", ""]
    rows: list[list[object]] = []
    best = {s: max(round(r.hit_rates[s], 3) for r in results) for s in sizes}
    for res in results:  # the best rate of each size in bold (ties: all of them)
        rows.append([f"`{res.policy}`", *(
            f"**{pct(res.hit_rates[s])}**" if round(res.hit_rates[s], 3) == best[s]
            else pct(res.hit_rates[s]) for s in sizes)])
    base = next((r for r in results if r.policy == "lru"), None)
    if base is not None:
        for res in (r for r in results if r.policy != "lru"):
            rows.append([f"`{res.policy}` vs `lru` (points)",
                         *(points(res.hit_rates[s] - base.hit_rates[s]) for s in sizes)])
    rows.append(["unlimited", *(pct(ceiling) for _ in sizes)])
    out.append(C.markdown_table(["policy", *(f"{s:g} %" for s in sizes)], rows))
    out += ["", "Cache sizes in blocks: " + ", ".join(
        f"{s:g} % = {capacity_for(trace, s) // BLOCK_BYTES:,}" for s in sizes) + "."]
    return "\n".join(out) + "\n"


def headline_rows(ceiling: float, results: list[Result], sizes: list[float],
                  args: argparse.Namespace) -> list[_results.Result]:
    """The page's rows: each policy against LRU at 1 % and 10 % of the unique blocks, and
    the memory tier's default policy at the largest size against the unlimited cache."""
    tier = {r.policy: r for r in results}
    run = dict(area="KV pool", unit="%", machine=C.machine_description(
        args.trace.parent, {"isolane": isolane.__version__}),
        date=C.now_text(), command=C.command_line())
    rows = []
    for name, res in tier.items():
        for size in (s for s in HEADLINE_SIZES if s in sizes and "lru" in tier):
            if name != "lru":
                rate, base = res.hit_rates[size] * 100, tier["lru"].hit_rates[size] * 100
                rows.append(_results.Result(
                    measure=f"block hit rate, Mooncake trace, cache {size:g} % of unique "
                            f"blocks, {name}", value=round(rate, 1), peer="lru",
                    peer_value=round(base, 1), ratio=round(rate - base, 1),
                    ratio_unit="points", **run))
    if DEFAULT_POLICY in tier:
        top = max(sizes)
        rate = tier[DEFAULT_POLICY].hit_rates[top] * 100
        rows.append(_results.Result(
            measure=f"block hit rate, Mooncake trace, cache {top:g} % of unique blocks, "
                    f"{DEFAULT_POLICY}", value=round(rate, 1), peer="unlimited cache (ceiling)",
            peer_value=round(ceiling * 100, 1), ratio=round(rate - ceiling * 100, 1),
            ratio_unit="points", **run))
    return rows


# -- command line ------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake trace (.jsonl)")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help=f"comma list from: {', '.join(POLICIES)}")
    p.add_argument("--sizes", default=",".join(f"{s:g}" for s in DEFAULT_SIZES),
                   help="cache sizes, percent of the unique blocks")
    p.add_argument("--out", type=Path, help="markdown file whose section to (re)write")
    _quick.add_argument(p)
    args = p.parse_args(argv)
    if args.quick:  # every policy, two sizes, the trace's first requests
        _quick.enter(args, p, folders=(), files=())
        args.sizes = "1,10"
    args.policies = [s.strip() for s in args.policies.split(",") if s.strip()]
    try:
        args.sizes = [float(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        p.error(f"--sizes must be numbers, got {args.sizes!r}")
    if unknown := [x for x in args.policies if x not in POLICIES]:
        p.error(f"unknown policies {unknown}; choose from {', '.join(POLICIES)}")
    if not args.sizes or any(not 0 < s <= 100 for s in args.sizes):
        p.error("--sizes must be percentages in (0, 100]")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    trace = load_trace(args.trace)
    if args.quick:
        trace = first_requests(trace, QUICK_REQUESTS)
    ceiling = replay_unlimited(trace)
    print(f"{len(trace.requests)} requests, {trace.blocks} blocks, {trace.unique_blocks} "
          f"unique; unlimited ceiling {ceiling * 100:.2f} %", file=sys.stderr, flush=True)
    results = run(trace, args.policies, args.sizes)
    report = render(trace, ceiling, results, args.sizes, args)
    C.print_report(report, args.out, SECTION)
    if args.out and _results.is_page(args.out):
        _results.write_results("kv_eviction", headline_rows(ceiling, results, args.sizes, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
