"""``isolane serve`` argument handling (the node itself: tests/node)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.cli.helpers import fails, ok, run


def test_serve_refuses_a_public_address_without_a_token(tmp_path: Path) -> None:
    result = run("serve", "--host", "0.0.0.0", "--port", "7999",
                 env={"ISOLANE_HOME": str(tmp_path), "ISOLANE_TOKEN": None})
    fails(result, 1, "without a token", "ISOLANE_TOKEN")
    assert not (tmp_path / "checkpoints").exists()  # refused before opening anything


def test_serve_rejects_bad_sizes_and_help_does_not_import_torch() -> None:
    fails(run("serve", "--max-block-bytes", "lots"), 1, "512MiB")
    assert "--max-request-bytes" in ok(run("serve", "--help")).output
    probe = ("import sys\nfrom isolane.cli.main import main\ntry:\n    main(['serve', '--help'])"
             "\nexcept SystemExit:\n    pass\nassert 'torch' not in sys.modules, 'torch'")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
