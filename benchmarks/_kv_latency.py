"""Small random reads: per-call latency under Zipf(1.0) at several concurrencies, and the
Redis server the benchmark starts on loopback for comparison.

``measure(reader, ids, threads, ...)`` runs ``threads`` Python threads in this process;
each reads its share of ``ids`` one call at a time into its own preallocated,
pre-touched 64 KiB buffer and records ``perf_counter_ns`` around every call (bounded
loops: every thread makes exactly its share of calls). Every ``CHECK_EVERY``-th call is
compared with the stored block after the clock stopped.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import _common as C
import _kv_data as D
import numpy as np
from _common import free_port

CHECK_EVERY = 16
Reader = Callable[[int, memoryview], None]  # (block id, 64 KiB destination)


@dataclass
class LatencyRun:
    threads: int
    calls: int
    p50_us: float
    p99_us: float
    p999_us: float
    mean_us: float
    seconds: float
    disk_read_bytes: int
    checked: int
    mismatches: int
    error: str | None = None


def percentiles(ns: np.ndarray) -> tuple[float, float, float, float]:
    us = ns / 1000.0
    p50, p99, p999 = np.percentile(us, [50, 99, 99.9], method="higher")
    return float(p50), float(p99), float(p999), float(us.mean())


def measure(make_reader: Callable[[], Reader], ids: list[int], threads: int,
            base: D.Bytes, block_bytes: int, *,
            read_bytes: Callable[[], int] = lambda: 0) -> LatencyRun:
    """Latency of ``len(ids)`` calls split over ``threads`` threads."""
    per = len(ids) // threads
    shares = [ids[t * per:(t + 1) * per] for t in range(threads)]
    samples = [np.zeros(per, dtype=np.int64) for _ in range(threads)]
    errors: list[str] = []
    checked = [0] * threads
    bad = [0] * threads
    barrier = threading.Barrier(threads + 1)

    def worker(t: int) -> None:
        try:
            reader = make_reader()
            _m, buf = D.aligned_buffer(block_bytes)
            out = memoryview(buf)
            mine, rec = shares[t], samples[t]
        except Exception as exc:  # reported in the row
            errors.append(f"{type(exc).__name__}: {exc}")
            barrier.wait()
            return
        barrier.wait()
        clock = time.perf_counter_ns
        try:
            for i, block_id in enumerate(mine):
                t0 = clock()
                reader(block_id, out)
                rec[i] = clock() - t0
                if i % CHECK_EVERY == 0:
                    checked[t] += 1
                    if not np.array_equal(buf, D.block_view(base, block_id, block_bytes)):
                        bad[t] += 1
        except Exception as exc:  # reported in the row
            errors.append(f"{type(exc).__name__}: {exc}")

    pool = [threading.Thread(target=worker, args=(t,), daemon=True) for t in range(threads)]
    for th in pool:
        th.start()
    disk_before = read_bytes()
    barrier.wait()
    start = time.perf_counter()
    for th in pool:
        th.join()
    seconds = time.perf_counter() - start
    disk = read_bytes() - disk_before
    all_ns = np.concatenate(samples)
    if errors:
        return LatencyRun(threads, len(all_ns), 0, 0, 0, 0, seconds, disk, sum(checked),
                          sum(bad), errors[0][:200])
    p50, p99, p999, mean = percentiles(all_ns)
    return LatencyRun(threads, len(all_ns), p50, p99, p999, mean, seconds, disk,
                      sum(checked), sum(bad))


# -- Redis on loopback ----------------------------------------------------------------------
@dataclass
class RedisServer:
    """``redis-server`` on 127.0.0.1 with persistence off, started and stopped by us."""

    folder: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    version: str = ""

    @property
    def command(self) -> list[str]:
        return ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--dir", str(self.folder),
                "--protected-mode", "yes"]

    def start(self, timeout_s: float = 20) -> None:
        import redis

        if shutil.which("redis-server") is None:
            raise FileNotFoundError("redis-server not installed: apt-get install -y "
                                    "redis-server")
        self.folder.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(self.command, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        client = redis.Redis(host="127.0.0.1", port=self.port)
        while True:
            try:
                client.ping()
                self.version = str(client.info("server").get("redis_version", ""))
                client.close()
                return
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server did not start: {' '.join(self.command)}"
                                       ) from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            C.stop_server(self.proc, timeout_s=20)
        self.proc = None
        shutil.rmtree(self.folder, ignore_errors=True)


def redis_client(port: int, max_connections: int = 64):  # type: ignore[no-untyped-def]
    import redis

    pool = redis.BlockingConnectionPool(host="127.0.0.1", port=port,
                                        max_connections=max_connections, timeout=30)
    return redis.Redis(connection_pool=pool)


def redis_key(block_id: int) -> bytes:
    return b"kv:%010d" % block_id


def load_redis(client, base: D.Bytes, ids: list[int], block_bytes: int,  # type: ignore[no-untyped-def]
               batch: int = 64) -> float:
    start = time.perf_counter()
    for i in range(0, len(ids), batch):
        pipe = client.pipeline(transaction=False)
        for j in ids[i:i + batch]:
            pipe.set(redis_key(j), D.block_view(base, j, block_bytes).tobytes())
        pipe.execute()
    return time.perf_counter() - start
