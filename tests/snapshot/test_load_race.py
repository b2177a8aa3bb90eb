"""A load racing an overwrite of the same name (found by the chaos soak): the overwrite
commits and removes the generation the load has located but not read yet. The load must
not report the healthy snapshot as damaged: it reads the generation that is live now."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from isolane import SnapshotStore
from isolane.lanes.assignment import JobKind
from tests.snapshot.conftest import assert_same

REPO = Path(__file__).resolve().parents[2]

OVERWRITE = """
import sys, torch
sys.path.insert(0, {repo!r})
from isolane import SnapshotStore
SnapshotStore({config!r}).save({{"w": torch.full((4, 1 << 18), 2.0)}}, "s", overwrite=True,
                               parent=False)
"""


def test_a_load_racing_an_overwrite_reads_the_live_generation(tmp_path: Path) -> None:
    config = tmp_path / "isolane.yaml"
    config.write_text(
        "device_groups:\n"
        f"  ckpt: {{role: write, devices: ['{tmp_path / 'd0'}'], threads: 1}}\n"
        "snapshot: {chunk_bytes: 1MiB}\n")
    store = SnapshotStore(str(config))
    store.save({"w": torch.full((4, 1 << 18), 1.0)}, "s")  # 4 chunks of 1 MiB
    # Hold the restore lane's only worker so that the load locates the old generation,
    # queues its reads, and reads only after the other process's overwrite removed it.
    gate = threading.Event()
    blocker = store.scheduler.lane(JobKind.CHECKPOINT_READ).submit(gate.wait, 120)
    outcome: dict[str, Any] = {}

    def load() -> None:
        try:
            outcome["state"] = store.load("s")
        except Exception as exc:  # reported by the assertion below
            outcome["error"] = exc

    reader = threading.Thread(target=load)
    reader.start()
    time.sleep(0.5)
    subprocess.run([sys.executable, "-c", OVERWRITE.format(repo=str(REPO), config=str(config))],
                   check=True, timeout=180)
    gate.set()
    blocker.result(timeout=10)
    reader.join(timeout=120)
    assert "error" not in outcome, outcome.get("error")
    assert_same({"w": torch.full((4, 1 << 18), 2.0)}, outcome["state"])
