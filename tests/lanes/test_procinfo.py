"""One pid probe (lanes.procinfo) for the lane plane's slots and GC's writing markers."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from isolane.lanes.procinfo import is_alive, start_ticks
from isolane.snapshot.manifest import WRITING_MARKER
from isolane.snapshot.marker import mark_writing
from isolane.snapshot.retention import writer_alive
from isolane.storage.local import LocalBlobStore


def _marker(pid: int, host: str | None = None) -> dict[str, object]:
    return {"pid": pid, "host": host or socket.gethostname(), "started": time.time()}


def test_a_running_process_is_alive_under_its_own_start_time() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        start = start_ticks(child.pid)
        assert start > 0
        assert is_alive(child.pid, 0) and is_alive(child.pid, start)
        assert not is_alive(child.pid, start + 1)  # same pid, another process
        assert writer_alive(_marker(child.pid), grace_s=0, now=time.time())
    finally:
        child.kill()
        child.wait()
    assert not is_alive(child.pid, start)
    assert not writer_alive(_marker(child.pid), grace_s=3600, now=time.time())


def test_a_killed_unreaped_writer_is_gone() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        os.kill(child.pid, 9)
        deadline = time.monotonic() + 10
        while is_alive(child.pid, 0) and time.monotonic() < deadline:
            time.sleep(0.01)  # a zombie until waited for: it runs nothing
        assert not is_alive(child.pid, 0)
        assert not writer_alive(_marker(child.pid), grace_s=3600, now=time.time())
    finally:
        child.wait()


def test_a_marker_from_another_host_is_trusted_for_the_grace_period() -> None:
    now = time.time()
    marker = {"pid": os.getpid(), "host": "another-host", "started": now - 10}
    assert writer_alive(marker, grace_s=60, now=now)
    assert not writer_alive(marker, grace_s=5, now=now)
    assert writer_alive(_marker(os.getpid()), grace_s=0, now=now)


def test_a_marker_whose_pid_was_reused_names_a_gone_writer() -> None:
    # The marker's writer exited and its pid now runs another process: GC must see
    # the writer gone, or the leftover generation is never swept.
    now = time.time()
    mine = start_ticks(os.getpid())
    reused = {**_marker(os.getpid()), "pid_start": mine + 1}
    assert not writer_alive(reused, grace_s=3600, now=now)
    assert writer_alive({**_marker(os.getpid()), "pid_start": mine}, grace_s=0, now=now)


def test_the_writing_marker_records_the_writers_start_time(tmp_path: Path) -> None:
    store = LocalBlobStore(str(tmp_path))
    mark_writing(store, "snap/gen")
    marker = json.loads(store.read(f"snap/gen/{WRITING_MARKER}"))
    assert marker["pid"] == os.getpid()
    assert marker["pid_start"] == start_ticks(os.getpid()) > 0
    assert writer_alive(marker, grace_s=0, now=time.time())
