"""Chain placement (pure): deterministic, spread, and stable when a node leaves."""

from __future__ import annotations

import hashlib
from collections import Counter

import pytest

from isolane.cluster.routing import RendezvousRouter, owner_of
from isolane.errors import InvalidArgumentError

NODES = [f"http://127.0.0.1:{7070 + i}" for i in range(4)]


def _key(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


def test_owner_is_a_pure_function_of_key_and_node_set() -> None:
    key = _key(1)
    assert owner_of(key, NODES) == owner_of(key, list(reversed(NODES)))
    # Pinned: a change of the hash would move every stored chain to another node.
    assert [owner_of(bytes([i]) * 16, NODES)[-4:] for i in range(5)] == [
        "7070", "7071", "7070", "7072", "7073"]


def test_chains_spread_over_the_nodes() -> None:
    counts = Counter(owner_of(_key(i), NODES) for i in range(4000))
    assert set(counts) == set(NODES)
    assert max(counts.values()) < 1.15 * 1000  # within 15 % of an even share


def test_a_node_leaving_moves_only_its_own_chains() -> None:
    before = {i: owner_of(_key(i), NODES) for i in range(2000)}
    after = {i: owner_of(_key(i), NODES[:-1]) for i in range(2000)}
    moved = [i for i in before if before[i] != after[i]]
    assert moved and all(before[i] == NODES[-1] for i in moved)


def test_a_router_routes_a_chain_by_its_first_key() -> None:
    router = RendezvousRouter(NODES)
    chain = [_key(i) for i in range(5)]
    assert router.owner(chain) == router.owner(chain[:1]) == owner_of(chain[0], NODES)
    with pytest.raises(InvalidArgumentError):
        router.owner([])
    with pytest.raises(InvalidArgumentError, match="listed twice"):
        RendezvousRouter([NODES[0], NODES[0]])
    with pytest.raises(InvalidArgumentError):
        owner_of(chain[0], [])
