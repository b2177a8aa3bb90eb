"""A chunk's bytes: filled from its tensors into a staging buffer, and hashed
(xxh3-128 of the bytes as stored, zero padding included). ``isolane.snapshot.stager``
does both for a save's chunks, ahead of the writes."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import xxhash

from isolane.snapshot.dtypes import as_bytes
from isolane.snapshot.plan import ChunkPlan
from isolane.storage.aligned import AlignedBuffer, copy_bytes, zero_bytes

Hashed = tuple[str, dict[int, str]]  # a chunk's hash and its pack pieces' hashes


def tensor_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU uint8 tensor, without a copy."""
    return memoryview(t.numpy())  # type: ignore[arg-type]


def chunk_hash(view: memoryview, pad: int = 0) -> str:
    h = xxhash.xxh3_128(view)
    if pad:
        h.update(bytes(pad))
    return h.hexdigest()


def staged_hashes(view: memoryview, chunk: ChunkPlan) -> tuple[str, dict[int, str]]:
    """The hash of a staged chunk (as stored) and, for a pack, of each tensor's bytes."""
    pieces = {p.tensor_id: chunk_hash(view[p.dst_offset:p.dst_offset + p.nbytes])
              for p in chunk.pieces} if chunk.is_pack else {}
    return chunk_hash(view[:chunk.stored_nbytes]), pieces


def source_hash(chunk: ChunkPlan, tensors: Mapping[int, torch.Tensor]) -> str | None:
    """The hash of a one-tensor chunk hashed where its CPU tensor lies (zero padding
    included: what ``staged_hashes`` gives once staged); None for packs and others."""
    if chunk.is_pack:
        return None
    piece = chunk.pieces[0]
    src = tensors[piece.tensor_id][piece.src_offset:piece.src_offset + piece.nbytes]
    if src.device.type != "cpu":
        return None
    return chunk_hash(tensor_view(src), chunk.stored_nbytes - chunk.data_nbytes)


def contiguous_bytes(t: torch.Tensor) -> torch.Tensor:
    return as_bytes(t.detach().contiguous())


def fill_chunk(buf: AlignedBuffer, chunk: ChunkPlan, tensors: Mapping[int, torch.Tensor]
               ) -> None:
    """Copy the chunk's pieces into ``buf`` and zero the gaps; CPU sources by
    ``memmove`` (GIL released, no OpenMP team per thread), others by ``copy_``."""
    cursor = 0
    dst: torch.Tensor | None = None
    for piece in chunk.pieces:
        zero_bytes(buf.address + cursor, piece.dst_offset - cursor)
        src = tensors[piece.tensor_id]
        if src.device.type == "cpu":
            copy_bytes(buf.address + piece.dst_offset, src.data_ptr() + piece.src_offset,
                       piece.nbytes)
        else:
            if dst is None:
                dst = torch.frombuffer(buf.view, dtype=torch.uint8, count=chunk.stored_nbytes)
            dst[piece.dst_offset:piece.dst_offset + piece.nbytes].copy_(
                src[piece.src_offset:piece.src_offset + piece.nbytes])
        cursor = piece.dst_offset + piece.nbytes
    zero_bytes(buf.address + cursor, chunk.stored_nbytes - cursor)

