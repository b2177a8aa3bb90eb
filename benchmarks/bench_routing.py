#!/usr/bin/env python
"""KV placement across storage nodes: the cluster client's chain-affine segments beside
the placement before (segments by their own digests), whole chains and the per-block
baselines; hit rate, load, keys moved and a lost node, on the Mooncake conversation trace
and three generated heavy-tailed traces.

    python benchmarks/bench_routing.py --quick                      # smoke test
    python benchmarks/bench_routing.py --out docs/BENCHMARKS.md     # full run

A simulation of isolane's pure routing logic (``isolane.cluster.ring``,
``chain_segments``, ``chain_placement``): no servers, no disks; the replays run in
``--workers`` processes. Traces (``_trace.py``, ``_trace_gen.py``), replayed in
timestamp order: a request's blocks are prefix ids (equal ids, equal prefix). Placements
(``_route_sim.py``), on the same requests:

- ``per-block ring`` / ``per-block mod-N``: every block by its own key on isolane's ring
  / by ``xxh3_64(key) mod N``: the baselines of the hit-rate target;
- ``whole-chain bounded``: a prompt's blocks all on the ring owner of its routing digest
  (the key of block ``k - 1``, k = 2), with bounded loads (``BoundedLoadRouter``,
  c = 1.25, load = blocks served so far);
- ``segment bounded``: segment i (S blocks) by its own segment digest with bounded loads
  (the placement before);
- ``segment affine spill``: the cluster client's ``ChainPlacement``.

Every node is a cache of the given policy (LRU or S3-FIFO,
``tests/support/eviction_oracles.py``) holding its share of a percentage of the trace's
unique blocks. A request's hits are the longest prefix of its blocks resident where they
route; then every block is touched or admitted there, tail first (as the memory tier
does). Reported per trace and N: block hit rate, request-level prefix hit rate, max/mean
load (blocks served per node), node requests per restore, keys moved on a join or leave
(over the ideal ``1 / max(N_old, N_new)``) and the share of cached prefix blocks still
served after a node dies (``_route_loss.py``). The noise of the targets' hit-rate gaps
is measured in the same run: the same replays under ``--namings`` namings of each
trace's blocks (salted hashes: other ring positions, the same workload;
``_route_noise.py``).

With ``--out`` on docs/BENCHMARKS.md the run writes ``benchmarks/results/routing.json``
(the client's placement against the targets, per trace) and ``routing_node_loss.json``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C
import _quick
import _results
import _route_loss
import _route_noise

C.ensure_repo_importable()

from _route_report import headline_rows, render  # noqa: E402
from _route_sim import (  # noqa: E402
    BLOCK_KEYS,
    CLIENT,
    NODE_COUNTS,
    POLICIES,
    QUICK_REQUESTS,
    ROUTERS,
    SECTION,
    SIZES,
    TRACES,
    Case,
    CaseResult,
    MoveResult,
    label,
    name_blocks,
    run_case,
    run_moves,
    versions,
)
from _trace import (  # noqa: E402
    DEFAULT_TRACE,
    Trace,
    first_requests,
    load_trace,
    replay_unlimited,
)
from _trace_gen import GENERATORS  # noqa: E402

from isolane.cluster.chain_segments import DEFAULT_SEGMENT_BLOCKS  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake trace (.jsonl)")
    p.add_argument("--traces", default=",".join(["mooncake", *GENERATORS]),
                   help="comma-separated: mooncake and/or " + ", ".join(GENERATORS))
    p.add_argument("--segment-blocks", type=int, default=DEFAULT_SEGMENT_BLOCKS,
                   help="S of the segment placements")
    p.add_argument("--workers", type=int, default=2, help="processes for the replays")
    p.add_argument("--namings", type=int, default=3,
                   help="namings of each trace's blocks for the noise of the hit-rate "
                        "gaps (1: no noise measure; --quick: 2)")
    p.add_argument("--nodes", help="comma-separated node counts (default: "
                   + ",".join(map(str, NODE_COUNTS)) + ")")
    _quick.add_argument(p)
    p.add_argument("--out", type=Path, help="markdown file whose section to (re)write")
    p.add_argument("--section", default=SECTION, help="section marker name in --out")
    p.add_argument("--json", type=Path, default=C.REPO_ROOT / ".bench" / "routing.json",
                   help="raw results (default .bench/routing.json)")
    args = p.parse_args(argv)
    try:
        nodes = tuple(int(x) for x in (args.nodes or "").split(",") if x.strip())
    except ValueError:
        p.error(f"--nodes must be whole numbers, got {args.nodes!r}")
    if any(x < 2 for x in nodes):
        p.error("--nodes must be 2 or more")
    args.routers = ROUTERS
    args.nodes = nodes or NODE_COUNTS
    args.policies, args.sizes = tuple(POLICIES), SIZES
    if args.quick:  # every trace (its first requests) and placement; 8 nodes, S3-FIFO
        _quick.enter(args, p, folders=())
        args.nodes, args.policies = (8,), ("s3fifo",)
        args.namings = min(args.namings, 2)
    # S3-FIFO (the pool's default) at every size, LRU at the middle one, and unlimited
    # caches.
    args.labels = (*(("s3fifo", z) for z in args.sizes),
                   *((("lru", args.sizes[1]),) if "lru" in args.policies else ()),
                   ("lru", None))
    args.trace_names = [t.strip() for t in args.traces.split(",") if t.strip()]
    unknown = set(args.trace_names) - {"mooncake", *GENERATORS}
    if unknown:
        p.error(f"unknown traces {sorted(unknown)}; choose from mooncake, "
                + ", ".join(GENERATORS))
    if min(args.workers, args.segment_blocks, args.namings) < 1:
        p.error("--workers, --segment-blocks and --namings must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()

    def log(text: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f} s]{text}", file=sys.stderr, flush=True)

    traces: dict[str, Trace] = {}
    for name in args.trace_names:
        trace = load_trace(args.trace) if name == "mooncake" else GENERATORS[name]()
        if args.quick:
            trace = first_requests(trace, QUICK_REQUESTS)
        traces[trace.name] = trace
        TRACES[trace.name] = trace
        for naming in range(args.namings):
            BLOCK_KEYS[trace.name, naming] = name_blocks(trace, naming)
    ceilings = {name: replay_unlimited(t) for name, t in traces.items()}
    cases = [Case(name, kind, n, args.segment_blocks, args.labels)
             for name in traces for n in args.nodes for kind in args.routers]
    # Cases are independent: spread them over processes (fork shares the traces).
    # Longest first, so the pool does not end on one long case.
    noise_cases = _route_noise.noise_cases(list(traces), args.nodes, args.segment_blocks,
                                           args.labels, args.namings)
    cases += noise_cases
    cases.sort(key=lambda c: -c.nodes * (3 if c.router in CLIENT else 1))
    results: list[CaseResult] = []
    noise: list[CaseResult] = []
    mid = label("s3fifo", args.sizes[1])
    with multiprocessing.get_context("fork").Pool(args.workers) as pool:
        for case, res in zip(cases, pool.imap(run_case, cases), strict=True):
            (noise if case.naming else results).append(res)
            log(f"  {case.trace}{f' naming {case.naming}' if case.naming else ''} "
                f"N={case.nodes} {case.router:20} {mid}: "
                f"{res.block_hits[mid] * 100:.1f} %, max/mean {res.max_over_mean:.2f}, "
                f"req/restore {res.requests_per_restore:.1f} ({res.seconds:.1f} s)")
        loss: list[_route_loss.LossResult] = []
        for res in pool.imap(_route_loss.run_loss_case,
                             _route_loss.loss_cases(list(traces), args.segment_blocks)):
            loss.append(res)
            log(f"  node loss {res.trace} N={res.nodes} {res.router:22} served "
                f"{res.share * 100:.1f} % (long {res.share_long * 100:.1f} %), stored "
                f"{res.stored:.3f}x ({res.seconds:.1f} s)")
    moves: list[MoveResult] = []
    for name in traces:
        moves += run_moves(name, args.segment_blocks, args.nodes, log)
    seconds = time.perf_counter() - start
    spreads = _route_noise.spreads(results, noise, list(traces), args.labels)
    raw = {"date": C.now_text(), "command": C.command_line(), "versions": versions(),
           "seconds": seconds, "ceilings": ceilings, "results": [vars(r) for r in results],
           "noise": [vars(r) for r in noise], "spreads": [vars(x) for x in spreads],
           "moves": [vars(m) for m in moves], "node_loss": [vars(r) for r in loss]}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(raw, indent=1))
    print(f"wrote {args.json}", file=sys.stderr)
    report = render(args, traces, ceilings, results, moves, seconds)
    report += "\n".join(_route_noise.render_noise(spreads)) + "\n"
    report += "\n### A lost node\n\n" + _route_loss.render_loss(loss)
    C.print_report(report, args.out, args.section)
    if args.out and _results.is_page(args.out):
        where = {"machine": C.machine_description(C.REPO_ROOT, versions()),
                 "date": C.now_text(), "command": C.command_line()}
        notes = {x.trace: x.note() for x in spreads}
        _results.write_results("routing", headline_rows(args, list(traces), results,
                                                        moves, where, notes))
        _results.write_results("routing_node_loss", _route_loss.headline_rows(loss, where))
    return 0


if __name__ == "__main__":
    sys.exit(main())
