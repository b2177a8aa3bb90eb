"""MembershipFollower: a cluster client's ring driven by the members registered in etcd.

What a person did by hand with a static ``cluster.nodes`` list (``add_node`` on one
client, ``add_node(move=False)`` on the others, ``complete_move`` once the first one's
``wait_moves`` returned) happens here on every change etcd reports
(``cluster.etcd_membership.MembershipWatch``):

- a node that registers joins the router's ring at once for writes, but counts as
  down until the client's probes get an answer from it (a registered URL that does not
  answer gets no traffic); a node whose key goes (clean stop, or lease expired) leaves;
- reads fall back to the previous rings while the move is pending;
- one client, elected through an etcd lock, runs the moves (``ChainMover``) and, when
  they are done, records the ring complete in etcd; every other client stops falling
  back when it sees that record for the ring it routes with.

The ring never empties: when every node is gone the last one stays (down: its chains
read as misses) until a node registers again.

Thread-safe: changes, elections and completions are serialised by one lock.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from isolane.client.mover import ChainMover
from isolane.cluster.etcd_client import EtcdClient
from isolane.cluster.etcd_membership import MembershipWatch
from isolane.cluster.etcd_records import ring_signature
from isolane.cluster.ring import NodePlacement
from isolane.cluster.router import ClusterRouter
from isolane.errors import AuthenticationError, EtcdUnavailableError, InvalidArgumentError

log = logging.getLogger(__name__)


class MembershipFollower:
    """Follows the members under ``client``'s prefix (module docstring). Call order:
    ``members = open(...)``, build the router on them, ``bind``, ``close``."""

    def __init__(self, client: EtcdClient, *, ttl_s: int) -> None:
        self._lock = threading.RLock()
        self._members: dict[str, float] = {}
        self.router: ClusterRouter | None = None
        self.mover: ChainMover | None = None
        self.watch = MembershipWatch(client, ttl_s=ttl_s, on_members=self.on_members,
                                     on_done=self.on_done, want_lock=self.want_lock,
                                     on_elected=self.on_elected)
        self.changes = 0
        self._probing = True

    def open(self, fallback: Sequence[str] = ()) -> dict[str, float]:
        """The members registered now (url -> weight). etcd not answering: ``fallback``
        (the static list) with a warning when given, else ``EtcdUnavailableError``. No
        member registered: ``InvalidArgumentError`` saying how to start one."""
        url = self.watch.client.target.url
        try:
            members = self.watch.start()
        except (EtcdUnavailableError, AuthenticationError) as exc:
            if not fallback:
                raise EtcdUnavailableError(url, f"{exc}; a client needs etcd at start to "
                                           "learn the nodes (or set cluster.etcd."
                                           "static_fallback with cluster.nodes)") from None
            log.warning("etcd %s unavailable at start: using the static list %s until it "
                        "answers (%s)", url, list(fallback), exc)
            self.watch.start_disconnected(exc)
            members = {node: 1.0 for node in fallback}
        if not members:
            raise InvalidArgumentError(
                f"no storage node is registered in etcd {url}; start one with "
                f"'isolane serve --cluster {url}'")
        self._members = dict(members)
        return dict(members)

    def bind(self, router: ClusterRouter, mover: ChainMover, *, probing: bool = True) -> None:
        """Start following: changes from now on reach ``router`` and ``mover``.
        ``probing``: the client probes its nodes (a new node waits for a probe's answer
        before it gets traffic; without probes it gets traffic at once)."""
        self.router, self.mover = router, mover
        self._probing = probing
        self.watch.run()

    # -- MembershipWatch callbacks ---------------------------------------------------------
    def on_members(self, members: dict[str, float]) -> None:
        router, mover = self.router, self.mover
        if router is None or mover is None:
            return
        with self._lock:
            for url, weight in sorted(members.items()):
                if self._members.get(url) == weight:
                    continue
                joined = url not in self._members
                old, new = router.join(url, weight)
                if joined and self._probing:
                    router.failed(url)  # no traffic until a probe answers
                    log.info("node %s joined (etcd)", url)
                self._members[url] = weight
                self._moved(old, new)
            for url in sorted(set(self._members) - set(members)):
                if len(self._members) == 1:
                    log.warning("every node left etcd; keeping %s in the ring (down) until "
                                "one registers", url)
                    router.failed(url)
                    break
                old, new = router.leave(url)
                del self._members[url]
                log.info("node %s left (etcd)", url)
                self._moved(old, new)
            self.changes += 1

    def _moved(self, old: NodePlacement, new: NodePlacement) -> None:
        if self.watch.is_mover and self.mover is not None:
            self.mover.rebalance(old, new)

    def on_done(self, ring: str) -> None:
        router, watch = self.router, self.watch
        if router is None:
            return
        with self._lock:
            if not watch.is_mover and ring == ring_signature(self._members) \
                    and router.moving:
                router.complete_move()
                log.info("moves to ring %s complete (recorded in etcd)", ring)

    def want_lock(self) -> str | None:
        router = self.router
        if router is None or not router.moving:
            return None
        with self._lock:
            return ring_signature(self._members)

    def on_elected(self, ring: str) -> None:
        router, mover = self.router, self.mover
        if router is None or mover is None:
            return
        with self._lock:
            current = router.ring
            previous = router.previous
            for ring_before in reversed(previous):
                mover.rebalance(ring_before, current)
            if not previous:
                self._record_done()

    def moves_done(self) -> None:
        """The mover's ``on_done``: every queued rebalance finished."""
        router, mover = self.router, self.mover
        if router is None or mover is None:
            return
        with self._lock:
            if mover.rebalancing:
                return  # a change arrived meanwhile: its moves complete later
            router.complete_move()
            self._record_done()

    def _record_done(self) -> None:
        if self.watch.is_mover:
            self.watch.record_done(ring_signature(self._members))

    # -- state -----------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        out = self.watch.describe()
        with self._lock:
            out["ring"] = ring_signature(self._members)
            out["changes"] = self.changes
        return out

    def close(self) -> None:
        self.watch.close()
