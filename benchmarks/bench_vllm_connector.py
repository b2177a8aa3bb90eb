"""Per-step overhead of IsolaneConnectorV1 inside vLLM's real scheduler, on the CPU.

    python benchmarks/bench_vllm_connector.py --out docs/BENCHMARKS.md

The engine is ``tests/integrations/vllm_engine.py``: vLLM 0.33's own ``Scheduler``,
``Request``s, KV cache config and ``allocate_kv_cache`` buffers, with a stand-in forward
that writes every scheduled slot of each layer at once (no model: what is left is the
engine loop and the connector). Three systems take turns in each round, each a fresh
engine running the same batch of requests to completion:

- ``no connector``: vLLM without a KV transfer config;
- ``connector, empty pool``: the connector on an empty embedded ``KVPool`` (lookups
  miss, every prompt's full blocks are stored);
- ``connector, warm pool``: a fresh engine on the pool the previous system filled (the
  shared prefixes are loaded, vLLM's own prefix cache is empty).

Reported per system: medians over rounds of the wall time per engine step and of the
time spent inside the connector's methods per step (both roles; measured by wrapping
them), and the connector's share of the step. The report text is generated from the
data.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (
    REPO_ROOT,
    command_line,
    machine_description,
    markdown_table,
    now_text,
    replace_section,
)

SECTION = "vllm-connector"
CONNECTOR_METHODS = ["get_num_new_matched_tokens", "update_state_after_alloc",
                     "build_connector_meta", "request_finished", "start_load_kv",
                     "wait_for_layer_load", "save_kv_layer", "wait_for_save",
                     "get_block_ids_with_load_errors"]


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
               chunk_tokens: int) -> dict[str, float]:
    from tests.integrations.vllm_engine import Engine, close_pools, make_request

    extra = None if pool is None else {"isolane_pool": str(pool),
                                       "isolane_namespace": "bench",
                                       "isolane_chunk_tokens": chunk_tokens}
    blocks = sum(-(-(len(p) + decode) // 16) for p in batch) + 16
    engine = Engine(root, extra, num_blocks=blocks, num_batched_tokens=2048, forward="bulk")
    clock = [0.0]
    if pool is not None:
        instrument(engine.worker, clock)
        instrument(engine.scheduler.connector, clock)
    for i, prompt in enumerate(batch):
        engine.add(make_request(f"r{i}", prompt, max_tokens=decode))
    steps, start = 0, time.perf_counter()
    computed = 0
    while engine.scheduler.has_unfinished_requests():
        out = engine.step().output
        computed += sum(out.num_scheduled_tokens.values())
        steps += 1
    wall = time.perf_counter() - start
    close_pools()
    return {"steps": steps, "wall_s": wall, "connector_s": clock[0],
            "computed_tokens": computed}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--shared-tokens", type=int, default=768)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, help="markdown file to write the section into")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    import torch
    import vllm

    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="isolane-bench-vllm-", dir=REPO_ROOT / ".bench")
                if (REPO_ROOT / ".bench").is_dir() else tempfile.mkdtemp())
    batch = prompts(args.requests, args.prompt_tokens, args.shared_tokens)
    systems = ["no connector", "connector, empty pool", "connector, warm pool"]
    results: dict[str, list[dict[str, float]]] = {s: [] for s in systems}
    try:
        run_engine(work, None, batch[:1], 2, args.chunk_tokens)  # warm-up (imports, config)
        for r in range(args.rounds):
            pool = work / f"pool-{r}"
            results["no connector"].append(run_engine(work, None, batch, args.decode_tokens,
                                                      args.chunk_tokens))
            results["connector, empty pool"].append(
                run_engine(work, pool, batch, args.decode_tokens, args.chunk_tokens))
            results["connector, warm pool"].append(
                run_engine(work, pool, batch, args.decode_tokens, args.chunk_tokens))
            shutil.rmtree(pool, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def med(system: str, key: str) -> float:
        return statistics.median(run[key] / run["steps"] if key != "steps" else run[key]
                                 for run in results[system])

    base = med("no connector", "wall_s")
    rows = []
    for system in systems:
        step_ms, conn_ms = med(system, "wall_s") * 1e3, med(system, "connector_s") * 1e3
        rows.append([system, int(med(system, "steps")),
                     int(statistics.median(r["computed_tokens"] for r in results[system])),
                     f"{step_ms:.2f}", f"{conn_ms:.2f}",
                     f"{conn_ms / step_ms * 100:.0f} %" if conn_ms else "-",
                     f"{step_ms / (base * 1e3):.2f}x",
                     ", ".join(f"{r['wall_s'] / r['steps'] * 1e3:.2f}" for r in results[system])])
    table = markdown_table(
        ["system", "engine steps", "tokens computed", "ms per step (median)",
         "connector ms per step", "connector share", "step vs no connector",
         "ms per step, runs"], rows)
    empty = results["connector, empty pool"]
    warm = results["connector, warm pool"]

    def med_ms(runs: list[dict[str, float]], key: str) -> float:
        return statistics.median(r[key] for r in runs) * 1e3

    def med_n(runs: list[dict[str, float]], key: str) -> float:
        return statistics.median(r[key] for r in runs)

    packages = {"torch": torch.__version__, "vllm": vllm.__version__}
    header = "\n".join([
        "## vLLM connector: per-step overhead in vLLM's scheduler "
        "(`benchmarks/bench_vllm_connector.py`)", "",
        f"Command: `{command_line()}`  ", f"Date: {now_text()}  ",
        f"Machine: {machine_description(work.parent, packages)}", ""])
    setup = " ".join([
        f"{args.requests} requests of {args.prompt_tokens} prompt tokens sharing the first",
        f"{args.shared_tokens}, {args.decode_tokens} decoded tokens each, vLLM block size 16,",
        f"pool blocks of {args.chunk_tokens} tokens, embedded `KVPool`, fp32 KV of 2 layers x",
        "2 KV heads x 16 dims (256 B per token and layer). vLLM's real scheduler and buffers",
        "with a stand-in forward that writes each layer's scheduled slots at once: the times",
        "are the engine loop plus the connector, without a model, so the connector's share",
        "here is an upper bound of its share next to a real forward. Medians of",
        f"{args.rounds} rounds; the systems take turns within each round. \"Connector ms per",
        "step\" is the time inside the connector's methods, both roles."])
    notes = "\n".join([
        "- Empty pool: every prompt's full pool blocks are stored (synchronously, inside",
        f"  `wait_for_save`): {med_ms(empty, 'connector_s'):.1f} ms per run in the connector.",
        "- Warm pool: a fresh engine loads the shared prefixes from the pool",
        f"  ({med_n(warm, 'computed_tokens'):.0f} tokens computed instead of",
        f"  {med_n(results['no connector'], 'computed_tokens'):.0f}):",
        f"  {med_ms(warm, 'connector_s'):.1f} ms per run in the connector.",
        "- Transfers are synchronous (`load_async` is never used): this is what that costs.",
    ])
    body = "\n".join([header, setup, "", table, "", notes, ""])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
    if args.out:
        replace_section(args.out, SECTION, body)
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
