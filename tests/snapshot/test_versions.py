"""TensorVersions: change detection by tensor identity, safe against its own callbacks."""

from __future__ import annotations

import threading
from typing import Any

import torch

from isolane.snapshot.versions import TensorVersions


def _in_thread(fn: Any, timeout_s: float = 10.0) -> bool:
    """Whether ``fn`` returned within ``timeout_s`` (a daemon thread: a deadlock does not
    hang the test run)."""
    done = threading.Event()

    def run() -> None:
        fn()
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return done.wait(timeout_s)


def test_a_tensor_freed_while_remember_holds_the_lock_does_not_deadlock() -> None:
    # The soak once hung a remote trainer for ever: garbage collection ran inside
    # remember()'s locked section, freed a remembered tensor, and that tensor's weakref
    # callback waited for the same lock ("Garbage-collecting" in versions.forget, called
    # from versions.remember). Here the tensor is freed inside the locked section by
    # replacing the only record that still holds it, the same path without the collector.
    versions = TensorVersions()
    owner, inner = torch.ones(2), torch.ones(3)
    versions.remember(inner, ("sig",), "g1", ("h",))
    versions.remember(owner, ("sig",), "g1", (inner,))  # type: ignore[arg-type]
    del inner  # the record of ``owner`` holds its last reference now

    assert _in_thread(lambda: versions.remember(owner, ("sig",), "g2", ("h2",)))
    assert versions.unchanged(owner, ("sig",), "g2") == ("h2",)


def test_records_of_freed_tensors_go_and_live_ones_stay() -> None:
    versions = TensorVersions()
    kept = torch.ones(2)
    versions.remember(kept, ("sig",), "g", ("a",))
    for _ in range(100):
        versions.remember(torch.ones(2), ("sig",), "g", ("b",))
    assert versions.unchanged(kept, ("sig",), "g") == ("a",)
    assert versions.unchanged(kept, ("other",), "g") is None
    assert versions.unchanged(kept, ("sig",), "another generation") is None
    assert len(versions) <= 2  # the 100 freed tensors' records are gone
