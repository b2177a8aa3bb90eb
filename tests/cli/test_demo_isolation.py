"""``isolane demo`` on a host config also runs its isolation part: a real trainer
process and a real inference process, with the host lane plane off and on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def test_the_demo_shows_kv_p99_and_save_throughput_with_the_plane_off_and_on(
        tmp_path: Path) -> None:
    config = tmp_path / "host.yaml"
    config.write_text(yaml.safe_dump({"home": str(tmp_path / "home")}))
    proc = subprocess.run(
        [sys.executable, "-m", "isolane.cli.main", "--config", str(config), "demo",
         "--size-mb", "8", "--isolation-seconds", "2"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "bit-exact" in out  # the snapshot walk-through still runs first
    rows = {line.split("  ")[0]: line for line in out.splitlines()}
    assert "inference alone" in rows
    for label in ("host plane off (per-process lanes)", "host plane on"):
        assert label in rows, out
        assert "written)" in rows[label]  # a save throughput was measured
    assert "SLO (qos.read_p99_slo_ms)" in out
    # the trainer removed its snapshots; the demo's own walk-through snapshot stays
    listed = subprocess.run([sys.executable, "-m", "isolane.cli.main", "--config",
                             str(config), "ls"], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, check=True).stdout
    assert "demo-iso-" not in listed and "demo-step-2" in listed
