"""GPU smoke test of isolane under a real ``vllm serve``, through isolane's own connector
or LMCache's (not part of CI: it needs a CUDA GPU and vLLM installed with its own torch,
e.g. ``pip install vllm==0.33.0``, plus ``lmcache==0.5.6`` for ``--connector lmcache``).

    python benchmarks/vllm_gpu_smoke.py --model /models/Qwen2.5-0.5B-Instruct
    python benchmarks/vllm_gpu_smoke.py --model MODEL --connector lmcache

Three servers in turn, each on 127.0.0.1 and stopped before the next starts:

1. ``baseline``: ``vllm serve`` without a KV connector;
2. ``fill``: with the connector on an empty pool (a temporary folder): stores the
   prompts. ``isolane``: ``IsolaneConnectorV1``. ``lmcache``: ``LMCacheConnectorV1``
   with the YAML of docs/INTEGRATIONS.md (LMCache's RAM tier off, so every chunk goes
   through the isolane plugin);
3. ``pool``: a fresh server on that pool (vLLM's prefix cache, and LMCache's memory,
   are empty: the shared prefix can only come from isolane).

Each sends the same prompts (a long shared prefix, different questions) greedily and
records the time to the first streamed token. Checks: the three runs give the same text;
with LMCache also that it created the plugin (its log has no "Failed to create backend")
and that the pool holds blocks after the fill run. Prints the first prompt's TTFT per run
(the only one whose prefix vLLM's own cache does not hold) and the ratio pool/baseline;
exit status 1 when a check fails.
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
import time
import urllib.request
from pathlib import Path
from typing import Any

from _common import free_port, stop_server, wait_until_healthy

NAMESPACE = "gpu-smoke"
QUESTIONS = ["Summarise the text in one sentence.", "What is the main risk described?",
             "List three key numbers from the text.", "Who is the intended reader?"]


def isolane_transfer(pool: Path, chunk_tokens: int) -> str:
    return json.dumps({
        "kv_connector": "IsolaneConnectorV1",
        "kv_connector_module_path": "isolane.integrations.vllm.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"isolane_pool": str(pool),
                                      "isolane_namespace": NAMESPACE,
                                      "isolane_chunk_tokens": chunk_tokens}})


def lmcache_yaml(pool: Path, chunk_tokens: int) -> str:
    """The YAML of docs/INTEGRATIONS.md, with LMCache's own RAM tier off."""
    return "\n".join([
        f"chunk_size: {chunk_tokens}", "local_cpu: false", "max_local_cpu_size: 2",
        'storage_plugins: ["isolane"]', "extra_config:",
        "  storage_plugin.isolane.module_path: isolane.integrations.lmcache",
        "  storage_plugin.isolane.class_name: IsolaneLMCacheBackend",
        f"  isolane.pool: {pool}", f"  isolane.namespace: {NAMESPACE}", ""])


def start(model: str, port: int, transfer: str | None, env: dict[str, str],
          log: Path) -> subprocess.Popen[bytes]:
    cmd = ["vllm", "serve", model, "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", "4096", "--gpu-memory-utilization", "0.5", "--enforce-eager",
           "--seed", "0"]
    if transfer is not None:
        cmd += ["--kv-transfer-config", transfer]
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            env={**os.environ, **env})
    return wait_until_healthy(proc, port, "vllm serve", log, 600)


def complete(port: int, model: str, prompt: str, max_tokens: int) -> tuple[str, float]:
    """Greedy streamed completion: (text, seconds to the first token)."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "stream": True}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    start_time, first, text = time.perf_counter(), None, []
    with urllib.request.urlopen(request, timeout=300) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk: dict[str, Any] = json.loads(line[6:])
            piece = chunk["choices"][0].get("text", "")
            if piece and first is None:
                first = time.perf_counter() - start_time
            text.append(piece)
    return "".join(text), first if first is not None else float("nan")


def run(model: str, transfer: str | None, env: dict[str, str], prompts: list[str],
        max_tokens: int, log: Path) -> tuple[list[str], list[float]]:
    port = free_port()
    proc = start(model, port, transfer, env, log)
    try:
        complete(port, model, "warm up", 4)
        results = [complete(port, model, p, max_tokens) for p in prompts]
    finally:
        stop_server(proc)
    return [t for t, _ in results], [s for _, s in results]


def pool_blocks(pool: Path, chunk_tokens: int) -> int:
    from isolane import KVPool

    with KVPool(str(pool), namespace=NAMESPACE, chunk_tokens=chunk_tokens) as kv:
        return sum(d["blocks"] for d in kv.stats()["disk"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a local model folder or hub name")
    parser.add_argument("--connector", choices=("isolane", "lmcache"), default="isolane",
                        help="isolane's IsolaneConnectorV1, or LMCache's connector with "
                             "the isolane storage plugin")
    parser.add_argument("--prefix-words", type=int, default=1500)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--chunk-tokens", type=int, default=256)
    args = parser.parse_args()
    if shutil.which("vllm") is None:
        print("vllm is not on PATH: install it on a GPU host (pip install vllm==0.33.0"
              + (" lmcache==0.5.6)" if args.connector == "lmcache" else ")"))
        return 2
    words = [f"item{i % 97} measured {i * 7 % 1000} units" for i in range(args.prefix_words)]
    prefix = "Report. " + " ".join(words) + "\n\n"
    prompts = [prefix + q for q in QUESTIONS]
    work = Path(tempfile.mkdtemp(prefix="isolane-vllm-smoke-"))
    try:
        pool = work / "pool"
        env: dict[str, str] = {}
        if args.connector == "isolane":
            transfer = isolane_transfer(pool, args.chunk_tokens)
        else:
            pool.mkdir()  # the plugin does not create the folder it is given
            config = work / "lmcache.yaml"
            config.write_text(lmcache_yaml(pool, args.chunk_tokens))
            transfer = json.dumps({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"})
            env["LMCACHE_CONFIG_FILE"] = str(config)
        base_text, base_ttft = run(args.model, None, {}, prompts, args.max_tokens,
                                   work / "baseline.log")
        fill_text, fill_ttft = run(args.model, transfer, env, prompts, args.max_tokens,
                                   work / "fill.log")
        stored = pool_blocks(pool, args.chunk_tokens)
        pool_text, pool_ttft = run(args.model, transfer, env, prompts, args.max_tokens,
                                   work / "pool.log")
        created = all("Failed to create backend" not in (work / f"{n}.log").read_text(
            errors="replace") for n in ("fill", "pool"))
        same = base_text == fill_text == pool_text
        print(f"model {args.model}, {args.connector} connector, {len(prompts)} prompts "
              f"sharing a ~{args.prefix_words * 4}-word prefix, greedy, {args.max_tokens} "
              f"tokens, blocks of {args.chunk_tokens} tokens")
        for name, ttft in [("baseline", base_ttft), ("fill", fill_ttft), ("pool", pool_ttft)]:
            print(f"  {name:9s} TTFT first prompt {ttft[0] * 1000:8.1f} ms, later prompts "
                  f"(vLLM's prefix cache) median {statistics.median(ttft[1:]) * 1000:8.1f} ms")
        print(f"  first-prompt TTFT pool/baseline: {pool_ttft[0] / base_ttft[0]:.2f}")
        print(f"  connector created its backend: {created}")
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
