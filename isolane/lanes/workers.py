"""A fixed set of worker threads over one priority queue.

What ``ThreadPoolExecutor`` does, plus an order: the lowest priority number runs first,
FIFO among equals (``ordered=False``: FIFO for everything, the no-isolation baseline).
Jobs are plain callables that must not raise; ``Lane`` wraps each in its ``Future``.

Threads start on the first submit. They hold the queue, not the pool, so a pool
nobody references is collected and its threads drain the queue and end. A forked
child starts with an empty queue and no threads (the parent's do not exist there) and
starts its own on its first submit. At interpreter exit, queued jobs still run, as
with ``ThreadPoolExecutor``.
"""

from __future__ import annotations

import atexit
import heapq
import itertools
import logging
import threading
import weakref
from collections.abc import Callable

from isolane.lanes.forksafe import ForkSafe

log = logging.getLogger(__name__)

Job = Callable[[], None]


class _JobQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Job]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition(threading.Lock())
        self._closed = False

    def put(self, priority: int, job: Job) -> None:
        with self._cond:
            heapq.heappush(self._heap, (priority, next(self._seq), job))
            self._cond.notify()

    def get(self) -> Job | None:
        """The next job; None once closed and drained."""
        with self._cond:
            while not self._heap and not self._closed:
                self._cond.wait()
            return heapq.heappop(self._heap)[2] if self._heap else None

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def __len__(self) -> int:
        return len(self._heap)


def _work(queue: _JobQueue, on_start: Callable[[], object] | None) -> None:
    if on_start is not None:
        on_start()
    while (job := queue.get()) is not None:
        try:
            job()
        except BaseException:  # Lane's wrapper reports to the Future; this is a bug
            log.exception("isolane worker job raised outside its Future")
        del job  # drop the reference before waiting for the next


class WorkerPool(ForkSafe):
    """``threads`` daemon threads named ``<name>_<i>``, started on the first submit.

    Thread-safe. ``close`` lets queued jobs finish and joins the threads; a later
    ``submit`` starts fresh ones.
    """

    def __init__(self, name: str, threads: int, *, ordered: bool = True,
                 on_start: Callable[[], object] | None = None) -> None:
        self.name = name
        self.on_start = on_start  # run first in each worker thread (e.g. its I/O priority)
        self.threads = threads
        self.ordered = ordered
        self._lock = threading.Lock()
        self._queue = _JobQueue()
        self._workers: list[threading.Thread] = []
        self._finalizer = weakref.finalize(self, _JobQueue.close, self._queue)
        super().__init__()
        _pools.add(self)

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()
        self._queue = _JobQueue()
        self._workers = []
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _JobQueue.close, self._queue)

    def submit(self, priority: int, job: Job) -> None:
        with self._lock:
            if not self._workers:
                for i in range(self.threads):
                    thread = threading.Thread(target=_work, args=(self._queue, self.on_start),
                                              name=f"{self.name}_{i}", daemon=True)
                    thread.start()
                    self._workers.append(thread)
            self._queue.put(priority if self.ordered else 0, job)

    @property
    def started_threads(self) -> int:
        """Worker threads running now (0 until the first submit, and after ``close``)."""
        with self._lock:
            return len(self._workers)

    @property
    def queue_depth(self) -> int:
        """Jobs waiting for a worker."""
        return len(self._queue)

    def close(self) -> None:
        """Run what is queued, then end the threads (not from one of them)."""
        with self._lock:
            queue, workers = self._queue, self._workers
            self._queue, self._workers = _JobQueue(), []
            self._finalizer.detach()
            self._finalizer = weakref.finalize(self, _JobQueue.close, self._queue)
        queue.close()
        for thread in workers:
            if thread is not threading.current_thread():
                thread.join()


_pools: weakref.WeakSet[WorkerPool] = weakref.WeakSet()


@atexit.register
def _drain_at_exit() -> None:
    # Daemon threads would be killed mid-job at exit; ThreadPoolExecutor users expect
    # queued work (an async save's last chunks) to finish first.
    for pool in list(_pools):
        pool.close()
