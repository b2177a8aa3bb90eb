"""The interpreter exits cleanly after an async save (issue 11, item 10).

``save_async(...).result()`` and then leaving without ``close()`` aborted the process
in about half the runs (SIGABRT, "terminate called without an active exception"): the
save's driver thread, which had run torch code, was still ending while the interpreter
finalised, and the C++ thread-local destructors it ran at thread exit were cut short
by the finalising interpreter. Save threads are now resident (they never exit while
the process lives), and an exit waits, bounded, for saves still in flight.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent("""
    import sys, torch
    from isolane import SnapshotStore
    store = SnapshotStore()
    model = torch.nn.Linear(2048, 2048)
    handle = store.save_async({"model": model.state_dict(), "x": torch.randn(10_000_000)},
                              sys.argv[1], overwrite=True)
    if sys.argv[2] == "wait":
        handle.result()
    print("LEAVING", flush=True)
""")


def _run(tmp_path: Path, name: str, mode: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, ISOLANE_HOME=str(tmp_path / "home"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(REPO)) if p)
    return subprocess.run([sys.executable, "-c", CHILD, name, mode], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_exit_after_async_save_result_without_close_is_clean(tmp_path: Path) -> None:
    for i in range(8):
        done = _run(tmp_path, f"s{i}", "wait")
        assert done.returncode == 0, (i, done.returncode, done.stderr[-2000:])
        assert "terminate called" not in done.stderr and "LEAVING" in done.stdout


@pytest.mark.parametrize("run", range(2))
def test_exit_while_an_async_save_is_in_flight_commits_it_first(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, run: int) -> None:
    from isolane import SnapshotStore

    done = _run(tmp_path, "pending", "leave")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "waiting up to" in done.stderr  # the exit said what it waited for
    monkeypatch.setenv("ISOLANE_HOME", str(tmp_path / "home"))
    assert SnapshotStore().load("pending")["x"].numel() == 10_000_000
