"""Save planning: tensors -> zarr arrays, chunks and packs, striped over devices.

Pure logic, no I/O: ``plan_save`` turns tensor specs into a ``SavePlan`` that the
writer executes. Big tensors become one zarr array each, chunked along their leading
dimensions so that a chunk holds at most ``chunk_bytes`` (balanced, so that the edge
chunk wastes at most a few rows); small tensors are packed, 64-byte aligned, into
``_packs/<n>`` uint8 arrays so that a checkpoint is not thousands of tiny objects.
Chunks go to the device the parent snapshot used for the same chunk (so it can be
hard-linked) or else to the least-loaded device. The plan lists the packs' chunks
first: the order chunks are staged and written in.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

PACK_ALIGN = 64
PACKS_GROUP = "_packs"
_SAFE = re.compile(r"[A-Za-z0-9.\-]")


@dataclass(frozen=True)
class TensorSpec:
    id: int
    path: tuple[str, ...]
    dtype: str
    shape: tuple[int, ...]
    itemsize: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


@dataclass(frozen=True)
class Piece:
    """Copy ``nbytes`` of tensor ``tensor_id`` at ``src_offset`` to ``dst_offset`` in a chunk."""

    tensor_id: int
    src_offset: int
    dst_offset: int
    nbytes: int


@dataclass(frozen=True)
class ChunkPlan:
    array: str
    coords: tuple[int, ...]
    stored_nbytes: int
    pieces: tuple[Piece, ...]
    device: int

    @property
    def key(self) -> str:
        return f"{self.array}/{chunk_key(self.coords)}"

    @property
    def data_nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)

    @property
    def is_pack(self) -> bool:
        return self.array.startswith(PACKS_GROUP + "/")


@dataclass(frozen=True)
class ArrayPlan:
    path: str
    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    torch_dtype: str
    itemsize: int
    tensor_id: int | None  # None for a pack


@dataclass(frozen=True)
class PackSlot:
    array: str
    offset: int
    nbytes: int


@dataclass(frozen=True)
class SavePlan:
    arrays: tuple[ArrayPlan, ...]
    chunks: tuple[ChunkPlan, ...]
    packed: Mapping[int, PackSlot]
    array_of: Mapping[int, str]
    groups: tuple[str, ...]

    @property
    def stored_nbytes(self) -> int:
        return sum(c.stored_nbytes for c in self.chunks)


def chunk_key(coords: tuple[int, ...]) -> str:
    """zarr v3 'default' chunk key encoding with the '.' separator: ``c.0.3``."""
    return "c" if not coords else "c." + ".".join(str(c) for c in coords)


def plan_chunk_shape(shape: tuple[int, ...], itemsize: int, chunk_bytes: int) -> tuple[int, ...]:
    """Largest C-contiguous chunk of at most ``chunk_bytes``, balanced along its split dim."""
    chunk = list(shape)
    inner = itemsize
    for dim in range(len(shape) - 1, -1, -1):
        if inner * max(shape[dim], 1) <= chunk_bytes:
            inner *= max(shape[dim], 1)
            chunk[dim] = max(shape[dim], 1)
            continue
        rows = max(1, chunk_bytes // inner)
        n_chunks = math.ceil(shape[dim] / rows)
        chunk[dim] = math.ceil(shape[dim] / n_chunks)
        for outer in range(dim):
            chunk[outer] = 1
        break
    return tuple(chunk)


def array_path(path: Sequence[object], taken: set[str]) -> str:
    """A zarr node path for a state-dict key path: parts escaped, '/'-joined, unique.

    ``taken`` holds the paths given out and, each ending in '/', their folders, so the
    check is a set lookup (planning stays linear in the number of tensors)."""
    parts = [_escape(str(p)) for p in path] or ["value"]
    candidate = "/".join(parts)
    n = 1
    while candidate in taken or candidate + "/" in taken:
        candidate = "/".join(parts) + f"~{n}"
        n += 1
    taken.add(candidate)
    folder = candidate
    while "/" in folder:
        folder = folder.rsplit("/", 1)[0]
        taken.add(folder + "/")
    return candidate


def _escape(part: str) -> str:
    out = "".join(ch if _SAFE.fullmatch(ch) else f"%{ord(ch):02X}" for ch in part) or "%"
    if out.startswith((".", "_", "c.")) or out == "c":
        out = f"%{ord(out[0]):02X}{out[1:]}"
    return out


def plan_save(
    tensors: Sequence[TensorSpec],
    *,
    n_devices: int,
    chunk_bytes: int,
    pack_threshold: int,
    parent_devices: Mapping[str, int] | None = None,
) -> SavePlan:
    """Plan arrays, chunks and packs; ``parent_devices`` maps chunk keys to devices."""
    parent_devices = parent_devices or {}
    load = [0] * n_devices
    arrays: list[ArrayPlan] = []
    chunks: list[ChunkPlan] = []
    packed: dict[int, PackSlot] = {}
    array_of: dict[int, str] = {}
    taken: set[str] = {PACKS_GROUP}

    def place(key: str, nbytes: int) -> int:
        device = parent_devices.get(key)
        if device is None or not 0 <= device < n_devices:
            device = min(range(n_devices), key=lambda d: (load[d], d))
        load[device] += nbytes
        return device

    small: list[TensorSpec] = []
    big: list[TensorSpec] = []
    for t in tensors:
        (small if t.nbytes < pack_threshold or not t.shape or 0 in t.shape else big).append(t)
    for spec in big:
        path = array_path(spec.path, taken)
        array_of[spec.id] = path
        cshape = plan_chunk_shape(spec.shape, spec.itemsize, chunk_bytes)
        arrays.append(ArrayPlan(path, spec.shape, cshape, spec.dtype, spec.itemsize, spec.id))
        chunk_elems = math.prod(cshape)
        grid = [math.ceil(s / c) for s, c in zip(spec.shape, cshape, strict=True)]
        for ordinal in range(math.prod(grid)):
            coords = _unravel(ordinal, grid)
            # Only the split dim (and those before it, of chunk size 1) vary, so the
            # chunk is one contiguous run of the tensor's bytes.
            start = sum(c * cs * st for c, cs, st in
                        zip(coords, cshape, _strides(spec.shape), strict=True))
            valid = math.prod(min(cs, s - c * cs)
                              for c, cs, s in zip(coords, cshape, spec.shape, strict=True))
            key = f"{path}/{chunk_key(coords)}"
            stored = chunk_elems * spec.itemsize
            chunks.append(ChunkPlan(
                path, coords, stored,
                (Piece(spec.id, start * spec.itemsize, 0, valid * spec.itemsize),),
                place(key, stored)))
    pack_pieces: list[Piece] = []
    pack_fill = 0
    n_packs = 0

    def seal_pack() -> None:
        nonlocal pack_pieces, pack_fill, n_packs
        if not pack_pieces:
            return
        path = f"{PACKS_GROUP}/{n_packs}"
        n_packs += 1
        arrays.append(ArrayPlan(path, (pack_fill,), (pack_fill,), "uint8", 1, None))
        chunks.append(ChunkPlan(path, (0,), pack_fill, tuple(pack_pieces),
                                place(f"{path}/c.0", pack_fill)))
        for piece in pack_pieces:
            packed[piece.tensor_id] = PackSlot(path, piece.dst_offset, piece.nbytes)
        pack_pieces, pack_fill = [], 0

    for spec in small:
        offset = -(-pack_fill // PACK_ALIGN) * PACK_ALIGN
        if pack_pieces and offset + spec.nbytes > chunk_bytes:
            seal_pack()
            offset = 0
        pack_pieces.append(Piece(spec.id, 0, offset, spec.nbytes))
        pack_fill = offset + spec.nbytes
    if pack_pieces and pack_fill == 0:
        pack_fill = 1  # a pack of empty / zero-byte tensors still gets a valid array
    seal_pack()
    groups = sorted({"/".join(a.path.split("/")[:i]) for a in arrays
                     for i in range(1, a.path.count("/") + 1)})
    # Packs first: they are always written (never linked), so in an incremental save,
    # where the small tensors change (adapters, optimizer steps) and the big ones are
    # mostly linked, their writes run while the big chunks are hashed, not after.
    order = [c for c in chunks if c.is_pack] + [c for c in chunks if not c.is_pack]
    return SavePlan(tuple(arrays), tuple(order), packed, array_of, tuple(groups))


def _strides(shape: tuple[int, ...]) -> list[int]:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= size
    return strides[::-1]


def _unravel(ordinal: int, grid: list[int]) -> tuple[int, ...]:
    coords = []
    for size in reversed(grid):
        coords.append(ordinal % size)
        ordinal //= size
    return tuple(reversed(coords))


def interleave_by_device(chunks: Sequence[ChunkPlan], n_devices: int) -> list[ChunkPlan]:
    """Interleave chunks by device so every device has requests in flight."""
    if n_devices == 1:
        return list(chunks)
    queues: list[list[ChunkPlan]] = [[] for _ in range(n_devices)]
    for chunk in chunks:
        queues[chunk.device].append(chunk)
    out: list[ChunkPlan] = []
    for i in range(max(len(q) for q in queues)):
        out.extend(q[i] for q in queues if i < len(q))
    return out
