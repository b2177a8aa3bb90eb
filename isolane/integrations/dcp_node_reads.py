"""A DCP load through a storage node: each rank receives the bytes its plan reads.

Every read item asks for a region of one stored item (a rank's DCP chunk). When that
region is one run of the stored item's bytes (``item_span``: every dimension after the
first partial one whole, every one before it a single index — rows of a dim-0 shard,
FSDP2's ``Shard(0)`` at another world size), only that run is fetched; any other region
(columns: ``Shard(0)`` read as ``Shard(1)``) fetches the whole stored item. The node
sends the chunk files that cover those runs, whole (a chunk's hash covers all of it:
``RemoteSnapshotStore.read_chunks``), and each is checked against the manifest's hash
before a byte of it is used. A region that fills its target exactly is received straight
into it. Byte items are read whole and accepted only through
``torch.load(weights_only=True)`` (``dcp_reader``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from isolane.client.snapshot_store import RemoteSnapshotStore
from isolane.errors import IntegrityError, InvalidArgumentError
from isolane.snapshot.dcp_reader import SavedItems, checked_bytes, copy_item
from isolane.snapshot.dtypes import as_bytes, dtype_from_name, dtype_name, itemsize
from isolane.snapshot.manifest import ChunkRecord, Manifest, TensorRecord


def item_span(shape: Sequence[int], itemsize: int, offsets: Sequence[int],
              lengths: Sequence[int]) -> tuple[int, int, bool]:
    """``[start, stop)`` bytes of a C-contiguous tensor of ``shape`` to read for the
    region at ``offsets`` of ``lengths``, and whether that is the region alone (True) or
    the whole tensor (the region is not one run of bytes)."""
    if any(n == 0 for n in lengths):
        return 0, 0, True
    first = 0  # the first dimension that is not a single index
    while first < len(shape) and lengths[first] == 1:
        first += 1
    if all(lengths[d] == shape[d] for d in range(first + 1, len(shape))):
        stride, start = 1, 0
        for dim in reversed(range(len(shape))):
            start += offsets[dim] * stride
            stride *= shape[dim]
        return start * itemsize, (start + math.prod(lengths)) * itemsize, True
    return 0, math.prod(shape) * itemsize, False


class NodeCheckpoint:
    """A DCP snapshot on a node as its manifest describes it: DCP's metadata, and where
    each DCP item lies. ``read`` is a rank's ``read_data``."""

    def __init__(self, remote: RemoteSnapshotStore, name: str, manifest: Manifest) -> None:
        self.remote = remote
        self.name = name
        self.manifest = manifest
        self.items = SavedItems.of(manifest, name)
        self.metadata = self.items.metadata

    def read(self, plan: LoadPlan, planner: LoadPlanner) -> int:
        """``plan``'s items into the planner's targets; the chunk bytes received."""
        return read_from_node(self.remote, self.name, self.manifest, self.items.id_of, plan,
                              planner)


@dataclass
class _Want:
    """The bytes ``[start, stop)`` of a stored item that one read item needs, received
    into ``out`` (a uint8 view of ``dest``)."""

    item: ReadItem
    record: TensorRecord
    start: int
    stop: int
    target: torch.Tensor | None  # the planner's (None: a byte item)
    dest: torch.Tensor  # the target itself, the region, the whole item, or raw bytes
    out: torch.Tensor
    got: int = 0


def read_from_node(remote: RemoteSnapshotStore, name: str, manifest: Manifest,
                   id_of: Callable[[ReadItem], int], plan: LoadPlan,
                   planner: LoadPlanner) -> int:
    """Read ``plan``'s items of snapshot ``name`` (``manifest``: its live generation)
    from the node into the planner's targets; the chunk bytes received."""
    records = {t.id: t for t in manifest.tensors}
    wants = [_want(item, records[id_of(item)], planner, name) for item in plan.items]
    order = {c.key: n for n, c in enumerate(manifest.chunks)}
    chunks = {c.key: c for c in manifest.chunks}
    by_tensor: dict[int, list[ChunkRecord]] = {}
    for c in manifest.chunks:
        if c.tensor is not None:
            by_tensor.setdefault(c.tensor, []).append(c)
    # chunk key -> (want, shift, lo, hi): tensor byte t lies at chunk byte t - shift,
    # for t in [lo, hi)
    needed: dict[str, list[tuple[_Want, int, int, int]]] = {}
    for want in wants:
        if want.start == want.stop:
            continue
        pack = want.record.pack
        if pack is not None:
            needed.setdefault(f"{pack.array}/c.0", []).append(
                (want, -pack.offset, 0, pack.nbytes))
            continue
        for c in by_tensor.get(want.record.id, []):
            if c.offset < want.stop and c.offset + c.nbytes > want.start:
                needed.setdefault(c.key, []).append((want, c.offset, c.offset,
                                                     c.offset + c.nbytes))

    def on_chunk(record: ChunkRecord, data: memoryview) -> None:
        raw = torch.frombuffer(data, dtype=torch.uint8) if len(data) else None
        for want, shift, lo, hi in needed[record.key]:
            a, b = max(lo, want.start), min(hi, want.stop)
            if a < b and raw is not None:
                want.out[a - want.start:b - want.start].copy_(raw[a - shift:b - shift])
                want.got += b - a

    asked = [chunks[k] for k in sorted(needed, key=order.__getitem__)]
    received = remote.read_chunks(name, manifest.generation, asked, on_chunk)
    for want in wants:
        item = want.item
        if want.got != want.stop - want.start:
            raise IntegrityError(f"snapshot '{name}'", f"the chunks of DCP item "
                                 f"{item.storage_index.fqn!r} do not hold its bytes")
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, checked_bytes(want.dest, item.storage_index.fqn))
            continue
        target = want.target
        assert target is not None
        if want.dest is not target:
            if tuple(want.dest.shape) == tuple(want.record.shape):
                copy_item(target, want.dest, item)
            else:
                with torch.no_grad():
                    target.copy_(want.dest)
        planner.commit_tensor(item, target)
    return received


def _want(item: ReadItem, record: TensorRecord, planner: LoadPlanner, name: str) -> _Want:
    dtype = dtype_from_name(record.dtype)
    if item.type == LoadItemType.BYTE_IO:
        nbytes = math.prod(record.shape) * itemsize(dtype)
        dest = torch.empty(nbytes, dtype=torch.uint8)
        return _Want(item, record, 0, nbytes, None, dest, dest)
    target = planner.resolve_tensor(item).detach()
    if target.dtype != dtype:
        raise InvalidArgumentError(
            f"'{item.dest_index.fqn}' is {dtype_name(target.dtype)} here but {record.dtype} "
            f"in snapshot '{name}'; load into a tensor of the saved dtype and convert after")
    start, stop, alone = item_span(record.shape, target.element_size(),
                                   item.storage_offsets, item.lengths)
    if alone and target.device.type == "cpu" and target.is_contiguous() and (
            tuple(target.shape) == tuple(item.lengths)):
        dest = target
    elif alone:
        dest = torch.empty(tuple(item.lengths), dtype=dtype)
    else:
        dest = torch.empty(record.shape, dtype=dtype)
    return _Want(item, record, start, stop, target, dest, as_bytes(dest))


__all__ = ["NodeCheckpoint", "item_span", "read_from_node"]
