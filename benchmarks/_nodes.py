"""``isolane serve`` processes on loopback for the cluster benchmarks (``bench_cluster.py``
and its ``--locality`` part): each a read group under its own folder with a memory tier
of ``memory_budget`` bytes, on a free port, killed with the benchmark however it exits.
Each node starts from an empty folder: blocks an earlier run left would count as already
stored, not new.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml
from _common import remove_path
from _kv_latency import free_port

NODES = 3


def _die_with_parent() -> None:
    """In a node before exec: SIGKILL it when the benchmark exits, however it exits."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Nodes:
    """``count`` (three) ``isolane serve`` processes on free loopback ports."""

    def __init__(self, folder: Path, memory_budget: int, count: int = NODES) -> None:
        self.folder = folder
        self.procs: list[subprocess.Popen[bytes]] = []
        self.urls: list[str] = []
        for i in range(count):
            home = folder / f"node-{i}"
            remove_path(home)
            home.mkdir(parents=True)
            config = home / "isolane.yaml"
            config.write_text(yaml.safe_dump({
                "home": str(home),
                "device_groups": {"kv": {"role": "read", "devices": [str(home / "kv")],
                                         "memory_budget": memory_budget}},
                "kvpool": {"segment_bytes": "256MiB"}}))
            port = free_port()
            log = open(home / "node.log", "ab")  # noqa: SIM115 - closed with the process
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "isolane.cli.main", "serve", "--config", str(config),
                 "--host", "127.0.0.1", "--port", str(port)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent))
            log.close()
            self.urls.append(f"http://127.0.0.1:{port}")

    def wait_ready(self, timeout_s: float = 60) -> None:
        import urllib.request

        deadline = time.monotonic() + timeout_s
        for url, proc in zip(self.urls, self.procs, strict=True):
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"node {url} exited; see {self.folder}/node-*/node.log")
                try:
                    with urllib.request.urlopen(url + "/healthz", timeout=2):
                        break
                except OSError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"node {url} not ready") from None
                    time.sleep(0.1)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
