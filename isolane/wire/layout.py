"""A KV namespace's layout as a node and its clients agree on it (pure, no torch).

The embedded ``KVPool`` fixes a namespace's dtype and block shape on its first
token-level put. Over the wire the client registers them first (``PUT /v1/kv/{ns}``,
JSON), so that a node can size-check every block it is sent and a later embedded or
remote pool computes the same keys:

    {"dtype": "bfloat16", "shape": [32, 2, 8, 128], "chunk_tokens": 256, "token_dim": 2}

``shape`` is the KV tensor's shape *without* its token dimension; the token dimension
sits at index ``token_dim`` of the full shape. A block is ``chunk_tokens`` tokens, so
it holds ``chunk_tokens * prod(shape) * itemsize(dtype)`` bytes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from isolane.errors import InvalidArgumentError

# torch dtype name -> bytes per element (what torch.empty((), dtype).element_size() says).
ITEMSIZE: dict[str, int] = {
    "bool": 1, "uint8": 1, "int8": 1,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    "int16": 2, "uint16": 2, "float16": 2, "bfloat16": 2,
    "int32": 4, "uint32": 4, "float32": 4,
    "int64": 8, "uint64": 8, "float64": 8, "complex64": 8,
    "complex128": 16,
}
MAX_DIMS = 8
MAX_CHUNK_TOKENS = 1 << 20


@dataclass(frozen=True)
class NamespaceLayout:
    dtype: str
    shape: tuple[int, ...]
    chunk_tokens: int
    token_dim: int = 2

    def __post_init__(self) -> None:
        if self.dtype not in ITEMSIZE:
            raise InvalidArgumentError(f"layout.dtype {self.dtype!r:.40} is not a KV dtype "
                                       f"isolane knows; use one of {', '.join(ITEMSIZE)}")
        if (not isinstance(self.shape, tuple) or not 1 <= len(self.shape) <= MAX_DIMS
                or any(not _whole(d) or d < 1 for d in self.shape)):
            raise InvalidArgumentError(
                f"layout.shape must list 1-{MAX_DIMS} positive whole numbers (the KV "
                f"tensor's shape without its token dimension), got {self.shape!r:.80}")
        if not _whole(self.chunk_tokens) or not 1 <= self.chunk_tokens <= MAX_CHUNK_TOKENS:
            raise InvalidArgumentError(f"layout.chunk_tokens must be 1-{MAX_CHUNK_TOKENS}, "
                                       f"got {self.chunk_tokens!r:.40}")
        if not _whole(self.token_dim) or not 0 <= self.token_dim <= len(self.shape):
            raise InvalidArgumentError(
                f"layout.token_dim must be 0-{len(self.shape)} (an index into the full KV "
                f"shape), got {self.token_dim!r:.40}")

    @property
    def block_bytes(self) -> int:
        return self.chunk_tokens * math.prod(self.shape) * ITEMSIZE[self.dtype]

    def full_shape(self, tokens: int) -> tuple[int, ...]:
        """The KV tensor's shape holding ``tokens`` tokens."""
        dims = list(self.shape)
        dims.insert(self.token_dim, tokens)
        return tuple(dims)

    def text(self) -> str:
        """The layout as ``KVNamespace.layout`` hashes it, e.g. ``[2,2,T,4,8]`` (what the
        embedded pool derives from its first put, so both compute the same keys)."""
        dims: list[str] = [str(d) for d in self.shape]
        dims.insert(self.token_dim, "T")
        return "[" + ",".join(dims) + "]"

    def to_dict(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": list(self.shape),
                "chunk_tokens": self.chunk_tokens, "token_dim": self.token_dim}

    @classmethod
    def from_dict(cls, data: Any) -> NamespaceLayout:
        if not isinstance(data, Mapping):
            raise InvalidArgumentError("a namespace layout is a JSON object with dtype, "
                                       "shape, chunk_tokens and token_dim")
        unknown = set(data) - {"dtype", "shape", "chunk_tokens", "token_dim"}
        if unknown:
            raise InvalidArgumentError(f"unknown layout field(s) {sorted(unknown)!r:.80}; "
                                       "known: dtype, shape, chunk_tokens, token_dim")
        shape = data.get("shape")
        return cls(dtype=data.get("dtype"),  # type: ignore[arg-type]  # checked in __post_init__
                   shape=tuple(shape) if isinstance(shape, list) else shape,  # type: ignore[arg-type]
                   chunk_tokens=data.get("chunk_tokens"),  # type: ignore[arg-type]
                   token_dim=data.get("token_dim", 2))


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
