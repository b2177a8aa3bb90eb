"""``--quick``: the smoke-test mode of every benchmark (``tests/test_benchmarks.py``).

A quick run shrinks its sizes to seconds but still runs every peer and case this machine
has, and writes nothing it keeps: ``--out`` is refused, and the scratch folders and the
output files the user did not name point into one temporary folder (under ``--dir`` when
given, else ``$TMPDIR``), removed when the process exits.
"""

from __future__ import annotations

import argparse
import atexit
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

HELP = ("smoke test: tiny sizes, one round, every peer this machine has; prints the "
        "report and writes no file (scratch in a temporary folder, removed at exit)")


def add_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help=HELP)


def enter(args: argparse.Namespace, parser: argparse.ArgumentParser, *,
          folders: Sequence[str] = ("dir",), files: Sequence[str] = ("json",)) -> Path:
    """Refuse ``--out``; point ``args.<folder>`` (each in ``folders``) and ``args.<file>``
    (each in ``files`` the user did not name) into the temporary folder, returned."""
    if getattr(args, "out", None) is not None:
        parser.error("--quick prints its report and writes no file: drop --out "
                     "(a full run writes the section)")
    given = [getattr(args, name) for name in folders
             if getattr(args, name, None) not in (None, parser.get_default(name))]
    if given:
        Path(given[0]).mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="isolane-quick-", dir=given[0] if given else None))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    for name in folders:
        setattr(args, name, root / name.replace("_", "-"))
    for name in files:
        if getattr(args, name, None) == parser.get_default(name):
            setattr(args, name, root / f"{name}.json")
    return root
