"""torch.distributed.checkpoint's ``Metadata`` as data (pure: no I/O, never pickled).

A checkpoint written through DCP (``isolane.snapshot.dcp``) keeps DCP's metadata in the
manifest's ``dcp`` field, a JSON object (docs/FORMATS.md, "DCP metadata")::

    {"version": 1,                      this encoding's version (DCP_VERSION)
     "dcp_version": "1.0.0",            DCP's own Metadata.version
     "state_dict": {fqn: {"tensor": {"dtype": "float32", "requires_grad": false,
                                     "size": [8, 4],
                                     "chunks": [{"offsets": [0, 0], "sizes": [4, 4]}, ...]}}
                    | {"bytes": {}}},
     "planner_data": <tree>,            the planner's data as an isolane tree (tree.py)
     "storage_meta": {"checkpoint_id": str | null, "save_id": ..., "load_id": ...,
                      "modules": [...]} | null,
     "items": [{"fqn": ..., "offset": [..] | null, "rank": r, "key": ...}, ...],
     "remote_ranks": [r, ...]}          ranks that wrote to another write group than the
                                        coordinator's (another host): their parts are
                                        read from the mirror (absent: none)

``items`` says where each saved item lives: the rank whose part holds it and its key
there (a tensor of that part; a byte item is a uint8 tensor). Anything the encoding
cannot hold (a planner whose data is not plain values) is refused with its name.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from isolane.errors import IntegrityError, UnsupportedValueError
from isolane.snapshot.dtypes import dtype_from_name, dtype_name
from isolane.snapshot.manifest import Manifest
from isolane.snapshot.sharding import part_prefix
from isolane.snapshot.tree import flatten_state, unflatten_state

DCP_VERSION = 1


@dataclass(frozen=True)
class ItemPlace:
    """Where one DCP item lives: the part of rank ``rank``, under ``key``."""

    rank: int
    key: str


def item_key(index: MetadataIndex) -> str:
    """The key of a DCP item inside its rank's part: the fqn, and ``@`` with the offsets
    of a tensor chunk (``model.w@512,0``)."""
    if index.offset is None:
        return index.fqn
    return f"{index.fqn}@{','.join(str(int(o)) for o in index.offset)}"


def index_of(fqn: str, offset: Iterable[int] | None) -> tuple[str, tuple[int, ...] | None]:
    return fqn, None if offset is None else tuple(int(o) for o in offset)


def remote_parts(dcp: Mapping[str, Any] | None) -> list[str]:
    """The part folders (``rank-<r>``) of a DCP checkpoint that lie on another host's
    write group than its manifest: on the mirror only, as far as this host knows."""
    if not dcp:
        return []
    return [part_prefix(int(r)) for r in dcp.get("remote_ranks", [])]


def without_remote_chunks(manifest: Manifest) -> Manifest:
    """The manifest without the chunks of its remote parts (what this host may link)."""
    remote = tuple(f"{p}/" for p in remote_parts(manifest.dcp))
    if not remote:
        return manifest
    return replace(manifest, chunks=tuple(c for c in manifest.chunks
                                          if not c.key.startswith(remote)))


def encode_metadata(metadata: Metadata, places: Mapping[MetadataIndex, ItemPlace],
                    remote_ranks: Iterable[int] = ()) -> dict[str, Any]:
    """The JSON object for ``metadata``, where its items went, and which ranks wrote to
    another write group than the coordinator's."""
    state: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            state[fqn] = {"bytes": {}}
            continue
        state[fqn] = {"tensor": {
            "dtype": dtype_name(md.properties.dtype),
            "requires_grad": bool(md.properties.requires_grad),
            "size": [int(s) for s in md.size],
            "chunks": [{"offsets": [int(o) for o in c.offsets],
                        "sizes": [int(s) for s in c.sizes]} for c in md.chunks]}}
    try:
        planner_tree, leaves = flatten_state(metadata.planner_data)
    except UnsupportedValueError as exc:
        raise UnsupportedValueError(
            "[planner_data]", f"the save planner's data cannot be stored as data ({exc}); "
            "use torch's DefaultSavePlanner or a planner whose planner_data holds plain "
            "values") from None
    if leaves:
        raise UnsupportedValueError("[planner_data]", "the save planner's data holds "
                                    "tensors; isolane stores plain values there only")
    meta = metadata.storage_meta
    remote = sorted(remote_ranks)
    return {
        "version": DCP_VERSION,
        "dcp_version": metadata.version,
        "state_dict": state,
        "planner_data": planner_tree,
        "storage_meta": None if meta is None else {
            "checkpoint_id": None if meta.checkpoint_id is None else str(meta.checkpoint_id),
            "save_id": meta.save_id, "load_id": meta.load_id,
            "modules": list(meta.modules)},
        "items": [{"fqn": index.fqn,
                   "offset": None if index.offset is None else [int(o) for o in index.offset],
                   "rank": place.rank, "key": place.key}
                  for index, place in places.items()],
        **({"remote_ranks": remote} if remote else {}),
    }


def decode_metadata(body: Mapping[str, Any], where: str
                    ) -> tuple[Metadata, dict[tuple[str, tuple[int, ...] | None], ItemPlace]]:
    """``Metadata`` and the item places from the JSON object; IntegrityError (naming
    ``where``) when it is not a DCP metadata object this isolane reads."""
    try:
        if body.get("version") != DCP_VERSION:
            raise ValueError(f"DCP metadata version {body.get('version')!r} is not supported "
                             f"(reads {DCP_VERSION}); upgrade isolane")
        state: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
        for fqn, md in body["state_dict"].items():
            if "bytes" in md:
                state[fqn] = BytesStorageMetadata()
                continue
            t = md["tensor"]
            state[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=dtype_from_name(t["dtype"]),
                                            requires_grad=bool(t["requires_grad"])),
                size=torch.Size(int(s) for s in t["size"]),
                chunks=[ChunkStorageMetadata(offsets=torch.Size(int(o) for o in c["offsets"]),
                                             sizes=torch.Size(int(s) for s in c["sizes"]))
                        for c in t["chunks"]])
        planner_data = unflatten_state(body["planner_data"], _no_tensor)
        meta = body["storage_meta"]
        storage_meta = None if meta is None else StorageMeta(
            checkpoint_id=meta["checkpoint_id"], save_id=meta["save_id"],
            load_id=meta["load_id"], modules=list(meta["modules"]))
        places = {index_of(i["fqn"], i["offset"]): ItemPlace(int(i["rank"]), str(i["key"]))
                  for i in body["items"]}
        metadata = Metadata(state_dict_metadata=state, planner_data=planner_data,
                            storage_data=None, storage_meta=storage_meta,
                            version=body["dcp_version"])
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise IntegrityError(f"DCP metadata of {where}", f"unreadable: {exc}") from None
    return metadata, places


def _no_tensor(_tensor_id: int) -> torch.Tensor:
    raise ValueError("DCP planner data holds no tensors")
