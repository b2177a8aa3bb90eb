"""Where isolane's save and restore seconds go, measured inside the benchmark's rounds.

- ``Steps``: wraps functions of isolane's modules for the length of one save or load
  and sums the seconds threads spend in each (thread-seconds), with when the first call
  began and the last one ended (seconds after the call started);
- ``profile_save``: one profiled full save (nothing linked) of the state dict into the
  store the round just saved into: marker, metadata, staging copies, hashing, O_DIRECT
  chunk writes, the fsyncs of step 4 and the manifest;
- ``profile_restores``: a plain and an ``into=`` load (cold) profiled the same way, the
  kernel's minor page faults of each, and the plain load again with one cost removed at
  a time (the hash check; the pre-fault threads) or with another number of pre-fault threads.

Rows go into the report's "Where the seconds go" table through ``piece(key, label,
note)`` (``bench_snapshot.Rows.row``).
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import _common as C
import _limits as LIM
import _statedicts as S

Piece = Callable[..., Any]  # Rows.row(key, label, note="") -> Row


class Steps:
    """Patch ``(owner, attribute, label)`` functions while active; per label: seconds
    spent (summed over threads), calls, first start and last end."""

    def __init__(self, steps: Sequence[tuple[Any, str, str]]) -> None:
        self.steps = list(steps)
        self.spent: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self._lock = threading.Lock()
        self.t0 = 0.0

    def _note(self, index: int, start_ns: int, end_ns: int) -> None:
        label, start, end = self.steps[index][2], start_ns / 1e9, end_ns / 1e9
        with self._lock:
            self.spent[label] = self.spent.get(label, 0.0) + end - start
            self.calls[label] = self.calls.get(label, 0) + 1
            self.first.setdefault(label, start)
            self.last[label] = max(self.last.get(label, end), end)

    @contextlib.contextmanager
    def active(self) -> Iterator[Steps]:
        with C.timed_calls([(owner, attr) for owner, attr, _ in self.steps], self._note):
            self.t0 = time.perf_counter()
            yield self


def save_steps() -> Steps:
    """The steps of a save (``isolane.snapshot.writer`` and the local store)."""
    import isolane.snapshot.chunks as chunks
    import isolane.snapshot.writer as writer
    from isolane.storage.local import LocalBlobStore

    return Steps([
        (writer, "mark_writing", "marker _writing.json (step 1)"),
        (writer.SnapshotWriter, "_write_zarr_metadata", "zarr metadata files (step 2)"),
        (writer, "fill_chunk", "staging copies (memmove)"),  # on the write lane's threads
        (chunks, "fill_chunk", "staging copies (memmove)"),  # staged ahead (STAGE_AHEAD)
        (chunks, "chunk_hash", "hashing (xxh3-128)"),
        (writer.StagingPool, "acquire", "getting a staging buffer (first touch included)"),
        (LocalBlobStore, "_write_direct", "chunk file writes (O_DIRECT, fsync deferred)"),
        (LocalBlobStore, "sync", "fsyncs of chunk files, metadata and folders (step 4)"),
        (LocalBlobStore, "write_atomic", "manifest, atomic write (step 5)"),
    ])


def record_save(piece: Piece, steps: Steps, wall: float, key: str, label: str) -> None:
    piece(f"{key}-wall", f"{label}: wall clock", "thread-seconds per step below; "
          "'began/ended' = seconds after the call").seconds.add(wall)
    for what in dict.fromkeys(what for _owner, _attr, what in steps.steps):
        if what not in steps.spent:
            continue
        piece(f"{key}-{what}", f"{label}: {what}, thread-seconds",
              f"{steps.calls[what]} calls").seconds.add(steps.spent[what])
        if what.startswith(("chunk file writes", "fsyncs", "manifest")):
            piece(f"{key}-{what}-began", f"{label}: {what}, first began at"
                  ).seconds.add(steps.first[what] - steps.t0)
            piece(f"{key}-{what}-ended", f"{label}: {what}, last ended at"
                  ).seconds.add(steps.last[what] - steps.t0)


def profile_save(saver: Any, sd: Mapping[str, Any], piece: Piece) -> None:
    """One profiled save, nothing linked (``parent=False``), warm staging buffers (the
    round's save came first), timed until committed (every file fsynced)."""
    store = getattr(saver, "store", None)
    if store is None:
        return
    LIM.settle()
    steps = save_steps()
    with steps.active():
        store.save(sd, "prof-save", parent=False)
        wall = time.perf_counter() - steps.t0
    store.delete("prof-save")
    record_save(piece, steps, wall, "prof-save", "save again, same store (warm staging, "
                "nothing linked)")


class _Matches(str):
    """A hash that equals every other: the load's hash checks pass without hashing."""

    def __eq__(self, other: object) -> bool:
        return True

    def __ne__(self, other: object) -> bool:
        return False

    __hash__ = str.__hash__


def profile_restores(saver: Any, sd: Mapping[str, Any], piece: Piece) -> None:
    """Profiled cold loads: plain and into= (thread-seconds per step, minor faults);
    then the plain load with the hash check removed and without the pre-fault thread."""
    import isolane.snapshot.reader as reader
    from isolane.storage.local import LocalBlobStore

    store = getattr(saver, "store", None)
    if store is None:
        return
    labels = [(LocalBlobStore, "read_into", "O_DIRECT reads (read_into)"),
              (reader, "chunk_hash", "hashing (xxh3-128)"),
              (reader, "copy_bytes", "staging copy into the target (memmove)"),
              (store.staging, "acquire", "waiting for a staging buffer")]
    nbytes = S.state_bytes(sd)

    def cold_load(**kwargs: Any) -> tuple[float, int]:
        template = S.empty_like_tree(sd) if kwargs.get("into") else None
        if template is not None:
            kwargs["into"] = template
        C.drop_page_cache()
        faults = LIM.minor_faults()
        start = time.perf_counter()
        restored = store.load("ckpt", **kwargs)
        S.touch_pages(restored)
        seconds = time.perf_counter() - start
        faults = LIM.minor_faults() - faults
        del restored, template
        gc.collect()
        return seconds, faults

    for mode in ("plain", "into", "mmap"):
        steps = Steps(labels)
        with steps.active():
            seconds, faults = cold_load(into=mode == "into", mmap=mode == "mmap")
        label = {"plain": "load()", "into": "load(into=...)", "mmap": "load(mmap=True)"}[mode]
        piece(f"prof-{mode}-wall", f"restore {label} profiled: wall clock",
              "the lane's 4 threads' time per step below (thread-seconds)").seconds.add(seconds)
        piece(f"prof-{mode}-faults", f"restore {label}: minor page faults (thousands; "
              "the 'median s' column)", f"{nbytes // 4096 // 1000}k pages of 4 KiB in the "
              "state dict").seconds.add(faults / 1000)
        for _owner, _attr, what in labels:
            if what in steps.spent or mode == "into":
                piece(f"prof-{mode}-{what}", f"restore {label}: {what}, thread-seconds"
                      ).seconds.add(steps.spent.get(what, 0.0))
        reads = labels[0][2]
        if steps.calls.get(reads):
            span = steps.last[reads] - steps.first[reads]
            piece(f"prof-{mode}-inflight", f"restore {label}: O_DIRECT reads in flight on "
                  "average (the 'median s' column: read thread-seconds / first began to "
                  "last ended)", f"{steps.calls[reads]} reads of "
                  f"{nbytes / steps.calls[reads] / 2**20:.1f} MiB on average").seconds.add(
                      steps.spent[reads] / span if span > 0 else 0.0)
    original = reader.chunk_hash
    reader.chunk_hash = lambda view, pad=0: _Matches()  # type: ignore[assignment]
    try:
        seconds, _ = cold_load()
    finally:
        reader.chunk_hash = original
    piece("prof-plain-nohash", "restore load() with the hash check removed: wall clock",
          "same reads, no xxh3").seconds.add(seconds)
    threads = reader.PREFAULT_THREADS
    other = 2 if threads == 1 else 1
    reader.PREFAULT_THREADS = other
    try:
        seconds, _ = cold_load()
    finally:
        reader.PREFAULT_THREADS = threads
    piece("prof-plain-faulters", f"restore load() with {other} pre-fault thread(s): wall "
          "clock", f"the A/B of isolane's default, {threads}").seconds.add(seconds)
    bounce = reader.BOUNCE_PLAIN
    reader.BOUNCE_PLAIN = not bounce
    try:
        seconds, _ = cold_load()
    finally:
        reader.BOUNCE_PLAIN = bounce
    how = ("straight into its fresh memory" if bounce
           else "through the huge-page staging buffers (+ memmove into its fresh memory)")
    piece("prof-plain-bounce", f"restore load() {how}: wall clock",
          f"the A/B of isolane's default (reader.BOUNCE_PLAIN = {bounce})").seconds.add(seconds)
    seconds = into_without_hugepages(store, cold_load)
    piece("prof-into-nothp", "restore load(into=...) through 4 staging buffers without "
          "MADV_HUGEPAGE: wall clock", "the A/B of the pool's huge-page advice (a fresh "
          "pool, its buffers touched before)").seconds.add(seconds)
    original_pf = reader.prefaulted
    reader.prefaulted = lambda parts, threads=1: contextlib.nullcontext()  # type: ignore[assignment]
    try:
        seconds, _ = cold_load()
    finally:
        reader.prefaulted = original_pf
    piece("prof-plain-nofault", "restore load() without the pre-fault thread: wall clock",
          "the O_DIRECT reads fault the fresh pages in themselves").seconds.add(seconds)


def into_without_hugepages(store: Any, cold_load: Callable[..., tuple[float, int]]) -> float:
    """An into= load through a fresh staging pool of 4 touched slot-sized buffers that
    were not advised MADV_HUGEPAGE (isolane's pool advises it)."""
    import isolane.snapshot.staging as staging

    pool = staging.StagingPool(store.staging.slot_bytes, store.staging.budget_bytes)
    advise = staging.advise_hugepages
    staging.advise_hugepages = lambda buf: None  # type: ignore[assignment]
    try:
        buffers = [pool.acquire() for _ in range(4)]
    finally:
        staging.advise_hugepages = advise
    for buf in buffers:
        LIM.populate(buf._map)
        pool.release(buf)
    saved, store.staging = store.staging, pool
    try:
        return cold_load(into=True)[0]
    finally:
        store.staging = saved
        # Out of the pool before it closes: a closed pool hands its idle buffers to the
        # process's warm cache, where the next round's fresh store would take these
        # unadvised ones for its saves and loads.
        unadvised = [pool.acquire() for _ in buffers]
        pool.close()
        for buf in unadvised:
            buf.close()
