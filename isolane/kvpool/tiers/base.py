"""The tier seam of the KV pool: one interface for memory, disk and capacity.

A ``KVPool`` holds its tiers as an ordered list, fastest first (``MemoryTier``, the
``DiskTier`` over the segment logs of all the read group's devices, the optional
``CapacityTier``). A get walks them in that order and stops at the first tier that has a
block; the pool then writes the hit back into the faster tiers (memory, and local disk
for a capacity hit). No tier calls back into the pool, and a tier never calls another
tier.

Every tier answers the read side of the same interface: ``contains_many`` (an index
probe, no data read), ``get_many`` (checked bytes or None), ``read_into`` (into tensors
of the block's shape; by default ``get_many`` and a copy) and ``delete_many``. How a tier
plans its reads is its own business: the disk tier locates, coalesces and cuts pieces
inside ``read_into``, the pool never sees a plan. Tiers that take blocks one by one
(memory, disk) are ``WritableTier``s with ``put_many``; the capacity tier is filled by
demotion of whole sealed segments instead.
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch

Block = bytes | memoryview
"""A block's bytes as a tier hands them out (read-only)."""


class Tier(ABC):
    """One level of the KV pool (see the module docstring). Thread-safe."""

    name: str

    @abstractmethod
    def contains_many(self, keys: Sequence[bytes]) -> npt.NDArray[np.bool_]:
        """Whether each key is held here (no data read)."""

    @abstractmethod
    def get_many(self, keys: Sequence[bytes]) -> list[Block | None]:
        """Each block's bytes (checked), None where it is not here or was damaged."""

    def read_into(self, keys: Sequence[bytes], dests: Sequence[torch.Tensor]) -> list[bool]:
        """Fill ``dests[i]`` (a tensor of the block's shape and dtype) with block
        ``keys[i]``; which were filled. The default reads with ``get_many`` and copies."""
        done = [False] * len(keys)
        for i, block in enumerate(self.get_many(keys) if keys else []):
            if block is not None:
                copy_block(block, dests[i])
                done[i] = True
        return done

    @abstractmethod
    def delete_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Drop these blocks; which of them were held here."""

    @abstractmethod
    def __len__(self) -> int:
        """Blocks held."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes held."""


class WritableTier(Tier):
    """A tier that takes blocks one by one (memory, disk)."""

    @abstractmethod
    def put_many(self, keys: Sequence[bytes], values: Sequence[Block]) -> int:
        """Store these blocks (keys not held yet); returns how many were stored."""


def copy_block(block: Block, dest: torch.Tensor) -> None:
    """Copy a block's bytes (C order of ``dest``'s shape) into ``dest``, any strides."""
    with warnings.catch_warnings():  # read-only buffers: the view is only copied from
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(block, dtype=torch.uint8)
    dest.copy_(raw.view(dest.dtype).view(dest.shape))
