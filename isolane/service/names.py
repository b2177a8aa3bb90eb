"""What a storage node accepts as a block key, a KV namespace or a snapshot name (pure).

Checked before anything is read or written; a bad value is an ``InvalidNameError``
(HTTP 400) whose message says what is allowed.

- block key: 32 lowercase hex characters (``isolane.kvpool.keys.key_from_hex``);
- KV namespace: 1-200 characters of ``[A-Za-z0-9._+=@:/-]``, starting with a letter or
  digit, no ``..``, no ``//``, no trailing ``/`` (model names such as
  ``meta-llama/Llama-3.1-8B`` fit; in URLs a ``/`` is sent as ``%2F``);
- snapshot name: ``SnapshotStore``'s own rule (``check_snapshot_name``, re-exported).
"""

from __future__ import annotations

import re

from isolane.errors import InvalidArgumentError, InvalidNameError
from isolane.kvpool.keys import key_from_hex
from isolane.snapshot.store import check_snapshot_name

__all__ = ["check_key", "check_namespace", "check_snapshot_name"]

_NAMESPACE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+=@:/-]{0,199}")


def check_key(text: str) -> bytes:
    """The 16-byte key written as ``text``; InvalidNameError otherwise."""
    try:
        return key_from_hex(text)
    except InvalidArgumentError as exc:
        raise InvalidNameError(f"malformed block key: {exc}") from None


def check_namespace(name: str) -> str:
    if (not isinstance(name, str) or _NAMESPACE.fullmatch(name) is None or ".." in name
            or "//" in name or name.endswith("/")):
        raise InvalidNameError(
            f"invalid KV namespace {name!r:.80}: use 1-200 letters, digits and ._+=@:/- , "
            "starting with a letter or digit, without '..', '//' or a trailing '/' "
            "(e.g. 'meta-llama/Llama-3.1-8B')")
    return name

