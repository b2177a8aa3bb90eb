"""The snapshot manifest (``isolane.json``) and the zarr v3 metadata written with it.

The manifest is written last, atomically: it is the commit point of a snapshot. Its
format is documented in docs/FORMATS.md; bump ``VERSION`` on any incompatible change.

Every open checks the manifest itself before anything is read through it: its
``checksum`` (xxh3-128 of the canonical JSON of every other field; manifests written
before the field existed have none and are read as before) and its layout
(``check_layout``: known dtypes, non-negative shapes, device indices in range of the
write group that holds each chunk, and chunks or pack slots that cover each tensor's
bytes exactly, no more and no less).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

import xxhash

from isolane import bounded_json
from isolane.errors import IntegrityError
from isolane.snapshot.plan import ArrayPlan

FORMAT = "isolane-snapshot"
VERSION = 1
MULTI_RANK_VERSION = 2  # written only by multi-rank saves, so older readers refuse them
# written only when a part lies on another write group than the manifest's (ranks on
# several hosts), so older readers, which would check its chunks against the wrong
# group, refuse it
MULTI_HOST_VERSION = 3
READ_VERSIONS = (VERSION, MULTI_RANK_VERSION, MULTI_HOST_VERSION)
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
    # the write group the part was written to when it is not the manifest's (another
    # host's): its chunks' device indices count in this group; None: the manifest's
    devices: tuple[str, ...] | None = None


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
    # torch.distributed.checkpoint's metadata, for snapshots saved through DCP
    # (isolane.snapshot.dcp_metadata); None: absent from the JSON
    dcp: dict[str, Any] | None = None

    def group_elsewhere(self, chunk: ChunkRecord) -> tuple[str, ...] | None:
        """The write group ``chunk`` was saved to when it is not the manifest's (its
        part's own, ``RankPart.devices``: another host's), else None; its device index
        counts in that group."""
        groups = self._groups_elsewhere
        return groups.get(chunk.key.partition("/")[0]) if groups else None

    @functools.cached_property
    def _groups_elsewhere(self) -> dict[str, tuple[str, ...]]:
        return {p.prefix: p.devices for p in self.ranks if p.devices is not None}

    def to_json(self) -> bytes:
        body = _fields_of(self)
        if not self.ranks:  # single-process manifests stay exactly version 1
            del body["ranks"]
            for t in body["tensors"]:
                del t["rank"], t["shard"]
        for r in body.get("ranks", ()):
            if r["devices"] is None:  # one write group: exactly version 2
                del r["devices"]
        if self.dcp is None:
            del body["dcp"]
        if any(r.devices is not None for r in self.ranks):
            version = MULTI_HOST_VERSION
        elif self.ranks:
            version = MULTI_RANK_VERSION
        else:
            version = VERSION
        body = {"format": FORMAT, "version": version, "hash_algorithm": HASH_ALGORITHM, **body}
        # The canonical JSON the checksum covers is the file itself, with the checksum
        # appended as its last field: one encoding, and ``from_json`` checks the bytes
        # as they lie instead of encoding what it parsed again.
        canonical = _canonical(body)
        return canonical[:-1] + _CHECKSUM_FIELD + _checksum_of(canonical).encode() + b'"}'

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Manifest:
        try:
            body = bounded_json.loads(data)
            if not isinstance(body, dict):
                raise ValueError(f"expected a JSON object, found {type(body).__name__}")
            if body.get("format") != FORMAT:
                raise ValueError(f"not an isolane manifest (format {body.get('format')!r})")
            if body.get("version") not in READ_VERSIONS:
                raise ValueError(f"manifest version {body.get('version')} is not supported by "
                                 f"this isolane (reads versions {READ_VERSIONS}); upgrade "
                                 "isolane")
            stored = body.pop("checksum", None)
            if stored is not None and not _checksummed_as_written(bytes(data), stored) \
                    and stored != content_checksum(body):
                raise ValueError(f"manifest checksum mismatch (stored {stored!r:.40}, content "
                                 f"hashes to {content_checksum(body)}): the file was changed "
                                 "or damaged after it was written")
            manifest = cls(
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
                ranks=tuple(_rank_part(r) for r in body.get("ranks", ())),
                dcp=_object_or_none(body.get("dcp")),
            )
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
            raise IntegrityError(f"manifest {where}", f"unreadable: {exc}") from None
        from isolane.snapshot.tree import tensor_ids  # imports torch: not at module level

        try:
            tensor_ids(manifest.tree, lambda _path: True)  # every node of a known kind
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
            raise IntegrityError(f"manifest {where}", f"malformed tree ({exc!r:.120})"
                                 ) from None
        problem = check_layout(manifest)
        if problem is not None:
            raise IntegrityError(f"manifest {where}", problem)
        return manifest


def _rank_part(body: dict[str, Any]) -> RankPart:
    devices = body.get("devices")
    if devices is not None and not (isinstance(devices, list) and devices
                                    and all(isinstance(d, str) for d in devices)):
        raise ValueError(f"rank {body.get('rank')!r}: 'devices' must be a non-empty list of "
                         "URLs")
    return RankPart(rank=body["rank"], prefix=body["prefix"], tree=body["tree"],
                    devices=None if devices is None else tuple(devices))


def _object_or_none(value: object) -> dict[str, Any] | None:
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"field 'dcp' must be an object, found {type(value).__name__}")
    return value


def _fields_of(value: Any) -> Any:
    """``dataclasses.asdict`` without its deep copy of every dict and list: records
    become dicts and tuples of them lists; the JSON values they hold (trees, user and
    DCP metadata, hundreds of kilobytes for a sharded checkpoint) are encoded as they
    are, not copied first."""
    if isinstance(value, _PLAIN):  # most fields of most records: first, and cheap
        return value
    if isinstance(value, tuple):
        return [_fields_of(v) for v in value]
    if not is_dataclass(value) or isinstance(value, type):
        return value
    kind: type = type(value)
    return {n: _fields_of(getattr(value, n)) for n in _field_names(kind)}


_PLAIN = (str, int, float, type(None))


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


def content_checksum(body: dict[str, Any]) -> str:
    """xxh3-128 of the canonical JSON (sorted keys, no spaces) of ``body`` without its
    ``checksum`` field."""
    return _checksum_of(_canonical({k: v for k, v in body.items() if k != "checksum"}))


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _checksum_of(canonical: bytes) -> str:
    return f"{HASH_ALGORITHM}:{xxhash.xxh3_128_hexdigest(canonical)}"


_CHECKSUM_FIELD = b',"checksum":"'


def _checksummed_as_written(data: bytes, stored: object) -> bool:
    """Whether ``data`` is in ``to_json``'s form, JSON with ``stored`` appended as its
    last field, and ``stored`` is the checksum of the JSON before it: those bytes are
    then the ones hashed when the file was written, without encoding the parsed content
    again. Files of any other form are checked by ``content_checksum``."""
    if not isinstance(stored, str):
        return False
    tail = _CHECKSUM_FIELD + stored.encode() + b'"}'
    if not data.endswith(tail):
        return False
    return _checksum_of(data[:-len(tail)] + b"}") == stored


def _itemsize(dtype: object) -> int | None:
    return _dtype_itemsize(dtype) if isinstance(dtype, str) else None


@functools.cache  # a manifest names few dtypes, each on hundreds of tensors
def _dtype_itemsize(name: str) -> int | None:
    import torch

    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        return None
    return torch.empty((), dtype=value).element_size()


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_layout(m: Manifest) -> str | None:
    """What is wrong with the manifest's layout (pure), or None: every tensor has a
    known dtype and a shape of non-negative ints; every chunk names a device of the
    write group it was saved to (the manifest's, or its part's own: ``RankPart.devices``,
    a part then listed in ``dcp.remote_ranks``) and holds at most its stored size;
    each big tensor's chunks tile its bytes ``[0, numel * itemsize)`` exactly; each
    packed tensor's slot has exactly its bytes and lies inside its pack."""
    n_devices = max(len(m.devices), 1)
    if any(p.devices is not None for p in m.ranks):  # read from the mirror, never from here
        listed = (m.dcp or {}).get("remote_ranks")
        remote = set(listed) if isinstance(listed, list) else set()
        for p in m.ranks:
            if p.devices is not None and p.rank not in remote:
                return (f"part {p.prefix!r} was written to a write group of its own, but "
                        "the manifest does not list its rank in dcp.remote_ranks")
    chunks_by_key: dict[str, ChunkRecord] = {}
    pieces: dict[int, list[tuple[int, int]]] = {}
    for c in m.chunks:
        if not (_is_count(c.device) and _is_count(c.stored) and _is_count(c.offset)
                and _is_count(c.nbytes)):
            return f"chunk {c.key!r}: device, sizes and offset must be non-negative integers"
        own = m.group_elsewhere(c)
        if own is not None and c.device >= len(own):
            return (f"chunk {c.key!r} is on device {c.device}, but its part was saved over "
                    f"{len(own)} device(s)")
        if own is None and c.device >= n_devices:
            return (f"chunk {c.key!r} is on device {c.device}, but the snapshot was saved "
                    f"over {n_devices} device(s)")
        if c.nbytes > c.stored:
            return f"chunk {c.key!r} claims {c.nbytes} bytes of data in {c.stored} stored"
        chunks_by_key[c.key] = c
        if c.tensor is not None:
            pieces.setdefault(c.tensor, []).append((c.offset, c.nbytes))
    for t in m.tensors:
        size = _itemsize(t.dtype)
        if size is None:
            return f"tensor {t.key!r} has an unknown dtype {t.dtype!r}"
        if not isinstance(t.shape, tuple) or not all(_is_count(d) for d in t.shape):
            return f"tensor {t.key!r} has an invalid shape {list(t.shape)!r}"
        nbytes = size
        for d in t.shape:
            nbytes *= d
        if t.pack is not None:
            pack = chunks_by_key.get(f"{t.pack.array}/c.0")
            if pack is None or not (_is_count(t.pack.offset) and t.pack.nbytes == nbytes
                                    and t.pack.offset + nbytes <= pack.stored):
                return (f"tensor {t.key!r} ({t.dtype}{list(t.shape)}, {nbytes} bytes) does not "
                        f"match its pack slot {t.pack.array}@{t.pack.offset}+{t.pack.nbytes}")
            continue
        cursor = 0
        for offset, length in sorted(pieces.get(t.id, [])):
            if offset != cursor:
                break
            cursor += length
        covered = sum(length for _o, length in pieces.get(t.id, []))
        if cursor != nbytes or covered != nbytes:
            return (f"the chunks of tensor {t.key!r} do not cover its {nbytes} bytes "
                    f"({t.dtype}{list(t.shape)}) exactly: they hold {covered} bytes, "
                    f"contiguous up to {cursor}")
    return None


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
