"""One side of a two-process save race (tests/snapshot/test_commit_race.py).

    python -m tests.snapshot.race_worker ROOT NAME ROLE OVERWRITE SYNC_DIR

``slow`` starts first and, once its first chunk is written, waits for ``fast`` to have
returned before it goes on to commit; ``fast`` starts once ``slow`` is under way. So
the save that *started* first *commits* last. Each prints one JSON line: the returned
``SnapshotInfo`` fields that matter, or the error's type and message.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from isolane import SnapshotStore
from tests.snapshot.test_store import _small_config


def _wait_for(path: Path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear")
        time.sleep(0.01)


def main(root: str, name: str, role: str, overwrite: str, sync: str) -> None:
    sync_dir = Path(sync)
    store = SnapshotStore(_small_config(Path(root)))
    fill = 1.0 if role == "slow" else 2.0
    state = {"w": torch.full((2_000_000,), fill), "role": role}
    waited = False

    def progress(done: int, total: int) -> None:
        nonlocal waited
        if role == "slow" and not waited:
            waited = True
            (sync_dir / "slow-started").touch()
            _wait_for(sync_dir / "fast-done")

    if role == "fast":
        _wait_for(sync_dir / "slow-started")
    try:
        info = store.save(state, name, overwrite=overwrite == "1", progress=progress)
        out = {"ok": True, "generation": info.generation,
               "live_generation": info.live_generation, "committed_at": info.committed_at}
    except Exception as exc:  # reported to the test, which decides
        out = {"ok": False, "error": type(exc).__name__, "message": str(exc)}
    finally:
        if role == "fast":
            (sync_dir / "fast-done").touch()
    store.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
