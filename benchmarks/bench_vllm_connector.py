"""Per-step overhead of IsolaneConnectorV1 inside vLLM's real scheduler, on the CPU.

    python benchmarks/bench_vllm_connector.py --out docs/BENCHMARKS.md  # records its rows
    python benchmarks/bench_vllm_connector.py --quick   # smoke test: 2 short requests, 1 round

The engine is ``tests/integrations/vllm_engine.py``: vLLM 0.33's own ``Scheduler``,
``Request``s, KV cache config and buffers, and a stand-in forward writing every scheduled
slot of each layer at once (no model: the engine loop and the connector are left). Five
systems take turns in each round, each a fresh engine running the same requests until
the scheduler has nothing left: ``no connector``, and the connector ``sync`` (transfers
inside the step) or ``async`` (on its background thread, the default) on an ``empty
pool`` (every full block stored) and on the ``warm pool`` it filled (prefixes loaded).
Per ``--forward-ms`` setting (``0,5``: none, or 5 ms of device time a forward step, the
host waiting as for a GPU), medians over rounds: a run's wall time, a forward step's
(a step that computed tokens) wall time and its time inside the connector's methods
(wrapped), and the idle steps (vLLM waiting for background loads).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _common as C
import _quick
import _results
from _kv import head, publish, run_facts

C.ensure_repo_importable()

SECTION = "vllm-connector"
CONNECTOR_METHODS = ["get_num_new_matched_tokens", "update_state_after_alloc",
                     "build_connector_meta", "request_finished", "update_connector_output",
                     "has_pending_block_frees", "handle_preemptions", "start_load_kv",
                     "wait_for_layer_load", "save_kv_layer", "wait_for_save",
                     "get_finished", "get_block_ids_with_load_errors"]
QUICK = {"requests": 2, "prompt_tokens": 512, "shared_tokens": 256, "decode_tokens": 4,
         "rounds": 1}
SYSTEMS = ["no connector", "sync, empty pool", "sync, warm pool", "async, empty pool",
           "async, warm pool"]


def instrument(connector: Any, clock: list[float]) -> None:
    """Wrap the connector's methods on this instance so their time adds to ``clock``."""
    for name in CONNECTOR_METHODS:
        method = getattr(connector, name)

        def wrapped(*args: Any, _m: Callable[..., Any] = method, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return _m(*args, **kwargs)
            finally:
                clock[0] += time.perf_counter() - start

        setattr(connector, name, wrapped)


def run_engine(root: Path, pool: Path | None, batch: list[list[int]], args: argparse.Namespace,
               background: bool = True, forward_ms: float = 0.0) -> dict[str, float]:
    """One fresh engine running ``batch`` until its scheduler has nothing left."""
    from tests.integrations.vllm_engine import Engine, close_pools, make_request

    extra = None if pool is None else {
        "isolane_pool": str(pool), "isolane_namespace": "bench",
        "isolane_chunk_tokens": args.chunk_tokens, "isolane_async_load": background,
        "isolane_async_save": background}
    blocks = sum(-(-(len(p) + args.decode_tokens) // 16) for p in batch) + 16
    engine = Engine(root, extra, num_blocks=blocks, num_batched_tokens=2048, forward="bulk")
    engine.forward_s, clock = forward_ms / 1e3, [0.0]
    if pool is not None:
        instrument(engine.worker, clock)
        instrument(engine.scheduler.connector, clock)
    for i, prompt in enumerate(batch):
        engine.add(make_request(f"r{i}", prompt, max_tokens=args.decode_tokens))
    run = dict.fromkeys(("steps", "idle_steps", "computed_tokens", "busy_s", "connector_s",
                         "slowest_s"), 0.0)
    start, outputs_s = time.perf_counter(), None  # when the last request finished
    while engine.scheduler.has_requests():  # finished requests' blocks may still be held
        if outputs_s is None and not engine.scheduler.has_unfinished_requests():
            outputs_s = time.perf_counter() - start
        before_step, before_clock = time.perf_counter(), clock[0]
        tokens = sum(engine.step().output.num_scheduled_tokens.values())
        took = time.perf_counter() - before_step
        if not tokens:
            run["idle_steps"] += 1
            continue
        run["steps"] += 1
        run["computed_tokens"] += tokens
        run["busy_s"] += took
        run["slowest_s"] = max(run["slowest_s"], took)
        run["connector_s"] += clock[0] - before_clock
    run["wall_s"] = time.perf_counter() - start
    run["outputs_s"] = run["wall_s"] if outputs_s is None else outputs_s
    engine.close()  # the background thread is idle by now (nothing held, nothing loading)
    close_pools()
    return run


Results = dict[str, list[dict[str, float]]]


def measure(work: Path, batch: list[list[int]], args: argparse.Namespace,
            forward_ms: float) -> Results:
    results: Results = {s: [] for s in SYSTEMS}
    for r in range(args.rounds):
        results["no connector"].append(run_engine(work, None, batch, args, forward_ms=forward_ms))
        for mode, background in (("sync", False), ("async", True)):
            for state in ("empty", "warm"):
                results[f"{mode}, {state} pool"].append(run_engine(
                    work, work / f"pool-{r}-{mode}", batch, args, background, forward_ms))
            shutil.rmtree(work / f"pool-{r}-{mode}", ignore_errors=True)
    return results


def per_step_ms(results: Results, system: str, key: str = "busy_s") -> float:
    """The median over runs of ``key`` per forward step, in ms."""
    return statistics.median(run[key] / run["steps"] for run in results[system]) * 1e3


def report(results: Results, forward_ms: float) -> str:
    """The table and the notes of one forward setting."""

    def med(system: str, key: str) -> float:
        return statistics.median(run[key] for run in results[system])

    def ms(system: str, key: str) -> float:
        return med(system, key) * 1e3

    def step_ms(system: str, key: str = "busy_s") -> float:
        return per_step_ms(results, system, key)

    def pct(a: float, b: float) -> str:
        return f"{(a / b - 1) * 100:+.0f} %"

    rows = []
    for system in SYSTEMS:
        conn, step = step_ms(system, "connector_s"), step_ms(system)
        rows.append([system, *(int(med(system, k)) for k in ("steps", "idle_steps",
                                                              "computed_tokens")),
                     f"{ms(system, 'outputs_s'):.1f}", f"{ms(system, 'wall_s'):.1f}",
                     f"{ms(system, 'wall_s') / ms('no connector', 'wall_s'):.2f}x",
                     f"{step:.2f}", f"{ms(system, 'slowest_s'):.2f}", f"{conn:.2f}",
                     f"{conn / step * 100:.0f} %" if conn else "-",
                     f"{step / step_ms('no connector'):.2f}x",
                     ", ".join(f"{r['busy_s'] / r['steps'] * 1e3:.2f}" for r in results[system])])
    table = C.markdown_table(
        ["system", "forward steps", "idle steps", "tokens computed",
         "ms until every request finished", "ms per run", "run vs no connector",
         "ms per forward step", "slowest forward step, ms", "connector ms per forward step",
         "connector share", "forward step vs no connector", "ms per forward step, runs"], rows)
    s_empty, a_empty, s_warm, a_warm = (f"{mode}, {state} pool" for state in ("empty", "warm")
                                        for mode in ("sync", "async"))
    title = ("Stand-in forward with no model time (`--forward-ms 0`): the upper bound of the "
             "connector's share" if not forward_ms else
             f"Stand-in forward plus {forward_ms:g} ms of device time per forward step "
             f"(`--forward-ms {forward_ms:g}`: the host sleeps, as it waits for a GPU)")
    notes = [
        f"- Stores (empty pool): background saves take the forward step from "
        f"{step_ms(s_empty):.2f} to {step_ms(a_empty):.2f} ms "
        f"({pct(step_ms(a_empty), step_ms(s_empty))}).",
        f"- Loads (warm pool, {med(s_warm, 'computed_tokens'):.0f} tokens computed instead "
        f"of {med('no connector', 'computed_tokens'):.0f}): background loads take the "
        f"forward step from {step_ms(s_warm):.2f} to {step_ms(a_warm):.2f} ms "
        f"({pct(step_ms(a_warm), step_ms(s_warm))}) and the slowest one (every running request "
        f"waits for it) from {ms(s_warm, 'slowest_s'):.2f} to {ms(a_warm, 'slowest_s'):.2f} ms."]
    return "\n".join([f"### {title}", "", table, "", *notes, ""])


def headline_rows(measured: dict[float, Results], where: dict[str, str]
                  ) -> list[_results.Result]:
    """The results page's rows: a forward step with the async connector (loads from a
    warm pool, stores into an empty one) against no connector, per forward setting."""
    rows = []
    for forward_ms, results in measured.items():
        base = per_step_ms(results, "no connector")
        device = f"{forward_ms:g} ms of device time" if forward_ms else "no device time"
        for system, what in (("async, warm pool", "async loads from a warm pool"),
                             ("async, empty pool", "async stores")):
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
    if args.quick:  # every system, both --forward-ms settings
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

    facts = run_facts(work.parent, {"torch": torch.__version__, "vllm": vllm.__version__})
    body = "\n".join([
        *head("vLLM connector: per-step overhead in vLLM's scheduler",
              "bench_vllm_connector.py", facts),
        f"{args.requests} requests of {args.prompt_tokens} prompt tokens sharing the first "
        f"{args.shared_tokens}, {args.decode_tokens} decoded tokens each, pool blocks of "
        f"{args.chunk_tokens} tokens; medians of {args.rounds} rounds. The method and the "
        "columns are in the module's docstring.", "",
        *(report(measured[ms], ms) for ms in settings)])
    publish(body, args.out, SECTION, "vllm_connector", headline_rows(measured, facts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
