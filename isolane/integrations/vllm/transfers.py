"""One background thread for a KV connector's transfers, and what the engine polls.

The engine's step must not wait on the pool: loads and saves are queued here and run
in order on one thread (``isolane-kv-transfers``), and the worker asks between steps
which requests' transfers are done. Per request it tracks:

- loads: a request's queued or running load; once it ran, the request is reported
  (``take_loaded``) with the engine blocks that could not be filled. A load of a request
  the engine dropped meanwhile (aborted) is skipped when it comes up, and reported all
  the same: the engine frees the request's blocks only then.
- saves: how many of a request's saves are queued or running (``saves_pending``);
  ``wait_saves`` blocks until there are none (a preempted request's blocks go back to
  the engine, which may hand them to another request in the very next forward).

A job that raises is logged and counts as done (a load: all its blocks failed, so the
engine recomputes them; a save: a future cache miss); the thread never dies of it.
Thread-safe.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from isolane.errors import InvalidArgumentError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Job:
    req_id: str
    run: Callable[[], set[int]]  # a load returns the blocks it could not fill
    is_load: bool
    all_blocks: frozenset[int] = frozenset()  # a load's blocks, failed if it raises


class Transfers:
    """The background transfers of one connector worker."""

    def __init__(self, name: str = "isolane-kv-transfers") -> None:
        self._name = name
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._saves: dict[str, int] = {}  # req -> saves queued or running
        self._loads: dict[str, int] = {}  # req -> loads queued or running
        self._loaded: set[str] = set()  # loads done since the last take_loaded
        self._failed_blocks: set[int] = set()
        self._dropped: set[str] = set()  # requests whose queued loads are skipped
        self._busy = 0  # jobs queued or running
        self._done = 0  # jobs run so far
        self._thread: threading.Thread | None = None
        self._closed = False

    # -- submitting ----------------------------------------------------------------------
    def submit_load(self, req_id: str, run: Callable[[], set[int]],
                    blocks: Iterable[int]) -> None:
        """Queue a load; ``run`` fills the request's blocks and returns those it could
        not (all of ``blocks`` count as failed if it raises)."""
        with self._lock:
            self._loads[req_id] = self._loads.get(req_id, 0) + 1
        self._put(_Job(req_id, run, True, frozenset(blocks)))

    def submit_save(self, req_id: str, run: Callable[[], None]) -> None:
        """Queue a save of the request's blocks (they must stay the engine's until
        ``saves_pending`` says it is done)."""
        with self._lock:
            self._saves[req_id] = self._saves.get(req_id, 0) + 1

        def save() -> set[int]:
            run()
            return set()

        self._put(_Job(req_id, save, False))

    def report_loaded(self, req_id: str) -> None:
        """Report a request as done loading without loading anything (a load planned
        for a request the engine dropped before it reached the worker)."""
        with self._lock:
            self._loaded.add(req_id)

    def drop_loads(self, req_ids: Iterable[str]) -> None:
        """Skip the queued loads of these requests (finished or aborted); a load already
        running finishes. Either way they are reported as done."""
        with self._lock:
            self._dropped.update(r for r in req_ids if r in self._loads)

    # -- polling -------------------------------------------------------------------------
    def take_loaded(self) -> tuple[set[str], set[int]]:
        """Requests whose loads finished since the last call, and the blocks those loads
        could not fill."""
        with self._lock:
            loaded, self._loaded = self._loaded, set()
            failed, self._failed_blocks = self._failed_blocks, set()
        return loaded, failed

    def saves_pending(self, req_id: str) -> bool:
        with self._lock:
            return self._saves.get(req_id, 0) > 0

    def wait_saves(self, req_ids: Iterable[str]) -> None:
        """Block until no save of these requests is queued or running."""
        wanted = set(req_ids)
        with self._changed:
            self._changed.wait_for(lambda: not any(self._saves.get(r) for r in wanted))

    def wait_any(self, timeout: float) -> None:
        """Wait until a queued job ran, at most ``timeout`` seconds (no wait when idle):
        an engine step with nothing to compute, spinning, would keep the interpreter
        from this thread."""
        with self._changed:
            done = self._done
            self._changed.wait_for(lambda: self._busy == 0 or self._done != done, timeout)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every queued job ran; False if ``timeout`` passed first."""
        with self._changed:
            return self._changed.wait_for(lambda: self._busy == 0, timeout)

    def close(self) -> None:
        """Run what is queued, then stop the thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        if thread is not None:
            self._queue.put(None)
            thread.join()

    # -- the thread ----------------------------------------------------------------------
    def _put(self, job: _Job) -> None:
        with self._lock:
            if self._closed:
                raise InvalidArgumentError("the connector's transfers are closed (the engine "
                                           "shut down); make a new connector")
            self._busy += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name,
                                                daemon=True)
                self._thread.start()
        self._queue.put(job)

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            failed = self._run(job)
            with self._changed:
                table = self._loads if job.is_load else self._saves
                table[job.req_id] -= 1
                if not table[job.req_id]:
                    del table[job.req_id]
                if job.is_load:
                    self._failed_blocks |= failed
                    if job.req_id not in self._loads:
                        self._loaded.add(job.req_id)
                        self._dropped.discard(job.req_id)
                self._busy -= 1
                self._done += 1
                self._changed.notify_all()

    def _run(self, job: _Job) -> set[int]:
        with self._lock:
            skip = job.is_load and job.req_id in self._dropped
        if skip:
            return set()
        try:
            return job.run()
        except Exception:  # a transfer thread must outlive any one job
            log.exception("KV %s of request %s failed%s", "load" if job.is_load else "save",
                          job.req_id, "; its blocks are recomputed" if job.is_load else "")
            return set(job.all_blocks)
