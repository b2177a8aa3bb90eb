"""GPU end-to-end run of the isolane LMCache plugin under a real ``vllm serve`` with
LMCache's vLLM connector (not part of CI: it needs a CUDA GPU, vLLM and LMCache built
for it, e.g. ``pip install vllm==0.33.0 lmcache==0.5.6`` next to isolane).

    python benchmarks/lmcache_gpu_smoke.py --model /models/Qwen2.5-0.5B-Instruct

Three servers in turn, each on 127.0.0.1 and stopped before the next starts:

1. ``baseline``: ``vllm serve`` without a KV connector;
2. ``fill``: with ``LMCacheConnectorV1`` and the YAML of docs/INTEGRATIONS.md (LMCache's
   RAM tier off, so every chunk goes through the isolane plugin) on an empty pool
   folder: the prompts' chunks are stored;
3. ``pool``: a fresh server on that pool (vLLM's prefix cache and LMCache's memory are
   empty: the shared prefix can only come from isolane).

Each sends the same prompts (a long shared prefix, different questions) greedily and
records the time to the first streamed token. Checks: the three runs give the same text,
LMCache created the plugin (its log has no "Failed to create backend"), and the pool
holds blocks after the fill run. Prints the first prompt's TTFT per run and the ratio
pool/baseline; exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _engine_servers import free_port, stop, wait_until_healthy
from vllm_gpu_smoke import QUESTIONS, complete

NAMESPACE = "gpu-smoke"


def lmcache_yaml(pool: Path, chunk_tokens: int) -> str:
    """The YAML of docs/INTEGRATIONS.md, with LMCache's own RAM tier off."""
    return "\n".join([
        f"chunk_size: {chunk_tokens}", "local_cpu: false", "max_local_cpu_size: 2",
        'storage_plugins: ["isolane"]', "extra_config:",
        "  storage_plugin.isolane.module_path: isolane.integrations.lmcache",
        "  storage_plugin.isolane.class_name: IsolaneLMCacheBackend",
        f"  isolane.pool: {pool}", f"  isolane.namespace: {NAMESPACE}", ""])


def start(model: str, port: int, config: Path | None, log: Path) -> subprocess.Popen[bytes]:
    cmd = ["vllm", "serve", model, "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", "4096", "--gpu-memory-utilization", "0.5", "--enforce-eager",
           "--seed", "0"]
    env = dict(os.environ)
    if config is not None:
        cmd += ["--kv-transfer-config",
                json.dumps({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"})]
        env["LMCACHE_CONFIG_FILE"] = str(config)
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)
    return wait_until_healthy(proc, port, "vllm serve", log, 600)


def run(model: str, config: Path | None, prompts: list[str], max_tokens: int,
        log: Path) -> tuple[list[str], list[float]]:
    port = free_port()
    proc = start(model, port, config, log)
    try:
        complete(port, model, "warm up", 4)
        results = [complete(port, model, p, max_tokens) for p in prompts]
    finally:
        stop(proc)
    return [t for t, _ in results], [s for _, s in results]


def pool_blocks(pool: Path, chunk_tokens: int) -> int:
    from isolane import KVPool

    with KVPool(str(pool), namespace=NAMESPACE, chunk_tokens=chunk_tokens) as kv:
        return sum(d["blocks"] for d in kv.stats()["disk"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a local model folder or hub name")
    parser.add_argument("--prefix-words", type=int, default=1500)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--chunk-tokens", type=int, default=256)
    args = parser.parse_args()
    if shutil.which("vllm") is None:
        print("vllm is not on PATH: install it on a GPU host (pip install vllm==0.33.0 "
              "lmcache==0.5.6)")
        return 2
    words = [f"item{i % 97} measured {i * 7 % 1000} units" for i in range(args.prefix_words)]
    prefix = "Report. " + " ".join(words) + "\n\n"
    prompts = [prefix + q for q in QUESTIONS]
    work = Path(tempfile.mkdtemp(prefix="isolane-lmcache-smoke-"))
    try:
        pool = work / "pool"
        pool.mkdir()  # the plugin does not create the folder it is given
        config = work / "lmcache.yaml"
        config.write_text(lmcache_yaml(pool, args.chunk_tokens))
        base_text, base_ttft = run(args.model, None, prompts, args.max_tokens,
                                   work / "baseline.log")
        fill_text, fill_ttft = run(args.model, config, prompts, args.max_tokens,
                                   work / "fill.log")
        stored = pool_blocks(pool, args.chunk_tokens)
        pool_text, pool_ttft = run(args.model, config, prompts, args.max_tokens,
                                   work / "pool.log")
        created = all("Failed to create backend" not in (work / f"{n}.log").read_text(
            errors="replace") for n in ("fill", "pool"))
        same = base_text == fill_text == pool_text
        print(f"model {args.model}, {len(prompts)} prompts sharing a ~{args.prefix_words * 4}"
              f"-word prefix, greedy, {args.max_tokens} tokens, LMCache chunks of "
              f"{args.chunk_tokens} tokens in isolane")
        for name, ttft in [("baseline", base_ttft), ("fill", fill_ttft), ("pool", pool_ttft)]:
            print(f"  {name:9s} TTFT first prompt {ttft[0] * 1000:8.1f} ms, later prompts "
                  f"(vLLM's prefix cache) median {statistics.median(ttft[1:]) * 1000:8.1f} ms")
        print(f"  first-prompt TTFT pool/baseline: {pool_ttft[0] / base_ttft[0]:.2f}")
        print(f"  LMCache created the isolane plugin: {created}")
        print(f"  blocks in the pool after the fill run: {stored}")
        print(f"  same greedy output with and without the pool: {same}")
        return 0 if same and created and stored > 0 else 1
    finally:
        if os.environ.get("KEEP_SMOKE_DIR") is None:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"kept {work}")


if __name__ == "__main__":
    sys.exit(main())
