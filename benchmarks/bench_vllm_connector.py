"""Per-step overhead of IsolaneConnectorV1 inside vLLM's real scheduler, on the CPU.

    python benchmarks/bench_vllm_connector.py --out docs/BENCHMARKS.md  # records its rows
    python benchmarks/bench_vllm_connector.py --quick   # smoke test: 2 short requests, 1 round

The engine is ``tests/integrations/vllm_engine.py``: vLLM 0.33's own ``Scheduler``,
``Request``s, KV cache config and ``allocate_kv_cache`` buffers, with a stand-in forward
that writes every scheduled slot of each layer at once (no model: what is left is the
engine loop and the connector), in the order of vLLM's model runner. Five systems take
turns in each round, each a fresh engine running the same batch of requests until the
scheduler has nothing left (finished requests' held blocks included):

- ``no connector``: vLLM without a KV transfer config;
- ``sync, empty pool`` / ``async, empty pool``: the connector on an empty embedded
  ``KVPool`` (lookups miss, every prompt's full blocks are stored), with transfers
  inside the step (``isolane_async_load``/``isolane_async_save`` false) or on the
  connector's background thread (the defaults);
- ``sync, warm pool`` / ``async, warm pool``: a fresh engine on the pool the previous
  system filled (the shared prefixes are loaded, vLLM's own prefix cache is empty).

Each system runs once per ``--forward-ms`` setting (default ``0,5``: no model time, and
5 ms of device time per forward step, which the host spends waiting with the
interpreter free, as it does for a GPU). Reported per system and setting: medians
over rounds of the wall time of a run, of the wall time
per engine step that computed tokens (the critical path of a forward step), of the
time spent inside the connector's methods per such step (both roles; measured by
wrapping them), and the steps that computed nothing (vLLM waiting for background
loads; a real engine core spins through them the same way). "sync" sets
``isolane_async_load``/``isolane_async_save`` false; "async" keeps the defaults.
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _quick, _results
from benchmarks._common import (
    REPO_ROOT,
    command_line,
    machine_description,
    markdown_table,
    now_text,
    print_report,
)

SECTION = "vllm-connector"
CONNECTOR_METHODS = ["get_num_new_matched_tokens", "update_state_after_alloc",
                     "build_connector_meta", "request_finished", "update_connector_output",
                     "has_pending_block_frees", "handle_preemptions", "start_load_kv",
                     "wait_for_layer_load", "save_kv_layer", "wait_for_save",
                     "get_finished", "get_block_ids_with_load_errors"]
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


def prompts(count: int, length: int, shared: int) -> list[list[int]]:
    prefix = [(i * 31 + 3) % 30000 for i in range(shared)]
    return [prefix + [(r * 977 + i * 13) % 30000 for i in range(length - shared)]
            for r in range(count)]


def run_engine(root: Path, pool: Path | None, batch: list[list[int]], decode: int,
               chunk_tokens: int, background: bool = True, forward_ms: float = 0.0
               ) -> dict[str, float]:
    from tests.integrations.vllm_engine import Engine, close_pools, make_request

    extra = None if pool is None else {"isolane_pool": str(pool),
                                       "isolane_namespace": "bench",
                                       "isolane_chunk_tokens": chunk_tokens,
                                       "isolane_async_load": background,
                                       "isolane_async_save": background}
    blocks = sum(-(-(len(p) + decode) // 16) for p in batch) + 16
    engine = Engine(root, extra, num_blocks=blocks, num_batched_tokens=2048, forward="bulk")
    engine.forward_s = forward_ms / 1e3
    clock = [0.0]
    if pool is not None:
        instrument(engine.worker, clock)
        instrument(engine.scheduler.connector, clock)
    for i, prompt in enumerate(batch):
        engine.add(make_request(f"r{i}", prompt, max_tokens=decode))
    steps = idle = computed = 0
    busy_s = busy_connector_s = slowest_s = 0.0
    start = time.perf_counter()
    outputs_s = None  # when the last request finished (its blocks may still be held)
    while engine.scheduler.has_requests():
        if outputs_s is None and not engine.scheduler.has_unfinished_requests():
            outputs_s = time.perf_counter() - start
        before_step, before_clock = time.perf_counter(), clock[0]
        out = engine.step().output
        tokens = sum(out.num_scheduled_tokens.values())
        if tokens:
            steps += 1
            computed += tokens
            took = time.perf_counter() - before_step
            busy_s += took
            slowest_s = max(slowest_s, took)
            busy_connector_s += clock[0] - before_clock
        else:
            idle += 1
    wall = time.perf_counter() - start
    engine.close()  # the background thread is idle by now (nothing held, nothing loading)
    close_pools()
    return {"steps": steps, "idle_steps": idle, "wall_s": wall,
            "outputs_s": wall if outputs_s is None else outputs_s, "busy_s": busy_s,
            "connector_s": busy_connector_s, "slowest_s": slowest_s,
            "computed_tokens": computed}


Results = dict[str, list[dict[str, float]]]


def measure(work: Path, batch: list[list[int]], args: argparse.Namespace,
            forward_ms: float) -> Results:
    results: Results = {s: [] for s in SYSTEMS}
    for r in range(args.rounds):
        results["no connector"].append(run_engine(
            work, None, batch, args.decode_tokens, args.chunk_tokens, forward_ms=forward_ms))
        for mode, background in (("sync", False), ("async", True)):
            pool = work / f"pool-{r}-{mode}"
            for state in ("empty", "warm"):
                results[f"{mode}, {state} pool"].append(run_engine(
                    work, pool, batch, args.decode_tokens, args.chunk_tokens, background,
                    forward_ms))
            shutil.rmtree(pool, ignore_errors=True)
    return results


def report(results: Results, forward_ms: float) -> str:
    """The table and the notes of one forward setting."""

    def med(system: str, key: str, per_step: bool = False) -> float:
        return statistics.median(run[key] / run["steps"] if per_step else run[key]
                                 for run in results[system])

    def step_ms(system: str, key: str = "busy_s") -> float:
        return med(system, key, per_step=True) * 1e3

    base_step, base_wall = step_ms("no connector"), med("no connector", "wall_s")
    rows = []
    for system in SYSTEMS:
        conn_ms = step_ms(system, "connector_s")
        rows.append([system, int(med(system, "steps")), int(med(system, "idle_steps")),
                     int(med(system, "computed_tokens")),
                     f"{med(system, 'outputs_s') * 1e3:.1f}", f"{med(system, 'wall_s') * 1e3:.1f}",
                     f"{med(system, 'wall_s') / base_wall:.2f}x",
                     f"{step_ms(system):.2f}", f"{med(system, 'slowest_s') * 1e3:.2f}",
                     f"{conn_ms:.2f}",
                     f"{conn_ms / step_ms(system) * 100:.0f} %" if conn_ms else "-",
                     f"{step_ms(system) / base_step:.2f}x",
                     ", ".join(f"{r['busy_s'] / r['steps'] * 1e3:.2f}" for r in results[system])])
    table = markdown_table(
        ["system", "forward steps", "idle steps", "tokens computed",
         "ms until every request finished", "ms per run",
         "run vs no connector", "ms per forward step", "slowest forward step, ms",
         "connector ms per forward step",
         "connector share", "forward step vs no connector", "ms per forward step, runs"],
        rows)
    sync_empty, async_empty = "sync, empty pool", "async, empty pool"
    sync_warm, async_warm = "sync, warm pool", "async, warm pool"

    def pct(a: float, b: float) -> str:
        return f"{(a / b - 1) * 100:+.0f} %"

    title = ("Stand-in forward with no model time (`--forward-ms 0`): the upper bound of the "
             "connector's share" if not forward_ms else
             f"Stand-in forward plus {forward_ms:g} ms of device time per forward step "
             f"(`--forward-ms {forward_ms:g}`: the host sleeps, as it waits for a GPU)")
    notes = "\n".join([
        "- Stores (empty pool): the connector's time per forward step is "
        f"{step_ms(sync_empty, 'connector_s'):.2f} ms synchronous, "
        f"{step_ms(async_empty, 'connector_s'):.2f} ms with background saves; the forward "
        f"step takes {step_ms(sync_empty):.2f} vs {step_ms(async_empty):.2f} ms "
        f"({pct(step_ms(async_empty), step_ms(sync_empty))}); every request finished after "
        f"{med(sync_empty, 'outputs_s') * 1e3:.1f} vs {med(async_empty, 'outputs_s') * 1e3:.1f}"
        f" ms, the blocks were all free after {med(sync_empty, 'wall_s') * 1e3:.1f} vs "
        f"{med(async_empty, 'wall_s') * 1e3:.1f} ms.",
        "- Loads (warm pool, "
        f"{med(sync_warm, 'computed_tokens'):.0f} tokens computed instead of "
        f"{med('no connector', 'computed_tokens'):.0f}): the connector's time per forward "
        f"step is {step_ms(sync_warm, 'connector_s'):.2f} ms synchronous, "
        f"{step_ms(async_warm, 'connector_s'):.2f} ms with background loads; the forward "
        f"step takes {step_ms(sync_warm):.2f} vs {step_ms(async_warm):.2f} ms "
        f"({pct(step_ms(async_warm), step_ms(sync_warm))}), the slowest one (every running "
        f"request waits for it) {med(sync_warm, 'slowest_s') * 1e3:.2f} vs "
        f"{med(async_warm, 'slowest_s') * 1e3:.2f} ms; the requests wait "
        f"{med(async_warm, 'idle_steps'):.0f} idle steps for their loads; every request "
        f"finished after {med(sync_warm, 'outputs_s') * 1e3:.1f} vs "
        f"{med(async_warm, 'outputs_s') * 1e3:.1f} ms.",
    ])
    return "\n".join([f"### {title}", "", table, "", notes, ""])


def headline_rows(measured: dict[float, Results], where: dict[str, str]
                  ) -> list[_results.Result]:
    """The results page's rows: a forward step with the async connector (loads from a
    warm pool, stores into an empty one) against no connector, per forward setting."""

    def step_ms(results: Results, system: str) -> float:
        return statistics.median(r["busy_s"] / r["steps"] for r in results[system]) * 1e3

    rows = []
    for forward_ms, results in measured.items():
        base = step_ms(results, "no connector")
        device = f"{forward_ms:g} ms of device time" if forward_ms else "no device time"
        for system, what in (("async, warm pool", "async loads from a warm pool"),
                             ("async, empty pool", "async stores")):
            step = step_ms(results, system)
            rows.append(_results.Result(
                area="Integrations", measure=f"vLLM forward step with the connector, {what}, "
                f"{device}", value=round(step, 2), unit="ms", peer="no connector",
                peer_value=round(base, 2), ratio=round(base / step, 2),
                why=None if forward_ms else (
                    "the upper bound: with no device time the connector's background work "
                    "shares the 2 cores with the stand-in forward; behind device time it is "
                    "hidden"), **where))
    return rows


QUICK = {"requests": 2, "prompt_tokens": 512, "shared_tokens": 256, "decode_tokens": 4,
         "rounds": 1}


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
        REPO_ROOT / ".bench" if (REPO_ROOT / ".bench").is_dir() else None)))
    batch = prompts(args.requests, args.prompt_tokens, args.shared_tokens)
    try:
        run_engine(work, None, batch[:1], 2, args.chunk_tokens)  # warm-up (imports, config)
        measured = {ms: measure(work, batch, args, ms) for ms in settings}
    finally:
        shutil.rmtree(work, ignore_errors=True)

    packages = {"torch": torch.__version__, "vllm": vllm.__version__}
    where = {"command": command_line(), "date": now_text(),
             "machine": machine_description(work.parent, packages)}
    header = "\n".join([
        "## vLLM connector: per-step overhead in vLLM's scheduler "
        "(`benchmarks/bench_vllm_connector.py`)", "",
        f"Command: `{where['command']}`  ", f"Date: {where['date']}  ",
        f"Machine: {where['machine']}", ""])
    setup = (f"{args.requests} requests of {args.prompt_tokens} prompt tokens sharing the "
             f"first {args.shared_tokens}, {args.decode_tokens} decoded tokens each, pool "
             f"blocks of {args.chunk_tokens} tokens; medians of {args.rounds} rounds. The "
             "method and the columns are in the module's docstring.")
    body = "\n".join([header, setup, "", *(report(measured[ms], ms) for ms in settings)])
    print_report(body, args.out, SECTION)
    if args.out and _results.is_page(args.out):
        _results.write_results("vllm_connector", headline_rows(measured, where))
    return 0


if __name__ == "__main__":
    sys.exit(main())
