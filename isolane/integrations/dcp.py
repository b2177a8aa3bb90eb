"""isolane as a torch.distributed.checkpoint storage layer (``isolane.snapshot.dcp``)::

    import torch.distributed.checkpoint as dcp
    from isolane.integrations.dcp import IsolaneStorageReader, IsolaneStorageWriter

    dcp.save(state, storage_writer=IsolaneStorageWriter(store, "step-100"))
    dcp.load(state, storage_reader=IsolaneStorageReader(store, "step-100"))
    fut = dcp.async_save(state, storage_writer=IsolaneStorageWriter(store, "step-200"))

``store``: a ``SnapshotStore``, or anything ``SnapshotStore(...)`` accepts (a folder, a
config, ``s3://...``, a node URL ``http://host:port``); a store opened here is this
writer's or reader's own: closed by ``close()``, or when the writer or reader is garbage
collected (after waiting for its mirrors).

Through a node (a ``RemoteSnapshotStore`` or its URL): the coordinator begins the save
on the node that owns the name, every rank streams its own items to it as its part
(``isolane.client.snapshot_parts``: chunks the parent holds are sent as hashes and
linked there), and the coordinator commits once every rank's part is written; a rank
that fails or dies commits nothing (the node sweeps its leftovers once the save's lease
runs out). A load asks the node for the chunks that hold the bytes the rank's plan reads
(``isolane.integrations.dcp_node_reads``).
"""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from isolane.client.snapshot_store import RemoteSnapshotStore
from isolane.config import Config
from isolane.errors import InvalidArgumentError
from isolane.integrations.dcp_node_reads import NodeCheckpoint
from isolane.opening import open_store as open_target
from isolane.snapshot import dcp as _dcp
from isolane.snapshot.dcp_metadata import ItemPlace, encode_metadata
from isolane.snapshot.results import SnapshotInfo
from isolane.snapshot.store import SnapshotStore

LocalStoreLike = SnapshotStore | Config | str | os.PathLike[str]
StoreLike = LocalStoreLike | RemoteSnapshotStore
Opened = SnapshotStore | RemoteSnapshotStore


def open_owned_store(owner: object, store: StoreLike
                     ) -> tuple[Opened, weakref.finalize[Any, Any] | None]:
    """The store, and the finalizer that closes it (at most once) when opened here."""
    if isinstance(store, SnapshotStore | RemoteSnapshotStore):
        return store, None
    opened: Opened = open_target(store)
    return opened, weakref.finalize(owner, opened.close)


class NodePartSaves:
    """A DCP save's steps as requests to the node that owns the snapshot's name."""

    def __init__(self, remote: RemoteSnapshotStore) -> None:
        self.remote = remote

    def begin(self, name: str, *, overwrite: bool, parent: str | bool | None) -> _dcp.Begun:
        generation, ref = self.remote.begin_parts(name, overwrite=overwrite, parent=parent)
        return _dcp.Begun(generation, ref, (self.remote.home(name)[0],))

    def write_part(self, name: str, begun: _dcp.Begun, rank: int,
                   items: dict[str, torch.Tensor], *, overwrite: bool) -> _dcp.PartWritten:
        part = self.remote.save_part(name, begun.generation, begun.parent, rank, items,
                                     overwrite=overwrite)
        return _dcp.PartWritten(rank, list(begun.home), part)

    def commit(self, name: str, begun: _dcp.Begun, parts: dict[int, _dcp.PartWritten],
               world: int, metadata: Metadata, places: Mapping[MetadataIndex, ItemPlace],
               user_metadata: dict[str, Any], *, overwrite: bool, mirror: bool | None,
               started: float) -> SnapshotInfo:
        _dcp.check_ranks(name, parts, world)
        return self.remote.commit_parts(
            name, begun.generation, begun.parent, world, encode_metadata(metadata, places),
            user_metadata, overwrite=overwrite, mirror=mirror,
            seconds=time.perf_counter() - started)


class IsolaneStorageWriter(_dcp.IsolaneStorageWriter):
    __doc__ = _dcp.IsolaneStorageWriter.__doc__

    def __init__(self, store: StoreLike, name: str, *, overwrite: bool = False,
                 parent: str | bool | None = None, mirror: bool | None = None,
                 metadata: Mapping[str, Any] | None = None) -> None:
        opened, self._owned = open_owned_store(self, store)
        if isinstance(opened, RemoteSnapshotStore):
            super().__init__(None, name, overwrite=overwrite, parent=parent, mirror=mirror,
                             metadata=metadata, saves=NodePartSaves(opened))
        else:
            super().__init__(opened, name, overwrite=overwrite, parent=parent,
                             mirror=mirror, metadata=metadata)

    def close(self) -> None:
        """Close the store when this writer opened it (after the save ended)."""
        if self._owned is not None:
            self._owned()


class IsolaneStorageReader(_dcp.IsolaneStorageReader):
    __doc__ = _dcp.IsolaneStorageReader.__doc__

    def __init__(self, store: StoreLike, name: str) -> None:
        opened, self._owned = open_owned_store(self, store)
        self._remote = opened if isinstance(opened, RemoteSnapshotStore) else None
        self._node: NodeCheckpoint | None = None
        super().__init__(opened if isinstance(opened, SnapshotStore) else None, name)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._remote is None:
            return super().read_metadata(*args, **kwargs)
        self._node = NodeCheckpoint(self._remote, self.name, self._remote.manifest(self.name))
        return self._node.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        if self._remote is None:
            super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        elif self._node is None:
            self.read_metadata()

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self._remote is None:
            return super().read_data(plan, planner)
        if self._node is None:
            raise InvalidArgumentError("read_data() before read_metadata()")
        self._node.read(plan, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def close(self) -> None:
        """Close the store when this reader opened it."""
        if self._owned is not None:
            self._owned()


__all__ = ["IsolaneStorageReader", "IsolaneStorageWriter", "NodePartSaves"]
