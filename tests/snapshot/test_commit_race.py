"""Two processes saving one name (issue 11, item 2): the commit decides, not the start.

The save that starts first is held back until the second has returned, so it commits
last. Without ``overwrite`` exactly one of them succeeds and the other gets
``SnapshotExistsError``; with ``overwrite=True`` the later commit is the live
snapshot, both callers are told which generation is live, and the replaced one is
gone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from isolane import SnapshotStore
from tests.snapshot.test_store import _small_config

REPO = Path(__file__).resolve().parents[2]


def _race(tmp_path: Path, name: str, *, overwrite: bool) -> dict[str, dict[str, Any]]:
    sync = tmp_path / f"sync-{name}"
    sync.mkdir()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(REPO)) if p)
    procs = {
        role: subprocess.Popen(
            [sys.executable, "-m", "tests.snapshot.race_worker", str(tmp_path), name, role,
             "1" if overwrite else "0", str(sync)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=REPO)
        for role in ("slow", "fast")}
    out = {}
    for role, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr.decode()
        out[role] = json.loads(stdout.decode().strip().splitlines()[-1])
    return out


@pytest.mark.parametrize("round_", range(2))
def test_two_processes_saving_one_new_name_exactly_one_succeeds(tmp_path: Path, round_: int
                                                                ) -> None:
    name = f"new-{round_}"
    result = _race(tmp_path, name, overwrite=False)
    assert result["fast"]["ok"], result
    assert not result["slow"]["ok"], result
    assert result["slow"]["error"] == "SnapshotExistsError", result
    store = SnapshotStore(_small_config(tmp_path))
    assert store.load(name)["role"] == "fast"
    assert store.info(name).generation == result["fast"]["generation"]
    gens = os.listdir(tmp_path / "d0" / "snapshots" / name)
    assert gens == [result["fast"]["generation"]]  # the refused one left nothing


def test_with_overwrite_the_later_commit_wins_and_both_are_told(tmp_path: Path) -> None:
    store = SnapshotStore(_small_config(tmp_path))
    store.save({"w": torch.zeros(4), "role": "first"}, "x")
    result = _race(tmp_path, "x", overwrite=True)
    slow, fast = result["slow"], result["fast"]
    assert slow["ok"] and fast["ok"], result
    assert slow["generation"] < fast["generation"]  # slow started first ...
    assert slow["committed_at"] > fast["committed_at"]  # ... and committed last
    assert fast["live_generation"] == fast["generation"]  # live when fast returned
    assert slow["live_generation"] == slow["generation"]
    fresh = SnapshotStore(_small_config(tmp_path))
    assert fresh.info("x").generation == slow["generation"]
    assert fresh.load("x")["role"] == "slow"
    assert os.listdir(tmp_path / "d0" / "snapshots" / "x") == [slow["generation"]]
    assert fresh.gc().swept_generations == ()
    assert fresh.load("x")["role"] == "slow"
