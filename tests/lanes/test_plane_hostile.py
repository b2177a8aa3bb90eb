"""A plane file cannot kill its members: truncating the live plane in place (what an
admin's cleanup or a full /dev/shm can do) leaves every member process running, on
per-process lanes, with one warning each — no SIGBUS. Real member processes
(``tests/lanes/plane_member.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from isolane.config import load_config
from isolane.lanes.plane import plane_path
from tests.lanes.test_plane_processes import REPO, config_file, lines, wait_for

__all__ = ["config_file"]  # the fixture, shared


def _start(config: Path, tmp: Path, name: str, seconds: float
           ) -> tuple[subprocess.Popen[bytes], Path, Path]:
    out, err = tmp / f"{name}.jsonl", tmp / f"{name}.err"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with open(err, "wb") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "tests.lanes.plane_member",
                                 str(config), "writer", str(seconds), str(out)],
                                cwd=REPO, env=env, stderr=stderr)
    wait_for(lambda: any(r.get("ready") for r in lines(out)), 20, f"{name} to join")
    return proc, out, err


@pytest.mark.parametrize("keep", [0, 4096 + 100])
def test_a_plane_truncated_under_its_members_kills_none(config_file: Path, tmp_path: Path,
                                                        keep: int) -> None:
    members = [_start(config_file, tmp_path, f"m{i}", 4.0) for i in range(3)]
    try:
        plane = plane_path(load_config(config_file))
        assert plane.stat().st_size > keep
        os.truncate(plane, keep)
        time.sleep(1.0)  # every member steps on the plane many times meanwhile
        assert all(proc.poll() is None for proc, _, _ in members), \
            [proc.returncode for proc, _, _ in members]
        rows_after = {out: len(lines(out)) for _, out, _ in members}
        time.sleep(0.5)
        assert all(len(lines(out)) > n for out, n in rows_after.items())  # still working
        for proc, _, err in members:
            assert proc.wait(timeout=20) == 0, err.read_text()[-2000:]
            warnings = [line for line in err.read_text().splitlines()
                        if "host lane plane" in line and "per-process lanes" in line]
            assert len(warnings) == 1, err.read_text()[-2000:]
    finally:
        for proc, _, _ in members:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_a_full_plane_folder_fails_at_join_not_at_a_page_fault(tmp_path: Path,
                                                               config_file: Path) -> None:
    """The plane's pages are allocated when it is made: on a full tmpfs the process is
    told at open and runs with per-process lanes; no half-made file is left."""
    folder = tmp_path / "shm"
    folder.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4k", "tmpfs", str(folder)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}): needs root")
    try:
        from dataclasses import replace

        from isolane.lanes.plane import PLANE_DIR_ENV, HostPlane

        config = load_config(config_file)
        config = replace(config, qos=replace(config.qos, plane_dir=str(folder)))
        old = os.environ.pop(PLANE_DIR_ENV, None)
        try:
            assert HostPlane.open(config) is None
        finally:
            if old is not None:
                os.environ[PLANE_DIR_ENV] = old
        assert [p.name for p in folder.iterdir() if not p.name.endswith(".lock")] == []
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)
