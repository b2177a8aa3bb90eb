"""isolane as a torch.distributed.checkpoint storage layer (``isolane.snapshot.dcp``)::

    import torch.distributed.checkpoint as dcp
    from isolane.integrations.dcp import IsolaneStorageReader, IsolaneStorageWriter

    dcp.save(state, storage_writer=IsolaneStorageWriter(store, "step-100"))
    dcp.load(state, storage_reader=IsolaneStorageReader(store, "step-100"))
    fut = dcp.async_save(state, storage_writer=IsolaneStorageWriter(store, "step-200"))

``store``: a ``SnapshotStore``, or anything ``SnapshotStore(...)`` accepts (a folder, a
config, ``s3://...``); a store opened here is this writer's or reader's own: closed by
``close()``, or when the writer or reader is garbage collected (after waiting for its
mirrors).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Mapping
from typing import Any

from isolane.config import Config, is_node_target
from isolane.errors import InvalidArgumentError
from isolane.snapshot import dcp as _dcp
from isolane.snapshot.store import SnapshotStore

StoreLike = SnapshotStore | Config | str | os.PathLike[str]


def _open(owner: object, store: StoreLike
          ) -> tuple[SnapshotStore, weakref.finalize[Any, Any] | None]:
    """The store, and the finalizer that closes it (at most once) when opened here."""
    if isinstance(store, SnapshotStore):
        return store, None
    if is_node_target(store):
        raise InvalidArgumentError(
            f"{store!r} names a storage node; DCP checkpoints are written by the ranks "
            "themselves: open the node's write group as a folder or config on each host, "
            "or save with isolane.open_store(url).save")
    opened = SnapshotStore(store)
    return opened, weakref.finalize(owner, opened.close)


class IsolaneStorageWriter(_dcp.IsolaneStorageWriter):
    __doc__ = _dcp.IsolaneStorageWriter.__doc__

    def __init__(self, store: StoreLike, name: str, *, overwrite: bool = False,
                 parent: str | bool | None = None, mirror: bool | None = None,
                 metadata: Mapping[str, Any] | None = None) -> None:
        opened, self._owned = _open(self, store)
        super().__init__(opened, name, overwrite=overwrite, parent=parent, mirror=mirror,
                         metadata=metadata)

    def close(self) -> None:
        """Close the store when this writer opened it (after the save ended)."""
        if self._owned is not None:
            self._owned()


class IsolaneStorageReader(_dcp.IsolaneStorageReader):
    __doc__ = _dcp.IsolaneStorageReader.__doc__

    def __init__(self, store: StoreLike, name: str) -> None:
        opened, self._owned = _open(self, store)
        super().__init__(opened, name)

    def close(self) -> None:
        """Close the store when this reader opened it."""
        if self._owned is not None:
            self._owned()


__all__ = ["IsolaneStorageReader", "IsolaneStorageWriter"]
