#!/usr/bin/env python
"""KV routing across storage nodes, placement units side by side: per block, whole
chain, chain segments; hit rate, load, keys moved and node requests per restore, on the
Mooncake conversation trace and three generated heavy-tailed traces.

    python benchmarks/bench_routing.py --quick                      # smoke test, ~1 min
    python benchmarks/bench_routing.py --out docs/BENCHMARKS.md     # full run, 3-15 min

A simulation of isolane's pure routing logic (``isolane.cluster.ring``,
``chain_segments``): no servers, no disks; the replays run in ``--workers`` processes.
Traces (``_trace.py``, ``_trace_gen.py``), replayed in timestamp order: a request's
blocks are prefix ids (equal ids, equal prefix). Routers, on the same requests:

- ``per-block ring``: isolane's ring (256 points a node), every block by its own key;
- ``per-block mod-N``: ``xxh3_64(key) mod N``, every block by its own key;
- ``whole-chain ring``: the chain's routing digest (the key of block ``k - 1``, k = 2)
  on the ring: a prompt's blocks all on one node;
- ``whole-chain bounded``: + bounded loads (``BoundedLoadRouter``, c = 1.25, load =
  blocks served so far, a chain kept where it was served last while within its bound);
- ``segment ring``: segment i (S blocks) of a chain by its segment digest on the ring
  (``plan_segments``: segment 0 anchored at the routing digest, segment i >= 1 at its
  own first block);
- ``segment bounded``: + bounded loads, per segment: what the cluster client runs;
- ``segment bounded hot only``: bounded loads for hot segments only (served more than
  ``HOT_FACTOR`` x the mean segment on their ring owner); the others stay on their ring
  owner whatever its load (evaluated here, not used by the client);
- ``segment v1 bounded``: ``segment bounded`` with every segment anchored at the routing digest
  (the segment digests before anchors, version 1);
- ``segment spread`` (on version-1 segments): a chain's segment j on the first node
  along the ring walk from its digest that holds fewer than ``ceil((j + 1) / N)`` of
  the chain's segments before it (``spread_owners``, evaluated here, not used by the
  client): every chain spreads evenly over the nodes;
- ``segment spread bounded``: + bounded loads, starting from the spread owner;
- ``per-block bounded``: every block with bounded loads;
- ``segment avoid w`` (+ ``bounded``): ``_route_families.py``;
- ``segment bounded sticky`` / ``per-block bounded sticky``: bounded loads for writes
  only (``_route_sim.STICKY``): a unit is read where it was written while resident
  there, and placed anew only when it would miss there;
- ``per-block hrw``, ``per-block hrw bounded``, ``segment hrw``, ``segment hrw bounded``:
  rendezvous (highest-random-weight) hashing instead of the ring (``_route_hrw.py``);
  bounded loads walk down a unit's scores.

With ``--clusters`` > 1 (node namings, medians) a table puts each family's median gap to
the best per-block baseline beside its range over the namings.

``--routers`` / ``--nodes`` run a subset (the heading says so; use another
``--section``).

Every node is a cache of the given policy (LRU or S3-FIFO, ``tests/support/eviction_oracles.py``)
holding a share of the trace's unique blocks divided by N. A request's hits are the
longest prefix of its blocks resident where they route (a block after a miss is
useless); then every block is touched or admitted there, tail first (as the memory
tier does: the head is evicted last; head first is replayed beside it for a few routers,
``ORDER_ROUTERS``). Reported per trace and N:
block hit rate, request-level prefix hit rate (the mean over requests of the share of
their blocks hit), max/mean load (blocks served per node), node requests per restore
(one request per node holding some of the prompt's blocks, as ``RemoteKVPool`` reads a
prompt, against ``ceil(n / S)``), and keys moved on join/leave (the share of stored
block copies whose node changes, over the ideal ``1 / max(N_old, N_new)``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C
import _quick
import _results
import _route_loss

C.ensure_repo_importable()

from _route_report import render  # noqa: E402
from _route_sim import (  # noqa: E402
    BLOCK_KEYS,
    DIGEST_K,
    K_VARIANTS,
    NAMINGS,
    NODE_COUNTS,
    NOISE_NODES,
    NOISE_ROUTERS,
    ORDER_ROUTERS,
    PER_BLOCK,
    POLICIES,
    QUICK_REQUESTS,
    ROUTERS,
    S_SWEEP,
    SECTION,
    SIZES,
    SWEEP_NODES,
    SWEPT,
    TRACES,
    Case,
    CaseResult,
    K,
    MoveResult,
    blake,
    label,
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


# -- command line -----------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake trace (.jsonl)")
    p.add_argument("--traces", default=",".join(["mooncake", *GENERATORS]),
                   help="comma-separated: mooncake and/or " + ", ".join(GENERATORS))
    p.add_argument("--segment-blocks", type=int, default=DEFAULT_SEGMENT_BLOCKS,
                   help="S of the segment routers")
    p.add_argument("--clusters", type=int, default=1, help="node namings per case (medians)")
    p.add_argument("--workers", type=int, default=2, help="processes for the replays")
    p.add_argument("--no-sweep", action="store_true", help="skip the S sweep")
    p.add_argument("--routers", help="comma-separated subset of the routers (default: all)")
    p.add_argument("--nodes", help="comma-separated node counts (default: "
                   + ",".join(map(str, NODE_COUNTS)) + ")")
    _quick.add_argument(p)
    p.add_argument("--out", type=Path, help="markdown file whose section to (re)write")
    p.add_argument("--section", default=SECTION, help="section marker name in --out")
    p.add_argument("--json", type=Path, default=C.REPO_ROOT / ".bench" / "routing.json",
                   help="raw results (default .bench/routing.json)")
    args = p.parse_args(argv)
    routers = [r.strip() for r in (args.routers or "").split(",") if r.strip()]
    if unknown_routers := sorted(set(routers) - set(ROUTERS)):
        p.error(f"unknown routers {unknown_routers}; choose from {', '.join(ROUTERS)}")
    if routers and not set(PER_BLOCK) <= set(routers):
        p.error(f"--routers must include the baselines {', '.join(PER_BLOCK)}")
    try:
        nodes = tuple(int(x) for x in (args.nodes or "").split(",") if x.strip())
    except ValueError:
        p.error(f"--nodes must be whole numbers, got {args.nodes!r}")
    if any(x < 2 for x in nodes):
        p.error("--nodes must be 2 or more")
    args.routers = tuple(r for r in ROUTERS if r in routers) if routers else ROUTERS
    args.nodes = nodes or NODE_COUNTS
    args.policies, args.sizes = tuple(POLICIES), SIZES
    if args.quick:  # every trace (its first requests), router and the sweep; 8 nodes, S3-FIFO
        _quick.enter(args, p, folders=())
        args.nodes, args.policies = (8,), ("s3fifo",)
    # S3-FIFO (the pool's default) at every size, LRU at the middle one, and unlimited
    # caches: the run stays within minutes.
    args.labels = (*(("s3fifo", z) for z in args.sizes),
                   *((("lru", args.sizes[1]),) if "lru" in args.policies else ()),
                   ("lru", None))
    args.trace_names = [t.strip() for t in args.traces.split(",") if t.strip()]
    unknown = set(args.trace_names) - {"mooncake", *GENERATORS}
    if unknown:
        p.error(f"unknown traces {sorted(unknown)}; choose from mooncake, "
                + ", ".join(GENERATORS))
    if min(args.clusters, args.workers, args.segment_blocks) < 1:
        p.error("--clusters, --workers and --segment-blocks must be >= 1")
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
        DIGEST_K[trace.name] = K
        if trace.name in K_VARIANTS:  # the same requests, another k
            k = K_VARIANTS[trace.name]
            variant = f"{trace.name} (k = {k})"
            traces[variant] = replace(trace, name=variant, description=(
                f"the same requests, the routing digest at block {k - 1} (k = {k})"))
            DIGEST_K[variant] = k
    for name, trace in traces.items():
        TRACES[name] = trace
        BLOCK_KEYS[name] = {h: blake(f"{trace.name.split()[0]}-{h}".encode())
                       for ids in trace.requests for h in ids}
    ceilings = {name: replay_unlimited(t) for name, t in traces.items()}
    labels = args.labels
    cases = [Case(name, kind, n, args.segment_blocks, c, labels)
             for name in traces for n in args.nodes for kind in args.routers
             for c in range(1 if kind.endswith("mod-N") else args.clusters)]
    mid = (("s3fifo", args.sizes[1]),)
    sweep_cases = [] if args.no_sweep else [
        Case(name, kind, SWEEP_NODES, s, 0, mid, group="sweep") for name in traces
        for kind in SWEPT for s in S_SWEEP] + [
        Case(name, kind, SWEEP_NODES, 1, 0, mid, group="sweep") for name in traces
        for kind in PER_BLOCK]
    noise_cases = [] if args.no_sweep else [
        Case(name, kind, n, args.segment_blocks, c, labels[:-1], group="noise")
        for name in traces for n in NOISE_NODES if n in args.nodes
        for kind in NOISE_ROUTERS for c in range(1, NAMINGS)]
    order_cases = [Case(name, kind, n, args.segment_blocks, 0, labels[:-1], group="order",
                        order="head")
                   for name in traces for n in args.nodes for kind in ORDER_ROUTERS
                   if kind in args.routers]
    results: list[CaseResult] = []
    ordered: list[CaseResult] = []
    sweep: list[CaseResult] = []
    noise: list[CaseResult] = []
    # Cases are independent: spread them over processes (fork shares the traces).
    # Longest first, so the pool does not end on one long case.
    order = sorted([*cases, *sweep_cases, *noise_cases, *order_cases], key=lambda c: -c.nodes * (
        3 if "bounded" in c.router else 1) * len(c.labels))
    with multiprocessing.get_context("fork").Pool(args.workers) as pool:
        for case, res in zip(order, pool.imap(run_case, order), strict=True):
            {"main": results, "sweep": sweep,
             "noise": noise, "order": ordered}[case.group].append(res)
            lbl = label(*case.labels[min(1, len(case.labels) - 1)])
            log(f"  {case.trace} N={case.nodes} S={case.s} {case.router:20} "
                f"{lbl}: {res.block_hits[lbl] * 100:.1f} %, max/mean "
                f"{res.max_over_mean:.2f}, req/restore {res.requests_per_restore:.1f} "
                f"({res.seconds:.1f} s)")
    loss: list[_route_loss.LossResult] = []
    with multiprocessing.get_context("fork").Pool(args.workers) as pool:
        for res in pool.imap(_route_loss.run_loss_case,
                             _route_loss.loss_cases(list(traces), args.segment_blocks,
                                                    quick=args.quick)):
            loss.append(res)
            log(f"  node loss {res.trace} N={res.nodes} {res.router:22} served "
                f"{res.share * 100:.1f} % (long {res.share_long * 100:.1f} %), stored "
                f"{res.stored:.3f}x ({res.seconds:.1f} s)")
    moves: list[MoveResult] = []
    for name in traces:
        moves += run_moves(name, args.segment_blocks, log)
    seconds = time.perf_counter() - start
    raw = {"date": C.now_text(), "command": C.command_line(), "versions": versions(),
           "seconds": seconds, "ceilings": ceilings,
           "results": [vars(r) for r in results], "sweep": [vars(r) for r in sweep],
           "noise": [vars(r) for r in noise], "order": [vars(r) for r in ordered],
           "moves": [vars(m) for m in moves], "node_loss": [vars(r) for r in loss]}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(raw, indent=1))
    print(f"wrote {args.json}", file=sys.stderr)
    report = render(args, traces, ceilings, results, sweep, moves, seconds,
                    noise, ordered)
    report += "\n### A lost node\n\n" + _route_loss.render_loss(loss)
    C.print_report(report, args.out, args.section)
    if args.out and _results.is_page(args.out):
        where = {"machine": C.machine_description(C.REPO_ROOT, versions()),
                 "date": C.now_text(), "command": C.command_line()}
        _results.write_results("routing_node_loss", _route_loss.headline_rows(loss, where))
    return 0


if __name__ == "__main__":
    sys.exit(main())
