"""The two processes of ``isolane demo``'s isolation part (run as ``python -m``).

    python -m isolane.cli.demo_workers inference|trainer|fill HOME_OR_CONFIG SLO_MS PLANE
        SECONDS

``inference``: restores KV prefixes (16-token blocks of 64 KiB, straight from the
device: no memory tier, O_DIRECT reads) of the demo's prompts from 4 threads and
prints the latency of each restore call (p50/p99/p999, ms) as one JSON line.
``trainer``: saves a LoRA-style state (a frozen base and a changing adapter plus
optimizer moments) again and again with ``save_async``, each save incremental on the
previous one, and prints the logical and written GB/s. ``PLANE`` is ``on`` or
``off`` (``qos.host_plane``). Both report the most host plane members they saw (0:
no plane). Each prints ``{"ready": true}`` once set up, then reads
the start time (CLOCK_MONOTONIC, shared by both processes) from stdin and measures
for ``SECONDS`` from then.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from isolane.config import Config, default_config, load_config

NAMESPACE = "demo-isolation"
CHUNK_TOKENS = 16
PROMPT_TOKENS = 256
PROMPTS = 192  # 192 x 1 MiB
KV_SHAPE = (4, 2, PROMPT_TOKENS, 8, 16)  # 4 KiB a token: 64 KiB a 16-token block
READ_THREADS = 4
PREFIX_BLOCKS = 8  # a restore reads 8 blocks (512 KiB) of a prompt's prefix


def demo_config(target: str, slo_ms: float, plane: bool) -> Config:
    base = load_config(target) if target.endswith((".yaml", ".yml")) else default_config(target)
    return replace(base, qos=replace(base.qos, read_p99_slo_ms=slo_ms, host_plane=plane))


def prompt(i: int) -> list[int]:
    return [(i * 7919 + t) % 50_000 for t in range(PROMPT_TOKENS)]


def fill(config: Config) -> None:
    """The demo's prompts in the KV pool (skipped when they are there)."""
    from isolane.kvpool.pool import KVPool

    with KVPool(config, namespace=NAMESPACE, chunk_tokens=CHUNK_TOKENS,
                memory_budget=0) as pool:
        gen = torch.Generator().manual_seed(0)
        for i in range(PROMPTS):
            if pool.lookup(prompt(i)) < PROMPT_TOKENS:
                pool.put(prompt(i), torch.randn(KV_SHAPE, generator=gen))


def host_members(scheduler: Any) -> int:
    """How many processes this one's host lane plane holds now (0: no plane)."""
    host = scheduler.stats()["governor"].get("host") or {}
    return int(host.get("members") or 0) if host.get("joined") else 0


class MembersSeen:
    """The most plane members seen, sampled every 0.1 s until ``stop_at``; and the
    bytes the scheduler's write lane had moved by then."""

    def __init__(self, scheduler: Any, stop_at: float) -> None:
        self.most = 0
        self.write_bytes_at_stop = 0
        self._thread = threading.Thread(target=self._run, args=(scheduler, stop_at),
                                        daemon=True)
        self._thread.start()

    def _run(self, scheduler: Any, stop_at: float) -> None:
        while (now := time.monotonic()) < stop_at:
            self.most = max(self.most, host_members(scheduler))
            time.sleep(min(0.1, stop_at - now))
        self.write_bytes_at_stop = scheduler.lanes["write"].counters.bytes

    def result(self) -> int:
        self._thread.join()
        return self.most


def open_pool(config: Config) -> Any:
    from isolane.kvpool.pool import KVPool

    return KVPool(config, namespace=NAMESPACE, chunk_tokens=CHUNK_TOKENS, memory_budget=0,
                  direct_reads=True)


def inference(pool: Any, start_at: float, seconds: float) -> dict[str, Any]:
    """Restores from READ_THREADS threads; every restore that starts inside the run
    counts. ``count`` 0 (no percentiles) when none did: an overloaded machine."""
    stop_at = start_at + seconds
    members = MembersSeen(pool.scheduler, stop_at)
    latencies: list[float] = []
    lock = threading.Lock()

    def reader(seed: int) -> None:
        rng = np.random.default_rng(seed)
        mine = []
        while (now := time.monotonic()) < stop_at:
            tokens = prompt(int(rng.integers(PROMPTS)))
            prefix = tokens[:CHUNK_TOKENS * PREFIX_BLOCKS]
            t0 = time.perf_counter()
            n, _kv = pool.get(prefix)
            dt = time.perf_counter() - t0
            if n != len(prefix):
                raise RuntimeError(f"the demo's prompt is missing from the pool ({n} tokens)")
            if now >= start_at:
                mine.append(dt)
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(READ_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    most = members.result()
    pool.close()
    ms = np.asarray(latencies) * 1e3
    out: dict[str, Any] = {"count": len(ms), "members": most}
    if len(ms):
        out.update({"p50": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99)),
                    "p999": float(np.percentile(ms, 99.9))})
    return out


def training_state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {"base": torch.randn(48 << 20, generator=gen),  # 192 MiB, frozen
            "adapter": torch.randn(1 << 20, generator=gen),
            "moments": torch.randn(24 << 20, generator=gen)}  # 96 MiB, changes every step


def trainer(store: Any, state: dict[str, torch.Tensor], start_at: float,
            seconds: float) -> dict[str, Any]:
    """Saves in a loop; logical/written GB/s count saves committed inside the run,
    ``moved_gb`` what the write lane wrote inside it (saves still in flight too)."""
    lane = store.scheduler.lanes["write"]
    members = MembersSeen(store.scheduler, start_at + seconds)
    time.sleep(max(0.0, start_at - time.monotonic()))
    moved_before = lane.counters.bytes
    logical = written = 0
    step, previous = 0, None
    names: list[str] = []
    while time.monotonic() < start_at + seconds:
        with torch.no_grad():
            state["adapter"].add_(0.01)
            state["moments"].mul_(0.999)
        name = f"demo-iso-{step}"
        handle = store.save_async(state, name, overwrite=True, parent=previous or False,
                                  mirror=False)
        info = handle.result()
        t1 = time.monotonic()
        if start_at <= t1 <= start_at + seconds:  # committed inside the measured run
            logical += info.logical_bytes
            written += info.written_bytes
        names.append(name)
        if len(names) > 2:
            store.delete(names.pop(0))
        previous, step = name, step + 1
    most = members.result()
    moved = members.write_bytes_at_stop - moved_before
    for name in names:
        store.delete(name)
    store.close()
    return {"logical_gbps": logical / seconds / 1e9, "written_gbps": written / seconds / 1e9,
            "moved_gb": moved / 1e9, "members": most}


def main(argv: list[str]) -> int:
    role, target, slo_ms, plane, seconds = argv
    config = demo_config(target, float(slo_ms), plane == "on")
    if role == "fill":
        fill(config)
        print(json.dumps({}), flush=True)
        return 0
    # Set up (imports, the pool's index, the training state) before saying ready, so
    # that a loaded machine does not eat the measured seconds with it.
    if role == "inference":
        pool = open_pool(config)
        pool.scheduler.join_host()
    else:
        from isolane.snapshot.store import SnapshotStore

        state, store = training_state(), SnapshotStore(config)
        store.scheduler.join_host()
    print(json.dumps({"ready": True}), flush=True)
    start_at = float(sys.stdin.readline())
    if role == "inference":
        out = inference(pool, start_at, float(seconds))
    else:
        out = trainer(store, state, start_at, float(seconds))
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
