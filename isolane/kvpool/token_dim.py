"""The token dimension of a KV tensor, shared by the embedded and the remote pool.

``token_dim`` indexes the KV tensor's shape as torch's ``dim`` arguments do: 0 is the
first dimension, -1 the last. A pool resolves it to a non-negative index against the
rank of the first KV tensor it sees (or of the namespace's stored layout), so pools
opened with ``token_dim=-3`` and ``token_dim=2`` on rank-5 tensors keep the same
layout and compute the same keys.
"""

from __future__ import annotations

from isolane.errors import InvalidArgumentError


def check_token_dim(token_dim: object) -> int:
    """``token_dim`` if it is a whole number (bools refused), else InvalidArgumentError."""
    if isinstance(token_dim, bool) or not isinstance(token_dim, int):
        raise InvalidArgumentError(f"token_dim must be a whole number (a dimension of the "
                                   f"KV tensor, negative counts from the end), got "
                                   f"{token_dim!r:.40}")
    return token_dim


def resolve_token_dim(token_dim: int, ndim: int) -> int:
    """``token_dim`` as an index into a shape of ``ndim`` dimensions (0 .. ndim-1)."""
    if not -ndim <= token_dim < ndim:
        raise InvalidArgumentError(
            f"token_dim={token_dim} is outside a KV tensor of {ndim} dimensions (valid: "
            f"{-ndim} to {ndim - 1}); pass the index of the tensor's token dimension")
    return token_dim % ndim
