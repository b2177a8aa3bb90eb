"""Engine servers (``vllm serve``, ``sglang.launch_server``) for the GPU smoke scripts: a
free port, the wait until ``/health`` answers, and the stop."""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until_healthy(proc: subprocess.Popen[bytes], port: int, name: str, log: Path,
                       timeout_s: float) -> subprocess.Popen[bytes]:
    """Return ``proc`` once ``/health`` answers; exit naming ``log`` if it dies or the
    time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited with {proc.returncode}; see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc
        except OSError:
            time.sleep(1)
    proc.terminate()
    raise SystemExit(f"{name} did not become healthy in {timeout_s:.0f} s; see {log}")


def stop(proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
