"""A real etcd server for tests (Debian's ``etcd-server``): one member on free loopback
ports with a temporary data folder.

    server = EtcdServer(tmp_path / "etcd").start()
    ... server.url("/isolane")  ->  etcd://127.0.0.1:PORT/isolane
    server.stop(); server.start()   # a restart keeps the data (leases included)
    server.kill()                   # SIGKILL, at teardown too

``enable_auth`` turns on authentication with a root user through ``etcdctl``, as an
operator would.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests.support.procs import HOST, OwnedProcess, die_with_parent, free_ports

ETCD = shutil.which("etcd") or "/usr/bin/etcd"
ETCDCTL = shutil.which("etcdctl") or "/usr/bin/etcdctl"


class EtcdServer(OwnedProcess):
    """One etcd process (drive it from the test thread)."""

    def __init__(self, folder: Path) -> None:
        super().__init__()
        self.folder = folder
        self.client_port, self.peer_port = free_ports(2)

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.client_port}"

    def url(self, prefix: str = "/isolane") -> str:
        return f"etcd://{HOST}:{self.client_port}{prefix}"

    def command(self) -> list[str]:
        peer = f"http://{HOST}:{self.peer_port}"
        return [ETCD, "--name", "test", "--data-dir", str(self.folder / "data"),
                "--listen-client-urls", self.endpoint,
                "--advertise-client-urls", self.endpoint,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"test={peer}", "--log-level", "warn"]

    def start(self, timeout_s: float = 20.0) -> EtcdServer:
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / "etcd.log", "ab") as log:
            proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL,
                                    stdout=log, stderr=subprocess.STDOUT,
                                    preexec_fn=die_with_parent)
        self._own(proc)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"etcd exited during start-up:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.endpoint + "/health", timeout=1) as resp:
                    if b"true" in resp.read():
                        return self
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"etcd not ready after {timeout_s} s:\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM and wait (data kept for the next ``start``)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            self._proc.wait(20)
        self._forget()

    def ctl(self, *args: str, user: str | None = None) -> str:
        """``etcdctl`` against this server; its output (raises on failure)."""
        command = [ETCDCTL, "--endpoints", self.endpoint, *args]
        if user is not None:
            command[1:1] = ["--user", user]
        done = subprocess.run(command, capture_output=True, text=True, timeout=20,
                              env={"ETCDCTL_API": "3", "PATH": "/usr/bin:/bin"})
        if done.returncode != 0:
            raise RuntimeError(f"etcdctl {' '.join(args)} failed: {done.stderr}")
        return done.stdout

    def enable_auth(self, password: str) -> None:
        """A root user with ``password``, authentication on."""
        self.ctl("user", "add", f"root:{password}")
        self.ctl("user", "grant-role", "root", "root")
        self.ctl("auth", "enable")

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join((self.folder / "etcd.log").read_text().splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()
