"""Shared fixtures: a real SeaweedFS S3 server for the session, buckets per test.

- ``s3_server``: one ``SeaweedServer`` for the whole session (started on first use,
  ~2-5 s), stopped at the end.
- ``s3_url``: a fresh bucket per test, ``("s3://bkt-<hex>/prefix", storage_options)``;
  the bucket is deleted afterwards.
- ``fresh_s3_server``: a server of the test's own, for tests that stop, kill or
  restart it.

Servers are killed in fixture finalizers; if the test process dies instead, the server
gets SIGKILL from the kernel (``PR_SET_PDEATHSIG``) or from a finalizer at exit.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:  # imported in the fixtures: runs without S3 tests skip s3fs/botocore
    from tests.support.seaweedfs import SeaweedServer


@pytest.fixture(scope="session", autouse=True)
def _lane_planes_in_tmp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Host lane planes of this run in its own folder, not /dev/shm: parallel runs
    never share one, and subprocesses the tests start inherit the variable."""
    import os

    folder = tmp_path_factory.mktemp("lane-planes")
    old = os.environ.get("ISOLANE_PLANE_DIR")
    os.environ["ISOLANE_PLANE_DIR"] = str(folder)
    yield
    if old is None:
        os.environ.pop("ISOLANE_PLANE_DIR", None)
    else:
        os.environ["ISOLANE_PLANE_DIR"] = old


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedServer]:
    from tests.support.seaweedfs import SeaweedServer

    server = SeaweedServer(tmp_path_factory.mktemp("seaweedfs"))
    try:
        server.start()
        yield server
    finally:
        server.close()


@pytest.fixture
def s3_url(s3_server: SeaweedServer) -> Iterator[tuple[str, dict[str, Any]]]:
    bucket = s3_server.create_bucket()
    yield f"s3://{bucket}/prefix", s3_server.storage_options
    s3_server.delete_bucket(bucket)


@pytest.fixture
def fresh_s3_server(tmp_path: Path) -> Iterator[SeaweedServer]:
    from tests.support.seaweedfs import SeaweedServer

    server = SeaweedServer(tmp_path / "seaweedfs")
    try:
        server.start()
        yield server
    finally:
        server.close()


@pytest.fixture
def tmpfs() -> Iterator[Callable[[str], Path]]:
    """Mount small tmpfs folders (we run as root in CI); unmounted afterwards."""
    mounted: list[Path] = []
    import tempfile

    def mount(size: str) -> Path:
        where = Path(tempfile.mkdtemp(prefix="isolane-tmpfs-"))
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                               str(where)], capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.fail(f"cannot mount a tmpfs for this test (needs root): {proc.stderr}")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)
