"""GPU end-to-end check of isolane as SGLang HiCache's L3 storage (not part of CI: it
needs a CUDA GPU and SGLang installed with its own torch, e.g. ``pip install
"sglang[all]==0.5.23"`` next to isolane).

    python benchmarks/sglang_gpu_smoke.py --model /models/Qwen2.5-0.5B-Instruct

Runs ``python -m sglang.launch_server`` with HiCache and the isolane backend (the flags
of docs/INTEGRATIONS.md, on a temporary pool folder), on 127.0.0.1:

1. ``cold``: a long prompt on the empty pool (``cached_tokens`` ~0); HiCache writes its
   pages through to the pool;
2. ``after flush``: ``/flush_cache`` empties the GPU and host caches, then the same prompt
   again: its prefix can only come from the pool (``cached_tokens`` > 0);
3. ``after restart``: a fresh server on the same pool, the same prompt
   (``cached_tokens`` > 0: the pages survived the restart).

It checks that the three greedy outputs are equal and prints each run's
``cached_tokens`` and time, and the pages SGLang's storage metrics (``--enable-metrics``:
the backend's ``get_stats``, logged to ``/metrics`` as ``sglang:prefetch_pgs``) say were
prefetched from the pool; exit status 1 when an output differs, a run after the flush or
the restart found nothing cached, or the metrics show no prefetched page.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from _common import free_port, stop_server, wait_until_healthy

PAGE_SIZE = 64


def extra_config(pool: Path) -> str:
    return json.dumps({"backend_name": "isolane", "module_path": "isolane.integrations.sglang",
                       "class_name": "IsolaneHiCacheStorage", "interface_v1": 1,
                       "isolane_pool": str(pool)})


def start(model: str, port: int, pool: Path, log: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model,
           "--host", "127.0.0.1", "--port", str(port), "--page-size", str(PAGE_SIZE),
           "--mem-fraction-static", "0.5", "--enable-hierarchical-cache",
           "--hicache-mem-layout", "page_first", "--hicache-write-policy", "write_through",
           "--hicache-storage-prefetch-policy", "wait_complete",
           "--hicache-storage-backend", "dynamic",
           "--hicache-storage-backend-extra-config", extra_config(pool),
           "--enable-cache-report", "--enable-metrics", "--random-seed", "0"]
    out = log.open("wb")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    return wait_until_healthy(proc, port, "sglang.launch_server", log, 900)


def post(port: int, path: str, body: dict[str, Any] | None = None) -> Any:
    data = json.dumps(body or {}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        text = response.read().decode()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def prefetched_pages(port: int) -> float:
    """Pages prefetched from L3 storage since start (``sglang:prefetch_pgs_sum`` of
    ``/metrics``, which SGLang fills from the backend's ``get_stats``)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("sglang:prefetch_pgs_sum"))


def generate(port: int, prompt: str, max_tokens: int) -> tuple[str, int, float]:
    """Greedy generation: (text, cached_tokens, seconds)."""
    begin = time.perf_counter()
    out = post(port, "/generate", {"text": prompt, "sampling_params": {
        "max_new_tokens": max_tokens, "temperature": 0}})
    return out["text"], int(out["meta_info"].get("cached_tokens", 0)), \
        time.perf_counter() - begin


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a local model folder or hub name")
    parser.add_argument("--prefix-words", type=int, default=1500)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--settle-s", type=float, default=5.0,
                        help="wait after the first request for HiCache's L3 write-back")
    args = parser.parse_args()
    try:
        import sglang  # noqa: F401
    except ImportError:
        print("sglang is not importable: install it on a GPU host "
              "(pip install 'sglang[all]==0.5.23')")
        return 2
    words = [f"item{i % 97} measured {i * 7 % 1000} units" for i in range(args.prefix_words)]
    prompt = "Report. " + " ".join(words) + "\n\nSummarise the text in one sentence."
    work = Path(tempfile.mkdtemp(prefix="isolane-sglang-smoke-"))
    pool = work / "pool"
    pool.mkdir()
    results: list[tuple[str, str, int, float]] = []
    try:
        port = free_port()
        proc = start(args.model, port, pool, work / "first.log")
        try:
            results.append(("cold", *generate(port, prompt, args.max_tokens)))
            time.sleep(args.settle_s)  # the write-through to L3 runs in the background
            post(port, "/flush_cache")
            results.append(("after flush", *generate(port, prompt, args.max_tokens)))
            pages = prefetched_pages(port)
        finally:
            stop_server(proc, timeout_s=120)
        port = free_port()
        proc = start(args.model, port, pool, work / "second.log")
        try:
            results.append(("after restart", *generate(port, prompt, args.max_tokens)))
        finally:
            stop_server(proc, timeout_s=120)
        print(f"model {args.model}, a ~{args.prefix_words * 4}-word prompt, greedy, "
              f"{args.max_tokens} tokens, page size {PAGE_SIZE}")
        for name, _text, cached, seconds in results:
            print(f"  {name:14s} cached_tokens {cached:6d}  {seconds * 1000:8.1f} ms")
        same = len({text for _, text, _, _ in results}) == 1
        hit = all(cached > 0 for _, _, cached, _ in results[1:])
        print(f"  same greedy output every time: {same}; prefix from the pool after the "
              f"flush and after the restart: {hit}; pages prefetched from the pool by the "
              f"first server (its storage metrics): {pages:.0f}")
        return 0 if same and hit and pages > 0 else 1
    finally:
        if os.environ.get("KEEP_SMOKE_DIR") is None:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"kept {work}")


if __name__ == "__main__":
    sys.exit(main())
