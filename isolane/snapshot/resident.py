"""Threads that live as long as the process, for the short jobs of a save.

Why not a fresh thread per save: a thread that has run torch code runs C++
thread-local destructors when it exits. An async save's driver thread used to end
just after ``SaveHandle.result()`` returned; when the caller then left the
interpreter at once, that thread's exit raced with finalisation, and a destructor
cut short by the finalising interpreter aborted the process ("terminate called
without an active exception", SIGABRT, about one exit in two). Resident threads
never exit: between jobs they park on a queue, and at process exit they are simply
gone, without running anything.

``RESIDENT`` is the process's one pool (threads are a process resource, like the
host lane plane). At interpreter exit a hook waits, up to ``EXIT_WAIT_S``, for the
jobs still running (an async save nobody waited for commits instead of being cut
off), logging what it waits for. The hook is registered with ``threading``'s exit
hooks, which run before ``concurrent.futures`` refuses new work (a save's last steps
use thread pools: plain ``atexit`` runs too late), and registered on the first job,
so that it runs before the hooks of what the save uses. In a forked child the
parent's threads do not exist: the pool starts afresh.

Thread-safe.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from queue import SimpleQueue
from typing import Any, TypeVar

from isolane.lanes.forksafe import ForkSafe

log = logging.getLogger(__name__)
T = TypeVar("T")
EXIT_WAIT_S = 600.0

_Job = tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]


class ResidentThreads(ForkSafe):
    """Run jobs on daemon threads that never exit; a new thread starts only when
    every existing one is busy."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._reset()
        super().__init__()

    def _reset(self) -> None:
        self._queue: SimpleQueue[_Job] = SimpleQueue()
        self._lock = threading.Lock()
        self._idle_changed = threading.Condition(self._lock)
        self._threads = 0
        self._idle = 0
        self._running: dict[int, str] = {}  # job id -> what it is, for the exit log
        self._hooked = False

    def _after_fork_in_child(self) -> None:
        self._reset()

    def submit(self, fn: Callable[..., T], *args: Any, what: str = "") -> Future[T]:
        fut: Future[T] = Future()
        with self._lock:
            self._running[id(fut)] = what or getattr(fn, "__name__", "job")
            if not self._hooked:
                self._hooked = True
                _register_exit_hook(self._wait_at_exit)
            if self._idle:
                self._idle -= 1
            else:
                self._threads += 1
                threading.Thread(target=self._work, name=f"{self.name}-{self._threads}",
                                 daemon=True).start()
        self._queue.put((fut, fn, args))
        return fut

    def _work(self) -> None:
        while True:
            fut, fn, args = self._queue.get()
            key = id(fut)
            if fut.set_running_or_notify_cancel():
                try:
                    result = fn(*args)
                except BaseException as exc:
                    fut.set_exception(exc)
                else:
                    fut.set_result(result)
            del fut, fn, args  # hold nothing of a finished job while parked
            with self._lock:
                self._running.pop(key, None)
                self._idle += 1
                self._idle_changed.notify_all()

    def busy(self) -> list[str]:
        with self._lock:
            return list(self._running.values())

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no job runs; False when ``timeout_s`` passed first."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._running:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle_changed.wait(left)
        return True


    def _wait_at_exit(self) -> None:
        busy = self.busy()
        if not busy:
            return
        log.warning("waiting up to %.0f s for %d save job(s) still running before exit "
                    "(%s); call SnapshotStore.close() or SaveHandle.result() to wait "
                    "explicitly", EXIT_WAIT_S, len(busy), ", ".join(sorted(set(busy))))
        if not self.wait_idle(EXIT_WAIT_S):
            log.error("save jobs still running after %.0f s at exit (%s); they are cut off "
                      "and their generations stay uncommitted ('isolane gc' sweeps them)",
                      EXIT_WAIT_S, ", ".join(sorted(set(self.busy()))))


def _register_exit_hook(hook: Callable[[], None]) -> None:
    """``threading._register_atexit`` (what concurrent.futures uses, since Python 3.9):
    runs at interpreter exit before non-daemon threads are joined and before the
    thread pools shut down; LIFO, so registering late means running early."""
    register = getattr(threading, "_register_atexit", None)
    if register is None:
        atexit.register(hook)
        return
    try:
        register(hook)
    except RuntimeError:  # the interpreter is already exiting: too late to wait
        log.warning("interpreter exiting: save jobs started now are not waited for")


RESIDENT = ResidentThreads("isolane-save")
