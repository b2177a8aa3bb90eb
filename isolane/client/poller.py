"""LoadPoller: a cluster client's background probes of its nodes.

Every ``period_s`` it asks each node for its load report (``GET /v1/stats``, which is
also the health probe) and hands the answer, or None when the node did not answer in
time, to ``on_result``. One daemon thread; the probes of one round run one after the
other, each bounded by the caller's ``probe`` timeout. Fork-safe: ``ensure_running``
in a forked child starts the child's own thread. ``close`` stops it and waits.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from isolane.lanes.forksafe import ForkSafe

log = logging.getLogger(__name__)
Stats = Mapping[str, Any]


class LoadPoller(ForkSafe):
    def __init__(self, probe: Callable[[str], Stats | None],
                 nodes: Callable[[], Sequence[str]],
                 on_result: Callable[[str, Stats | None], None], *,
                 period_s: float = 1.0) -> None:
        self.probe = probe
        self.nodes = nodes
        self.on_result = on_result
        self.period_s = period_s
        self.rounds = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        super().__init__()

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()
        self._thread = None

    def ensure_running(self) -> None:
        """Start the thread unless it runs in this process (cheap when it does)."""
        thread = self._thread
        if thread is not None and thread.is_alive() and self._pid == os.getpid():
            return
        with self._lock:
            if self._stop.is_set():
                return
            if self._thread is None or not self._thread.is_alive() or \
                    self._pid != os.getpid():
                self._pid = os.getpid()
                self._thread = threading.Thread(target=self._run, name="isolane-kv-poller",
                                                daemon=True)
                self._thread.start()

    def poll_once(self) -> None:
        """One round: probe every node, report each answer."""
        for node in self.nodes():
            if self._stop.is_set():
                return
            self.on_result(node, self.probe(node))
        self.rounds += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once()
            except Exception as exc:  # the thread must outlive any bug: logged
                log.warning("KV load poller round failed: %s", exc)
            self._stop.wait(self.period_s)

    def close(self) -> None:
        with self._lock:
            self._stop.set()
            thread = self._thread
        if thread is not None and thread.is_alive() and thread is not threading.current_thread():
            thread.join()
