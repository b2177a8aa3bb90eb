"""Helpers for tests that run servers as child processes (no heavy imports)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import weakref
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"
_PR_SET_PDEATHSIG = 1


def free_ports(count: int) -> list[int]:
    """``count`` distinct free TCP ports on 127.0.0.1 (all held open while choosing)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((HOST, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def run_ranks(worker: Path, args: list[str], world: int, timeout_s: float
              ) -> list[tuple[int, str]]:
    """Run ``python worker *args`` as ranks 0..world-1 of one torch.distributed job on
    loopback (gloo's environment, one OpenMP thread each, the repository on the path);
    each rank's exit code and the end of its stderr, in rank order. A rank that outlives
    ``timeout_s`` is killed."""
    repo = Path(__file__).resolve().parents[2]
    port = free_ports(1)[0]
    procs = [subprocess.Popen(
        [sys.executable, str(worker), *args], cwd=repo, text=True,
        env={**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world),
             "LOCAL_RANK": str(rank), "MASTER_ADDR": HOST, "MASTER_PORT": str(port),
             "OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo)},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for rank in range(world)]
    ended = []
    for proc in procs:
        try:
            _out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            _out, err = proc.communicate()
        ended.append((proc.returncode, err[-3000:]))
    return ended


def die_with_parent() -> None:
    """In the child before exec: SIGKILL me when the process that started me exits."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _reap(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


class OwnedProcess:
    """A server child the test owns: killed with the test's object if nobody stopped it."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None

    def _own(self, proc: subprocess.Popen[bytes]) -> None:
        self._proc = proc
        self._finalizer = weakref.finalize(self, _reap, proc)

    def kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._forget()

    def _forget(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
        self._proc = None
