"""Leases of the multi-rank saves begun on this node (``isolane.node.snapshot_parts``).

DCP never calls ``finish`` when a rank fails or dies, so nobody tells the node that a
save it began is over. Each save begun here holds a lease, renewed by every request of
that save (a rank's plan, its part's upload for as long as it streams, the commit). A
save whose lease ran out (``node.part_save_lease_s`` since its last request ended, and
none in flight) is abandoned: ``expired`` hands it to the node's sweeper, which discards
its generation, and a late part or commit of it is refused (409). A save begun by an
earlier process of this node has no lease here and is refused as well (its marker names
a dead process, so ``isolane gc`` sweeps it).

No I/O; thread-safe (handlers on the event loop, the sweeper in a worker thread).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from isolane.errors import ConflictError, InvalidArgumentError

SaveKey = tuple[str, str]  # (name, generation)
MAX_SWEEP_PERIOD_S = 60.0


@dataclass
class _Lease:
    renewed: float  # when its last request ended (the clock's seconds)
    holders: int = 0  # requests of the save in flight


class PartLeases:
    """The open multi-rank saves of this node process and when each was last touched."""

    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not lease_s > 0:
            raise InvalidArgumentError(f"a part save's lease must be positive, got {lease_s}")
        self.lease_s = lease_s
        self._clock = clock
        self._lock = threading.Lock()
        self._leases: dict[SaveKey, _Lease] = {}
        self.abandoned = 0  # saves whose lease ran out, since the node started

    @property
    def sweep_period_s(self) -> float:
        """How often the sweeper looks: a quarter of the lease, at most a minute."""
        return min(self.lease_s / 4, MAX_SWEEP_PERIOD_S)

    def grant(self, name: str, generation: str) -> None:
        """A save was begun: its lease starts now."""
        with self._lock:
            self._leases[(name, generation)] = _Lease(self._clock())

    @contextmanager
    def hold(self, name: str, generation: str) -> Iterator[None]:
        """A request of the save is in flight: the lease cannot run out until it ends,
        and is renewed then. ConflictError when the save holds no lease here."""
        with self._lock:
            lease = self._leases.get((name, generation))
            if lease is None:
                raise ConflictError(
                    f"generation {generation} of '{name}' is not a save in progress on "
                    "this node (committed, abandoned past node.part_save_lease_s, begun "
                    "before the node restarted, or never begun): begin one with "
                    f"POST /v1/snapshots/{name}/parts")
            lease.holders += 1
        try:
            yield
        finally:
            with self._lock:
                lease.holders -= 1
                lease.renewed = self._clock()

    def end(self, name: str, generation: str) -> None:
        """The save committed or was discarded: it needs no lease."""
        with self._lock:
            self._leases.pop((name, generation), None)

    def expired(self) -> list[SaveKey]:
        """The saves whose lease ran out, taken out of the table (a request of theirs
        that comes later is refused): the caller discards them."""
        now = self._clock()
        with self._lock:
            gone = [key for key, lease in self._leases.items()
                    if lease.holders == 0 and now - lease.renewed > self.lease_s]
            for key in gone:
                del self._leases[key]
            self.abandoned += len(gone)
        return gone

    def to_dict(self) -> dict[str, float | int]:
        """For the node's stats: open saves, abandoned ones, the lease."""
        with self._lock:
            return {"open": len(self._leases), "abandoned": self.abandoned,
                    "lease_s": self.lease_s}

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)
