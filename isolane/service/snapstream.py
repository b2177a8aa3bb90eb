"""Snapshot streams on the wire: a save's upload and a restore's download (no I/O).

A stream is a JSON header (the state dict's tree, each tensor's dtype and shape, the
user's metadata) followed by every tensor's raw bytes in the header's order, and an
end marker. Tensors travel as dtype/shape metadata plus their C-contiguous bytes
(bfloat16 and float8 as their bits, complex as interleaved real/imaginary parts);
nothing is pickled. Every integer is little endian; checksums are xxh3-64 (seed 0).
Layout (``docs/FORMATS.md``, "Storage node wire format", version 1)::

    +----------+---------+-------+------------+-------------+
    | magic    | version | flags | header_len | header      |
    | ISOSNAPS | u16 = 1 | u16=0 | u32        | JSON, UTF-8 |
    +----------+---------+-------+------------+-------------+
    then for each entry of header["tensors"], in order:
    +-----------+----------+--------+--------+----------+
    | tensor id | reserved | nbytes | data   | checksum |
    | u32       | u32 = 0  | u64    | nbytes | u64      |
    +-----------+----------+--------+--------+----------+
    then the end marker:
    +----------+---------+-------------+
    | ISOSNEND | count   | total_bytes |
    | 8        | u64     | u64         |
    +----------+---------+-------------+

    header = {"format": "isolane-snapshot-stream", "version": 1, "name": ...,
              "metadata": {...}, "tree": <the manifest's tree>,
              "tensors": [{"id", "key", "dtype", "shape", "nbytes"}, ...]}

A receiver commits nothing before it has read the end marker and checked every
tensor's length and checksum: a truncated stream is never a snapshot.
"""

from __future__ import annotations

import json
import math
import mmap
import re
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from isolane.errors import WireFormatError
from isolane.service.frames import Buffer
from isolane.snapshot.dtypes import as_bytes, dtype_from_name, dtype_name, itemsize
from isolane.snapshot.tree import Json, TensorLeaf, dotted_key, tensor_ids

STREAM_MAGIC = b"ISOSNAPS"
END_MAGIC = b"ISOSNEND"
FORMAT = "isolane-snapshot-stream"
VERSION = 1
PREAMBLE = struct.Struct("<8sHHI")
TENSOR_HEADER = struct.Struct("<IIQ")
CHECKSUM = struct.Struct("<Q")
END = struct.Struct("<8sQQ")
MAX_HEADER_BYTES = 64 << 20
PIECE_BYTES = 4 << 20  # tensor bytes are sent and received in pieces of this size
_DTYPE = re.compile(r"[a-z][a-z0-9_]{0,39}")


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
class StreamHeader:
    name: str
    tree: Json
    tensors: tuple[TensorEntry, ...]
    metadata: dict[str, Any]

    @property
    def data_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def stream_bytes(self) -> int:
        """Length of the whole stream (preamble to end marker)."""
        return (PREAMBLE.size + len(self.encode()) + END.size + sum(
            TENSOR_HEADER.size + t.nbytes + CHECKSUM.size for t in self.tensors))

    def encode(self) -> bytes:
        return json.dumps({"format": FORMAT, "version": VERSION, "name": self.name,
                           "metadata": self.metadata, "tree": self.tree,
                           "tensors": [t.to_dict() for t in self.tensors]},
                          separators=(",", ":"), allow_nan=False).encode()


def header_for(name: str, tree: Json, leaves: list[TensorLeaf],
               metadata: Mapping[str, Any] | None) -> StreamHeader:
    """The header of a stream carrying ``leaves`` (as ``flatten_state`` returns them)."""
    entries = tuple(
        TensorEntry(leaf.id, dotted_key(leaf.path), dtype_name(leaf.tensor.dtype),
                    tuple(leaf.tensor.shape), leaf.tensor.numel() * leaf.tensor.element_size())
        for leaf in leaves)
    return StreamHeader(name, tree, entries, dict(metadata or {}))


def encode_preamble(header: bytes) -> bytes:
    return PREAMBLE.pack(STREAM_MAGIC, VERSION, 0, len(header))


def decode_preamble(data: Buffer) -> int:
    """The header length; WireFormatError for anything but a version-1 stream."""
    magic, version, flags, length = PREAMBLE.unpack(data)
    if magic != STREAM_MAGIC:
        raise WireFormatError(f"not a snapshot stream: magic {bytes(magic)!r}, expected "
                              f"{STREAM_MAGIC!r} (docs/FORMATS.md)")
    if version != VERSION or flags:
        raise WireFormatError(f"snapshot stream version {version} (flags {flags}) is not "
                              f"supported; this isolane speaks version {VERSION}")
    if length > MAX_HEADER_BYTES:
        raise WireFormatError(f"snapshot stream header of {length} bytes is over the limit "
                              f"of {MAX_HEADER_BYTES}")
    return int(length)


def decode_header(data: Buffer) -> StreamHeader:
    """Parse and check a header: known dtypes, sizes that match shapes, and a tree whose
    tensors are exactly the listed ones."""
    try:
        raw = json.loads(bytes(data))
    except (UnicodeDecodeError, ValueError) as exc:
        raise WireFormatError(f"snapshot stream header is not JSON: {exc}") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT or raw.get("version") != VERSION:
        raise WireFormatError(f"snapshot stream header must be a {FORMAT} version {VERSION} "
                              "object")
    name, metadata, tensors = raw.get("name"), raw.get("metadata", {}), raw.get("tensors")
    if not isinstance(name, str) or not isinstance(metadata, dict) or not isinstance(
            tensors, list):
        raise WireFormatError("snapshot stream header needs name (text), metadata (an "
                              "object) and tensors (a list)")
    entries = tuple(_entry(t) for t in tensors)
    ids = [e.id for e in entries]
    if len(set(ids)) != len(ids):
        raise WireFormatError("snapshot stream header lists a tensor id twice")
    try:
        in_tree = tensor_ids(raw.get("tree"), lambda _path: True)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        raise WireFormatError(f"snapshot stream header has a malformed tree ({exc!r:.80})"
                              ) from None
    if in_tree != set(ids):
        raise WireFormatError("the tree of the snapshot stream header names other tensors "
                              "than its tensor list")
    return StreamHeader(name, raw["tree"], entries, metadata)


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


def encode_tensor_header(entry: TensorEntry) -> bytes:
    return TENSOR_HEADER.pack(entry.id, 0, entry.nbytes)


def check_tensor_header(data: Buffer, entry: TensorEntry) -> None:
    tid, reserved, nbytes = TENSOR_HEADER.unpack(data)
    if tid != entry.id or reserved or nbytes != entry.nbytes:
        raise WireFormatError(f"snapshot stream out of order: expected tensor {entry.id} "
                              f"('{entry.key}', {entry.nbytes} bytes), got tensor {tid} of "
                              f"{nbytes} bytes")


def encode_end(header: StreamHeader) -> bytes:
    return END.pack(END_MAGIC, len(header.tensors), header.data_bytes)


def check_end(data: Buffer, header: StreamHeader) -> None:
    magic, count, total = END.unpack(data)
    if magic != END_MAGIC or count != len(header.tensors) or total != header.data_bytes:
        raise WireFormatError("snapshot stream ends without a matching end marker; "
                              "nothing was committed")


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


def tensor_from_buffer(buffer: Buffer | mmap.mmap, offset: int, entry: TensorEntry
                       ) -> torch.Tensor:
    """A tensor viewing ``entry.nbytes`` bytes of ``buffer`` at ``offset`` (no copy)."""
    if entry.nbytes == 0:
        return empty_tensor(entry)
    raw = torch.frombuffer(buffer, dtype=torch.uint8, count=entry.nbytes, offset=offset)
    dtype = dtype_from_name(entry.dtype)
    if dtype.is_complex:
        real = raw.view(torch.float32 if dtype == torch.complex64 else torch.float64)
        return torch.view_as_complex(real.view(-1, 2)).view(entry.shape)
    width = itemsize(dtype)
    if width > 1:  # bit-cast through an integer of the same width (as dtypes.as_bytes)
        raw = raw.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[width])
    return raw.view(dtype).view(entry.shape)


def pieces(view: memoryview, size: int = PIECE_BYTES) -> Iterator[memoryview]:
    for start in range(0, len(view), size):
        yield view[start:start + size]


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
