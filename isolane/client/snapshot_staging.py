"""Client-side staging of ``RemoteSnapshotStore.save_async``: copies of the caller's
tensors, so that it may change them while the upload runs."""

from __future__ import annotations

import builtins
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from isolane.snapshot.tree import TensorLeaf, dotted_key, flatten_state, unflatten_state
from isolane.storage.aligned import copy_bytes

COPY_THREADS = 2  # save_async staging copies run on this many threads
COPY_PIECE_BYTES = 8 << 20  # in pieces of this size (smaller tensors: copy_)


class ClientStaging:
    """Copies of a state dict's tensors for ``save_async``, reused save after save when
    keys, dtypes and shapes repeat (fresh memory costs a page fault per page). CPU
    tensors are copied by ``memmove`` in pieces on ``COPY_THREADS`` threads (GIL
    released, as the embedded store's staging copies): ~2x ``Tensor.copy_`` here. Not
    thread-safe: the store stages one save at a time."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, tuple[int, ...]], torch.Tensor] = {}
        self._copiers: ThreadPoolExecutor | None = None

    def stage(self, state_dict: Any) -> Any:
        """The state dict with every tensor copied (ties kept); the copies stay with
        the staging until the next ``stage``."""
        tree, leaves = flatten_state(state_dict)
        keep: dict[tuple[str, torch.dtype, tuple[int, ...]], torch.Tensor] = {}
        copies: dict[int, torch.Tensor] = {}
        moves: builtins.list[tuple[int, int, int]] = []
        for leaf in leaves:
            copies[leaf.id] = self._copy(leaf, keep, moves)
        if moves:
            if self._copiers is None:
                self._copiers = ThreadPoolExecutor(COPY_THREADS,
                                                   thread_name_prefix="isolane-stage")
            list(self._copiers.map(lambda m: copy_bytes(*m), moves))
        self._buffers = keep
        return unflatten_state(tree, copies.__getitem__)

    def _copy(self, leaf: TensorLeaf, keep: dict[tuple[str, torch.dtype, tuple[int, ...]],
                                                 torch.Tensor],
              moves: builtins.list[tuple[int, int, int]]) -> torch.Tensor:
        src = leaf.tensor.detach()
        slot = (dotted_key(leaf.path), src.dtype, tuple(src.shape))
        buf = self._buffers.get(slot)
        if buf is None:
            buf = torch.empty(src.shape, dtype=src.dtype)
        nbytes = src.numel() * src.element_size()
        if src.device.type == "cpu" and src.is_contiguous() and nbytes >= COPY_PIECE_BYTES:
            for start in range(0, nbytes, COPY_PIECE_BYTES):
                moves.append((buf.data_ptr() + start, src.data_ptr() + start,
                              min(COPY_PIECE_BYTES, nbytes - start)))
        else:
            buf.copy_(src)
        keep[slot] = buf
        return buf

    def clear(self) -> None:
        self._buffers = {}
        if self._copiers is not None:
            self._copiers.shutdown(wait=True)
            self._copiers = None
