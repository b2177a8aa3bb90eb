"""What a storage node accepts as a block key, a KV namespace or a snapshot name (pure).

Checked before anything is read or written; a bad value is an ``InvalidNameError``
(HTTP 400) whose message says what is allowed.

- block key: 32 lowercase hex characters (``isolane.kvpool.keys.key_from_hex``);
- KV namespace: the pool's own rule (``isolane.kvpool.namespaces.check_namespace``,
  re-exported): 1-200 characters of ``[A-Za-z0-9._+=@:/-]``, starting with a letter or
  digit, no ``..``, no ``//``, no trailing ``/`` (in URLs a ``/`` is sent as ``%2F``);
- snapshot name: ``SnapshotStore``'s own rule (``isolane.snapshot.names.check_snapshot_name``,
  re-exported).
"""

from __future__ import annotations

from isolane.errors import InvalidArgumentError, InvalidNameError
from isolane.kvpool.keys import key_from_hex
from isolane.kvpool.namespaces import check_namespace
from isolane.snapshot.names import check_snapshot_name

__all__ = ["check_key", "check_namespace", "check_snapshot_name"]


def check_key(text: str) -> bytes:
    """The 16-byte key written as ``text``; InvalidNameError otherwise."""
    try:
        return key_from_hex(text)
    except InvalidArgumentError as exc:
        raise InvalidNameError(f"malformed block key: {exc}") from None
