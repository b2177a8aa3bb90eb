"""Per-step overhead of IsolaneConnectorV1 inside vLLM's real scheduler, on the CPU.

    python benchmarks/bench_vllm_connector.py --out docs/BENCHMARKS.md  # records its rows
    python benchmarks/bench_vllm_connector.py --quick   # smoke test: 2 short requests, 1 round

The engine is ``tests/integrations/vllm_engine.py``: vLLM 0.33's own ``Scheduler``,
``Request``s, KV cache config and buffers, and a stand-in forward writing every scheduled
slot of each layer at once (no model: the engine loop and the connector are left). Three
systems take turns in each round, each a fresh engine running the same requests until
the scheduler has nothing left: ``no connector``, and the connector (transfers on its
background thread, the default) on an ``empty pool`` (every full block stored) and on
the ``warm pool`` it filled (prefixes loaded: fewer tokens computed, else the run fails).
Per ``--forward-ms`` setting (``0,5``: none, or 5 ms of device time a forward step, the
host waiting as for a GPU), medians over rounds of a forward step's wall time (a step
that computed tokens).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _common as C
import _quick
import _results

C.ensure_repo_importable()

QUICK = {"requests": 2, "prompt_tokens": 512, "shared_tokens": 256, "decode_tokens": 4,
         "rounds": 1}
SYSTEMS = ["no connector", "empty pool", "warm pool"]


def run_engine(root: Path, pool: Path | None, batch: list[list[int]], args: argparse.Namespace,
               forward_ms: float = 0.0) -> dict[str, float]:
    """One fresh engine running ``batch`` until its scheduler has nothing left."""
    from tests.integrations.vllm_engine import Engine, close_pools, make_request

    extra = None if pool is None else {
        "isolane_pool": str(pool), "isolane_namespace": "bench",
        "isolane_chunk_tokens": args.chunk_tokens}
    blocks = sum(-(-(len(p) + args.decode_tokens) // 16) for p in batch) + 16
    engine = Engine(root, extra, num_blocks=blocks, num_batched_tokens=2048, forward="bulk")
    engine.forward_s = forward_ms / 1e3
    for i, prompt in enumerate(batch):
        engine.add(make_request(f"r{i}", prompt, max_tokens=args.decode_tokens))
    run = dict.fromkeys(("steps", "computed_tokens", "busy_s"), 0.0)
    while engine.scheduler.has_requests():  # finished requests' blocks may still be held
        before_step = time.perf_counter()
        tokens = sum(engine.step().output.num_scheduled_tokens.values())
        if tokens:  # a step with none waited for background loads
            run["steps"] += 1
            run["computed_tokens"] += tokens
            run["busy_s"] += time.perf_counter() - before_step
    engine.close()  # the background thread is idle by now (nothing held, nothing loading)
    close_pools()
    return run


Results = dict[str, list[dict[str, float]]]


def measure(work: Path, batch: list[list[int]], args: argparse.Namespace,
            forward_ms: float) -> Results:
    results: Results = {s: [] for s in SYSTEMS}
    for r in range(args.rounds):
        results["no connector"].append(run_engine(work, None, batch, args, forward_ms=forward_ms))
        for state in ("empty", "warm"):
            results[f"{state} pool"].append(run_engine(work, work / f"pool-{r}", batch, args,
                                                       forward_ms))
        shutil.rmtree(work / f"pool-{r}", ignore_errors=True)
    loaded, computed = (statistics.median(run["computed_tokens"] for run in results[system])
                        for system in ("warm pool", "no connector"))
    if loaded >= computed:
        raise RuntimeError(f"the warm pool loaded nothing: {loaded:.0f} tokens computed, as "
                           "many as with no connector")
    return results


def per_step_ms(results: Results, system: str, key: str = "busy_s") -> float:
    """The median over runs of ``key`` per forward step, in ms."""
    return statistics.median(run[key] / run["steps"] for run in results[system]) * 1e3


def headline_rows(measured: dict[float, Results], where: dict[str, str]
                  ) -> list[_results.Result]:
    """The results page's rows: a forward step with the async connector (loads from a
    warm pool, stores into an empty one) against no connector, per forward setting."""
    rows = []
    for forward_ms, results in measured.items():
        base = per_step_ms(results, "no connector")
        device = f"{forward_ms:g} ms of device time" if forward_ms else "no device time"
        for system, what in (("warm pool", "async loads from a warm pool"),
                             ("empty pool", "async stores")):
            step = per_step_ms(results, system)
            rows.append(_results.Result(
                area="Integrations", measure=f"vLLM forward step with the connector, {what}, "
                f"{device}", value=round(step, 2), unit="ms", peer="no connector",
                peer_value=round(base, 2), ratio=round(base / step, 2),
                why=None if forward_ms else (
                    "the upper bound: with no device time the connector's background work "
                    "shares the 2 cores with the stand-in forward; behind device time it is "
                    "hidden"), **where))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--shared-tokens", type=int, default=768)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--forward-ms", default="0,5",
                        help="comma-separated: per setting, the forward of a step that "
                             "computes tokens also sleeps this long (the host waiting for a "
                             "GPU; 0: no model at all)")
    parser.add_argument("--out", type=Path, help="markdown file to write the section into")
    _quick.add_argument(parser)
    args = parser.parse_args(argv)
    scratch: Path | None = None
    if args.quick:  # every system, both --forward-ms settings, 1 round
        scratch = _quick.enter(args, parser, folders=(), files=())
        vars(args).update(QUICK)
    settings = [float(v) for v in args.forward_ms.split(",")]

    import torch
    import vllm

    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="isolane-bench-vllm-", dir=scratch or (
        C.REPO_ROOT / ".bench" if (C.REPO_ROOT / ".bench").is_dir() else None)))
    prefix = [(i * 31 + 3) % 30000 for i in range(args.shared_tokens)]
    batch = [prefix + [(r * 977 + i * 13) % 30000 for i in range(args.prompt_tokens
                                                                 - args.shared_tokens)]
             for r in range(args.requests)]
    try:
        run_engine(work, None, batch[:1], args)  # warm-up (imports, config)
        measured = {ms: measure(work, batch, args, ms) for ms in settings}
    finally:
        shutil.rmtree(work, ignore_errors=True)

    facts = C.run_facts(work.parent, {"torch": torch.__version__, "vllm": vllm.__version__})
    body = "\n".join([
        *C.report_head("vLLM connector: per-step overhead in vLLM's scheduler "
                       "(`benchmarks/bench_vllm_connector.py`)", facts),
        f"{args.requests} requests of {args.prompt_tokens} prompt tokens sharing the first "
        f"{args.shared_tokens}, {args.decode_tokens} decoded tokens each, pool blocks of "
        f"{args.chunk_tokens} tokens; medians of {args.rounds} rounds; forward settings "
        f"(ms of device time a step): {args.forward_ms}. The method is in the module's "
        "docstring.", ""])
    C.publish("vllm_connector", body, headline_rows(measured, facts), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
