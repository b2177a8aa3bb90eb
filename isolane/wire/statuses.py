"""Errors <-> HTTP statuses: the one table a node answers by and a client raises by.

A node answers an error as JSON ``{"error": <class name>, "message": <text>,
"fields": {...}}`` with the status of the first matching row of ``STATUS_OF``; the
client raises the same class again (only classes listed here: never a name it was
sent), so ``except SnapshotNotFoundError`` works the same against a node as embedded.
"""

from __future__ import annotations

from typing import Any

from isolane.errors import (
    AuthenticationError,
    CapacityError,
    ConfigError,
    ConflictError,
    IntegrityError,
    InvalidArgumentError,
    InvalidNameError,
    IsolaneError,
    KeyNotFoundError,
    NodeUnavailableError,
    PayloadTooLargeError,
    SnapshotExistsError,
    SnapshotNotFoundError,
    StorageError,
    UnsupportedValueError,
    WireFormatError,
)

STATUS_OF: tuple[tuple[type[BaseException], int], ...] = (
    (AuthenticationError, 401),
    (PayloadTooLargeError, 413),
    (SnapshotNotFoundError, 404),
    (KeyNotFoundError, 404),
    (SnapshotExistsError, 409),
    (ConflictError, 409),
    (ConfigError, 409),  # e.g. a namespace stored with other chunk_tokens
    (WireFormatError, 400),
    (InvalidNameError, 400),
    (UnsupportedValueError, 400),
    (InvalidArgumentError, 400),
    (CapacityError, 507),
    (StorageError, 503),
    (IntegrityError, 500),
    (IsolaneError, 500),
    (OSError, 503),  # a disk or backend failure that escaped translation
)
_CLASSES: dict[str, type[BaseException]] = {
    cls.__name__: cls for cls, _ in STATUS_OF if issubclass(cls, IsolaneError)}
_CLASSES["NodeUnavailableError"] = NodeUnavailableError


def status_for(exc: BaseException) -> int:
    """The HTTP status of an error (500 for anything not in the table: a bug)."""
    for cls, status in STATUS_OF:
        if isinstance(exc, cls):
            return status
    return 500


def error_body(exc: BaseException) -> dict[str, Any]:
    name = type(exc).__name__
    if name not in _CLASSES or not isinstance(exc, IsolaneError):
        name = "StorageError" if isinstance(exc, OSError) else "IsolaneError"
    fields = {k: v for k, v in vars(exc).items()
              if isinstance(v, str | int | float | bool) and not k.startswith("_")}
    return {"error": name, "message": str(exc), "fields": fields}


def error_from_body(status: int, body: Any, where: str) -> IsolaneError:
    """The error a node described (``where`` names the node for unreadable answers)."""
    if not isinstance(body, dict) or not isinstance(body.get("message"), str):
        if status == 401:
            return AuthenticationError(f"{where} refused the request (HTTP 401): set the "
                                       "node's token (ISOLANE_TOKEN or node.token)")
        return StorageError(f"{where} answered HTTP {status} without an error description")
    cls = _CLASSES.get(str(body.get("error")), IsolaneError)
    # Rebuilt without calling the class's own __init__ (their signatures differ): the
    # node's message as is, plus the plain fields it sent (name, what, field ...).
    exc = cls.__new__(cls)
    BaseException.__init__(exc, body["message"])
    fields = body.get("fields")
    if isinstance(fields, dict):
        for key, value in fields.items():
            if isinstance(key, str) and key.isidentifier() and isinstance(
                    value, str | int | float | bool):
                setattr(exc, key, value)
    if not isinstance(exc, IsolaneError):  # unreachable: the table lists IsolaneErrors
        return IsolaneError(body["message"])
    return exc
