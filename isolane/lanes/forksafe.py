"""Rebuild locks and threads in a forked child (DataLoader workers fork).

A lock that some other thread held at the moment of ``fork`` stays held forever in the
child, and the parent's threads do not exist there. Objects that own locks or threads
subclass ``ForkSafe`` and implement ``_after_fork_in_child``; one ``os.register_at_fork``
hook calls it on every live instance in the child before any other code runs.
"""

from __future__ import annotations

import os
import weakref


class ForkSafe:
    """Mixin: call ``super().__init__()`` last in ``__init__``."""

    def __init__(self) -> None:
        _live.add(self)

    def _after_fork_in_child(self) -> None:
        """Replace locks, forget the parent's threads and in-flight state."""
        raise NotImplementedError


_live: weakref.WeakSet[ForkSafe] = weakref.WeakSet()


def _reinit_all() -> None:
    for obj in list(_live):
        obj._after_fork_in_child()


if hasattr(os, "register_at_fork"):  # POSIX only; nothing forks elsewhere
    os.register_at_fork(after_in_child=_reinit_all)
