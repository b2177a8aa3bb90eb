"""Redis on loopback, the KV peer of ``bench_cluster.py``: ``redis-server`` started and
stopped by the benchmark, persistence off, and a client with a blocking connection pool.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import _common as C
from _common import free_port


@dataclass
class RedisServer:
    """``redis-server`` on 127.0.0.1 with persistence off, started and stopped by us."""

    folder: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    version: str = ""

    def start(self, timeout_s: float = 20) -> None:
        import redis

        if shutil.which("redis-server") is None:
            raise FileNotFoundError("redis-server not installed: apt-get install -y redis-server")
        command = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save",
                   "", "--appendonly", "no", "--dir", str(self.folder), "--protected-mode", "yes"]
        self.folder.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        deadline, client = time.monotonic() + timeout_s, redis.Redis(host="127.0.0.1",
                                                               port=self.port)
        while True:
            try:
                self.version = str(client.info("server").get("redis_version", ""))
                client.close()
                return
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server did not start: {' '.join(command)}"
                                       ) from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            C.stop_server(self.proc, timeout_s=20)
        self.proc = None
        shutil.rmtree(self.folder, ignore_errors=True)
