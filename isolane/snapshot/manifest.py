"""The snapshot manifest (``isolane.json``) and the zarr v3 metadata written with it.

The manifest is written last, atomically: it is the commit point of a snapshot. Its
format is documented in docs/FORMATS.md; bump ``VERSION`` on any incompatible change.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from isolane.errors import IntegrityError
from isolane.snapshot.plan import ArrayPlan

FORMAT = "isolane-snapshot"
VERSION = 1
MULTI_RANK_VERSION = 2  # written only by multi-rank saves, so older readers refuse them
READ_VERSIONS = (VERSION, MULTI_RANK_VERSION)
MANIFEST = "isolane.json"
WRITING_MARKER = "_writing.json"
PART_MANIFEST = "_part.json"  # one rank's share of a multi-rank save, merged by rank 0
HASH_ALGORITHM = "xxh3_128"


@dataclass(frozen=True)
class PackRef:
    array: str
    offset: int
    nbytes: int
    hash: str


@dataclass(frozen=True)
class ShardRef:
    """This tensor holds rows ``[offset, offset + shape[0])`` of one with ``total`` rows."""

    offset: int
    total: int


@dataclass(frozen=True)
class TensorRecord:
    id: int
    key: str
    dtype: str
    shape: tuple[int, ...]
    array: str | None = None
    pack: PackRef | None = None
    rank: int | None = None  # multi-rank snapshots: the rank that saved it
    shard: ShardRef | None = None  # multi-rank snapshots: its rows of a dim-0-split tensor


@dataclass(frozen=True)
class RankPart:
    """One rank's share of a multi-rank snapshot: its state dict's structure."""

    rank: int
    prefix: str  # folder of its arrays and chunks, relative to the generation
    tree: Any


@dataclass(frozen=True)
class ChunkRecord:
    """One stored chunk file. For a tensor chunk, ``tensor``/``offset``/``nbytes`` say
    which bytes of the tensor it holds (a prefix of the file; the rest is zero padding)."""

    key: str
    device: int
    stored: int
    hash: str
    tensor: int | None = None
    offset: int = 0
    nbytes: int = 0
    linked: bool = False


@dataclass(frozen=True)
class SnapshotStats:
    logical_bytes: int
    stored_bytes: int
    written_bytes: int
    linked_bytes: int
    seconds: float


@dataclass(frozen=True)
class Manifest:
    name: str
    generation: str
    committed_at: float
    tree: Any
    tensors: tuple[TensorRecord, ...]
    chunks: tuple[ChunkRecord, ...]
    devices: tuple[str, ...]
    stats: SnapshotStats
    metadata: dict[str, Any] = field(default_factory=dict)
    parent: dict[str, str] | None = None
    ranks: tuple[RankPart, ...] = ()  # empty: a single-process snapshot

    def to_json(self) -> bytes:
        body = asdict(self)
        if not self.ranks:  # single-process manifests stay exactly version 1
            del body["ranks"]
            for t in body["tensors"]:
                del t["rank"], t["shard"]
        version = MULTI_RANK_VERSION if self.ranks else VERSION
        body = {"format": FORMAT, "version": version, "hash_algorithm": HASH_ALGORITHM, **body}
        return json.dumps(body, separators=(",", ":"), allow_nan=False).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Manifest:
        try:
            body = json.loads(data)
            if not isinstance(body, dict):
                raise ValueError(f"expected a JSON object, found {type(body).__name__}")
            if body.get("format") != FORMAT:
                raise ValueError(f"not an isolane manifest (format {body.get('format')!r})")
            if body.get("version") not in READ_VERSIONS:
                raise ValueError(f"manifest version {body.get('version')} is not supported by "
                                 f"this isolane (reads versions {READ_VERSIONS}); upgrade "
                                 "isolane")
            return cls(
                name=body["name"], generation=body["generation"],
                committed_at=body["committed_at"], tree=body["tree"],
                tensors=tuple(
                    TensorRecord(
                        id=t["id"], key=t["key"], dtype=t["dtype"], shape=tuple(t["shape"]),
                        array=t["array"], pack=PackRef(**t["pack"]) if t["pack"] else None,
                        rank=t.get("rank"),
                        shard=ShardRef(**t["shard"]) if t.get("shard") else None)
                    for t in body["tensors"]),
                chunks=tuple(ChunkRecord(**c) for c in body["chunks"]),
                devices=tuple(body["devices"]), stats=SnapshotStats(**body["stats"]),
                metadata=body["metadata"], parent=body["parent"],
                ranks=tuple(RankPart(**r) for r in body.get("ranks", ())),
            )
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
            raise IntegrityError(f"manifest {where}", f"unreadable: {exc}") from None


def zarr_array_meta(array: ArrayPlan, zarr_dtype: str) -> bytes:
    fill: Any = False if zarr_dtype == "bool" else (
        [0.0, 0.0] if zarr_dtype.startswith("complex") else (
            0.0 if zarr_dtype.startswith("float") else 0))
    codecs: list[dict[str, Any]] = [{"name": "bytes"}]
    if zarr_dtype not in ("bool", "uint8", "int8"):
        codecs[0]["configuration"] = {"endian": "little"}
    meta = {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(array.shape),
        "data_type": zarr_dtype,
        "chunk_grid": {"name": "regular",
                       "configuration": {"chunk_shape": list(array.chunk_shape)}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "."}},
        "fill_value": fill,
        "codecs": codecs,
        "attributes": {"torch_dtype": array.torch_dtype},
    }
    return json.dumps(meta).encode()


def zarr_group_meta(attributes: dict[str, Any] | None = None) -> bytes:
    return json.dumps({"zarr_format": 3, "node_type": "group",
                       "attributes": attributes or {}}).encode()
