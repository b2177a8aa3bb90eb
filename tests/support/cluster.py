"""Helpers for cluster tests: waiting on a client's view of its nodes."""

from __future__ import annotations

import time
from collections.abc import Callable

from isolane.client.kv_pool import RemoteKVPool


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0,
               what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s} s")
        time.sleep(0.02)


def wait_up(pool: RemoteKVPool, *urls: str, timeout_s: float = 10.0) -> None:
    """Until the pool's probes see every one of ``urls`` (all its nodes by default) up."""
    cluster = pool.cluster
    assert cluster is not None
    wanted = urls or tuple(cluster.members)
    wait_until(lambda: all(cluster.is_up(u) for u in wanted), timeout_s,
               f"nodes {wanted} up in the client's view")
