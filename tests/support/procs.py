"""Helpers for tests that run servers as child processes (no heavy imports)."""

from __future__ import annotations

import contextlib
import ctypes
import signal
import socket
import subprocess
import weakref
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
