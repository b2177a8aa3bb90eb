"""Multi-rank snapshots as data (pure, no I/O, no collectives).

Each rank of a multi-rank save writes its own state dict under ``rank-<r>/`` of one
generation; rank 0 merges the ranks' partial manifests into one (``merge_parts``).
Loading with the saved world size gives each rank its own state dict back
(``rank_view``); any other world size sees rank 0's structure with every dim-0-split
tensor cut anew (``global_view``, ``row_range``, ``plan_row_slices``).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from isolane.errors import InvalidArgumentError
from isolane.snapshot.manifest import (
    ChunkRecord,
    Manifest,
    RankPart,
    ShardRef,
    SnapshotStats,
    TensorRecord,
)


@dataclass(frozen=True)
class Shard:
    """Says a saved tensor is rows ``[offset, offset + tensor.shape[0])`` of a tensor
    split along dim 0 that has ``total`` rows; every rank holds one such piece."""

    offset: int
    total: int

    @classmethod
    def even(cls, rank: int, world_size: int, total: int) -> Shard:
        """This rank's piece under ``torch.tensor_split(t, world_size)``."""
        return cls(row_range(total, rank, world_size)[0], total)


@dataclass(frozen=True)
class ChunkSlice:
    """Copy bytes ``[start, stop)`` of a chunk's data to ``dst_offset`` of the output."""

    chunk: ChunkRecord
    start: int
    stop: int
    dst_offset: int


@dataclass(frozen=True)
class PackedSlice:
    """Copy bytes ``[start, stop)`` of a packed (small) tensor to ``dst_offset``."""

    source: TensorRecord
    start: int
    stop: int
    dst_offset: int


def part_prefix(rank: int) -> str:
    return f"rank-{rank:05d}"


def row_range(total: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of ``rank``, split as ``torch.tensor_split`` does (the
    first ``total % world_size`` ranks get one row more)."""
    if not 0 <= rank < world_size:
        raise InvalidArgumentError(f"shard rank {rank} is outside [0, {world_size})")
    base, extra = divmod(total, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def check_shards(shards: Mapping[str, Shard], shapes: Mapping[str, tuple[int, ...]]
                 ) -> dict[str, ShardRef]:
    """Validate one rank's ``shards=`` against its tensors' shapes (dotted keys)."""
    out: dict[str, ShardRef] = {}
    for key, spec in shards.items():
        shape = shapes.get(key)
        if shape is None:
            raise InvalidArgumentError(f"shards names {key!r}, which is not a tensor of this "
                                       "rank's state dict; use the dotted key, e.g. 'model.w'")
        if not shape:
            raise InvalidArgumentError(f"shards[{key!r}]: a 0-d tensor cannot be split along "
                                       "dim 0")
        if not (spec.offset >= 0 and spec.offset + shape[0] <= spec.total):
            raise InvalidArgumentError(
                f"shards[{key!r}]: rows [{spec.offset}, {spec.offset + shape[0]}) do not fit "
                f"in a tensor of {spec.total} rows")
        out[key] = ShardRef(spec.offset, spec.total)
    return out


def merge_parts(parts: Sequence[Manifest], shards: Sequence[Mapping[str, ShardRef]], *,
                name: str, generation: str, committed_at: float, seconds: float,
                metadata: dict[str, Any], parent: dict[str, str] | None,
                devices: tuple[str, ...],
                part_devices: Mapping[int, tuple[str, ...]] | None = None) -> Manifest:
    """One manifest from every rank's partial one (``parts[r]`` from rank ``r``).

    Tensor ids are renumbered so that they are unique, chunk keys and array paths get
    the rank's folder in front; the top-level tree is rank 0's. ``devices`` is the
    write group of the manifest; ``part_devices`` names, by rank, the other write
    groups some parts were written to (another host's), in which their chunks'
    device indices count. Raises
    InvalidArgumentError when the pieces of a split tensor do not tile it exactly."""
    tensors: list[TensorRecord] = []
    chunks: list[ChunkRecord] = []
    ranks: list[RankPart] = []
    next_id = 0
    for rank, (part, refs) in enumerate(zip(parts, shards, strict=True)):
        folder = part_prefix(rank)
        base = next_id
        for t in part.tensors:
            pack = replace(t.pack, array=f"{folder}/{t.pack.array}") if t.pack else None
            tensors.append(replace(
                t, id=t.id + base, array=f"{folder}/{t.array}" if t.array else None,
                pack=pack, rank=rank, shard=refs.get(t.key)))
            next_id = max(next_id, t.id + base + 1)
        chunks.extend(replace(c, key=f"{folder}/{c.key}",
                              tensor=None if c.tensor is None else c.tensor + base)
                      for c in part.chunks)
        ranks.append(RankPart(rank, folder, _renumber(part.tree, base),
                              devices=(part_devices or {}).get(rank)))
    _check_tiling(tensors)
    stats = SnapshotStats(
        logical_bytes=sum(p.stats.logical_bytes for p in parts),
        stored_bytes=sum(p.stats.stored_bytes for p in parts),
        written_bytes=sum(p.stats.written_bytes for p in parts),
        linked_bytes=sum(p.stats.linked_bytes for p in parts), seconds=seconds)
    return Manifest(name=name, generation=generation, committed_at=committed_at,
                    tree=ranks[0].tree, tensors=tuple(tensors), chunks=tuple(chunks),
                    devices=devices, stats=stats, metadata=metadata, parent=parent,
                    ranks=tuple(ranks))


def rank_view(manifest: Manifest, rank: int) -> Manifest:
    """The snapshot as rank ``rank`` saved it (same world size)."""
    part = manifest.ranks[rank]
    return replace(manifest, tree=part.tree,
                   tensors=tuple(t for t in manifest.tensors if t.rank == rank))


def global_view(manifest: Manifest) -> tuple[Manifest, dict[int, tuple[TensorRecord, ...]]]:
    """Rank 0's structure with split tensors at their full shape, and for each split
    tensor (by rank 0's id) its pieces on every rank, in row order."""
    by_rank: dict[int, dict[str, TensorRecord]] = defaultdict(dict)
    for t in manifest.tensors:
        by_rank[t.rank or 0][t.key] = t
    own = by_rank[0]
    for rank in range(1, len(manifest.ranks)):
        extra = set(by_rank[rank]) - set(own)
        if extra:
            raise InvalidArgumentError(
                f"rank {rank} of snapshot '{manifest.name}' saved {sorted(extra)[0]!r}, which "
                f"rank 0 did not: load it with world size {len(manifest.ranks)} (each rank "
                "gets its own state dict back)")
    tensors: list[TensorRecord] = []
    sources: dict[int, tuple[TensorRecord, ...]] = {}
    for t in manifest.tensors:
        if t.rank not in (0, None):
            continue
        if t.shard is None:
            tensors.append(t)
            continue
        pieces = tuple(sorted((by_rank[r][t.key] for r in by_rank if t.key in by_rank[r]),
                              key=lambda p: p.shard.offset if p.shard else 0))
        sources[t.id] = pieces
        tensors.append(replace(t, shape=(t.shard.total, *t.shape[1:])))
    return replace(manifest, tensors=tuple(tensors)), sources


def plan_row_slices(pieces: Sequence[TensorRecord],
                    chunks_of: Mapping[int, Sequence[ChunkRecord]],
                    start: int, stop: int, row_bytes: int
                    ) -> tuple[list[ChunkSlice], list[PackedSlice]]:
    """Which bytes of which chunks hold rows ``[start, stop)`` of a split tensor, and
    where they go in a tensor of those rows. Chunks that hold none are not read."""
    chunk_slices: list[ChunkSlice] = []
    packed: list[PackedSlice] = []
    for piece in pieces:
        if piece.shard is None:
            continue
        lo = max(start, piece.shard.offset)
        hi = min(stop, piece.shard.offset + piece.shape[0])
        if lo >= hi or row_bytes == 0:
            continue
        a = (lo - piece.shard.offset) * row_bytes  # bytes of the piece wanted: [a, b)
        b = (hi - piece.shard.offset) * row_bytes
        dst = (lo - start) * row_bytes
        if piece.pack is not None:
            packed.append(PackedSlice(piece, a, b, dst))
            continue
        for chunk in chunks_of.get(piece.id, ()):
            ca, cb = max(a, chunk.offset), min(b, chunk.offset + chunk.nbytes)
            if ca < cb:
                chunk_slices.append(ChunkSlice(chunk, ca - chunk.offset, cb - chunk.offset,
                                               dst + ca - a))
    return chunk_slices, packed


def _check_tiling(tensors: Sequence[TensorRecord]) -> None:
    pieces: dict[str, list[tuple[ShardRef, TensorRecord]]] = defaultdict(list)
    for t in tensors:
        if t.shard is not None:
            pieces[t.key].append((t.shard, t))
    for key, group in pieces.items():
        group.sort(key=lambda item: item[0].offset)
        total, first = group[0][0].total, group[0][1]
        end = 0
        for shard, p in group:
            if (shard.total, p.dtype, p.shape[1:]) != (total, first.dtype, first.shape[1:]):
                raise InvalidArgumentError(
                    f"the pieces of {key!r} disagree on dtype, trailing shape or total rows "
                    f"(rank {first.rank}: {first.dtype}{list(first.shape)} of {total}, rank "
                    f"{p.rank}: {p.dtype}{list(p.shape)} of {shard.total}); pass the same "
                    "Shard total on every rank")
            if shard.offset != end:
                raise InvalidArgumentError(
                    f"the pieces of {key!r} leave a gap or overlap at row {end} (rank "
                    f"{p.rank} starts at {shard.offset}); each row must be on one rank")
            end = shard.offset + p.shape[0]
        if end != total:
            raise InvalidArgumentError(f"the pieces of {key!r} cover {end} of {total} rows")


def _renumber(tree: Any, base: int) -> Any:
    if isinstance(tree, dict):
        if tree.get("t") == "tensor":
            return {**tree, "id": tree["id"] + base}
        return {k: _renumber(v, base) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_renumber(v, base) for v in tree]
    return tree


def row_nbytes(shape: tuple[int, ...], itemsize: int) -> int:
    return math.prod(shape[1:]) * itemsize
