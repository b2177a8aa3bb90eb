"""``isolane kv verify`` tells the truth about blocks lost since the last clean close:
a sealed segment truncated (to nothing, or mid-record) holds fewer records than its
hint promised, and verify names the loss and exits 2."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.cli.helpers import fails, ok, run
from tests.cli.test_kv_cli import fill, write_config


@pytest.mark.parametrize("keep", [0, 1000])
def test_a_truncated_sealed_segment_is_reported_lost(tmp_path: Path, keep: int) -> None:
    config = write_config(tmp_path)
    pool = fill(config, "llama")
    pool.logs[0].rotate()  # seal the 4 blocks (its hint is written)
    segment = next((tmp_path / "kv0" / "kvpool" / "llama" / "segments").glob("*.sealed"))
    pool.close()
    assert "4 blocks checked" in ok(run("--config", config, "kv", "verify")).stdout
    os.truncate(segment, keep)
    result = fails(run("--config", config, "kv", "verify", "--json"), 2)
    report = json.loads(result.stdout)
    assert report["ok"] is False and report["damaged"] >= 1
    reasons = [d["reason"] for d in report["namespaces"][0]["dropped_earlier"]]
    assert any("hint promised" in r for r in reasons), reasons
