"""Snapshot names, generation folders and user metadata: the rules, checked before any
I/O (pure; the embedded store, the remote client and the node share them).

Layout of one snapshot on a device: ``snapshots/<name>/<generation>/...``
(``prefix_of``); a generation is ``<time_ns:020d>-<6 hex>``, sortable by creation time
and unique across writers (``new_generation``).
"""

from __future__ import annotations

import json
import re
import secrets
import time
from collections.abc import Mapping
from typing import Any, Literal

from isolane.errors import InvalidArgumentError, InvalidNameError

ChangeDetection = Literal["hash", "version"]

ROOT = "snapshots"
GENERATION = re.compile(r"\d{20}-[0-9a-f]{6}")  # fullmatch
SNAPSHOT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+=@-]{0,199}")  # fullmatch


def is_snapshot_name(name: object) -> bool:
    return isinstance(name, str) and bool(SNAPSHOT_NAME.fullmatch(name)) and ".." not in name


def check_snapshot_name(name: str) -> str:
    if not is_snapshot_name(name):
        shown = repr(name)
        raise InvalidNameError(
            f"invalid snapshot name {shown}: use 1-200 letters, digits and ._+=@- , starting "
            "with a letter or digit, with no '/', '..', spaces or control characters "
            "(e.g. 'step-100')")
    return name


def prefix_of(name: str, generation: str) -> str:
    return f"{ROOT}/{name}/{generation}"


def new_generation() -> str:
    """A generation folder name: sortable by creation time, unique across writers."""
    return f"{time.time_ns():020d}-{secrets.token_hex(3)}"


def check_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    """A JSON round trip of the user's metadata (refused when it has none)."""
    if metadata is None:
        return {}
    try:
        return dict(json.loads(json.dumps(dict(metadata), allow_nan=False)))
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"metadata must be JSON-serialisable (str keys; numbers, "
                                   f"strings, lists, dicts): {exc}") from None


def check_change_detection(mode: str) -> str:
    if mode not in ("hash", "version"):
        raise InvalidArgumentError(f"change_detection must be 'hash' or 'version', "
                                   f"got {mode!r}")
    return mode
