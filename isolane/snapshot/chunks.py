"""A chunk's bytes: filled from its tensors into a staging buffer, and hashed
(xxh3-128 of the bytes as stored, zero padding included); ``stage_ahead`` does both
for a save's chunks on threads of its own, ahead of the writes."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import xxhash

from isolane.snapshot.dtypes import as_bytes
from isolane.snapshot.plan import ChunkPlan
from isolane.snapshot.staging import StagingPool
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


class _Stopped(Exception):
    """A chunk staged after the save failed: dropped, not an error of its own."""


def stage_ahead(chunks: Sequence[ChunkPlan], tensors: Mapping[int, torch.Tensor],
                staging: StagingPool, *, threads: int, window: int,
                linkable: Callable[[ChunkPlan, str], bool] | None,
                submit: Callable[[ChunkPlan, AlignedBuffer | None, Hashed], Future[Any] | None],
                failed: threading.Event, errors: list[BaseException]) -> None:
    """Copy and hash ``chunks`` in order on ``threads`` threads, each ``submit``-ted
    (to the write lane, which owns the buffer from there) once staged; at most
    ``window`` buffers out, each until its job is done. ``linkable(chunk, hash)``: the
    chunk is hashed where its tensor lies first and, when linkable, submitted with no
    buffer (no copy). A failure goes to ``errors`` and sets ``failed``, which stops the
    staging. Returns once every chunk was submitted or dropped."""
    # No prefill of the extra buffers here: a second prefill thread next to the store's
    # delayed a process's first write (0.63-0.69 s against 0.29-0.34 s).
    slots = threading.Semaphore(window)

    def stage(chunk: ChunkPlan, staged: AlignedBuffer) -> None:
        kept: AlignedBuffer | None = staged
        hashed: Hashed
        try:
            if failed.is_set():
                raise _Stopped
            digest = source_hash(chunk, tensors) if linkable is not None else None
            if digest is not None and linkable is not None and linkable(chunk, digest):
                staging.release(staged)
                kept, hashed = None, (digest, {})
            else:
                fill_chunk(staged, chunk, tensors)
                hashed = (digest, {}) if digest is not None else staged_hashes(staged.view,
                                                                                chunk)
        except BaseException as exc:
            if kept is not None:
                staging.release(kept)
            slots.release()
            if not isinstance(exc, _Stopped):
                errors.append(exc)
                failed.set()
            return
        try:
            fut = submit(chunk, kept, hashed)
        except BaseException as exc:  # the lane refused it (e.g. shut down under the save)
            if kept is not None:
                staging.release(kept)
            slots.release()  # else the loop below waits for a slot that never comes
            errors.append(exc)
            failed.set()
            return
        if fut is None:
            slots.release()
        else:
            fut.add_done_callback(lambda _f: slots.release())

    with ThreadPoolExecutor(threads, thread_name_prefix="isolane-stage") as pool:
        for chunk in chunks:
            slots.acquire()
            if failed.is_set():
                slots.release()
                break
            try:
                staged = staging.acquire(chunk.stored_nbytes)
            except BaseException as exc:  # out of memory: the chunks already out finish
                slots.release()
                errors.append(exc)
                failed.set()
                break
            pool.submit(stage, chunk, staged)
