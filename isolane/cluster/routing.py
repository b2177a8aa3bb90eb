"""Which storage node holds a prompt's chain of KV blocks (pure, no I/O).

A chain is routed as a whole, so a prompt's blocks live on one node and are restored
there with sequential reads. The client asks a ``Router`` with the chain's leading
keys (first block first). ``RemoteKVPool`` routes with ``cluster.ClusterRouter`` (the
consistent-hash ring of ``isolane.cluster.ring``: bounded loads, moves on join/leave)
unless given another router, such as this module's ``RendezvousRouter``, which looks
at the first key only and keeps nothing in the background.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Protocol

from isolane.errors import InvalidArgumentError


class Router(Protocol):
    """Places chains on nodes. ``owner`` must be deterministic across processes."""

    @property
    def nodes(self) -> Sequence[str]: ...

    def owner(self, chain: Sequence[bytes]) -> str:
        """The node of the chain whose leading block keys are ``chain`` (non-empty)."""
        ...


def owner_of(first_key: bytes, nodes: Sequence[str]) -> str:
    """Rendezvous (highest random weight) hashing: the node ``n`` with the largest
    BLAKE2b-64 of ``utf8(n) || 0x00 || first_key``. Removing a node moves only its keys."""
    if not nodes:
        raise InvalidArgumentError("no storage nodes to route to; pass at least one URL")
    return max(nodes, key=lambda node: hashlib.blake2b(
        node.encode() + b"\0" + bytes(first_key), digest_size=8).digest())


class RendezvousRouter:
    """Routes a chain by its first key with ``owner_of``."""

    def __init__(self, nodes: Sequence[str]) -> None:
        if not nodes:
            raise InvalidArgumentError("no storage nodes to route to; pass at least one URL")
        if len(set(nodes)) != len(nodes):
            raise InvalidArgumentError(f"storage node listed twice in {list(nodes)}")
        self._nodes = tuple(nodes)

    @property
    def nodes(self) -> Sequence[str]:
        return self._nodes

    def owner(self, chain: Sequence[bytes]) -> str:
        if not chain:
            raise InvalidArgumentError("a chain needs at least one block key to be routed")
        return owner_of(chain[0], self._nodes)
