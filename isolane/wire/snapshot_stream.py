"""Snapshot streams on the wire: a save's upload and a restore's download (no I/O).

A stream is a JSON header (the state dict's tree, each tensor's dtype and shape, the
user's metadata, and the snapshot's chunks: which tensor bytes each holds), then every
chunk in the header's order, then an end marker. A chunk travels as its bytes as
stored (a big tensor's slice, or a pack of small tensors with their 64-byte alignment
gaps), cut after its last data byte, followed by its xxh3-128 content hash — the same
hash the manifest records, so the node hashes an upload once, as it writes it, and a
download is checked by the client against the manifest's hash (damage on disk or in
transit, named by tensor). An upload may send a chunk the node already holds as its
hash alone (``LINKED``): the node links it instead of receiving it again.
Tensors are dtype/shape metadata plus their C-contiguous bytes (bfloat16 and float8 as
their bits, complex as interleaved real/imaginary parts); nothing is pickled. Every
integer is little endian. Layout (``docs/FORMATS.md``, "Snapshot streams", version 2)::

    +----------+---------+-------+------------+-------------+
    | magic    | version | flags | header_len | header      |
    | ISOSNAPS | u16 = 2 | u16=0 | u32        | JSON, UTF-8 |
    +----------+---------+-------+------------+-------------+
    then for each entry of header["chunks"], in order:
    +-------+-------+--------+--------+-----------+
    | index | flags | nbytes | data   | hash      |   flags: 0 data, 1 LINKED
    | u32   | u32   | u64    | nbytes | 16 bytes  |   (LINKED: nbytes = 0)
    +-------+-------+--------+--------+-----------+
    then the end marker:
    +----------+---------+-------------+
    | ISOSNEND | count   | data_bytes  |   count = chunks, data_bytes = sum of nbytes
    | 8        | u64     | u64         |
    +----------+---------+-------------+

    header = {"format": "isolane-snapshot-stream", "version": 2, "name": ...,
              "metadata": {...}, "tree": <the manifest's tree>,
              "tensors": [{"id", "key", "dtype", "shape", "nbytes"}, ...],
              "chunks": [{"key", "stored", "nbytes", "pieces": [[tensor id,
                          src_offset, dst_offset, nbytes], ...]}, ...]}

A chunk's ``nbytes`` on the wire reach at least the end of its last piece (a download
sends a whole pack even when only some of its tensors are wanted); ``hash`` is
xxh3-128 of those bytes followed by ``stored - nbytes`` zero bytes (an edge chunk's padding), as
16 big-endian bytes (the manifest's hex digest). A receiver commits nothing before it
has read the end marker and checked every chunk: a truncated stream is never a snapshot.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import struct
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from isolane import bounded_json
from isolane.errors import PayloadTooLargeError, WireFormatError
from isolane.snapshot.dtypes import as_bytes, dtype_from_name, dtype_name, itemsize
from isolane.snapshot.manifest import ChunkRecord, Manifest
from isolane.snapshot.plan import SavePlan
from isolane.snapshot.tree import Json, TensorLeaf, dotted_key, tensor_ids
from isolane.wire.frames import Buffer
from isolane.wire.stream_limits import DEFAULT_LIMITS, StreamLimits

STREAM_MAGIC = b"ISOSNAPS"
END_MAGIC = b"ISOSNEND"
FORMAT = "isolane-snapshot-stream"
VERSION = 2
PREAMBLE = struct.Struct("<8sHHI")
CHUNK_HEADER = struct.Struct("<IIQ")
HASH_BYTES = 16
END = struct.Struct("<8sQQ")
LINKED = 1
MAX_HEADER_BYTES = 64 << 20

MAX_CHUNK_BYTES = 1 << 30  # what one chunk may hold (a receiver buffers one whole)
PIECE_BYTES = 4 << 20  # bytes are sent and received in pieces of this size
# HTTP: the stream's content type, where a manifest's snapshot lies on the node, and a
# download's generation (the client asks for the other parts of that one) and the
# number of parts the node splits it into (1: this stream carries every chunk).
CONTENT_TYPE = "application/x-isolane-snapshot-stream"
PATH_HEADER = "X-Isolane-Path"
GENERATION_HEADER = "X-Isolane-Generation"
PARTS_HEADER = "X-Isolane-Parts"
# An upload's plan: the plan_token a plan request answered, sent back with the upload
# (the node then neither plans nor decodes the header again), and the client's id,
# one per client store, that the node binds the plan to.
PLAN_HEADER = "X-Isolane-Plan"
CLIENT_HEADER = "X-Isolane-Client"
_DTYPE = re.compile(r"[a-z][a-z0-9_]{0,39}")
_KEY_PART = re.compile(r"[A-Za-z0-9._%+=@,~-]{1,200}")


@dataclass(frozen=True)
class TensorEntry:
    id: int
    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "key": self.key, "dtype": self.dtype,
                "shape": list(self.shape), "nbytes": self.nbytes}


@dataclass(frozen=True)
class PieceEntry:
    """``nbytes`` of tensor ``tensor`` at ``src_offset`` lie at ``dst_offset`` in the chunk."""

    tensor: int
    src_offset: int
    dst_offset: int
    nbytes: int


@dataclass(frozen=True)
class ChunkEntry:
    key: str  # the chunk's key in the snapshot (e.g. "model/w/c.0", "_packs/0/c.0")
    stored: int  # its size as stored (hashed with zero padding up to this)
    nbytes: int  # its bytes on the wire: at least up to the end of its last piece
    pieces: tuple[PieceEntry, ...]

    @property
    def single(self) -> PieceEntry | None:
        """The one piece when the chunk is a plain slice of one tensor, else None."""
        if len(self.pieces) == 1 and self.pieces[0].dst_offset == 0:
            return self.pieces[0]
        return None

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "stored": self.stored, "nbytes": self.nbytes,
                "pieces": [[p.tensor, p.src_offset, p.dst_offset, p.nbytes]
                           for p in self.pieces]}


@dataclass(frozen=True)
class StreamHeader:
    name: str
    tree: Json
    tensors: tuple[TensorEntry, ...]
    metadata: dict[str, Any]
    chunks: tuple[ChunkEntry, ...] = ()

    @property
    def data_bytes(self) -> int:
        """Tensor bytes the stream describes."""
        return sum(t.nbytes for t in self.tensors)

    def wire_bytes(self, linked: Collection[int] = ()) -> int:
        """Chunk bytes sent when the chunks at the indexes ``linked`` go as hashes."""
        return sum(c.nbytes for i, c in enumerate(self.chunks) if i not in linked)

    def stream_bytes(self, linked: Collection[int] = (),
                     only: Collection[int] | None = None) -> int:
        """Length of the whole stream (preamble to end marker); ``only``: of a part
        stream that carries the chunks at those indexes alone."""
        sent = range(len(self.chunks)) if only is None else only
        return (PREAMBLE.size + len(self.encode()) + END.size
                + len(sent) * (CHUNK_HEADER.size + HASH_BYTES)
                + sum(self.chunks[i].nbytes for i in sent if i not in linked))

    def with_chunks(self, chunks: Sequence[ChunkEntry]) -> StreamHeader:
        return StreamHeader(self.name, self.tree, self.tensors, self.metadata, tuple(chunks))

    def encode(self) -> bytes:
        return json.dumps({"format": FORMAT, "version": VERSION, "name": self.name,
                           "metadata": self.metadata, "tree": self.tree,
                           "tensors": [t.to_dict() for t in self.tensors],
                           "chunks": [c.to_dict() for c in self.chunks]},
                          separators=(",", ":"), allow_nan=False).encode()


def header_for(name: str, tree: Json, leaves: Sequence[TensorLeaf],
               metadata: Mapping[str, Any] | None,
               chunks: Sequence[ChunkEntry] = ()) -> StreamHeader:
    """The header of a stream carrying ``leaves`` (as ``flatten_state`` returns them)."""
    entries = tuple(
        TensorEntry(leaf.id, dotted_key(leaf.path), dtype_name(leaf.tensor.dtype),
                    tuple(leaf.tensor.shape), leaf.tensor.numel() * leaf.tensor.element_size())
        for leaf in leaves)
    return StreamHeader(name, tree, entries, dict(metadata or {}), tuple(chunks))


def tensor_chunks(entries: Sequence[TensorEntry], chunk_bytes: int = 64 << 20
                  ) -> tuple[ChunkEntry, ...]:
    """Chunks that cut each tensor into plain slices of at most ``chunk_bytes`` (for
    a stream of tensors that are not stored as chunks, e.g. a resharded restore)."""
    out = []
    for entry in entries:
        for start in range(0, max(entry.nbytes, 1), chunk_bytes):
            size = min(chunk_bytes, entry.nbytes - start)
            out.append(ChunkEntry(f"t{entry.id}/{start}", size, size,
                                  (PieceEntry(entry.id, start, 0, size),)))
    return tuple(out)


def plan_chunks(plan: SavePlan) -> tuple[ChunkEntry, ...]:
    """The chunks of a save plan as a stream lists them."""
    out = []
    for c in plan.chunks:
        pieces = tuple(PieceEntry(p.tensor_id, p.src_offset, p.dst_offset, p.nbytes)
                       for p in c.pieces)
        nbytes = max((p.dst_offset + p.nbytes for p in pieces), default=0)
        out.append(ChunkEntry(c.key, c.stored_nbytes, nbytes, pieces))
    return tuple(out)


def wire_bytes(record: ChunkRecord) -> int:
    """The bytes a stream sends of a stored chunk: a tensor chunk up to its last data
    byte, a pack whole."""
    return record.nbytes if record.tensor is not None else record.stored


def manifest_chunks(manifest: Manifest, ids: Collection[int]) -> tuple[ChunkEntry, ...]:
    """The chunks of a committed snapshot that hold the tensors ``ids`` (whole packs)."""
    in_pack: dict[str, list[PieceEntry]] = {}
    for t in manifest.tensors:
        if t.pack is not None and t.id in ids:
            in_pack.setdefault(t.pack.array, []).append(
                PieceEntry(t.id, 0, t.pack.offset, t.pack.nbytes))
    out = []
    for c in manifest.chunks:
        if c.tensor is not None:
            if c.tensor in ids:
                out.append(ChunkEntry(c.key, c.stored, wire_bytes(c),
                                      (PieceEntry(c.tensor, c.offset, 0, c.nbytes),)))
        else:
            array = c.key.rsplit("/", 1)[0]
            if array in in_pack:
                out.append(ChunkEntry(c.key, c.stored, wire_bytes(c), tuple(in_pack[array])))
    return tuple(out)


# -- encoding and checking ------------------------------------------------------------------
def encode_preamble(header: bytes) -> bytes:
    return PREAMBLE.pack(STREAM_MAGIC, VERSION, 0, len(header))


def decode_preamble(data: Buffer, max_header_bytes: int = MAX_HEADER_BYTES) -> int:
    """The header length; WireFormatError for anything but a version-2 stream."""
    magic, version, flags, length = PREAMBLE.unpack(data)
    if magic != STREAM_MAGIC:
        raise WireFormatError(f"not a snapshot stream: magic {bytes(magic)!r}, expected "
                              f"{STREAM_MAGIC!r} (docs/FORMATS.md)")
    if version != VERSION or flags:
        raise WireFormatError(f"snapshot stream version {version} (flags {flags}) is not "
                              f"supported; this isolane speaks version {VERSION} — update "
                              "the client and the node together")
    if length > max_header_bytes:
        raise PayloadTooLargeError("the snapshot stream header", length, max_header_bytes,
                                   field="node.max_header_bytes")
    return int(length)


def decode_header(data: Buffer, *, need_chunks: bool = True, partial: bool = False,
                  limits: StreamLimits = DEFAULT_LIMITS) -> StreamHeader:
    """Parse and check a header: known dtypes, sizes that match shapes, a tree whose
    tensors are exactly the listed ones (``partial``: at least those, as a download of
    some keys sends the whole tree), and (``need_chunks``) chunks that hold every
    tensor byte exactly once."""
    try:
        raw = bounded_json.loads(bytes(data), max_depth=limits.max_depth,
                                 what="snapshot stream header")
    except bounded_json.JsonTooDeepError as exc:
        raise WireFormatError(f"{exc}: raise {limits.config_section}.max_json_depth to "
                              "accept it") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise WireFormatError(f"snapshot stream header is not JSON: {exc}") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT or raw.get("version") != VERSION:
        raise WireFormatError(f"snapshot stream header must be a {FORMAT} version {VERSION} "
                              "object")
    name, metadata, tensors = raw.get("name"), raw.get("metadata", {}), raw.get("tensors")
    chunks = raw.get("chunks", [])
    if not isinstance(name, str) or not isinstance(metadata, dict) or not isinstance(
            tensors, list) or not isinstance(chunks, list):
        raise WireFormatError("snapshot stream header needs name (text), metadata (an "
                              "object), tensors and chunks (lists)")
    limits.check_counts(len(tensors), len(chunks), sum(
        len(c["pieces"]) if isinstance(c, dict) and isinstance(c.get("pieces"), list) else 0
        for c in chunks))
    entries = tuple(_entry(t) for t in tensors)
    ids = [e.id for e in entries]
    if len(set(ids)) != len(ids):
        raise WireFormatError("snapshot stream header lists a tensor id twice")
    try:
        in_tree = tensor_ids(raw.get("tree"), lambda _path: True)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        raise WireFormatError(f"snapshot stream header has a malformed tree ({exc!r:.80})"
                              ) from None
    if not (in_tree >= set(ids) if partial else in_tree == set(ids)):
        raise WireFormatError("the tree of the snapshot stream header names other tensors "
                              "than its tensor list")
    header = StreamHeader(name, raw["tree"], entries, metadata, decode_chunks(chunks))
    if need_chunks:
        check_coverage(header)
    return header


def decode_chunks(data: Any) -> tuple[ChunkEntry, ...]:
    """The ``chunks`` list of a header or of a node's plan answer, checked entry by entry
    (``check_coverage`` checks them against the tensors)."""
    if not isinstance(data, list):
        raise WireFormatError("the chunks of a snapshot stream are a list")
    return tuple(_chunk(c) for c in data)


def check_coverage(header: StreamHeader) -> None:
    """Every byte of every tensor in exactly one chunk piece (WireFormatError)."""
    sizes = {t.id: t for t in header.tensors}
    spans: dict[int, list[tuple[int, int]]] = {t.id: [] for t in header.tensors}
    for chunk in header.chunks:
        ends = []
        for p in chunk.pieces:
            entry = sizes.get(p.tensor)
            if entry is None or p.src_offset + p.nbytes > entry.nbytes:
                raise WireFormatError(f"chunk {chunk.key} of the snapshot stream holds bytes "
                                      f"of tensor {p.tensor} it does not have")
            if p.nbytes:
                spans[p.tensor].append((p.src_offset, p.src_offset + p.nbytes))
                ends.append((p.dst_offset, p.dst_offset + p.nbytes))
        ends.sort()
        if any(a[1] > b[0] for a, b in itertools.pairwise(ends)):
            raise WireFormatError(f"pieces of chunk {chunk.key} overlap")
    for tid, ranges in spans.items():
        ranges.sort()
        cursor = 0
        for start, end in ranges:
            if start != cursor:
                cursor = -1
                break
            cursor = end
        if cursor != sizes[tid].nbytes:
            raise WireFormatError(f"the chunks of the snapshot stream do not hold tensor "
                                  f"'{sizes[tid].key}' exactly once")


def _entry(data: Any) -> TensorEntry:
    if not isinstance(data, dict):
        raise WireFormatError("each tensor of a snapshot stream is an object")
    tid: Any = data.get("id")
    key: Any = data.get("key")
    dtype: Any = data.get("dtype")
    shape: Any = data.get("shape")
    nbytes: Any = data.get("nbytes")
    if (not _whole(tid) or not isinstance(key, str) or not isinstance(dtype, str)
            or not isinstance(shape, list) or not all(_whole(d) and d >= 0 for d in shape)
            or not _whole(nbytes) or tid < 0 or tid >= 1 << 32 or len(shape) > 64):
        raise WireFormatError(f"malformed tensor entry in a snapshot stream: {data!r:.120}")
    if _DTYPE.fullmatch(dtype) is None:
        raise WireFormatError(f"unknown dtype {dtype!r:.40} in a snapshot stream")
    try:
        size = itemsize(dtype_from_name(dtype))
    except ValueError as exc:
        raise WireFormatError(str(exc)) from None
    if nbytes != math.prod(shape) * size:
        raise WireFormatError(f"tensor '{key}' is {dtype}{shape}: {math.prod(shape) * size} "
                              f"bytes, but the stream says {nbytes}")
    return TensorEntry(tid, key, dtype, tuple(shape), nbytes)


def _chunk(data: Any) -> ChunkEntry:
    if not isinstance(data, dict):
        raise WireFormatError("each chunk of a snapshot stream is an object")
    key: Any = data.get("key")
    stored: Any = data.get("stored")
    nbytes: Any = data.get("nbytes")
    pieces: Any = data.get("pieces")
    if (not isinstance(key, str) or not _good_key(key) or not _whole(stored)
            or not 0 <= stored <= MAX_CHUNK_BYTES or not _whole(nbytes)
            or not 0 <= nbytes <= stored or not isinstance(pieces, list)
            or len(pieces) > 1 << 20):
        raise WireFormatError(f"malformed chunk entry in a snapshot stream: {data!r:.120} "
                              f"(stored at most {MAX_CHUNK_BYTES} bytes)")
    out = []
    for piece in pieces:
        if (not isinstance(piece, list) or len(piece) != 4
                or not all(_whole(v) and v >= 0 for v in piece)):
            raise WireFormatError(f"malformed piece {piece!r:.80} of chunk {key}")
        out.append(PieceEntry(*piece))
    entry = ChunkEntry(key, stored, nbytes, tuple(out))
    end = max((p.dst_offset + p.nbytes for p in out), default=0)
    if end > nbytes:
        raise WireFormatError(f"chunk {key} of a snapshot stream holds bytes up to {end} "
                              f"but sends {nbytes}")
    return entry


def part_indexes(count: int, part: int, parts: int) -> list[int]:
    """The chunk indexes part ``part`` of ``parts`` carries (a download over several
    connections): every ``parts``-th chunk, from ``part`` on, so that all parts walk
    the chunks in the same order and stay near each other on the disk."""
    return list(range(part, count, parts))


def encode_chunk_header(index: int, nbytes: int, *, linked: bool = False) -> bytes:
    return CHUNK_HEADER.pack(index, LINKED if linked else 0, 0 if linked else nbytes)


def check_chunk_header(data: Buffer, index: int, chunk: ChunkEntry) -> bool:
    """True when the chunk comes as its hash alone (LINKED); WireFormatError when it is
    not the chunk expected next."""
    got, flags, nbytes = CHUNK_HEADER.unpack(data)
    linked: bool = flags == LINKED
    if got != index or flags not in (0, LINKED) or nbytes != (0 if linked else chunk.nbytes):
        raise WireFormatError(f"snapshot stream out of order: expected chunk {index} "
                              f"({chunk.key}, {chunk.nbytes} bytes), got chunk {got} "
                              f"(flags {flags}) of {nbytes} bytes")
    return linked


def encode_end(count: int, data_bytes: int) -> bytes:
    return END.pack(END_MAGIC, count, data_bytes)


def check_end(data: Buffer, count: int, data_bytes: int) -> None:
    magic, got_count, got_bytes = END.unpack(data)
    if magic != END_MAGIC or got_count != count or got_bytes != data_bytes:
        raise WireFormatError("snapshot stream ends without a matching end marker; "
                              "nothing was committed")


def hash_bytes(hexdigest: str) -> bytes:
    """The 16 bytes on the wire for a manifest's hex digest."""
    return bytes.fromhex(hexdigest)


def hash_hex(data: Buffer) -> str:
    return bytes(data).hex()


def chunk_digest(view: Buffer, stored: int) -> str:
    """xxh3-128 of a chunk as stored: ``view`` then zero padding up to ``stored``."""
    h = xxhash.xxh3_128(view)
    pad = stored - len(view)
    while pad > 0:
        zeros = bytes(min(pad, 1 << 20))
        h.update(zeros)
        pad -= len(zeros)
    return h.hexdigest()


def chunk_view(chunk: ChunkEntry, tensors: Mapping[int, memoryview]) -> memoryview:
    """The chunk's wire bytes from tensor byte views: a slice where it is one, else
    assembled (packs: small)."""
    piece = chunk.single
    if piece is not None and piece.nbytes == chunk.nbytes:
        return tensors[piece.tensor][piece.src_offset:piece.src_offset + piece.nbytes]
    out = bytearray(chunk.nbytes)
    for p in chunk.pieces:
        out[p.dst_offset:p.dst_offset + p.nbytes] = tensors[p.tensor][
            p.src_offset:p.src_offset + p.nbytes]
    return memoryview(out)


# -- tensors -----------------------------------------------------------------------------
def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A CPU tensor's bytes in C order (copied only when not contiguous or not on CPU)."""
    t = tensor.detach()
    if t.device.type != "cpu" or not t.is_contiguous():
        t = t.contiguous().cpu()
    return memoryview(as_bytes(t).numpy()).cast("B")  # type: ignore[arg-type]


def empty_tensor(entry: TensorEntry) -> torch.Tensor:
    return torch.empty(entry.shape, dtype=dtype_from_name(entry.dtype))


def writable_bytes(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor (to receive into it directly)."""
    return memoryview(as_bytes(tensor).numpy()).cast("B")  # type: ignore[arg-type]


def pieces(view: memoryview, size: int = PIECE_BYTES) -> Iterator[memoryview]:
    for start in range(0, len(view), size):
        yield view[start:start + size]


def _good_key(key: str) -> bool:
    parts = key.split("/")
    return len(parts) <= 64 and all(
        _KEY_PART.fullmatch(p) is not None and p not in (".", "..") for p in parts)


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
