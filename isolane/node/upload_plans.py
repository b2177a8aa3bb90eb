"""Upload plans a node keeps between a plan request and its upload (pure: no I/O).

``POST /v1/snapshots/<name>/plan`` plans the save and answers a ``plan_token``; the
upload that sends it back (``X-Isolane-Plan``) takes that plan instead of planning
again, and its stream header, when byte for byte the one planned, is not decoded a
second time (``isolane.node.snapshot_upload``). An entry is:

- used once (``take`` removes it);
- kept at most ``max_age_s`` and among the ``max_entries`` newest (older ones dropped);
- bound to who asked (``owner_of``: a digest of the bearer credentials, the client's
  id, the peer address, the snapshot name and the overwrite flag), so one client
  cannot take another's plan even with its token: a foreign ``take`` answers None and
  leaves the entry to its owner.

A token that is unknown, used, expired or foreign is not an error: the upload is
planned again and its stream checked against that plan as any other. Only a malformed
token is refused (``check_plan_token``). Thread-safe.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from isolane.errors import InvalidArgumentError
from isolane.wire.snapshot_stream import PLAN_HEADER

T = TypeVar("T")
MAX_ENTRIES = 64
MAX_AGE_S = 600.0
_TOKEN = re.compile(r"[A-Za-z0-9_-]{22,64}")


def check_plan_token(token: str) -> str:
    if _TOKEN.fullmatch(token) is None:
        raise InvalidArgumentError(f"{PLAN_HEADER} takes the plan_token a plan request "
                                   f"answered (22 to 64 of A-Z a-z 0-9 _ -), got "
                                   f"{token!r:.80}; leave the header out to have the "
                                   "upload planned again")
    return token


def owner_of(authorization: str | None, client: str | None, peer: str | None, name: str,
             *, overwrite: bool) -> str:
    """Who may take a plan: a digest, so that credentials are not kept in memory."""
    parts = (authorization or "", client or "", peer or "", name, "1" if overwrite else "0")
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


@dataclass(frozen=True)
class _Entry(Generic[T]):
    owner: str
    kept_at: float
    value: T


class UploadPlans(Generic[T]):
    """See the module docstring; ``clock``: seconds, monotonic (tests pass a fake)."""

    def __init__(self, *, max_entries: int = MAX_ENTRIES, max_age_s: float = MAX_AGE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_entries < 1 or max_age_s <= 0:
            raise InvalidArgumentError("UploadPlans needs max_entries >= 1 and max_age_s > 0")
        self.max_entries = max_entries
        self.max_age_s = max_age_s
        self._clock = clock
        self._entries: OrderedDict[str, _Entry[T]] = OrderedDict()
        self._lock = threading.Lock()

    def keep(self, owner: str, value: T) -> str:
        """Keep ``value`` for ``owner``; returns the token that takes it back."""
        token = secrets.token_urlsafe(24)
        with self._lock:
            self._expire(self._clock())
            self._entries[token] = _Entry(owner, self._clock(), value)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        return token

    def take(self, token: str | None, owner: str) -> T | None:
        """The value kept under ``token`` for ``owner`` (removed), else None."""
        if token is None:
            return None
        with self._lock:
            self._expire(self._clock())
            entry = self._entries.get(token)
            if entry is None or not secrets.compare_digest(entry.owner, owner):
                return None
            del self._entries[token]
            return entry.value

    def _expire(self, now: float) -> None:
        while self._entries:
            token, entry = next(iter(self._entries.items()))
            if now - entry.kept_at <= self.max_age_s:
                return
            del self._entries[token]

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)


@dataclass
class PlanCounts:
    """Plans a node made for uploads, and how many uploads followed a kept one
    (``GET /v1/stats``, ``snapshots``). Counted on the event loop's thread."""

    plans: int = 0
    plans_reused: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"plans": self.plans, "plans_reused": self.plans_reused}
