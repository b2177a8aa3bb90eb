"""DCP's Metadata as JSON (isolane.snapshot.dcp_metadata): pure, no ranks, no disk."""

from __future__ import annotations

import json

import pytest
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
from isolane.snapshot.dcp_metadata import ItemPlace, decode_metadata, encode_metadata, item_key


def _metadata(planner_data: object) -> Metadata:
    chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([3, 4])),
              ChunkStorageMetadata(torch.Size([3, 0]), torch.Size([3, 4]))]
    return Metadata(
        state_dict_metadata={
            "model.w": TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16,
                                                              requires_grad=True),
                                             torch.Size([6, 4]), chunks),
            "step": BytesStorageMetadata()},
        planner_data=planner_data,
        storage_meta=StorageMeta(checkpoint_id="s1", save_id="x", modules=["m"]),
        version="1.0.0")


def test_metadata_round_trips_through_json() -> None:
    places = {MetadataIndex("model.w", torch.Size([0, 0])): ItemPlace(0, "model.w@0,0"),
              MetadataIndex("model.w", torch.Size([3, 0])): ItemPlace(1, "model.w@3,0"),
              MetadataIndex("step"): ItemPlace(0, "step")}
    meta = _metadata({"model.w": ("model", "w"), "step": ("step",)})
    body = json.loads(json.dumps(encode_metadata(meta, places)))
    back, where = decode_metadata(body, "test")
    assert back.state_dict_metadata == meta.state_dict_metadata
    assert back.planner_data == meta.planner_data and back.version == "1.0.0"
    assert back.storage_meta == meta.storage_meta
    assert where[("model.w", (3, 0))] == ItemPlace(1, "model.w@3,0")
    assert where[("step", None)] == ItemPlace(0, "step")
    assert item_key(MetadataIndex("b", torch.Size([]))) == "b@"


def test_planner_data_that_is_not_plain_values_is_refused() -> None:
    with pytest.raises(UnsupportedValueError, match="planner"):
        encode_metadata(_metadata({"w": object()}), {})


@pytest.mark.parametrize("damage", [{"version": 2}, {"state_dict": {"w": {"tensor": {}}}},
                                    {"items": [{"fqn": "w"}]}])
def test_unreadable_metadata_is_an_integrity_error(damage: dict[str, object]) -> None:
    body = {**encode_metadata(_metadata({}), {}), **damage}
    with pytest.raises(IntegrityError, match="DCP metadata of snap"):
        decode_metadata(body, "snap")
