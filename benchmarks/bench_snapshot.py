#!/usr/bin/env python
"""Checkpoint save and restore: isolane against torch.save, safetensors, DCP and the disk.

    python benchmarks/bench_snapshot.py --quick                      # smoke test, seconds
    python benchmarks/bench_snapshot.py --scale 0.1 --repeats 1      # a short run, ~1-2 min
    python benchmarks/bench_snapshot.py --out docs/BENCHMARKS.md     # full run, ~4 GB dicts

One run measures every system on the same in-memory state dicts (built in
``_statedicts``), round by round so that a noisy neighbour hits all systems alike, and
prints a markdown table of medians and ratios (``--out`` also writes it between the
``<!-- bench:snapshot -->`` markers of that file).

- **save**: from the call until the data is durable (the benchmark fsyncs every file and
  folder written, inside the timing); each save goes into a new, empty folder.
- **isolane extras**: a second save into the same store after every tensor changed
  (warm buffers, no dedup possible) and ``save_async``: the time until it returns (the
  state dict is then mutated, as a training loop would) and until ``result()``.
- **restore**: after ``drop_caches``; includes touching every page of every tensor so
  lazy loaders pay their reads; each restore is compared bit for bit with the original.
- **peak RSS**: each save once more in a fresh process that builds the same state dict.
- **LoRA**: 5 saves of a frozen base + adapter, the adapter changed in place in between.
- **limits** (``_limits``): the fastest of several simple writers of the same bytes, in
  the same rounds (``pwrite`` loops of 8/32/64 MiB O_DIRECT requests from 1 and 4
  threads, ``dd`` and ``fio`` when installed); the cold read limit is a plain 4-thread
  read of isolane's own chunk files, right before its restores.
- **profile**: the pieces of isolane's save and restore measured alone in the same
  rounds (files and their fsyncs, staging copy, hashing, faulting fresh memory).

isolane rows are skipped, with the reason, while ``isolane.snapshot`` is not importable
(``--quick`` fails instead: it is the smoke test of these paths).
Outputs go to ``--dir`` (default ``.bench/``, gitignored) and are deleted after use.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C
import _limits as LIM
import _quick
import _replay as R
import _snap_profile as P
import _statedicts as S
import safetensors
import torch
import xxhash
from _savers import SYSTEMS, AsyncSaving, Saver, isolane_missing, make_saver

C.ensure_repo_importable()

SECTION = "snapshot"
DEFAULT_SYSTEMS = ("torch", "safetensors", "dcp1", "dcp4", "isolane", "isolane-version")
# also: "isolane-fsync-each" (--systems), the A/B of deferred chunk fsyncs
LORA_SKIP = ("dcp1",  # five full re-saves per round: keep the LoRA case to the main peers
             "isolane-fsync-each")  # saves only: the A/B is the mixed case's
QUICK_RSS = ("isolane",)  # --quick: the peak-RSS children of isolane (sync and async) only
MIXED_SKIP = ("isolane-version",)  # every tensor changes between mixed saves: same as hash
QUICK_SCALE = 0.005  # ~20 MB mixed state dict
TARGETS = {  # what isolane is built to reach on this kind of machine
    "save_vs_torch": 4.0, "save_vs_dcp4": 2.0, "save_vs_limit": 0.95, "restore_vs_torch": 1.5,
    "restore_vs_torch_mmap": 1.0, "into_vs_read_limit": 0.85, "async_blocking": 0.10,
}
INTO_MODE = 2  # index of load(into=...) among IsolaneSaver.restore_modes()
ADJACENT_READ = "direct-adjacent"  # the read limit measured next to it
# The timed save and load(into=) each share their round with the simplest code doing the
# same work: a simple writer of one file / the plain read limit, and isolane's own file
# operations replayed (``_replay``); the save also with ``writer.STAGE_AHEAD`` flipped
# ("ab"). Each goes first once every 3 rounds; in round 1 the replay follows isolane,
# whose operations it records then.
SAVE_ORDERS = (("pwrite", "save", "ab", "replay"), ("replay", "ab", "pwrite", "save"),
               ("ab", "save", "replay", "pwrite"))
INTO_ORDERS = (("limit", "into", "replay"), ("replay", "limit", "into"),
               ("into", "replay", "limit"))
_T0 = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f}s] {message}", file=sys.stderr, flush=True)


# -- results -----------------------------------------------------------------------------
@dataclass
class Row:
    label: str
    note: str = ""
    seconds: C.Samples = field(default_factory=C.Samples)
    blocked: C.Samples = field(default_factory=C.Samples)  # async: until save_async returned
    verdicts: list[S.Verdict] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def median(self) -> float | None:
        return self.seconds.median if self.seconds else None

    def check_text(self) -> str:
        if self.errors:
            return "ERROR: " + self.errors[0]
        failed = [v for v in self.verdicts if not v.ok]
        if failed:
            return failed[0].text()
        return self.verdicts[-1].text() if self.verdicts else ""


class Rows(dict[str, Row]):
    def row(self, key: str, label: str, note: str = "") -> Row:
        if key not in self:
            self[key] = Row(label, note)
        return self[key]

    def median(self, key: str) -> float | None:
        return self[key].median if key in self else None


@dataclass
class Results:
    plans: dict[str, S.StatePlan] = field(default_factory=dict)
    limits: Rows = field(default_factory=Rows)
    saves: Rows = field(default_factory=Rows)
    restores: Rows = field(default_factory=Rows)
    reads: Rows = field(default_factory=Rows)  # cold read limits of isolane's chunk files
    profile: Rows = field(default_factory=Rows)  # pieces of a save / restore alone
    rss: dict[str, dict[str, Any]] = field(default_factory=dict)
    lora_full: Rows = field(default_factory=Rows)
    lora_resave: Rows = field(default_factory=Rows)
    cache_dropped: bool = True
    skipped: list[str] = field(default_factory=list)
    save_ops: R.SaveOps | None = None  # the first timed save's file operations
    read_ops: R.ReadOps | None = None  # the first timed load(into=)'s reads
    replays: Rows = field(default_factory=Rows)  # isolane next to its replayed operations
    disk: dict[str, list[dict[str, float]]] = field(default_factory=dict)  # by replays key


# -- measuring one system ----------------------------------------------------------------
def settled(measure: Callable[[Path, int], C.WriteLimit | None], path: Path, nbytes: int
            ) -> C.WriteLimit | None:
    C.remove_path(path)
    LIM.settle()
    return measure(path, nbytes)


def timed_save(saver: Saver, sd: Mapping[str, Any], name: str, *, settle: bool = True
               ) -> float:
    if settle:
        LIM.settle()  # start from clean dirty-page state, deleted files trimmed
    start = time.perf_counter()
    saver.save(sd, name)
    C.fsync_tree(saver.output(name))
    return time.perf_counter() - start


def timed_async(saver: Saver, sd: Mapping[str, Any], name: str,
                probes: list[torch.Tensor]) -> tuple[float, float]:
    """(seconds until save_async returned, seconds until durable). Right after it returns
    the probes are changed (undone after ``result()``): the snapshot must not see that."""
    if not isinstance(saver, AsyncSaving):
        raise TypeError(f"{saver.label} has no save_async")
    prepare = getattr(saver, "prepare_async", None)
    if callable(prepare):
        prepare(sd)  # e.g. warm reusable buffers, as a long-running job would have
    LIM.settle()
    start = time.perf_counter()
    pending = saver.save_async(sd, name)
    blocked = time.perf_counter() - start
    S.flip_bits(probes, 4)
    try:
        pending.result()
        C.fsync_tree(saver.output(name))
        total = time.perf_counter() - start
    finally:
        S.flip_bits(probes, 4)
    return blocked, total


def restore_once(saver: Saver, mode_index: int, name: str, sd: Mapping[str, Any], *,
                 cold: bool, disk: tuple[R.DiskStats, dict[str, float]] | None = None
                 ) -> tuple[float, S.Verdict, bool]:
    """One timed restore; ``disk``: what the device did during the timed part only."""
    mode = saver.restore_modes()[mode_index]
    template = S.empty_like_tree(sd) if mode.needs_template else None
    dropped = C.drop_page_cache() if cold else False

    def load() -> Mapping[Any, Any]:
        restored = mode.load(name, template)
        S.touch_pages(restored)
        return restored

    span = disk[0].span(disk[1]) if disk is not None else contextlib.nullcontext()
    with span:
        seconds, restored = C.timed(load)
    return seconds, S.compare(sd, restored), dropped


def mixed_round(key: str, rnd: int, sd: dict[str, Any], base: Path, res: Results,
                source: Any) -> None:
    """One round for one system: save, extra saves, every restore mode; then clean up."""
    folder = base / f"mixed-{key}-r{rnd}"
    C.remove_path(folder)
    saver = make_saver(key, folder)
    tensors = S.tensors_of(sd)
    try:
        row = res.saves.row(key, saver.label, saver.note)
        if key == "isolane":
            save_group(saver, sd, base, res, source, rnd, row)
        else:
            row.seconds.add(timed_save(saver, sd, "ckpt"))
        log(f"  {saver.label}: {row.seconds.values[-1]:.2f} s")
        if saver.reuses_buffers:
            S.flip_bits(tensors, 1)  # every element changes: nothing to dedup against
            try:
                second = res.saves.row(f"{key}:2nd", f"{saver.label}, 2nd save, same store",
                                       "every tensor changed since the 1st save")
                second.seconds.add(timed_save(saver, sd, "ckpt-2nd"))
                log(f"  {second.label}: {second.seconds.values[-1]:.2f} s")
            finally:
                S.flip_bits(tensors, 1)
        if isinstance(saver, AsyncSaving) and not getattr(saver, "save_only", False):
            S.flip_bits(tensors, 2)  # a third distinct state
            try:
                arow = res.saves.row(f"{key}:async", saver.async_label, " ".join(
                    ["blocked = until the call returned (the state dict is then changed); "
                     "median s = until durable;", saver.async_note]).strip())
                blocked, total = timed_async(saver, sd, "ckpt-async", [tensors[0], tensors[-1]])
                arow.blocked.add(blocked)
                arow.seconds.add(total)
                log(f"  {arow.label}: blocked {blocked:.2f} s, durable {total:.2f} s")
                if rnd == 0:
                    _, verdict, _ = restore_once(saver, 0, "ckpt-async", sd, cold=False)
                    arow.verdicts.append(verdict)
            finally:
                S.flip_bits(tensors, 2)
        if key == "isolane":
            measure_pieces(saver, sd, base / f"pieces-r{rnd}", res)
            P.profile_save(saver, sd, res.profile.row)
            P.profile_restores(saver, sd, res.profile.row)
        for index, mode in enumerate(saver.restore_modes()):
            if key == "isolane" and index == INTO_MODE:
                into_group(saver, sd, base, res, rnd, mode)
                continue
            rrow = res.restores.row(f"{key}:{index}", mode.label, mode.note)
            seconds, verdict, dropped = restore_once(saver, index, "ckpt", sd, cold=True)
            gc.collect()  # free the restored copy before the next restore
            res.cache_dropped &= dropped
            rrow.seconds.add(seconds)
            rrow.verdicts.append(verdict)
            log(f"  {mode.label}: {seconds:.2f} s, {verdict.text()}")
    finally:
        saver.close()
        C.remove_path(folder)


def on_disk(res: Results, key: str, label: str, stats: R.DiskStats, fn: Callable[[], float],
            note: str = "") -> float:
    """Run the timed ``fn`` (seconds) and record it, with what the device saw, as a row
    of the replay table."""
    seen: dict[str, float] = {}
    with stats.span(seen):
        seconds = fn()
    res.replays.row(key, label, note).seconds.add(seconds)
    res.disk.setdefault(key, []).append(seen)
    return seconds


def save_group(saver: Any, sd: Mapping[str, Any], base: Path, res: Results,
               source: Any, rnd: int, row: Row) -> None:
    """isolane's timed (and profiled) save, the same simple writer as the limit's, and
    isolane's own file operations replayed by the simplest code, in a rotating order."""
    stats = R.DiskStats.of(base, writes=True)
    for item in SAVE_ORDERS[rnd % len(SAVE_ORDERS)]:
        if item == "pwrite":
            save_pwrite(sd, base, res, source, stats)
        elif item == "save":
            save_timed(saver, sd, res, row, stats)
        elif item == "ab":
            save_ab(sd, base, res, stats)
        elif res.save_ops is not None:
            save_replay(res.save_ops, base, res, stats)


def save_pwrite(sd: Mapping[str, Any], base: Path, res: Results, source: Any,
                stats: R.DiskStats) -> None:
    writer = LIM.simple_writers()[0]
    limit_file = base / "limit-adjacent.bin"
    nbytes = S.state_bytes(sd)
    try:
        LIM.settle()
        seconds = on_disk(res, "w-pwrite", f"{writer.label}, one new file (the limit's "
                          "kind)", stats, lambda: writer.write(limit_file, nbytes,
                                                               memoryview(source)))
    finally:
        C.remove_path(limit_file)
    res.limits.row(f"{writer.key}-adjacent", f"{writer.label} (limit), next to isolane's "
                   "save", "same file, same size, fsync at the end; order rotating with "
                   "the save").seconds.add(seconds)


def save_timed(saver: Any, sd: Mapping[str, Any], res: Results, row: Row,
               stats: R.DiskStats) -> None:
    """The measured save (fresh store), profiled; recorded in the first round."""
    steps = P.save_steps()
    ops = R.SaveOps()
    record = (R.record_save(saver.store, "ckpt", ops) if res.save_ops is None
              else contextlib.nullcontext())
    LIM.settle()
    with steps.active(), record:
        seconds = on_disk(res, "w-save", "isolane SnapshotStore.save (fresh store)", stats,
                          lambda: timed_save(saver, sd, "ckpt", settle=False))
    row.seconds.add(seconds)
    if res.save_ops is None and ops.chunks:
        res.save_ops = ops
    P.record_save(res.profile.row, steps, seconds, "prof-first",
                  "the measured save (fresh store)")


def save_ab(sd: Mapping[str, Any], base: Path, res: Results, stats: R.DiskStats) -> None:
    """The A/B of ``writer.STAGE_AHEAD``: the same save from a fresh store of its own
    with the switch flipped."""
    import isolane.snapshot.writer as writer

    folder = base / "save-ab"
    C.remove_path(folder)
    saver = make_saver("isolane", folder)
    ahead = writer.STAGE_AHEAD
    how = ("copies and hashes on the write lane's threads" if ahead
           else "copies and hashes staged ahead on stager threads")
    writer.STAGE_AHEAD = not ahead
    try:
        LIM.settle()
        seconds = on_disk(res, "w-save-ab", f"isolane SnapshotStore.save (fresh store), {how}",
                          stats, lambda: timed_save(saver, sd, "ckpt", settle=False),
                          f"the A/B of isolane's default (writer.STAGE_AHEAD = {ahead})")
        log(f"  isolane save, {how}: {seconds:.2f} s")
    finally:
        writer.STAGE_AHEAD = ahead
        saver.close()
        C.remove_path(folder)


def save_replay(ops: R.SaveOps, base: Path, res: Results, stats: R.DiskStats) -> None:
    scratch = base / "replay-save"
    C.remove_path(scratch)
    big = LIM.warm_memory(max(w for _p, w, _l in ops.chunks) + 4096, huge=True)
    view = memoryview(big)

    def replayed() -> float:
        start = time.perf_counter()
        R.replay_save(ops, scratch, view)
        C.fsync_tree(scratch.joinpath(*Path(ops.chunks[0][0]).parts[:3]))
        return time.perf_counter() - start

    try:
        LIM.settle()
        seconds = on_disk(res, "w-replay", "isolane's save replayed: the same files, request "
                          "sizes, order and fsyncs from a plain loop (no copy, no hash)",
                          stats, replayed, f"{len(ops.chunks)} chunk files, "
                          f"{len(ops.small)} small files, {len(ops.synced)} fsyncs")
        log(f"  isolane's save replayed: {seconds:.2f} s")
    finally:
        view.release()
        big.close()
        C.remove_path(scratch)


def into_group(saver: Any, sd: Mapping[str, Any], base: Path, res: Results, rnd: int,
               mode: Any) -> None:
    """The timed load(into=...), the cold read limit of its chunk files and its own reads
    replayed by the simplest code, in a rotating order."""
    stats = R.DiskStats.of(base, writes=False)
    for item in INTO_ORDERS[rnd % len(INTO_ORDERS)]:
        if item == "into":
            into_timed(saver, sd, res, mode, stats)
        elif item == "limit":
            into_limit(saver, sd, res, stats)
        elif res.read_ops is not None:
            into_replay(saver, res.read_ops, res, stats)


def into_timed(saver: Any, sd: Mapping[str, Any], res: Results, mode: Any,
               stats: R.DiskStats) -> None:
    rrow = res.restores.row(f"isolane:{INTO_MODE}", mode.label, mode.note)
    ops = R.ReadOps()
    record = (R.record_reads(saver.store, ops) if res.read_ops is None
              else contextlib.nullcontext())
    seen: dict[str, float] = {}
    with record:  # the device's counters over the load alone (not its target's zeroing)
        seconds, verdict, dropped = restore_once(saver, INTO_MODE, "ckpt", sd, cold=True,
                                                 disk=(stats, seen))
    res.replays.row("r-into", "isolane SnapshotStore.load(into=...)").seconds.add(seconds)
    res.disk.setdefault("r-into", []).append(seen)
    got = [verdict, dropped]
    gc.collect()
    if res.read_ops is None and ops.reads:
        res.read_ops = ops
    res.cache_dropped &= bool(got[1])
    rrow.seconds.add(seconds)
    rrow.verdicts.append(got[0])
    log(f"  {mode.label}: {seconds:.2f} s, {got[0].text()}")


def into_limit(saver: Any, sd: Mapping[str, Any], res: Results, stats: R.DiskStats) -> None:
    """The cold O_DIRECT read limit of the snapshot's chunk files, next to the timed
    ``load(into=...)`` of the round."""
    files = LIM.chunk_files(saver.output("ckpt"))
    room = LIM.files_bytes(files)
    warm = LIM.warm_memory(room, huge=True)
    try:
        C.drop_page_cache()
        seconds = on_disk(res, "r-limit", "plain read of its chunk files, largest first, "
                          "O_DIRECT, 4 threads, into touched huge-page memory (the limit)",
                          stats,
                          lambda: LIM.timed(lambda: LIM.read_files(files, warm,
                                                                   direct=True)))
    finally:
        warm.close()
    res.reads.row(ADJACENT_READ, "plain read of isolane's chunk files, O_DIRECT, 4 threads, "
                  "into touched huge-page memory (limit), next to the timed load(into=...)",
                  "order rotating with the load and the replay"
                  ).seconds.add(seconds * S.state_bytes(sd) / room)
    log(f"  read limit next to load(into=): {seconds:.2f} s")


def into_replay(saver: Any, ops: R.ReadOps, res: Results, stats: R.DiskStats) -> None:
    target = LIM.warm_memory(R.reads_room(ops))
    stagings = R.staging_buffers(ops)
    folder = Path(saver.output("ckpt"))
    try:
        C.drop_page_cache()
        seconds = on_disk(res, "r-replay", "load(into=...)'s reads replayed: the same files, "
                          "order and request sizes, O_DIRECT into 4 reused buffers + xxh3 + "
                          "memmove into touched memory", stats,
                          lambda: R.replay_reads(ops, folder, target, stagings),
                          f"{len(ops.reads)} reads of "
                          f"{ops.nbytes / max(len(ops.reads), 1) / 2**20:.1f} MiB on average")
    finally:
        target.close()
        for buf in stagings:
            buf.close()
    log(f"  into='s reads replayed: {seconds:.2f} s")


def measure_pieces(saver: Saver, sd: Mapping[str, Any], scratch: Path, res: Results) -> None:
    """Cold reads of the snapshot's own chunk files (the read limit), and the pieces of
    a save and a restore alone, on the same bytes."""
    files = LIM.chunk_files(saver.output("ckpt"))
    room = LIM.files_bytes(files)
    nbytes = S.state_bytes(sd)
    warm = LIM.warm_memory(room)
    try:
        for direct, key, label in ((True, "direct", "O_DIRECT"), (False, "buffered",
                                                                   "buffered")):
            C.drop_page_cache()
            seconds = LIM.timed(lambda direct=direct: LIM.read_files(files, warm,
                                                                     direct=direct))
            res.reads.row(key, f"plain read of isolane's chunk files, {label}, 4 threads, "
                          "into touched 4 KiB pages (limit)", f"{len(files)} files"
                          ).seconds.add(
                              seconds * nbytes / room)
    finally:
        warm.close()
    piece = res.profile.row
    C.drop_page_cache()
    fresh = LIM.fresh_memory(room)
    try:
        piece("read-fresh", "restore: the same O_DIRECT reads into fresh memory (faults "
              "inline)").seconds.add(LIM.timed(lambda: LIM.read_files(files, fresh,
                                                                      direct=True)))
    finally:
        fresh.close()
    for faulters in (1, 2):
        C.drop_page_cache()
        fresh = LIM.fresh_memory(room)
        try:
            piece(f"read-prefaulted-{faulters}", "restore, simplest code: the same O_DIRECT "
                  f"reads + xxh3 into fresh memory, {faulters} thread(s) faulting it in "
                  "ahead (the bound of a restore into new memory)").seconds.add(
                      LIM.read_files_prefaulted(files, fresh, faulters=faulters))
        finally:
            fresh.close()
    C.drop_page_cache()
    warm = LIM.warm_memory(room + 4096)
    try:
        took: list[float] = []
        seconds = LIM.read_files_staged(files, warm, read_seconds=took)
        piece("read-staged", "restore, simplest code: the same O_DIRECT reads into 4 reused "
              "staging buffers + xxh3 + memmove into touched, misaligned memory (the bound "
              "of into= targets O_DIRECT cannot fill)").seconds.add(seconds)
        piece("read-staged-inflight", "restore, simplest code, staged: O_DIRECT reads in "
              "flight on average (the 'median s' column: read thread-seconds / wall clock)",
              f"{len(took)} reads of {nbytes / max(len(took), 1) / 2**20:.1f} MiB on average"
              ).seconds.add(sum(took) / seconds)
    finally:
        warm.close()
    fresh = LIM.fresh_memory(room)
    try:
        faults = LIM.minor_faults()
        seconds = LIM.timed(lambda: LIM.populate(fresh))
        faults = LIM.minor_faults() - faults
        piece("fault", "restore: fault in fresh memory alone (MADV_POPULATE_WRITE, 1 "
              "thread)", "the kernel's page-fault rate: see below").seconds.add(seconds)
        piece("fault-rate", "restore: the kernel's fault rate on this VM, thousand 4 KiB "
              "pages a second (the 'median s' column)", "minor faults counted by getrusage "
              "/ seconds of the piece above").seconds.add(faults / seconds / 1000)
    finally:
        fresh.close()
    fresh = LIM.fresh_memory(room)
    try:
        seconds = LIM.timed(lambda: LIM.populate_threads(fresh, 2))
        piece("fault-2t", "restore: fault in fresh memory alone, 2 threads (halves)"
              ).seconds.add(seconds)
    finally:
        fresh.close()
    tensors = [S.as_byte_view(t) for t in S.tensors_of(sd)]
    piece("hash", "save and restore: xxh3-128 of every tensor, 1 thread").seconds.add(
        LIM.timed(lambda: [xxhash.xxh3_128(v).digest() for v in tensors]))
    piece("copy", "save: copy every tensor into a warm staging buffer (memmove, 1 "
          "thread)").seconds.add(copy_seconds(tensors))
    sizes = [p.stat().st_size for p in files]
    for each, key, label in ((True, "files-fsync-each", "each fsynced after its write"),
                             (False, "files-fsync-end", "all fsynced after the last write")):
        C.remove_path(scratch)
        big = LIM.warm_memory(max(sizes) + 4096)
        view = memoryview(big)
        LIM.settle()
        try:
            piece(key, f"save: one O_DIRECT file per chunk ({len(files)}), 4 threads, "
                  f"{label}").seconds.add(LIM.write_files(scratch, sizes, view,
                                                          fsync_each=each))
        finally:
            view.release()
            big.close()
            C.remove_path(scratch)


def copy_seconds(tensors: list[memoryview]) -> float:
    """Copy every tensor into one warm buffer the way isolane stages (``memmove``)."""
    from isolane.storage.aligned import buffer_address, copy_bytes

    staging = LIM.warm_memory(max(v.nbytes for v in tensors))
    view = memoryview(staging)
    try:
        dst = buffer_address(view)
        sources = [(buffer_address(v), v.nbytes) for v in tensors if v.nbytes]
        start = time.perf_counter()
        for src, n in sources:
            copy_bytes(dst, src, n)
        return time.perf_counter() - start
    finally:
        view.release()
        staging.close()


def lora_round(key: str, rnd: int, sd: dict[str, Any], adapter: list[torch.Tensor],
               saves: int, base: Path, res: Results) -> None:
    folder = base / f"lora-{key}-r{rnd}"
    C.remove_path(folder)
    saver = make_saver(key, folder)
    try:
        full = res.lora_full.row(key, saver.label)
        again = res.lora_resave.row(key, saver.label)
        for i in range(saves):
            if i:
                for t in adapter:
                    t.add_(1e-3)  # a training step changed the adapter, not the base
            sd["step"] = i
            seconds = timed_save(saver, sd, f"lora-{i}")
            (again if i else full).seconds.add(seconds)
            if i and not saver.incremental:
                saver.remove(f"lora-{i - 1}")
        log(f"  {saver.label}: full {full.seconds.values[-1]:.2f} s, re-saves "
            f"{', '.join(f'{v:.2f}' for v in again.seconds.values[-(saves - 1):])} s")
        if rnd == 0:
            _, verdict, _ = restore_once(saver, 0, f"lora-{saves - 1}", sd, cold=False)
            again.verdicts.append(verdict)
    finally:
        saver.close()
        C.remove_path(folder)


def guarded(row_rows: Rows, key: str, label: str, fn: Callable[[], None]) -> None:
    """Run one system's round; a failure is recorded in its row, the others go on."""
    try:
        fn()
    except Exception as exc:  # report any system's failure in the table, keep measuring
        traceback.print_exc()
        row_rows.row(key, label).errors.append(f"{type(exc).__name__}: {exc}"[:200])


# -- the cases ---------------------------------------------------------------------------
def run_mixed(args: argparse.Namespace, systems: list[str], res: Results) -> None:
    plan = S.plan_mixed(args.scale)
    res.plans["mixed"] = plan
    mixed_rounds(plan, args, systems, res)  # returns after the state dict is freed
    gc.collect()
    if not args.no_rss:
        measure_rss(args, systems, res)


def mixed_rounds(plan: S.StatePlan, args: argparse.Namespace, systems: list[str],
                 res: Results) -> None:
    log(f"mixed: building {C.fmt_gb(plan.nbytes)} ({len(plan.tensors)} tensors)")
    sd = S.build_state_dict(plan)
    limit_file = args.dir / "limit.bin"
    source = LIM.random_buffer(64 << 20)
    for rnd in range(args.repeats):
        log(f"mixed: round {rnd + 1}/{args.repeats}")
        for writer in LIM.simple_writers():
            C.remove_path(limit_file)
            try:
                LIM.settle()
                seconds = writer.write(limit_file, plan.nbytes, memoryview(source))
            finally:
                C.remove_path(limit_file)
            blocks = -(-plan.nbytes // writer.block_bytes) * writer.block_bytes
            res.limits.row(writer.key, f"{writer.label} (limit)",
                           "one new file, fsync at the end (wall clock)").seconds.add(
                               seconds * plan.nbytes / blocks)
            log(f"  {writer.label}: {blocks / seconds / C.GB:.2f} GB/s")
        for limit in (settled(C.measure_dd_write, limit_file, plan.nbytes),
                      settled(C.measure_fio_write, limit_file, plan.nbytes)):
            if limit is not None:
                label = f"{limit.tool} O_DIRECT sequential write (limit)"
                note = f"`{limit.command}`" + (" (fio's own write runtime)"
                                               if limit.tool == "fio" else " (wall clock)")
                res.limits.row(limit.tool, label, note).seconds.add(
                    limit.seconds * plan.nbytes / limit.nbytes)
                log(f"  {label}: {limit.nbytes / limit.seconds / C.GB:.2f} GB/s")
        turn = rnd % len(systems)  # who goes first rotates: no system always follows another
        for key in systems[turn:] + systems[:turn]:
            if key in MIXED_SKIP:
                continue
            guarded(res.saves, key, key, lambda key=key, rnd=rnd: mixed_round(
                key, rnd, sd, args.dir, res, source))


def measure_rss(args: argparse.Namespace, systems: list[str], res: Results) -> None:
    log("mixed: peak RSS, one fresh process per system")
    for key in systems:
        if key in MIXED_SKIP or (args.quick and key not in QUICK_RSS):
            continue  # --quick: a child of each kind of isolane save (a peer's is the same)
        variants = [False, True] if f"{key}:async" in res.saves else [False]
        for use_async in variants:
            name = f"{key}:async" if use_async else key
            argv = [str(Path(__file__).resolve()), "--child", "save", "--system", key,
                    "--case", "mixed", "--scale", str(args.scale), "--dir", str(args.dir)]
            try:
                res.rss[name] = C.run_child(argv + (["--async"] if use_async else []))
                log(f"  {name}: peak {res.rss[name]['peak_rss'] / C.GB:.2f} GB")
            except RuntimeError as exc:
                res.rss[name] = {"error": str(exc).splitlines()[-1][:200]}
                log(f"  {name}: {exc}")


def run_lora(args: argparse.Namespace, systems: list[str], res: Results) -> None:
    plan = S.plan_lora(args.scale)
    res.plans["lora"] = plan
    log(f"lora: building {C.fmt_gb(plan.nbytes)} ({len(plan.tensors)} tensors)")
    sd = S.build_state_dict(plan)
    adapter = [S.get_path(sd, p) for p in S.adapter_paths(plan)]
    keys = [k for k in systems if k not in LORA_SKIP]
    for rnd in range(args.repeats):
        log(f"lora: round {rnd + 1}/{args.repeats}")
        for key in keys:
            guarded(res.lora_full, key, key, lambda key=key, rnd=rnd: lora_round(
                key, rnd, sd, adapter, args.lora_saves, args.dir, res))


def child_save(args: argparse.Namespace) -> None:
    """``--child save``: build the state dict, save it once, report time and peak RSS."""
    plan = S.PLANS[args.case](args.scale)
    sd = S.build_state_dict(plan)
    folder = args.dir / f"rss-{args.system}-{os.getpid()}"
    C.remove_path(folder)
    saver = make_saver(args.system, folder)
    gc.collect()
    rss_before = C.current_rss_bytes()
    reset = C.reset_peak_rss()
    try:
        if args.use_async:
            tensors = S.tensors_of(sd)
            blocked, seconds = timed_async(saver, sd, "rss", [tensors[0]])
        else:
            blocked, seconds = 0.0, timed_save(saver, sd, "rss")
        # VmHWM, not ru_maxrss: Linux carries the parent's peak into ru_maxrss across
        # fork + exec, so a child's ru_maxrss is never below its parent's RSS at fork
        peak, ru_maxrss = C.hwm_rss_bytes(), C.peak_rss_bytes()
    finally:
        saver.close()
        C.remove_path(folder)
    C.emit_result({"system": args.system, "async": args.use_async, "sd_bytes": plan.nbytes,
                   "rss_before": rss_before, "peak_rss": peak, "ru_maxrss": ru_maxrss,
                   "peak_reset": reset, "seconds": seconds, "blocked": blocked})


# -- the report --------------------------------------------------------------------------
def render(res: Results, args: argparse.Namespace, systems: list[str]) -> str:
    title = "Checkpoint save and restore"
    if args.section != SECTION:
        title += f" ({args.section})"
    out: list[str] = [f"## {title} (`benchmarks/bench_snapshot.py`)", ""]
    packages = {"torch": torch.__version__, "safetensors": safetensors.__version__}
    fio = C.tool_version(["fio", "--version"])
    if fio:
        packages["fio"] = fio.removeprefix("fio-")
    out += [f"Command: `{C.command_line()}`  ", f"Date: {C.now_text()}  ",
            "Machine: " + C.machine_description(args.dir, packages), ""]
    out.append(
        f"Medians of {args.repeats} run(s) (individual runs listed); 1 GB = 10^9 bytes. A save "
        "is timed until durable: every file and folder it wrote is fsynced inside the timing. "
        "Every timed write (saves and simple writers alike) starts after `sync` and a "
        f"{LIM.SETTLE_S:g} s pause, so that none runs while the disk still trims a scratch "
        "file deleted just before (the filesystem is mounted with `discard` here). "
        "Systems take turns round by round, the one going first rotating each round. "
        "Restores run after `sync; echo 3 > "
        "/proc/sys/vm/drop_caches`" + ("" if res.cache_dropped else
                                       " (**refused: not root — restores ran warm**)") +
        ", include touching every page of every tensor, and are compared bit for bit with "
        "the original afterwards.")
    out += [""] + [f"> {line}" for line in res.skipped] + ([""] if res.skipped else [])

    out += ["### State dicts", "", C.markdown_table(
        ["case", "size", "tensors", "< 1 MiB", "contents"],
        [[p.case, C.fmt_gb(p.nbytes), len(p.tensors), p.count_small(), p.description]
         for p in res.plans.values()]), ""]

    if "mixed" in res.plans:
        nbytes = res.plans["mixed"].nbytes
        torch_s = res.saves.median("torch")
        rows = []
        for row in [*res.limits.values(), *res.saves.values()]:
            rows.append([row.label, C.fmt_seconds(row.median), C.fmt_rate(nbytes, row.median),
                         C.fmt_seconds(row.blocked.median) if row.blocked else "",
                         row.seconds.runs_text(), C.fmt_ratio(C.ratio(torch_s, row.median)),
                         row.check_text(), row.note])
        out += [f"### Save: mixed ({C.fmt_gb(nbytes)})", "", C.markdown_table(
            ["system", "median s", "GB/s", "blocked s", "runs (s)", "speedup vs torch.save",
             "check", "notes"], rows), ""]

        torch_r = res.restores.median("torch:0")
        out += ["### Restore: mixed (cold page cache)", "", C.markdown_table(
            ["system", "median s", "GB/s", "runs (s)", "speedup vs torch.load", "check",
             "notes"],
            [[r.label, C.fmt_seconds(r.median), C.fmt_rate(nbytes, r.median),
              r.seconds.runs_text(), C.fmt_ratio(C.ratio(torch_r, r.median)), r.check_text(),
              r.note] for r in res.restores.values()]), ""]

        if res.reads or res.profile:
            prow = [[r.label, C.fmt_seconds(r.median), C.fmt_rate(nbytes, r.median),
                     r.seconds.runs_text(), r.note]
                    for r in [*res.reads.values(), *res.profile.values()]]
            out += ["### Where the seconds go: the pieces alone, same bytes, same rounds", "",
                    "Each piece measured on its own right after isolane's save in every "
                    "round (reads after dropping the page cache). GB/s = state-dict bytes / "
                    "seconds.", "", C.markdown_table(
                        ["piece", "median s", "GB/s", "runs (s)", "notes"], prow), ""]

        if res.replays:
            out += ["### isolane next to its own file operations replayed by the simplest "
                    "code (same rounds)", "",
                    "The timed save and load(into=...) above, each sharing its round with "
                    "the limit's kind of simple writer or reader and with what isolane asked "
                    "of the local store (recorded in round 1) replayed by a plain loop: the "
                    "same files, request sizes and order (and for the save the same "
                    "fsyncs), without isolane's copies, hashes (the read replay does hash "
                    "and copy, as into= must) or planning. Which of the three goes first "
                    "rotates every round (in round 1 the replay follows isolane). Device "
                    "columns: `/proc/diskstats` of the disk over each timed piece (medians): "
                    "requests the device completed, their average size, the share of the "
                    "wall clock it had a request in flight, and the requests it held on "
                    "average.", "", C.markdown_table(
                        ["piece", "median s", "GB/s", "runs (s)", "device requests",
                         "KiB per request", "device busy", "requests in flight", "notes"],
                        replay_rows(res, nbytes)), ""]

        bounds = bound_rows(res)
        if bounds:
            out += ["### Each target against the simplest code doing the same work (same "
                    "run)", "",
                    "'needs' = the time the target asks for (from the peer or limit measured "
                    "in the same rounds); 'bound' = the fastest simple loop doing the same "
                    "work on the same bytes (rows above). When the bound itself is over "
                    "what the target needs, no implementation of that kind reaches it on "
                    "this machine; when isolane is well over the bound, the rest is "
                    "isolane's own.", "", C.markdown_table(
                        ["target", "isolane s", "needs s", "bound s", "bound", "isolane / "
                         "bound", "verdict"], bounds), ""]

        if res.rss:
            rss_rows = []
            for name, r in res.rss.items():
                label = res.saves[name].label if name in res.saves else name
                if "error" in r:
                    rss_rows.append([label, "", "", "", "ERROR: " + r["error"]])
                    continue
                rss_rows.append([label, C.fmt_gb(r["peak_rss"]),
                                 C.fmt_gb(r["peak_rss"] - r["sd_bytes"]),
                                 C.fmt_gb(r["peak_rss"] - r["rss_before"]),
                                 "" if r["peak_reset"] else "peak not reset after build"])
            out += ["### Peak memory of one save (mixed, fresh process)", "",
                    "A child process builds the same state dict and saves it once. Peak = "
                    "`VmHWM`, reset with `/proc/self/clear_refs` after building, so 'added by "
                    "the save' is the save's own memory on top of the process and its state "
                    "dict ('peak - state dict' also counts the interpreter and torch). "
                    "(`ru_maxrss` is unusable here: Linux carries the parent's peak into a "
                    "child's `ru_maxrss` across fork + exec.)", "", C.markdown_table(
                        ["system", "peak RSS", "peak - state dict", "added by the save",
                         "notes"], rss_rows), ""]

    if "lora" in res.plans:
        nbytes = res.plans["lora"].nbytes
        torch_re = res.lora_resave.median("torch")
        rows = []
        for key, full in res.lora_full.items():
            again = res.lora_resave.get(key, Row(full.label))
            rows.append([full.label, C.fmt_seconds(full.median), C.fmt_seconds(again.median),
                         C.fmt_rate(nbytes, again.median), again.seconds.runs_text(),
                         C.fmt_ratio(C.ratio(full.median, again.median)),
                         C.fmt_ratio(C.ratio(torch_re, again.median)),
                         full.check_text() or again.check_text()])
        out += [f"### LoRA: {args.lora_saves} saves, adapter changed in place in between "
                f"({C.fmt_gb(nbytes)})", "",
                "The 1st save is a full save into an empty folder; the re-saves follow an "
                "in-place `add_` on every adapter tensor (isolane dedups the unchanged base "
                "against the previous snapshot; the peers write everything again and delete "
                "the previous file). GB/s = state-dict size / re-save time.", "",
                C.markdown_table(
                    ["system", "1st save s", "re-save median s", "effective GB/s",
                     "re-saves (s)", "re-save speedup vs own 1st", "re-save speedup vs "
                     "torch.save", "check (last save restored)"], rows), ""]

    out += ["### Ratios", "", C.markdown_table(["ratio", "value", "target", "the target takes"],
                                               ratio_rows(res)), ""]
    return "\n".join(out)


def replay_rows(res: Results, nbytes: int) -> list[list[str]]:
    rows = []
    for key, r in res.replays.items():
        seen = res.disk.get(key, [])

        def med(field: str, seen: list[dict[str, float]] = seen) -> float | None:
            values = sorted(d[field] for d in seen if field in d)
            return C.Samples(values).median if values else None

        requests, kib, busy, depth = (med(f) for f in ("requests", "request_kib", "busy",
                                                       "depth"))
        rows.append([r.label, C.fmt_seconds(r.median), C.fmt_rate(nbytes, r.median),
                     r.seconds.runs_text(), f"{requests:.0f}" if requests is not None else "",
                     f"{kib:.0f}" if kib is not None else "",
                     f"{busy * 100:.0f} %" if busy is not None else "",
                     f"{depth:.1f}" if depth is not None else "", r.note])
    return rows


def bound_rows(res: Results) -> list[list[str]]:
    """[target, isolane s, needed s, bound s, bound's name, isolane / bound, verdict] for
    the issue-13 targets, from this run's medians."""
    saves, restores, prof = res.saves, res.restores, res.profile
    limits = [r.median for r in res.limits.values() if r.median]
    reads = [r.median for r in res.reads.values() if r.median]
    into_limit = res.reads.median(ADJACENT_READ) or (min(reads) if reads else None)
    torch_r, torch_mmap = restores.median("torch:0"), restores.median("torch:1")
    replays = res.replays
    fresh = [m for m in (prof.median("read-prefaulted-1"), prof.median("read-prefaulted-2"))
             if m]
    cases = [
        ("save ≥ 95 % of the fastest simple writer", saves.median("isolane"),
         min(limits) / TARGETS["save_vs_limit"] if limits else None,
         replays.median("w-replay"), "isolane's own save replayed in the same rounds: the "
         "same files, request sizes, order and fsyncs from a plain loop (no copy, no hash)"),
        ("plain load() ≥ 1.5x torch.load", restores.median("isolane:0"),
         torch_r / TARGETS["restore_vs_torch"] if torch_r else None,
         min(fresh) if fresh else None, "O_DIRECT reads + xxh3 into fresh memory, "
         "1 or 2 threads faulting ahead (the faster)"),
        ("plain load() ≥ 1.0x torch.load(mmap=True)", restores.median("isolane:0"),
         torch_mmap / TARGETS["restore_vs_torch_mmap"] if torch_mmap else None,
         min(fresh) if fresh else None, "O_DIRECT reads + xxh3 into fresh memory, "
         "1 or 2 threads faulting ahead (the faster)"),
        ("load(into=) ≥ 85 % of the cold read limit (measured next to it)",
         restores.median("isolane:2"),
         into_limit / TARGETS["into_vs_read_limit"] if into_limit else None,
         replays.median("r-replay"), "its own reads replayed in the same rounds: the same "
         "files, order and request sizes, O_DIRECT into 4 reused buffers + xxh3 + memmove "
         "into the targets"),
        ("load(mmap=True) vs torch.load(mmap=True) (no target: fastest in its class)",
         restores.median("isolane:1"), torch_mmap, None, ""),
    ]
    rows = []
    for target, iso, needs, bound, what in cases:
        if iso is None or needs is None:
            continue
        if iso <= needs:
            verdict = "met"
        elif bound is not None and bound > needs:
            verdict = (f"not met; out of reach here: the simplest code takes {bound:.2f} s, "
                       f"{(bound / needs - 1) * 100:.0f} % over what the target needs")
            if iso > bound * 1.05:
                verdict += f"; isolane is another {(iso / bound - 1) * 100:.0f} % over it"
        elif bound is not None:
            verdict = (f"not met; the simplest code is within the target, isolane is "
                       f"{(iso / bound - 1) * 100:.0f} % over it")
        else:
            verdict = "not met"
        rows.append([target, C.fmt_seconds(iso), C.fmt_seconds(needs),
                     C.fmt_seconds(bound) if bound else "", what,
                     C.fmt_ratio(C.ratio(iso, bound)) if bound else "", verdict])
    return rows


def ratio_rows(res: Results) -> list[list[str]]:
    """[ratio, value, target, what the target takes]; the last column turns a save target
    into a write rate and compares it with the measured O_DIRECT limit."""
    saves, restores = res.saves, res.restores
    nbytes = res.plans["mixed"].nbytes if "mixed" in res.plans else 0
    iso = saves.median("isolane")
    limits = [r.median for r in res.limits.values() if r.median]
    limit = min(limits) if limits else None  # fastest tool = the tightest limit
    rows: list[list[str]] = []

    def add(label: str, value: float | None, target: str = "", *, percent: bool = False,
            needs: str = "") -> None:
        rows.append([label, C.fmt_ratio(value, percent=percent), target, needs])

    def needs_save(peer_s: float | None, factor: float) -> str:
        if not peer_s or not nbytes:
            return ""
        rate = factor * nbytes / peer_s
        share = f" = {rate * limit / nbytes * 100:.0f} % of the limit" if limit else ""
        return f"{rate / C.GB:.2f} GB/s{share}"

    def needs_restore(peer_s: float | None, factor: float) -> str:
        return f"{factor * nbytes / peer_s / C.GB:.2f} GB/s" if peer_s and nbytes else ""

    torch_s, dcp4_s = saves.median("torch"), saves.median("dcp4")
    add("isolane save vs torch.save (speedup)", C.ratio(torch_s, iso),
        f"≥ {TARGETS['save_vs_torch']:.0f}x", needs=needs_save(torch_s,
                                                               TARGETS["save_vs_torch"]))
    add("isolane save vs DCP thread_count=4 (speedup)", C.ratio(dcp4_s, iso),
        f"≥ {TARGETS['save_vs_dcp4']:.0f}x", needs=needs_save(dcp4_s, TARGETS["save_vs_dcp4"]))
    add("isolane save, share of the write limit (fastest simple writer: pwrite loops, dd, fio)",
        C.ratio(limit, iso), f"≥ {TARGETS['save_vs_limit'] * 100:.0f} %", percent=True,
        needs=needs_save(limit, TARGETS["save_vs_limit"]))
    replay = res.replays.median("w-replay")
    add("isolane save / its own save replayed (same rounds)",
        C.ratio(res.replays.median("w-save"), replay))
    ahead = writer_stage_ahead()
    how = "on the write lane's threads" if ahead else "staged ahead on stager threads"
    ab = res.replays.median("w-save-ab")
    add(f"isolane save with copies and hashes {how}, share of the write limit (the A/B of "
        f"writer.STAGE_AHEAD = {ahead})", C.ratio(limit, ab), percent=True)
    add(f"isolane save with copies and hashes {how} / its own save replayed (same rounds)",
        C.ratio(ab, replay))
    add("isolane save with each chunk file fsynced after its write, share of the write "
        "limit (the A/B of deferred chunk fsyncs)",
        C.ratio(limit, saves.median("isolane-fsync-each")), percent=True)
    add("isolane 2nd save (same store) vs torch.save",
        C.ratio(torch_s, saves.median("isolane:2nd")))
    add("isolane 1st save of a fresh store (staging prefilled when the save starts, not "
        "at open) vs its 2nd save (warm staging): speed ratio",
        C.ratio(saves.median("isolane:2nd"), iso), "≈ 1.0x")
    torch_r = restores.median("torch:0")
    add("isolane restore vs torch.load (speedup)",
        C.ratio(torch_r, restores.median("isolane:0")), f"≥ {TARGETS['restore_vs_torch']}x",
        needs=needs_restore(torch_r, TARGETS["restore_vs_torch"]))
    add("isolane restore (mmap=True) vs torch.load (speedup)",
        C.ratio(torch_r, restores.median("isolane:1")), f"≥ {TARGETS['restore_vs_torch']}x")
    add("isolane restore (into=...) vs torch.load (speedup)",
        C.ratio(torch_r, restores.median("isolane:2")), f"≥ {TARGETS['restore_vs_torch']}x")
    add("isolane restore (into=...) vs DCP load (thread_count=4 files) (speedup)",
        C.ratio(restores.median("dcp4:0"), restores.median("isolane:2")))
    add("isolane LoRA re-save vs its full save (speedup)",
        C.ratio(res.lora_full.median("isolane"), res.lora_resave.median("isolane")))
    add("isolane LoRA re-save vs torch.save re-save (speedup)",
        C.ratio(res.lora_resave.median("torch"), res.lora_resave.median("isolane")))
    add("isolane LoRA re-save, change_detection='version', vs its full save (speedup)",
        C.ratio(res.lora_full.median("isolane-version"),
                res.lora_resave.median("isolane-version")))
    torch_mmap = restores.median("torch:1")
    add("isolane restore vs torch.load(mmap=True) (speedup)",
        C.ratio(torch_mmap, restores.median("isolane:0")),
        f"≥ {TARGETS['restore_vs_torch_mmap']:.1f}x",
        needs=needs_restore(torch_mmap, TARGETS["restore_vs_torch_mmap"]))
    add("isolane restore (mmap=True) vs torch.load(mmap=True) (speedup)",
        C.ratio(torch_mmap, restores.median("isolane:1")))
    reads = [r.median for r in res.reads.values() if r.median]
    read_limit = min(reads) if reads else None
    add("isolane restore (into=...), share of the cold read limit of its chunk files "
        "measured next to it (same round, alternating which goes first)",
        C.ratio(res.reads.median(ADJACENT_READ), restores.median(f"isolane:{INTO_MODE}")),
        f"≥ {TARGETS['into_vs_read_limit'] * 100:.0f} %", percent=True)
    for index, name in ((2, "into=..."), (0, "plain"), (1, "mmap=True")):
        add(f"isolane restore ({name}), share of the fastest cold read limit of its chunk "
            "files (any of the rows above)",
            C.ratio(read_limit, restores.median(f"isolane:{index}")), percent=True)
    for key, name in (("isolane", "isolane save_async"), ("dcp4", "DCP async_save")):
        row = saves.get(f"{key}:async")
        blocked = row.blocked.median if row and row.blocked else None
        add(f"{name} blocking time / its sync save", C.ratio(blocked, saves.median(key)),
            f"≤ {TARGETS['async_blocking'] * 100:.0f} %" if key == "isolane" else "",
            percent=True)
    for key, name in (("torch", "torch.save"), ("safetensors", "safetensors save_file"),
                      ("dcp4", "DCP thread_count=4")):
        add(f"{name}, share of the O_DIRECT write limit", C.ratio(limit, saves.median(key)),
            percent=True)
    return rows


def writer_stage_ahead() -> bool:
    import isolane.snapshot.writer as writer

    return bool(writer.STAGE_AHEAD)


# -- command line ------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", type=float, default=1.0,
                   help="state dict size factor: 1.0 = ~4 GB mixed, ~3 GB LoRA base")
    p.add_argument("--repeats", type=int, default=3, help="runs per measurement (median)")
    p.add_argument("--dir", type=Path, default=C.REPO_ROOT / ".bench",
                   help="scratch folder for the saves (deleted after each)")
    p.add_argument("--out", type=Path, help="markdown file whose section to (re)write")
    p.add_argument("--section", default=SECTION, help="section marker name in --out")
    p.add_argument("--cases", default="mixed,lora", help="comma list: mixed, lora")
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                   help=f"comma list from: {', '.join(SYSTEMS)}")
    p.add_argument("--lora-saves", type=int, default=5, help="saves in the LoRA sequence")
    p.add_argument("--no-rss", action="store_true", help="skip the peak-RSS child processes")
    p.add_argument("--json", type=Path, help="also write the raw measurements here")
    p.add_argument("--child", choices=["save"], help=argparse.SUPPRESS)
    p.add_argument("--system", help=argparse.SUPPRESS)
    p.add_argument("--case", choices=list(S.PLANS), help=argparse.SUPPRESS)
    p.add_argument("--async", dest="use_async", action="store_true", help=argparse.SUPPRESS)
    _quick.add_argument(p)
    args = p.parse_args(argv)
    if args.quick:  # every system (isolane-fsync-each too), both cases, the RSS children
        _quick.enter(args, p)
        args.scale, args.repeats, args.lora_saves = QUICK_SCALE, 1, 2
        if args.systems == p.get_default("systems"):
            args.systems = ",".join(SYSTEMS)
    if args.scale <= 0 or args.repeats < 1 or args.lora_saves < 2:
        p.error("--scale must be > 0, --repeats >= 1 and --lora-saves >= 2")
    args.dir = args.dir.resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    if args.child:
        child_save(args)
        return 0
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    if unknown or any(c not in S.PLANS for c in cases):
        print(f"unknown system or case in {systems} / {cases}; systems: {', '.join(SYSTEMS)};"
              f" cases: {', '.join(S.PLANS)}", file=sys.stderr)
        return 2
    res = Results()
    if args.quick and (why := isolane_missing()):
        print(f"--quick: cannot import isolane.snapshot.SnapshotStore ({why})",
              file=sys.stderr)
        return 1
    if "isolane" in systems and (why := isolane_missing()):
        systems.remove("isolane")
        res.skipped.append(f"isolane rows skipped: `from isolane.snapshot import "
                           f"SnapshotStore` failed ({why}).")
        log(f"SKIPPING isolane: cannot import isolane.snapshot.SnapshotStore ({why}); "
            "measuring the peers only")
    if "mixed" in cases:
        run_mixed(args, systems, res)
    if "lora" in cases:
        run_lora(args, systems, res)
    C.print_report(render(res, args, systems), args.out, args.section)
    if args.json:
        args.json.write_text(json.dumps(raw(res), indent=1))
    return 0


def raw(res: Results) -> dict[str, Any]:
    def rows(r: Rows) -> dict[str, Any]:
        return {k: {"label": v.label, "seconds": v.seconds.values, "blocked": v.blocked.values,
                    "check": v.check_text()} for k, v in r.items()}

    return {"sizes": {k: p.nbytes for k, p in res.plans.items()},
            "limits": rows(res.limits), "saves": rows(res.saves),
            "restores": rows(res.restores), "rss": res.rss,
            "lora_full": rows(res.lora_full), "lora_resave": rows(res.lora_resave)}


if __name__ == "__main__":
    sys.exit(main())
