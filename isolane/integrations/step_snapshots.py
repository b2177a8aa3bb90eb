"""The step-numbered snapshots every training integration keeps (``<prefix><step>``):
the store API they use (``SnapshotTarget``), listing and pruning a prefix, and starting
a save — async when asked, from rank 0 only under torch.distributed.

Shared by ``callbacks.PeriodicSnapshot``, ``hf_trainer`` and ``lightning_io``; imports
no framework (torch only).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Protocol

import torch

from isolane.errors import InvalidArgumentError


class PendingSave(Protocol):
    """What ``save_async`` returns (``SaveHandle``)."""

    def done(self) -> bool: ...

    def result(self, timeout: float | None = None) -> Any: ...


class SnapshotTarget(Protocol):
    """The part of the SnapshotStore API the callbacks use: the embedded store and the
    remote client (``isolane.open_store("http://node:port")``) both have it, ``save_async``
    included (the remote one stages on the client and uploads in the background).
    ``save_async`` is used only when a callback saves asynchronously; a target without
    it is refused up front then (``check_async``)."""

    def save(self, state_dict: Any, name: str, metadata: Mapping[str, Any] | None = None, *,
             overwrite: bool = False) -> Any: ...

    def load(self, name: str) -> Any: ...

    def list(self) -> list[Any]: ...

    def delete(self, name: str) -> None: ...


def snapshots_with_prefix(store: SnapshotTarget, prefix: str) -> list[tuple[int, str]]:
    """``(step, name)`` of the committed snapshots named ``<prefix><step>``, oldest first."""
    pattern = re.compile(re.escape(prefix) + r"(\d+)")
    found = []
    for info in store.list():
        match = pattern.fullmatch(info.name)
        if match:
            found.append((int(match.group(1)), info.name))
    return sorted(found)


def prune_snapshots(store: SnapshotTarget, prefix: str, keep_last: int | None) -> list[str]:
    """Delete all but the newest ``keep_last`` committed ``<prefix><step>`` snapshots.

    Only this prefix is touched (``SnapshotStore.gc(keep_last=)`` would apply to every
    snapshot in the store). Returns the deleted names."""
    if keep_last is None or not is_saving_rank():
        return []
    old = snapshots_with_prefix(store, prefix)[:-keep_last] if keep_last else []
    for _step, name in old:
        store.delete(name)
    return [name for _step, name in old]


def check_async(store: SnapshotTarget, async_: bool) -> None:
    """Refuse ``async_=True`` up front for a store without ``save_async``."""
    if async_ and not callable(getattr(store, "save_async", None)):
        raise InvalidArgumentError(f"{type(store).__name__} has no save_async; pass "
                                   "async_=False to save synchronously")


def start_save(store: SnapshotTarget, state: Any, name: str, metadata: Mapping[str, Any],
               async_: bool) -> PendingSave | None:
    """Save (overwriting a snapshot of that name: a run resumed from an older snapshot
    saves the same steps again); async: the handle, once the tensors are staged."""
    if not is_saving_rank():
        return None
    if async_:
        handle: PendingSave = store.save_async(  # type: ignore[attr-defined]
            state, name, metadata, overwrite=True)
        return handle
    from isolane.snapshot.store import SnapshotStore

    # Data-parallel replicas hold the same state: rank 0 saves it alone, not as a
    # multi-rank collective (that needs every rank to call save).
    local = {"distributed": False} if isinstance(store, SnapshotStore) else {}
    store.save(state, name, metadata, overwrite=True, **local)
    return None


def is_saving_rank() -> bool:
    """False on every rank but 0 of an initialised torch.distributed group: the
    callbacks save replicated (data-parallel) state from rank 0 only."""
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def check_prefix(prefix: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+=@-]{0,150}", prefix) or prefix[-1].isdigit():
        raise InvalidArgumentError(
            f"snapshot prefix {prefix!r} must be letters, digits and ._+=@- , start with a "
            "letter or digit and not end with a digit (the step number follows it)")
    return prefix
