"""The KV pool API: one protocol every KV pool keeps, one token level for all of them.

``KVPoolAPI`` is what the embedded ``KVPool`` (``kvpool/pool.py``) and ``RemoteKVPool``
(``client/kv_pool.py``) both promise, and what the integrations (the transformers hook,
the vLLM connector) type their pool with; ``tests/contracts`` holds both to it.

``TokenLayer`` is the token level both pools inherit, written once over the block calls
each pool implements: tokens -> block keys (``keys.py``, seeded by the namespace and its
layout) -> ``put_blocks`` / ``lookup_blocks`` / ``delete_blocks`` and two reads of a
cached prefix (``_read_prefix`` into tensors, ``_prefetch_prefix`` to warm it). The
checks of a KV tensor against the namespace's layout (dtype, shape, ``token_dim``,
``token_dim.py``) and of an ``out`` tensor live here, so the two pools cannot disagree.

Call order: a namespace's layout is fixed by its first ``put`` (or known from storage);
before that ``block_keys`` is ``[]``, so lookups and gets miss and ``get_into`` fills
nothing. Thread-safety is the implementing pool's (both are thread-safe).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Protocol, overload, runtime_checkable

import torch

from isolane.errors import InvalidArgumentError
from isolane.kvpool.keys import KVContext, KVNamespace, TokenIds, block_keys, token_bytes
from isolane.kvpool.tiers.base import Block
from isolane.kvpool.token_dim import resolve_token_dim
from isolane.tensor_devices import unreadable_device

__all__ = ["Block", "BlockViews", "KVPoolAPI", "TokenLayer", "block_bytes_of", "shape_with_tokens"]

Layout = tuple[str, tuple[int, ...]]
"""``(dtype name, KV shape without its token dimension)``."""
Destinations = Callable[[int], Sequence[torch.Tensor]]
"""Given the number of blocks about to be read, a destination tensor (block shape) each."""


@runtime_checkable
class KVPoolAPI(Protocol):
    """What every KV pool offers: the embedded ``KVPool`` and ``RemoteKVPool``.

    Token level: ``put`` stores the KV of the full blocks of a prompt, ``lookup`` counts
    the tokens of its longest cached prefix (no data read), ``get`` returns them,
    ``get_into`` reads them into a tensor, ``prefetch`` warms them, ``delete`` drops them.
    Block level: the same on keys (``block_keys``) and raw block bytes. Bad input raises
    ``InvalidArgumentError``; unreachable storage reads as a miss.
    """

    namespace: str
    chunk_tokens: int
    token_dim: int

    @property
    def layout(self) -> Layout | None: ...

    def block_keys(self, token_ids: TokenIds, context: KVContext | None = None
                   ) -> list[bytes]: ...

    def put(self, token_ids: TokenIds, kv: torch.Tensor, *,
            context: KVContext | None = None) -> int: ...

    def lookup(self, token_ids: TokenIds, *, context: KVContext | None = None) -> int: ...

    def get(self, token_ids: TokenIds, *, context: KVContext | None = None
            ) -> tuple[int, torch.Tensor | None]: ...

    def get_into(self, token_ids: TokenIds, out: torch.Tensor, *,
                 context: KVContext | None = None) -> int: ...

    def prefetch(self, token_ids: TokenIds, *,
                 context: KVContext | None = None) -> Future[int]: ...

    def delete(self, token_ids: TokenIds, *, context: KVContext | None = None) -> int: ...

    def adopt_layout(self, dtype: str, shape: tuple[int, ...]) -> Layout: ...

    def put_blocks(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> int: ...

    def get_blocks(self, keys: Sequence[bytes]) -> Sequence[Block | None]: ...

    def get_blocks_into(self, keys: Sequence[bytes], dests: Sequence[torch.Tensor]) -> int: ...

    def lookup_blocks(self, keys: Sequence[bytes]) -> int: ...

    def delete_blocks(self, keys: Sequence[bytes]) -> int: ...

    def stats(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


class TokenLayer(ABC):
    """The token-level API over a pool's block calls (see the module docstring).

    A subclass sets ``namespace``, ``chunk_tokens``, ``token_dim`` (resolved to an index
    once the layout is known), ``tp_rank`` and ``tp_size``, and implements the abstract
    members below."""

    namespace: str
    chunk_tokens: int
    token_dim: int
    tp_rank: int
    tp_size: int
    _keyspace: KVNamespace | None = None

    # -- what a pool implements ----------------------------------------------------------
    @property
    @abstractmethod
    def layout(self) -> Layout | None:
        """``(dtype, shape without the token dimension)`` fixed by the first put, or None."""

    @abstractmethod
    def _adopt_layout(self, dtype: str, shape: tuple[int, ...], token_dim: int) -> Layout:
        """Fix the namespace's layout to this one unless it has one; return the
        namespace's layout (this one, or the one fixed before)."""

    @abstractmethod
    def put_blocks(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> int: ...

    @abstractmethod
    def lookup_blocks(self, keys: Sequence[bytes]) -> int: ...

    @abstractmethod
    def delete_blocks(self, keys: Sequence[bytes]) -> int: ...

    @abstractmethod
    def _read_prefix(self, keys: list[bytes], dests: Destinations) -> int:
        """Read the longest stored prefix of ``keys``: once the number ``n`` of blocks to
        read is known, ``dests(n)`` gives their destinations; returns how many leading
        blocks were filled (at most ``n``; 0 without calling ``dests`` on a miss)."""

    @abstractmethod
    def _prefetch_prefix(self, keys: list[bytes]) -> Future[int]:
        """Warm the stored prefix of ``keys`` in the background; its tokens."""

    @abstractmethod
    def _check_open(self) -> None:
        """InvalidArgumentError when the pool is closed."""

    # -- keys ------------------------------------------------------------------------------
    def block_keys(self, token_ids: TokenIds, context: KVContext | None = None
                   ) -> list[bytes]:
        """Keys of the full blocks of ``token_ids`` ([] while no layout is known)."""
        self._check_open()
        keyspace = self._keyspace
        if keyspace is None:
            layout = self.layout
            if layout is None:
                return []
            keyspace = self._keyspace = KVNamespace(
                model=self.namespace, dtype=layout[0],
                layout=shape_with_tokens(layout[1], self.token_dim, "T"),
                tp_rank=self.tp_rank, tp_size=self.tp_size)
        return block_keys(token_ids, self.chunk_tokens, keyspace, context)

    # -- block level over caller-chosen keys ----------------------------------------------
    def adopt_layout(self, dtype: str, shape: tuple[int, ...]) -> Layout:
        """Fix the namespace's layout (``dtype`` name, KV shape without its token
        dimension) unless it has one, as a first ``put`` would; returns the namespace's
        layout, which the caller compares with its own. For block-level users whose
        keys are not token chains (an engine's own page hashes)."""
        self._check_open()
        if not hasattr(torch, dtype) or not isinstance(getattr(torch, dtype), torch.dtype):
            raise InvalidArgumentError(f"{dtype!r} is not a torch dtype name (e.g. 'bfloat16')")
        known = self.layout
        if known is not None:
            return known
        dims = tuple(int(d) for d in shape)
        if any(d < 1 for d in dims):
            raise InvalidArgumentError(f"KV shape {list(shape)} has a dimension below 1")
        return self._adopt_layout(dtype, dims, resolve_token_dim(self.token_dim, len(dims) + 1))

    def get_blocks_into(self, keys: Sequence[bytes], dests: Sequence[torch.Tensor]) -> int:
        """Read the longest stored prefix of ``keys`` into ``dests`` (one tensor a key,
        each holding exactly one block's bytes in its C order, any dtype, shape and
        strides); returns how many leading blocks were filled. CPU destinations are
        read into in place, one contiguous run at a time (a strided view of a larger
        buffer needs no staging copy on the embedded pool). A damaged block reads as a
        miss and ends the prefix; destinations past the returned count may have been
        written."""
        if not self._check_dests(keys, dests):
            return 0
        return self._read_prefix([bytes(k) for k in keys], lambda n: dests[:n])

    def _check_dests(self, keys: Sequence[bytes], dests: Sequence[torch.Tensor]) -> bool:
        """Whether there is anything to read into ``dests`` (``get_blocks_into``'s
        checks: InvalidArgumentError for a count or size that does not fit)."""
        if len(keys) != len(dests):
            raise InvalidArgumentError(f"get_blocks_into got {len(keys)} keys and "
                                       f"{len(dests)} destinations")
        layout = self.layout
        if layout is None or not keys:
            return False
        size = math.prod(layout[1]) * self.chunk_tokens * getattr(torch, layout[0]).itemsize
        for dest in dests:
            if not isinstance(dest, torch.Tensor) or dest.numel() * dest.element_size() != size:
                got = (f"{dest.numel() * dest.element_size()} bytes"
                       if isinstance(dest, torch.Tensor) else type(dest).__name__)
                raise InvalidArgumentError(
                    f"a destination holds {got}; a block of namespace '{self.namespace}' "
                    f"is {size} bytes: pass one block-sized tensor per key")
        return True

    # -- token level -----------------------------------------------------------------------
    def put(self, token_ids: TokenIds, kv: torch.Tensor, *,
            context: KVContext | None = None) -> int:
        """Store the KV of ``token_ids`` (full blocks only); returns new blocks stored."""
        n_tokens = len(token_bytes(token_ids)) // 4
        if not isinstance(kv, torch.Tensor):
            raise InvalidArgumentError(f"kv must be a torch.Tensor, got {type(kv).__name__}")
        problem = unreadable_device(kv)
        if problem is not None:
            raise InvalidArgumentError(f"kv cannot be stored: {problem}; nothing was stored")
        dim = resolve_token_dim(self.token_dim, kv.dim())
        if kv.shape[dim] != n_tokens:
            raise InvalidArgumentError(
                f"kv has shape {list(kv.shape)}; its dimension {self.token_dim} (token_dim) "
                f"must equal the number of tokens, {n_tokens}")
        dtype = str(kv.dtype).removeprefix("torch.")
        shape = tuple(int(s) for i, s in enumerate(kv.shape) if i != dim)
        known = self._adopt_layout(dtype, shape, dim)
        if known != (dtype, shape):
            raise InvalidArgumentError(
                f"KV tensor of dtype {dtype} and shape {list(kv.shape)} does not match "
                f"namespace '{self.namespace}' (dtype {known[0]}, shape "
                f"{shape_with_tokens(known[1], self.token_dim, 'T')}); use another "
                "namespace for another model or layout")
        keys = self.block_keys(token_ids, context)
        if not keys:
            return 0
        ct = self.chunk_tokens
        return self.put_blocks(keys, [block_bytes_of(kv.narrow(dim, i * ct, ct))
                                      for i in range(len(keys))])

    def lookup(self, token_ids: TokenIds, *, context: KVContext | None = None) -> int:
        """Tokens of the longest cached prefix (no data read)."""
        return self.lookup_blocks(self.block_keys(token_ids, context)) * self.chunk_tokens

    def get(self, token_ids: TokenIds, *, context: KVContext | None = None
            ) -> tuple[int, torch.Tensor | None]:
        """``(n_tokens, kv)`` of the longest cached prefix; ``(0, None)`` on a miss."""
        keys = self.block_keys(token_ids, context)
        layout = self.layout
        if not keys or layout is None:
            return 0, None
        ct, dim = self.chunk_tokens, self.token_dim
        made: list[torch.Tensor] = []

        def dests(n: int) -> Sequence[torch.Tensor]:
            made.append(torch.empty(shape_with_tokens(layout[1], dim, n * ct),
                                    dtype=getattr(torch, layout[0])))
            return BlockViews(made[0], dim, ct, n)

        filled = self._read_prefix(keys, dests)
        if filled == 0 or not made:
            return 0, None
        out = made[0]
        if filled * ct < out.shape[dim]:  # a block went missing or was damaged meanwhile
            out = out.narrow(dim, 0, filled * ct).contiguous()
        return filled * ct, out

    def get_into(self, token_ids: TokenIds, out: torch.Tensor, *,
                 context: KVContext | None = None) -> int:
        """Fill the first cached-prefix tokens of ``out`` (token dim ``token_dim``) and
        return how many; an embedded pool reads the blocks straight into ``out``'s
        memory when it is a CPU tensor. Tokens of ``out`` past the returned count may
        have been written."""
        layout = self.layout
        if layout is None:
            return 0
        self._check_out(layout, out)
        ct, dim = self.chunk_tokens, self.token_dim
        room = out.shape[dim] // ct
        keys = self.block_keys(token_ids, context)[:room + 1]  # one more: is there more?

        def dests(n: int) -> Sequence[torch.Tensor]:
            if n > room:
                raise InvalidArgumentError(f"out holds {out.shape[dim]} tokens, the cached "
                                           "prefix has more; pass a tensor with room for "
                                           "the whole prompt")
            return BlockViews(out, dim, ct, n)

        return self._read_prefix(keys, dests) * ct

    def prefetch(self, token_ids: TokenIds, *,
                 context: KVContext | None = None) -> Future[int]:
        """Warm the cached prefix in the background (the embedded pool's memory tier, or
        the memory tiers of the nodes holding it); the Future gives its tokens."""
        return self._prefetch_prefix(self.block_keys(token_ids, context))

    def delete(self, token_ids: TokenIds, *, context: KVContext | None = None) -> int:
        """Drop every full block of ``token_ids``; returns how many were stored."""
        return self.delete_blocks(self.block_keys(token_ids, context))

    # -- checks ------------------------------------------------------------------------------
    def _check_out(self, layout: Layout, out: torch.Tensor) -> None:
        if not isinstance(out, torch.Tensor):
            raise InvalidArgumentError(f"out must be a torch.Tensor, got {type(out).__name__}")
        dtype_name, shape = layout
        dtype = str(out.dtype).removeprefix("torch.")
        got = tuple(s for i, s in enumerate(out.shape) if i != self.token_dim)
        if dtype != dtype_name or out.dim() != len(shape) + 1 or got != shape:
            raise InvalidArgumentError(
                f"out has dtype {dtype} and shape {list(out.shape)}; namespace "
                f"'{self.namespace}' stores dtype {dtype_name}, shape "
                f"{shape_with_tokens(shape, self.token_dim, 'T')}: allocate out with that "
                "dtype and shape")


class BlockViews(Sequence[torch.Tensor]):
    """The first ``n`` blocks of ``chunk_tokens`` tokens of ``tensor`` along ``dim``, each
    view made when it is asked for (by the thread that reads that block, not by the
    caller before the first read is issued: 256 ``narrow`` calls are ~0.3 ms)."""

    def __init__(self, tensor: torch.Tensor, dim: int, chunk_tokens: int, n: int) -> None:
        self._tensor, self._dim, self._ct, self._n = tensor, dim, chunk_tokens, n

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> torch.Tensor: ...

    @overload
    def __getitem__(self, i: slice) -> list[torch.Tensor]: ...

    def __getitem__(self, i: int | slice) -> torch.Tensor | list[torch.Tensor]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._n))]
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(f"block {i} of {self._n}")
        return self._tensor.narrow(self._dim, i * self._ct, self._ct)

    def strided(self) -> tuple[torch.Tensor, tuple[int, ...], int] | None:
        """(the tensor, a block's shape, bytes from a block's memory to the next one's):
        block 0 is the tensor's memory cut to a block's shape (same strides and storage
        offset, so no ``narrow`` is needed to describe it) and block i is block 0 moved
        by i steps, so its byte views need no torch call of their own
        (``reader.TensorTargets``); None when there are no blocks."""
        if not self._n:
            return None
        t, dim = self._tensor, self._dim
        shape = list(t.shape)
        shape[dim] = self._ct
        return t, tuple(shape), t.stride(dim) * self._ct * t.element_size()


def block_bytes_of(tensor: torch.Tensor) -> memoryview:
    """A block tensor's bytes in C order (copied only when not contiguous or not on CPU)."""
    t = tensor.detach()
    if t.device.type != "cpu" or not t.is_contiguous():
        t = t.contiguous().cpu()
    flat = t.reshape(-1).view(torch.uint8)  # every dtype views as bytes on torch 2.x
    return memoryview(flat.numpy()).cast("B")  # type: ignore[arg-type]


def shape_with_tokens(shape: tuple[int, ...], token_dim: int, tokens: int | str) -> Any:
    """The full KV shape: ``shape`` with ``tokens`` inserted at ``token_dim`` (a list),
    or with ``tokens`` as text (``"T"``) the layout text the keys hash: ``[2,2,T,4,8]``."""
    dims: list[Any] = list(shape)
    dims.insert(token_dim, tokens)
    return dims if isinstance(tokens, int) else "[" + ",".join(str(d) for d in dims) + "]"
