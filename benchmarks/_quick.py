"""``--quick``: the smoke-test mode every benchmark entry point has.

A quick run takes seconds: each benchmark shrinks its own sizes and runs one round, but
still runs every peer and case this machine has, so that API drift in any of its paths
fails it (``tests/test_benchmarks.py`` runs each one as a subprocess). What it shares is
here: a quick run writes nothing it keeps. ``--out`` is refused (the report is printed,
never written into docs/BENCHMARKS.md); the scratch folders and the output files the
user did not name (``--json`` defaults such as ``.bench/routing.json``, which a later
report may read) point into one fresh temporary folder, removed when the process exits.
The temporary folder is made under ``--dir`` when one is given, else under ``$TMPDIR``.
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
    """Refuse ``--out``; make the temporary folder and point ``args.<folder>`` (each in
    ``folders``) into it, and ``args.<file>`` (each in ``files``) too unless the user
    named that file. Returns the temporary folder (removed at exit)."""
    if getattr(args, "out", None) is not None:
        parser.error("--quick prints its report and writes no file: drop --out "
                     "(a full run writes the section)")
    given = [getattr(args, name) for name in folders
             if getattr(args, name, None) is not None
             and getattr(args, name) != parser.get_default(name)]
    parent = Path(given[0]) if given else None
    if parent is not None:
        parent.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="isolane-quick-", dir=parent))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    for name in folders:
        setattr(args, name, root / name.replace("_", "-"))
    for name in files:
        if getattr(args, name, None) == parser.get_default(name):
            setattr(args, name, root / f"{name}.json")
    return root
