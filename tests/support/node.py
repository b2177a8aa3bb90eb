"""Real storage nodes for tests: ``isolane serve`` processes on free loopback ports.

    node = NodeProcess(write_node_config(tmp_path), token="t0k3n").start()
    ... RemoteKVPool([node.url], token=node.token) ...
    node.stop()      # SIGTERM: graceful (finishes requests, flushes indexes); exit code
    node.kill()      # SIGKILL: a crash
    node.start()     # again, same port and data

The process is started as ``python -m isolane.cli.main serve`` (what the ``isolane``
script runs), gets ``PR_SET_PDEATHSIG`` so it dies with the test process, and a
finalizer kills it at interpreter exit. ``start`` returns once ``/healthz`` answers.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from isolane.wire import frames
from isolane.wire.chain_list import decode_chain_list
from tests.support.procs import OwnedProcess, die_with_parent, free_ports

HOST = "127.0.0.1"


def write_node_config(folder: Path, **sections: Any) -> Path:
    """A host config under ``folder``: a write group, a read group, small segments."""
    data: dict[str, Any] = {
        "home": str(folder / "home"),
        "device_groups": {
            "checkpoint": {"role": "write", "devices": [str(folder / "ckpt")],
                           "inflight_bytes": "64MiB"},
            "kv": {"role": "read", "devices": [str(folder / "kv")],
                   "memory_budget": "16MiB", "inflight_bytes": "64MiB"},
        },
        "snapshot": {"chunk_bytes": "1MiB", "pack_threshold": "64KiB",
                     "staging_budget": "8MiB"},
        "kvpool": {"segment_bytes": "1MiB"},
    }
    data.update(sections)
    path = folder / "isolane.yaml"
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data))
    return path


class NodeStartError(RuntimeError):
    """The node did not answer /healthz in time; the message has its log's tail."""


class NodeProcess(OwnedProcess):
    """One ``isolane serve`` process (not thread-safe: drive it from the test)."""

    def __init__(self, config: Path, *, token: str | None = None, port: int | None = None,
                 args: tuple[str, ...] = (), startup_timeout_s: float = 90.0) -> None:
        super().__init__()
        self.config = config
        self.token = token
        self.port = port or free_ports(1)[0]
        self.args = args
        self.startup_timeout_s = startup_timeout_s
        self.log_path = config.parent / f"node-{self.port}.log"

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def command(self) -> list[str]:
        return [sys.executable, "-m", "isolane.cli.main", "serve", "--config", str(self.config),
                "--host", HOST, "--port", str(self.port), *self.args]

    def launch(self) -> NodeProcess:
        """Start the process without waiting for it (``wait_ready`` next)."""
        if self.running:
            return self
        env = dict(os.environ)
        env.pop("ISOLANE_TOKEN", None)
        if self.token is not None:
            env["ISOLANE_TOKEN"] = self.token
        with open(self.log_path, "ab") as log:
            proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, env=env,
                                    preexec_fn=die_with_parent)
        self._own(proc)
        return self

    def wait_ready(self) -> NodeProcess:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                raise NodeStartError(f"node exited during start-up\n{self.log_tail()}")
            try:
                if self.request("GET", "/healthz")[0] == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.05)
        self.kill()
        raise NodeStartError(f"node {self.url} not ready after {self.startup_timeout_s} s\n"
                             f"{self.log_tail()}")

    def start(self) -> NodeProcess:
        return self.launch().wait_ready()

    def request(self, method: str, path: str, body: bytes | None = None,
                headers: dict[str, str] | None = None, *, token: str | None = "default"
                ) -> tuple[int, bytes]:
        """A plain request (status, body); ``token="default"`` sends the node's token."""
        sent = dict(headers or {})
        use = self.token if token == "default" else token
        if use is not None:
            sent["Authorization"] = f"Bearer {use}"
        req = urllib.request.Request(self.url + path, data=body, method=method, headers=sent)
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def json(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        status, raw = self.request(method, path, data)
        assert status < 400, (status, raw)
        return json.loads(raw)

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM and wait; returns the exit code."""
        assert self._proc is not None
        self._proc.send_signal(signal.SIGTERM)
        code = self._proc.wait(timeout_s)
        self._forget()
        return code

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return "(no log)"
        return "--- node log tail ---\n" + "\n".join(text[-lines:])

    def __enter__(self) -> NodeProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()

    def __repr__(self) -> str:
        return f"NodeProcess({self.url}, {'pid ' + str(self.pid) if self.running else 'stopped'})"


@contextlib.contextmanager
def running_nodes(nodes: list[NodeProcess]) -> Iterator[list[NodeProcess]]:
    """Start every node at once (their imports overlap), wait for each, kill all after."""
    for node in nodes:
        node.launch()
    try:
        for node in nodes:
            node.wait_ready()
        yield nodes
    finally:
        for node in nodes:
            node.kill()


def holders(nodes: list[NodeProcess], namespace: str, keys: list[bytes]) -> list[str]:
    """The URLs of the nodes that store every one of ``keys``."""
    out = []
    for node in nodes:
        status, body = node.request("POST", f"/v1/kv/{namespace}/lookup",
                                    frames.encode_keys(keys))
        if status == 200 and json.loads(body)["blocks"] == len(keys):
            out.append(node.url)
    return out


def chain_listing(node: NodeProcess, namespace: str) -> dict[bytes, list[bytes]]:
    """The node's chain listing (one request, however slow the node); {} on an error."""
    status, body = node.request("GET", f"/v1/kv/{namespace}/chains")
    return dict(decode_chain_list(body)) if status == 200 else {}
