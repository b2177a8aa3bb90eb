"""What the snapshot stores answer, embedded and remote alike: ``SnapshotInfo``,
``GcReport``, the ``SaveHandle`` of an async save, and the rule that an async save's
failure nobody asked for is raised by the next save (``AsyncSaves``).

Imports neither store: ``isolane.snapshot.store`` and ``isolane.client.snapshot_store``
both build on it.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from isolane.errors import IsolaneError
from isolane.snapshot.catalog import DamagedSnapshot
from isolane.snapshot.manifest import Manifest
from isolane.snapshot.names import prefix_of


@dataclass(frozen=True)
class SnapshotInfo:
    name: str
    generation: str
    committed_at: float
    logical_bytes: int
    stored_bytes: int
    written_bytes: int
    linked_bytes: int
    tensors: int
    seconds: float
    location: str  # "local" or "mirror"
    url: str
    parent: dict[str, str] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    mirrored: bool | None = None
    # The name's live generation when this was returned: a save's own generation,
    # unless a later commit (overwrite=True) has replaced it meanwhile.
    live_generation: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def of(cls, manifest: Manifest, device_url: str, location: str,
           mirrored: bool | None = None) -> SnapshotInfo:
        """The info of ``manifest``'s generation on the device at ``device_url``."""
        s = manifest.stats
        return cls(
            name=manifest.name, generation=manifest.generation,
            committed_at=manifest.committed_at, logical_bytes=s.logical_bytes,
            stored_bytes=s.stored_bytes, written_bytes=s.written_bytes,
            linked_bytes=s.linked_bytes, tensors=len(manifest.tensors), seconds=s.seconds,
            location=location,
            url=f"{device_url}/{prefix_of(manifest.name, manifest.generation)}",
            parent=manifest.parent, metadata=manifest.metadata, mirrored=mirrored)


@dataclass(frozen=True)
class GcReport:
    deleted_snapshots: tuple[str, ...]
    swept_generations: tuple[str, ...]
    damaged: tuple[DamagedSnapshot, ...] = ()  # reported, never swept


class SaveHandle:
    """Returned by ``save_async``: the tensors are staged; durability follows."""

    def __init__(self, name: str, future: Future[SnapshotInfo]) -> None:
        self.name = name
        self._future = future
        self.reported = False

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> SnapshotInfo:
        """Block until the snapshot is committed; raises the save's error."""
        self.reported = True
        return self._future.result(timeout)

    def exception(self) -> BaseException | None:
        return self._future.exception() if self._future.done() else None


class AsyncSaves:
    """The last async save of a store: its failure, if nobody asked for it through
    ``SaveHandle.result()``, is raised once by the next save."""

    def __init__(self) -> None:
        self._last: SaveHandle | None = None
        self._lock = threading.Lock()

    def started(self, handle: SaveHandle) -> None:
        with self._lock:
            self._last = handle

    def raise_unreported_error(self) -> None:
        with self._lock:
            last = self._last
            failure = last.exception() if last is not None else None
            if last is None or last.reported or failure is None:
                return
            last.reported = True
        raise IsolaneError(f"the previous async save of '{last.name}' failed: "
                           f"{failure}; it was not committed — save it again") from failure
