"""Cluster membership kept in etcd: a node's registration under a lease, a client's
watch of the members, and the election of the one client that moves chains.

**Nodes** (:class:`NodeRegistration`): ``start`` grants a lease of ``ttl_s`` seconds and
creates the node's key under it (``etcd_records``) in one transaction; a key for the
same URL held by another process that keeps it for a whole TTL refuses the start
(``ConflictError``: two nodes cannot be one URL; a dead node's key expires meanwhile,
so a node restarted at once on its old port gets its URL back). A thread refreshes the
lease every ``ttl_s / 3``; when etcd no longer knows it (the node was stopped longer
than the TTL, or etcd lost it) the node registers anew, and while etcd does not answer
it keeps serving and retries each second (logged once).
``close`` revokes the lease: a clean stop leaves at once. Expiry is decided by etcd's
clock alone (a lease's TTL counts on the server), so clock skew between nodes and etcd
does not move it.

**Clients** (:class:`MembershipWatch`): ``start`` reads the members once (raising
``EtcdUnavailableError`` when etcd does not answer), then a thread watches the prefix
and calls ``on_members`` with the whole member map after each change, ``on_done`` with
the ring a mover recorded complete. When the watch breaks (etcd restarted or gone) the
last members stay in force, which is logged once and shown by ``describe``; the thread
reads the prefix again once etcd answers and watches on from there. Malformed values
are ignored with one warning each.

**Election**: a second thread ticks every ``tick_s``; while ``want_lock()`` says a move
is pending and this client is not the mover, it tries to create ``move/lock`` under
its own lease (granted then, refreshed each tick while held). The winner is told by
``on_elected``; it records the move with ``record_done(ring)``, which also releases the
lock. A mover that dies loses its lease, the lock with it, and the next tick elects
another client.

Thread-safe. Callbacks run on the watch or tick thread, never under this module's
locks.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from isolane.cluster.etcd_client import (
    EtcdAuth,
    EtcdClient,
    EtcdRequestError,
    KeyValue,
    WatchEvent,
    parse_etcd_url,
)
from isolane.cluster.etcd_records import (
    MOVE_DONE,
    MOVE_LOCK,
    MoveRecord,
    NodeRecord,
    RecordError,
    node_key,
    url_of_node_key,
)
from isolane.errors import AuthenticationError, ConflictError, EtcdUnavailableError

if TYPE_CHECKING:
    from isolane.config import EtcdConfig

log = logging.getLogger(__name__)
PASSWORD_ENV = "ISOLANE_ETCD_PASSWORD"
ETCD_FAILURES = (EtcdUnavailableError, EtcdRequestError, AuthenticationError)
"""What a call to etcd raises when it does not do what was asked (logged, retried)."""
RETRY_S = 1.0  # between attempts while etcd does not answer


def client_for(etcd: EtcdConfig, *, timeout_s: float = 2.0) -> EtcdClient:
    """The client of ``cluster.etcd`` (password: the config's, else $ISOLANE_ETCD_PASSWORD)."""
    password = etcd.password if etcd.password is not None else os.environ.get(PASSWORD_ENV)
    auth = EtcdAuth(user=etcd.user, password=password, ca_file=etcd.ca_file,
                    cert_file=etcd.cert_file, key_file=etcd.key_file)
    return EtcdClient(parse_etcd_url(etcd.url), auth, timeout_s=timeout_s)


class NodeRegistration:
    """One node's key in etcd (module docstring). ``url``: the address clients reach the
    node at."""

    def __init__(self, client: EtcdClient, url: str, *, ttl_s: int, weight: float = 1.0
                 ) -> None:
        self.client = client
        self.ttl_s = ttl_s
        self.record = NodeRecord(url, weight, time.time(), uuid.uuid4().hex, os.getpid())
        self.key = node_key(client.target.prefix, url)
        self._lease = 0
        self._registered_at: float | None = None  # monotonic
        self._registrations = 0
        self._error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """Register now (raises ``EtcdUnavailableError`` or ``ConflictError``), then keep
        the lease alive in the background."""
        self._register()
        self._thread = threading.Thread(target=self._run, name="isolane-etcd-lease",
                                        daemon=True)
        self._thread.start()

    def _register(self) -> None:
        # A key held by another instance may be a live node, or the stale key of a node
        # that died (or of this URL's previous process) whose lease has not run out yet:
        # wait one TTL for it to expire; a live holder keeps it, and is refused.
        deadline = time.monotonic() + self.ttl_s + 1.0
        while True:
            lease = self.client.grant(self.ttl_s)
            existing = self.client.create(self.key, self.record.encode(), lease=lease)
            if existing is None:
                break
            if _instance(existing, self.record.url) == self.record.instance:
                self.client.put(self.key, self.record.encode(), lease=lease)
                break
            with contextlib.suppress(EtcdRequestError):
                self.client.revoke(lease)
            if time.monotonic() > deadline or self._stop.wait(0.25):
                holder = _describe_holder(existing, self.record.url)
                raise ConflictError(
                    f"node URL {self.record.url} is already registered in etcd "
                    f"{self.client.target.url} by another node ({holder or 'unreadable'}), "
                    f"which kept it for {self.ttl_s} s; give this node another "
                    "--port/--advertise-url, or stop the other one")
        with self._lock:
            self._lease = lease
            self._registered_at = time.monotonic()
            self._registrations += 1
            self._error = None
        log.info("registered %s in etcd %s (lease %x, ttl %d s)", self.record.url,
                 self.client.target.url, lease, self.ttl_s)

    def _run(self) -> None:
        period = max(0.2, self.ttl_s / 3)
        while not self._stop.wait(period if self._error is None else RETRY_S):
            try:
                ttl = self.client.keepalive(self._lease) if self._lease else 0
                if ttl <= 0:
                    if self._error is None:
                        log.warning("etcd lease of %s expired; registering again",
                                    self.record.url)
                    self._register()
                elif self._error is not None:
                    log.info("etcd %s answers again; %s is registered",
                             self.client.target.url, self.record.url)
                    self._error = None
            except (*ETCD_FAILURES, ConflictError) as exc:
                if self._error is None:
                    log.warning("node %s cannot refresh its etcd registration (keeps "
                                "serving, retrying every %.0f s): %s", self.record.url,
                                RETRY_S, exc)
                with self._lock:
                    self._error = str(exc)
                    if isinstance(exc, ConflictError):
                        self._lease = 0

    def close(self) -> None:
        """Withdraw: stop refreshing and revoke the lease (its key goes with it)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._lease:
            try:
                self.client.revoke(self._lease)
            except ETCD_FAILURES as exc:
                log.warning("could not withdraw %s from etcd (it leaves when its lease "
                            "expires, within %d s): %s", self.record.url, self.ttl_s, exc)
            self._lease = 0

    def describe(self) -> dict[str, Any]:
        """JSON-able: the node's membership as it stands (``/v1/stats`` ``cluster``)."""
        with self._lock:
            at = self._registered_at
            return {"source": "etcd", "etcd": self.client.target.url, "url": self.record.url,
                    "registered": self._error is None and bool(self._lease),
                    "lease_id": f"{self._lease:x}", "lease_ttl_s": self.ttl_s,
                    "lease_age_s": None if at is None else round(time.monotonic() - at, 3),
                    "registrations": self._registrations, "error": self._error}


def _describe_holder(kv: KeyValue, url: str) -> str | None:
    try:
        record = NodeRecord.decode(url, kv.value)
    except RecordError:
        return None
    return f"pid {record.pid}, instance {record.instance[:8]}"


def _instance(kv: KeyValue, url: str) -> str | None:
    try:
        return NodeRecord.decode(url, kv.value).instance
    except RecordError:
        return None


class MembershipWatch:
    """A client's view of the members in etcd (module docstring). Callbacks:
    ``on_members(url -> weight)`` after every change, ``on_done(ring)`` when a mover
    records a ring complete, ``want_lock() -> ring or None`` asked each tick,
    ``on_elected(ring)`` once this client holds the move lock."""

    def __init__(self, client: EtcdClient, *, ttl_s: int,
                 on_members: Callable[[dict[str, float]], None],
                 on_done: Callable[[str], None],
                 want_lock: Callable[[], str | None],
                 on_elected: Callable[[str], None], tick_s: float = 0.5) -> None:
        self.client = client
        self.prefix = client.target.prefix
        self.ttl_s = ttl_s
        self.tick_s = tick_s
        self.client_id = uuid.uuid4().hex
        self._on_members, self._on_done = on_members, on_done
        self._want_lock, self._on_elected = want_lock, on_elected
        self._records: dict[str, NodeRecord] = {}
        self._warned: set[tuple[str, int]] = set()
        self._revision = 0
        self._connected = True
        self._disconnected_at: float | None = None
        self._lease = 0
        self._lock_ring: str | None = None
        self._done_ring: str | None = None
        self._stop = threading.Event()
        self._mutex = threading.Lock()
        self._stream: Any = None
        self._threads: list[threading.Thread] = []

    # -- life ------------------------------------------------------------------------------
    def start(self) -> dict[str, float]:
        """Read the members (raises ``EtcdUnavailableError``); ``run`` watches next."""
        self._read_all()
        return self.members()

    def start_disconnected(self, error: Exception) -> None:
        """Begin without etcd (the caller uses a static list meanwhile); ``run`` reads
        the members once etcd answers."""
        self._lost(error)

    def run(self) -> None:
        """Watch and take part in elections in the background (after ``start``)."""
        for target, name in ((self._watch_loop, "isolane-etcd-watch"),
                             (self._tick_loop, "isolane-etcd-election")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def close(self) -> None:
        self._stop.set()
        stream = self._stream
        if stream is not None:
            stream.close()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(5)
        if self._lease:
            # The lock, if held, goes with the lease; unrevoked, it expires within ttl_s.
            with contextlib.suppress(*ETCD_FAILURES):
                self.client.revoke(self._lease)
            self._lease = 0

    # -- state -----------------------------------------------------------------------------
    def members(self) -> dict[str, float]:
        with self._mutex:
            return {r.url: r.weight for r in self._records.values()}

    def records(self) -> list[NodeRecord]:
        with self._mutex:
            return sorted(self._records.values(), key=lambda r: r.url)

    @property
    def connected(self) -> bool:
        return self._connected

    def describe(self) -> dict[str, Any]:
        with self._mutex:
            gone = self._disconnected_at
            return {"source": "etcd", "etcd": self.client.target.url,
                    "connected": self._connected, "revision": self._revision,
                    "disconnected_s": None if gone is None
                    else round(time.monotonic() - gone, 3),
                    "mover": self._lock_ring is not None, "last_done_ring": self._done_ring}

    # -- the watch -------------------------------------------------------------------------
    def _read_all(self) -> None:
        revision, kvs = self.client.range_prefix(self.prefix + "/")
        records: dict[str, NodeRecord] = {}
        done: str | None = None
        for kv in kvs:
            record = self._node_record(kv)
            if record is not None:
                records[kv.key] = record
            elif kv.key == self.prefix + MOVE_DONE:
                done = self._move_record(kv)
        with self._mutex:
            self._records = records
            self._revision = revision
            self._done_ring = done

    def _node_record(self, kv: KeyValue) -> NodeRecord | None:
        url = url_of_node_key(self.prefix, kv.key)
        if url is None:
            return None
        try:
            return NodeRecord.decode(url, kv.value)
        except RecordError as exc:
            self._warn_once(kv, str(exc))
            return None

    def _move_record(self, kv: KeyValue) -> str | None:
        try:
            return MoveRecord.decode(kv.value).ring
        except RecordError as exc:
            self._warn_once(kv, str(exc))
            return None

    def _warn_once(self, kv: KeyValue, why: str) -> None:
        if (kv.key, kv.mod_revision) not in self._warned:
            self._warned.add((kv.key, kv.mod_revision))
            log.warning("ignoring etcd key %s: %s", kv.key, why)

    def _watch_loop(self) -> None:
        if not self._connected:
            self._resync()
        while not self._stop.is_set():
            try:
                stream = self.client.watch(self.prefix + "/", self._revision + 1)
                self._stream = stream
                if self._stop.is_set():
                    stream.close()
                    return
                for events in stream.events():
                    self._apply(events)
            except ETCD_FAILURES as exc:
                self._lost(exc)
            while not self._stop.wait(RETRY_S if not self._connected else 0.05):
                self._resync()
                if self._connected:
                    break

    def _apply(self, events: list[WatchEvent]) -> None:
        changed = False
        done: str | None = None
        with self._mutex:
            before = {r.url: r.weight for r in self._records.values()}
        for event in events:
            kv = event.kv
            self._revision = max(self._revision, kv.mod_revision)
            if url_of_node_key(self.prefix, kv.key) is not None:
                record = None if event.kind == "delete" else self._node_record(kv)
                with self._mutex:
                    if record is None:
                        self._records.pop(kv.key, None)
                    else:
                        self._records[kv.key] = record
                changed = True
            elif kv.key == self.prefix + MOVE_DONE and event.kind == "put":
                done = self._move_record(kv)
        members = self.members()
        if changed and members != before:
            self._on_members(members)
        if done is not None:
            with self._mutex:
                self._done_ring = done
            self._on_done(done)

    def _lost(self, exc: Exception) -> None:
        if self._stop.is_set():
            return
        if self._connected:
            log.warning("etcd %s unreachable: keeping the last membership (%d nodes) until "
                        "it answers again: %s", self.client.target.url, len(self._records),
                        exc)
            with self._mutex:
                self._connected = False
                self._disconnected_at = time.monotonic()

    def _resync(self) -> None:
        """Read everything again after a broken watch: etcd may have restarted, leases
        may have expired meanwhile."""
        before = self.members()
        try:
            self._read_all()
        except ETCD_FAILURES as exc:
            self._lost(exc)
            return
        if not self._connected:
            log.info("etcd %s answers again", self.client.target.url)
            with self._mutex:
                self._connected = True
                self._disconnected_at = None
        members = self.members()
        if members != before:
            self._on_members(members)

    # -- election --------------------------------------------------------------------------
    def _tick_loop(self) -> None:
        while not self._stop.wait(self.tick_s):
            try:
                self._tick()
            except ETCD_FAILURES as exc:
                log.debug("election tick: %s", exc)

    def _tick(self) -> None:
        if self._lease and self.client.keepalive(self._lease) <= 0:
            self._lease = 0
            self._lock_ring = None  # the lock went with the lease
        ring = self._want_lock()
        if ring is None or self._lock_ring is not None:
            return
        if not self._lease:
            self._lease = self.client.grant(self.ttl_s)
        record = MoveRecord(ring, self.client_id)
        if self.client.create(self.prefix + MOVE_LOCK, record.encode(),
                              lease=self._lease) is None:
            self._lock_ring = ring
            log.info("this client moves chains to ring %s (elected through etcd)", ring)
            self._on_elected(ring)

    def record_done(self, ring: str) -> None:
        """The moves to ``ring`` are complete: tell every client, release the lock."""
        if self._lock_ring is None:
            return  # the lock was lost with the lease: the next mover records it
        try:
            self.client.put(self.prefix + MOVE_DONE, MoveRecord(ring, self.client_id).encode())
            self.client.delete(self.prefix + MOVE_LOCK)
        except ETCD_FAILURES as exc:
            log.warning("could not record the move to ring %s in etcd (other clients keep "
                        "reading from previous owners a while longer): %s", ring, exc)
        self._lock_ring = None

    @property
    def is_mover(self) -> bool:
        return self._lock_ring is not None

