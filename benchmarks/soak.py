"""Chaos soak: trainers, gc, rm, inference and storage nodes under SIGKILLs, full disks
and flipped bytes, for a bounded time; then every invariant is checked.

    python benchmarks/soak.py --minutes 10 --seed 11 --out docs/BENCHMARKS.md  # records its rows
    python benchmarks/soak.py --quick    # 15 s of chaos: the smoke test (tests/test_soak.py)

Members (real processes in ``_soak_worker.py``, started again after every kill): trainers
on the embedded store (sync, async, incremental, overwrite, two racing for each new
name), a 2-rank torchrun job (gloo), a trainer through three ``isolane serve`` nodes, gc,
rm, a verifier loading acknowledged snapshots, KV inference on the embedded pool and
through the nodes, and a fourth node that joins and leaves. Faults on ``--seed`` (what
they hit depends on timing): SIGKILL of a member, a torchrun rank or a node; a full
tmpfs holding one checkpoint and one KV device; a byte flipped in a chunk, a manifest
digit or a KV record (each recorded); symlinks into a canary tree planted where the
stores delete; SIGKILL of a member hung in an operation. Beside them a cluster through a
real etcd: three nodes and two KV clients on ``KVPool.connect("etcd://...")`` under a
node SIGKILL, a node SIGSTOPped past its lease and an etcd restart.

The 19 invariants (``INVARIANTS``), checked once every member stopped (exit code 1 if any
fails): acknowledged saves load bit-exact (an IntegrityError only for bytes damaged on
purpose); damage is detected; one damaged snapshot fails alone (list() works); overwrite
keeps the newest commit; one save wins a new name; no KV get returns wrong bytes; KV
misses only for damaged or evicted blocks; gc deletes nothing committed; gc leaves no
orphan; nothing outside the stores changes (the canary); no process hangs; no member
exits by itself; no cluster client crashes; every node back in the membership (etcd
and every client's ring); members exit cleanly; members restart; nodes log no
tracebacks; errors are IsolaneErrors; the final check runs. The run folder (``--dir``)
is deleted afterwards unless ``--keep``.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _common as C
import _quick
import _soak_worker as W
import torch
import yaml
from _results import Result

from isolane import IntegrityError, KVPool, RemoteKVPool, RemoteSnapshotStore, SnapshotStore
from isolane.errors import SnapshotNotFoundError
from isolane.kvpool.log.keydir import FLAG_PUT, FLAG_TOMBSTONE
from isolane.kvpool.log.records import RECORD_HEADER, SEGMENT_HEADER_BYTES, record_geometry
from isolane.snapshot.manifest import MANIFEST, PART_MANIFEST, WRITING_MARKER
from tests.support.etcd import EtcdServer
from tests.support.node import NodeProcess, write_node_config
from tests.support.procs import die_with_parent, free_ports

HERE = Path(__file__).resolve().parent
WORKERS = {"sync": "sync", "async": "async", "incremental": "incremental",
           "overwrite": "overwrite", "race-a": "race", "race-b": "race", "remote": "remote",
           "dist": "dist", "gc": "gc", "rm": "rm", "verify": "verify", "kv": "kv",
           "kv-cluster": "kv-cluster"}
SAVERS = ("sync", "async", "incremental", "overwrite", "race-a", "race-b", "dist", "remote")
TMPFS_MIB = 96
GC_GRACE_S = 10
SNAPSHOT_SECTION = {"chunk_bytes": "1MiB", "pack_threshold": "64KiB",
                    "staging_budget": "16MiB", "gc_grace_s": GC_GRACE_S}
OP_TIMEOUT_S = 180.0  # an operation running longer is a hang
# A member must exit this soon after SIGTERM: above the 150 s an operation in flight may
# take within the clients' timeouts and retries (_soak_worker.REMOTE_READ_TIMEOUT_S).
STOP_TIMEOUT_S = 240.0
NODE_START_S = 240.0  # two dozen processes import torch at once on a shared machine
BATCH = 256  # KV blocks a final read asks for at once
# Not chunk data: a rank's part manifest is merged into the snapshot's at commit (a flip
# in it after that is harmless, so no verify can be asked to see it).
NOT_CHUNKS = {MANIFEST, "zarr.json", WRITING_MARKER, PART_MANIFEST}
INVARIANTS = (
    "acknowledged saves load bit-exact", "damage is detected",
    "one damaged snapshot fails alone", "overwrite keeps the newest commit",
    "one save wins a new name", "no KV get returns wrong bytes",
    "KV misses only for damaged or evicted blocks", "gc deletes nothing committed",
    "gc leaves no orphan", "nothing outside the stores changes", "no process hangs",
    "no member exits by itself", "no cluster client crashes",
    "every node back in the membership", "members exit cleanly", "members restart",
    "nodes log no tracebacks", "errors are IsolaneErrors", "final check runs")
LOADED_WRONG = "acknowledged saves load bit-exact"


def devices(paths: dict[str, Path], group: str) -> tuple[list[Path], list[Path]]:
    """The device folders of ``group`` (``ckpt`` or ``kv``): the embedded store's (one on
    the tmpfs), and one on each node."""
    emb = paths["stores"] / "embedded"
    return ([emb / f"{group}0", emb / "small" / f"{group}1"],
            [paths["stores"] / f"node-{i}" / group for i in range(1, 5)])


def log_tail(path: Path, lines: int = 12) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def first_traceback(log: Path) -> str | None:
    text = log.read_text(errors="replace")
    at = text.find("Traceback")
    return None if at < 0 else f"{text.count('Traceback')}, the first: {text[at:at + 600]}"


@dataclass
class Member:
    """A worker process (or the torchrun job) the soak starts, kills and restarts."""

    name: str
    argv: list[str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    killed: bool = False  # by the chaos thread: its exit is expected
    stopping: bool = False
    starts: int = 0

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, cwd=C.REPO_ROOT,
                                         preexec_fn=die_with_parent)
        self.killed = False
        self.starts += 1

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def victims(self) -> list[int]:
        """The pids a kill may hit: the process, or for torchrun its ranks."""
        if not self.alive or self.proc is None:
            return []
        if self.name != "dist":
            return [self.proc.pid]
        with contextlib.suppress(OSError):
            pid = self.proc.pid
            return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
        return []


class Soak:
    def __init__(self, args: argparse.Namespace, run: Path) -> None:
        self.args, self.run = args, run
        shutil.rmtree(run, ignore_errors=True)
        self.paths = W.run_paths(run)
        for key in ("journal", "hb", "ctl", "logs", "stores", "canary"):
            self.paths[key].mkdir(parents=True)
        self.journal = W.Journal(self.paths["journal"] / "chaos.jsonl")
        self.members: dict[str, Member] = {}
        self.nodes: dict[str, NodeProcess] = {}
        self.nodes_away: set[str] = set()  # killed or starting: no kill target
        self.tmpfs: Path | None = None
        self.findings: list[dict[str, str]] = []
        self.lock, self.done = threading.Lock(), threading.Event()
        self.timers: list[threading.Thread] = []
        self.stop_s: dict[str, float] = {}  # SIGTERM to exit, by member
        self.cluster = ClusterPhase(self, run / "cluster")
        self.cluster_thread = threading.Thread(
            target=self.guard, args=("cluster phase", self.cluster.run), daemon=True)
        self.cluster_result: dict[str, Any] = {}
        self.started_at, self.stopped_at, self.wall_started = 0.0, 0.0, time.time()
        # PR_SET_PDEATHSIG kills a child when the *thread* that started it ends: every
        # (re)start from another thread runs in this one, which lives until cleanup.
        self.starter = ThreadPoolExecutor(1, thread_name_prefix="soak-starter")

    def setup(self) -> None:
        make_canary(self.paths["canary"], self.args.seed)
        W.write_json(self.run / "canary-before.json", tree_digest(self.paths["canary"]))
        emb = self.paths["stores"] / "embedded"
        (emb / "small").mkdir(parents=True)
        mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_MIB}m,mode=0700",
                                "tmpfs", str(emb / "small")], capture_output=True, text=True)
        why = (mount.stderr or mount.stdout).strip() or f"mount exited {mount.returncode}"
        self.tmpfs = emb / "small" if mount.returncode == 0 else None
        self.tmpfs_note = (f"tmpfs of {TMPFS_MIB} MiB (mount -t tmpfs)" if self.tmpfs
                           else f"not injected: mount -t tmpfs failed ({why})")
        ckpt, kv = (devices(self.paths, group)[0] for group in ("ckpt", "kv"))
        self.paths["embedded_config"].write_text(yaml.safe_dump({
            "home": str(emb / "home"), "device_groups": {
                "checkpoint": {"role": "write", "devices": [str(d) for d in ckpt],
                               "inflight_bytes": "64MiB"},
                "kv": {"role": "read", "devices": [str(d) for d in kv],
                       "memory_budget": "16MiB", "inflight_bytes": "64MiB"}},
            "snapshot": SNAPSHOT_SECTION, "kvpool": {"segment_bytes": "1MiB"}}))
        for i, port in enumerate(free_ports(4), 1):
            cfg = write_node_config(self.paths["stores"] / f"node-{i}", snapshot=SNAPSHOT_SECTION)
            self.nodes[f"node-{i}"] = NodeProcess(cfg, port=port, startup_timeout_s=NODE_START_S)
            self.nodes[f"node-{i}"].log_path = self.paths["logs"] / f"node-{i}.log"
        urls = [node.url for node in self.nodes.values()]
        W.write_json(self.paths["nodes"], {"base": urls[:3], "urls": urls})
        W.write_json(self.paths["members"], {"version": 0, "members": urls[:3]})
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                    "--master-addr", "127.0.0.1", "--master-port", str(free_ports(1)[0]),
                    "--max-restarts", "0"]
        for name, role in WORKERS.items():
            self.members[name] = Member(name, [
                *(torchrun if role == "dist" else [sys.executable]), str(HERE / "_soak_worker.py"),
                role, str(self.run), name, str(self.args.seed)], self.paths["logs"] / f"{name}.log")

    def start_all(self) -> None:
        base = [self.nodes[f"node-{i}"] for i in range(1, 4)]
        for node in base:
            node.launch()
        self.cluster.launch()
        for m in self.members.values():  # start-up overlaps: the nodes answer soon enough
            m.start()
        for node in base:
            node.wait_ready()
        self.cluster.wait_ready()
        # The cluster phase has its own nodes, etcd and clients: its schedule runs while
        # the members start, and ends while they stop.
        self.cluster_thread.start()
        # The clock starts once every member runs its first operation.
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not all(
                (self.paths["hb"] / name).exists() for name in [*WORKERS, "dist-rank1"]):
            if dead := [m.name for m in self.members.values() if not m.alive]:
                raise RuntimeError(f"members died during start-up: {dead}; see "
                                   f"{self.paths['logs']}")
            time.sleep(0.2)
        self.started_at = time.monotonic()
        startup = round(time.time() - self.wall_started, 1)
        self.journal.write("clock", startup_s=startup)
        print(f"[soak] members up after {startup} s; chaos starts", flush=True)

    def finding(self, invariant: str, detail: str) -> None:
        with self.lock:
            self.findings.append({"invariant": invariant, "detail": detail})
        self.journal.write("finding", invariant=invariant, detail=detail)
        print(f"[soak] VIOLATION {invariant}: {detail}", flush=True)

    def guard(self, what: str, fn: Callable[[], Any], default: Any = None) -> Any:
        """``fn()``; an exception (a check or schedule that broke) is a finding."""
        try:
            return fn()
        except Exception as exc:
            self.finding("final check runs", f"{what}: {type(exc).__name__}: {exc}: "
                                             f"{traceback.format_exc()[-1500:]}")
            return default

    def monitor(self) -> None:
        """Members that exit by themselves (restarted) and operations that hang (killed)."""
        while not self.done.wait(0.5):
            with self.lock:
                members = list(self.members.values())
            for m in members:  # one the chaos thread killed, it restarts
                if not (m.alive or m.stopping or m.killed or m.proc is None):
                    self.finding("no member exits by itself", f"{m.name} exited with "
                                 f"{m.proc.returncode}: {log_tail(m.log, 8)}")
                    self.start_from_thread(m.start)
            for hb in self.paths["hb"].iterdir():
                state = W.read_json(hb)
                if not state or state.get("op") is None \
                        or time.time() - float(state["since"]) < OP_TIMEOUT_S:
                    continue
                pid = int(state["pid"])
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, 0)
                    self.finding("no process hangs", f"{hb.name} (pid {pid}) in '{state['op']}' "
                                 f"for {time.time() - float(state['since']):.0f} s; killed")
                    W.write_json(hb, {"op": None, "since": time.time(), "pid": pid})
                    if (member := self.members.get(hb.name.split("-rank")[0])) is not None:
                        member.killed = True
                        self.later(1.0, member.start)
                    os.kill(pid, signal.SIGKILL)

    def later(self, delay_s: float, fn: Callable[[], Any],
              wait: subprocess.Popen[bytes] | None = None) -> None:
        """``fn()`` in the starter thread after ``delay_s`` (and ``wait`` has exited)."""
        def run() -> None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                if wait is not None:
                    wait.wait(120)
            time.sleep(delay_s)
            try:
                self.start_from_thread(fn)
            except Exception as exc:  # a restart that failed is a finding, not a crash
                self.finding("members restart", f"{getattr(fn, '__qualname__', fn)}: {exc}")
        self.timers.append(threading.Thread(target=run, daemon=True))
        self.timers[-1].start()

    def start_node(self, name: str) -> None:
        """Start a node; the chaos thread leaves it alone until it answers."""
        self.nodes_away.add(name)
        try:
            self.nodes[name].start()
        finally:
            self.nodes_away.discard(name)

    def start_from_thread(self, fn: Callable[[], Any]) -> Any:
        return self.starter.submit(fn).result()

    # -- chaos ------------------------------------------------------------------------------
    def chaos(self) -> None:
        rng = random.Random(self.args.seed)
        snaps, kv = ([*emb, *nodes] for emb, nodes in (devices(self.paths, g)
                                                       for g in ("ckpt", "kv")))
        faults: dict[str, tuple[int, Callable[[int], dict[str, Any] | None]]] = {
            "kill": (45, lambda n: self.fault_kill(rng)),
            "flip-chunk": (15, lambda n: flip_chunk(rng, snaps)),
            "flip-segment": (15, lambda n: flip_segment(rng, kv)),
            "flip-manifest": (7, lambda n: flip_manifest_digit(rng, snaps)),
            "fill-disk": (12, lambda n: self.fault_fill_disk(rng, n)),
            "symlink": (3, lambda n: plant_symlink(rng, snaps[:2], self.paths["canary"], n))}
        kinds, weights = list(faults), [w for w, _ in faults.values()]
        deadline, n = self.started_at + self.args.minutes * 60, 0
        while not self.done.wait(rng.uniform(0.5, 1.5) * self.args.fault_every) \
                and time.monotonic() <= deadline:
            n += 1  # every kind once first, so that a short run injects each of them too
            kind = kinds[n - 1] if n <= len(kinds) else rng.choices(kinds, weights)[0]
            try:
                record = faults[kind][1](n)
            except OSError as exc:  # a file vanished under us (gc, rm): try again later
                record = {"skipped": f"{type(exc).__name__}: {exc}"}
            self.journal.write("fault", fault=kind, n=n, **(record or {"skipped": "no target"}))

    def fault_kill(self, rng: random.Random) -> dict[str, Any] | None:
        """SIGKILL a member, a torchrun rank or a node; started again after a moment."""
        with self.lock:
            names = sorted(m.name for m in self.members.values() if m.alive and not m.killed)
        names += sorted(name for name, node in self.nodes.items()
                        if node.running and name not in self.nodes_away)
        if not names:
            return None
        victim, delay = rng.choice(names), rng.uniform(0.3, 2.5)
        member = self.members.get(victim)
        if member is None:
            pid = self.nodes[victim].pid
            self.nodes_away.add(victim)
            self.nodes[victim].kill()
        else:
            if not (pids := member.victims()):
                return None
            pid, member.killed = rng.choice(pids), True
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

        def restart() -> None:
            if member is None and not (self.done.is_set() and victim == "node-4"):
                self.start_node(victim)
            elif member is not None and not (self.done.is_set() or member.stopping):
                member.start()
        self.later(delay, restart, wait=member.proc if member is not None else None)
        return {"target": victim, "pid": pid, "restart_s": round(delay, 2)}

    def fault_fill_disk(self, rng: random.Random, n: int) -> dict[str, Any] | None:
        """Fill the tmpfs until ENOSPC, hold it full for a few seconds, free it."""
        if self.tmpfs is None:
            return None
        filler, written, block = self.tmpfs / f"filler-{n}", 0, b"\xa5" * (1 << 20)
        try:
            with open(filler, "wb", buffering=0) as f:
                while block:  # halving the block at each ENOSPC, down to a byte
                    try:
                        written += f.write(block) or 0
                    except OSError as exc:
                        if exc.errno != errno.ENOSPC:
                            raise
                        block = block[:len(block) // 2]
            hold = rng.uniform(2.0, 6.0)
            self.done.wait(hold)
        finally:
            filler.unlink(missing_ok=True)
        return {"bytes": written, "held_s": round(hold, 2)}

    def membership(self) -> None:
        """node-4 joins and leaves (twice in runs of 3 minutes or more): ``kv-cluster``
        carries it out and acknowledges in ``ctl/members-ack-<version>``."""
        duration, base = self.args.minutes * 60, W.read_json(self.paths["nodes"])["base"]
        plan = [(action, (at + c * 0.45) * duration) for c in range(1 + (self.args.minutes >= 3))
                for action, at in (("join", 0.15), ("leave", 0.35))]
        for version, (action, at) in enumerate(plan, 1):
            if self.done.wait(max(0.0, self.started_at + at - time.monotonic())):
                return
            if action == "join":
                try:
                    self.start_from_thread(lambda: self.start_node("node-4"))
                except Exception as exc:
                    self.finding("members restart", f"node-4 did not start: {exc}")
                    continue
            W.write_json(self.paths["members"], {"version": version, "members": [
                *base, *([self.nodes["node-4"].url] if action == "join" else [])]})
            ack = self.paths["ctl"] / f"members-ack-{version}"
            deadline = time.monotonic() + 180
            while not ack.exists() and time.monotonic() < deadline and not self.done.is_set():
                time.sleep(0.2)
            self.journal.write("membership-done", action=action, version=version,
                               acked=ack.exists(), moved=(W.read_json(ack) or {}).get("moved"))
            if action == "leave" and "node-4" not in self.nodes_away:
                with contextlib.suppress(Exception):
                    self.nodes["node-4"].stop(30)

    # -- the end --------------------------------------------------------------------------
    def shutdown(self) -> None:
        """SIGTERM every member (``dist`` stops at ``ctl/stop-dist``); judge how they end."""
        self.done.set()
        for t in self.timers:
            t.join(120)
        (self.paths["ctl"] / "stop-dist").touch()
        for m in self.members.values():
            m.stopping = True
            if m.alive and m.proc is not None and m.name != "dist":
                m.proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        waiting = [m for m in self.members.values() if m.proc is not None]
        while waiting and time.monotonic() - sent < STOP_TIMEOUT_S:
            for m in [m for m in waiting if m.proc is not None and m.proc.poll() is not None]:
                self.stop_s[m.name] = time.monotonic() - sent
                waiting.remove(m)
            time.sleep(0.05)
        for m in waiting:  # hung: where (the worker dumps its stacks), then killed
            assert m.proc is not None
            with contextlib.suppress(ProcessLookupError):
                m.proc.send_signal(signal.SIGUSR1)
            time.sleep(2.0)
            self.finding("no process hangs", f"{m.name} did not stop within {STOP_TIMEOUT_S} s "
                                             f"of SIGTERM; killed. {log_tail(m.log, 60)}")
            m.proc.kill()
            m.proc.wait()
        began = {(name, e["pid"]) for name, events in W.read_journals(self.paths["journal"]).items()
                 for e in events if e["ev"] == "start"}
        for m in self.members.values():
            if m.proc is None or m in waiting or m.proc.returncode == 0 or m.killed:
                continue
            if m.proc.returncode == -signal.SIGTERM and (m.name, m.proc.pid) not in began:
                continue  # restarted just before the stop: SIGTERM came before any code ran
            self.finding("members exit cleanly", f"{m.name} exited with {m.proc.returncode} "
                                                 f"after SIGTERM: {log_tail(m.log, 8)}")
        self.stopped_at = time.monotonic()

    def finish_cluster(self) -> None:
        """The cluster's fault schedule runs out (it is not cut short), then its clients
        read everything once more and the cluster is judged."""
        self.cluster_thread.join()
        self.cluster_result = self.guard("cluster phase", self.cluster.finish, {})

    def finish(self) -> dict[str, Any]:
        """The checks with the nodes up, then with them stopped; the canary; the results."""
        for node in self.nodes.values():
            if not node.running:
                node.start()
        empty = {"violations": [], "counts": {}}
        t0 = time.monotonic()
        remote = self.guard("check remote", lambda: run_checks("remote", self.run), empty)
        print(f"[soak] remote check {time.monotonic() - t0:.0f} s", flush=True)
        for name, node in self.nodes.items():
            if (code := node.stop(60)) != 0:
                self.finding("members exit cleanly", f"{name} exited with {code} after SIGTERM")
        # Leftovers younger than the gc grace period are spared: wait it out since the
        # last writer stopped.
        time.sleep(max(0.0, self.stopped_at + GC_GRACE_S + 1 - time.monotonic()))
        t0 = time.monotonic()
        local = self.guard("check local", lambda: run_checks("local", self.run), empty)
        print(f"[soak] local check {time.monotonic() - t0:.0f} s", flush=True)
        if self.tmpfs is not None:
            if self.args.keep:  # for a post-mortem: the tmpfs goes with the unmount
                shutil.copytree(self.tmpfs, self.tmpfs.with_name("small-copy"), symlinks=True)
            unmount(self.tmpfs)
            self.tmpfs = None
        for name, node in self.nodes.items():
            if (tb := first_traceback(node.log_path)) is not None:
                self.finding("nodes log no tracebacks", f"{name}: {tb}")
        before = W.read_json(self.run / "canary-before.json")
        after = tree_digest(self.paths["canary"])
        changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
        if changed:
            self.finding("nothing outside the stores changes",
                         f"{len(changed)} canary entries changed: {changed[:8]}")
        return summarize(W.read_journals(self.paths["journal"]), [remote, local], self.findings,
                         canary_changed=len(changed), canary_entries=len(before),
                         disk_full=self.tmpfs_note, minutes=self.args.minutes,
                         seed=self.args.seed, cluster=self.cluster_result,
                         starts={m.name: m.starts for m in self.members.values()})

    def cleanup(self) -> None:
        self.done.set()
        for m in self.members.values():
            if m.alive and m.proc is not None:
                m.proc.kill()
                m.proc.wait()
        for node in self.nodes.values():
            node.kill()
        self.cluster.cleanup()
        self.starter.shutdown(wait=True)
        if self.tmpfs is not None:
            unmount(self.tmpfs)


class ClusterPhase:
    """Three nodes found through a real etcd and two KV clients on ``KVPool.connect``; a
    node SIGKILLed and restarted, one SIGSTOPped past its lease and resumed, etcd
    restarted. Children start in the soak's starter thread."""

    def __init__(self, soak: Soak, folder: Path) -> None:
        self.soak, self.folder = soak, folder
        folder.mkdir()
        self.etcd = EtcdServer(folder / "etcd")
        self.url = self.etcd.url(W.PREFIX)
        section = {"etcd": {"url": self.url, "lease_ttl_s": W.LEASE_TTL_S}}
        self.nodes = [NodeProcess(write_node_config(folder / f"node-{i}", cluster=section),
                                  args=("--cluster", self.url), startup_timeout_s=NODE_START_S)
                      for i in range(1, 4)]
        self.urls = sorted(n.url for n in self.nodes)
        self.clients: dict[str, subprocess.Popen[bytes]] = {}
        self.events: list[dict[str, Any]] = []

    def launch(self) -> None:
        for start in (self.etcd.start, *(node.launch for node in self.nodes)):
            self.soak.start_from_thread(start)

    def wait_ready(self) -> None:
        """Every node answers and is registered; then the clients start (a client on an
        empty prefix is refused: it names the command that starts a node)."""
        for node in self.nodes:
            node.wait_ready()
        if self.wait_for("every node registered", lambda: self.registered() == set(self.urls),
                         30.0) is None:
            raise RuntimeError(f"nodes not registered in etcd: {self.registered()}")
        for name in W.CLIENTS:
            self.soak.start_from_thread(lambda name=name: self.start_client(name))

    def start_client(self, name: str) -> None:
        with open(self.folder / f"{name}.log", "ab") as log:
            self.clients[name] = subprocess.Popen(
                [sys.executable, str(HERE / "_soak_worker.py"), "etcd-client", str(self.folder),
                 name, self.url, str(self.soak.args.seed)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                preexec_fn=die_with_parent)

    def status(self, name: str) -> dict[str, Any]:
        return W.read_json(self.folder / f"status-{name}.json") or {}

    def registered(self) -> set[str]:
        """Node URLs registered in etcd now (empty while etcd does not answer)."""
        try:
            keys = self.etcd.ctl("get", "--prefix", f"{W.PREFIX}/nodes/", "--keys-only")
        except (RuntimeError, OSError, subprocess.TimeoutExpired):
            return set()
        return {unquote(k.rsplit("/", 1)[1]) for k in keys.split()}

    def wait_for(self, what: str, test: Callable[[], bool], timeout_s: float) -> float | None:
        """Seconds until ``test()`` held, or None (journaled) when it did not in time."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if test():
                return round(time.monotonic() - t0, 2)
            time.sleep(0.2)
        self.soak.journal.write("cluster-timeout", what=what, timeout_s=timeout_s)
        return None

    def step(self, fault: str, **fields: Any) -> None:
        self.events.append({"fault": fault, **fields})
        self.soak.journal.write("cluster-fault", fault=fault, **fields)

    def run(self) -> None:
        """The faults in order, each waited out: kill, stop, etcd restart."""
        ttl = W.LEASE_TTL_S
        self.wait_for("clients ready", lambda: all(self.status(n).get("acked", 0) > 0
                                                   for n in W.CLIENTS), 120.0)
        time.sleep(2.0)  # prompts on every node before the first fault
        killed, paused = random.Random(self.soak.args.seed).sample(self.nodes, 2)
        killed.kill()  # SIGKILL: no withdrawal, the lease expires
        gone = self.wait_for("killed node leaves", lambda: killed.url not in self.registered(),
                             ttl + 10.0)
        self.soak.start_from_thread(killed.launch)
        killed.wait_ready()
        back = self.wait_for("killed node back", lambda: killed.url in self.registered(), 60.0)
        self.step("SIGKILL node and restart", node=killed.url, left_s=gone, back_s=back)
        assert paused.pid is not None
        os.kill(paused.pid, signal.SIGSTOP)
        try:
            gone = self.wait_for("stopped node leaves",
                                 lambda: paused.url not in self.registered(), ttl + 10.0)
            time.sleep(1.0)
        finally:
            os.kill(paused.pid, signal.SIGCONT)
        back = self.wait_for("resumed node back", lambda: paused.url in self.registered(), 30.0)
        self.step("SIGSTOP node past its lease, SIGCONT", node=paused.url, left_s=gone,
                  back_s=back)
        self.etcd.stop()
        time.sleep(ttl + 1.0)  # longer than a lease: clients must keep their members
        self.soak.start_from_thread(self.etcd.start)
        back = self.wait_for("every node registered after the etcd restart",
                             lambda: len(self.registered()) == len(self.nodes), 60.0)
        self.step("etcd restart", down_s=ttl + 1.0, all_back_s=back)
        self.wait_for("every client sees every node",
                      lambda: all(self.status(n).get("nodes") == self.urls for n in W.CLIENTS),
                      30.0)

    def finish(self) -> dict[str, Any]:
        """Clients read everything once more and exit; no wrong byte (a miss is fine), no
        client crash, every node back in etcd and in every client's ring."""
        finding = self.soak.finding
        self.resume()
        for node in self.nodes:
            if not node.running:
                self.soak.start_from_thread(node.start)
        registered = self.registered()
        W.write_json(self.folder / "phase", "final")
        results: dict[str, Any] = {}
        for name, proc in self.clients.items():
            try:
                code = proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
                finding("no cluster client crashes", f"{name} did not finish in 120 s")
            result = W.read_json(self.folder / f"result-{name}.json")
            if code != 0 or result is None:
                finding("no cluster client crashes", f"{name} exited {code}: "
                        f"{log_tail(self.folder / f'{name}.log')}")
                continue
            results[name] = result
            for raw in result["raw"][:5]:
                finding("errors are IsolaneErrors", f"{name}: {raw}")
            if result["wrong"]:
                finding("no KV get returns wrong bytes", f"{name} (etcd cluster): "
                        f"{len(result['wrong'])} blocks, e.g. {result['wrong'][0]}")
            if result["final_nodes"] != self.urls:
                finding("every node back in the membership",
                        f"{name} ends with {result['final_nodes']}, not {self.urls}")
        if sorted(registered) != self.urls:
            finding("every node back in the membership",
                    f"etcd holds {sorted(registered)}, not {self.urls}")
        for i, node in enumerate(self.nodes, 1):
            if (code := node.stop(60) if node.running else None) not in (0, None):
                finding("members exit cleanly", f"etcd node-{i} exited with {code}")
            if (tb := first_traceback(node.log_path)) is not None:
                finding("nodes log no tracebacks", f"etcd node-{i}: {tb}")
        self.etcd.kill()
        total: Counter[str] = Counter()
        for r in results.values():
            total.update({k: len(r[k]) if k == "wrong" else r[k] for k in (
                "puts", "errors", "wrong", "blocks_checked", "served_final", "asked_final")})
        return {"events": self.events, "clients": len(results), "registered": len(registered),
                **{k: total[k] for k in ("puts", "errors", "wrong", "blocks_checked")},
                "served_share_after": round(total["served_final"] / total["asked_final"], 4)
                if total["asked_final"] else None}

    def resume(self) -> None:
        for pid in (node.pid for node in self.nodes if node.pid is not None):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def cleanup(self) -> None:
        for proc in self.clients.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        self.resume()
        for node in self.nodes:
            node.kill()
        self.etcd.kill()


# -- the checks, once every member stopped ------------------------------------------------
class Checks:
    """The invariants judged from the journals and the stores. Misses and integrity
    errors are excused only by the fault journal or the pool's eviction journal,
    deletions only by rm's journal."""

    def __init__(self, run: Path) -> None:
        self.paths = W.run_paths(run)
        self.journals = W.read_journals(self.paths["journal"])
        self.violations: list[dict[str, str]] = []
        self.counts: Counter[str] = Counter()
        faults = self.events("fault", "chaos")
        self.file_flips = [e for e in faults if "ino" in e
                           and e["fault"] in ("flip-chunk", "flip-manifest")]
        self.damaged_keys = {e["key"] for e in faults if "key" in e}
        self.evicted = {k for e in self.events("evicted") for k in e["keys"]}
        self.removed = {(e["store"], e["name"]) for e in self.events("rm-intent")}
        self.acks = [dict(e, member=m) for m, evs in self.journals.items() for e in evs
                     if e["ev"] == "ack"]
        self.roots = dict(zip(("embedded", "remote"), devices(self.paths, "ckpt"), strict=True))

    def events(self, ev: str, member: str | None = None) -> list[dict[str, Any]]:
        return [e for m, evs in self.journals.items() if member in (None, m) for e in evs
                if e["ev"] == ev]

    def violate(self, invariant: str, detail: str, count: str | None = None) -> None:
        self.violations.append({"invariant": invariant, "detail": detail})
        if count:
            self.counts[count] += 1

    def flipped(self, kinds: Iterable[str] = ("flip-chunk", "flip-manifest")) -> list[str]:
        """Paths of the files flipped on purpose, with their other hard links."""
        return [p for e in self.file_flips if e["fault"] in kinds
                for p in [e["path"], *e.get("links", [])]]

    def damaged(self, store: str, name: str) -> bool:
        """Whether a recorded flip hit a file of snapshot ``name`` (by path at the time,
        or by the inode of a file it holds now, as hard links share it)."""
        if any(f"/snapshots/{name}/" in p for p in self.flipped()):
            return True
        inodes = {(e["dev"], e["ino"]) for e in self.file_flips}
        return any(inode(p) in inodes for root in self.roots[store]
                   for p in W.regular_files(root / "snapshots" / name))

    # -- snapshots ------------------------------------------------------------------------
    def load(self, store: Any, kind: str, name: str, saved_as: str) -> Any:
        """The state ``name`` loads as, or None (why not recorded)."""
        try:
            return store.load(name, shard=(0, 1)) if saved_as == "dist" else store.load(name)
        except IntegrityError as exc:
            if self.damaged(kind, name):
                self.counts["final: damaged on purpose, IntegrityError"] += 1
            else:
                self.violate(LOADED_WRONG, f"{kind} '{name}': IntegrityError without recorded "
                                           f"damage: {exc}")
        except Exception as exc:
            self.violate(LOADED_WRONG, f"{kind} '{name}': {type(exc).__name__}: {exc}", "lost")
        return None

    def compare(self, kind: str, name: str, got: Any, want: Any, counted: str) -> None:
        if diff := W.differences(got, want):
            self.violate("damage is detected" if self.damaged(kind, name) else LOADED_WRONG,
                         f"{kind} '{name}' loaded without an IntegrityError: {diff[:3]}", "wrong")
        else:
            self.counts[counted] += 1
            self.counts["bytes verified: snapshots (final)"] += W.state_bytes(want)

    def snapshots(self, store: Any, kind: str) -> None:
        """Every acknowledged save loads bit-exact (or fails on damage), verify refuses
        one whose chunk was flipped, and no new name was acknowledged to two savers."""
        acks = [a for a in self.acks if a.get("store") == kind and not a["name"].startswith("ow-")]
        for name, n in Counter(a["name"] for a in acks).items():
            if n > 1:
                self.violate("one save wins a new name", f"{kind} '{name}' acknowledged to {n} "
                             f"savers: {[a['member'] for a in acks if a['name'] == name]}")
        chunk_flips = self.flipped(("flip-chunk",))
        for ack in acks:
            name = ack["name"]
            if (kind, name) in self.removed:
                self.counts["final: removed by rm (skipped)"] += 1
                continue
            if (got := self.load(store, kind, name, ack["kind"])) is not None:
                self.compare(kind, name, got, W.expected_state(ack["kind"], ack["seed"]),
                             "final: snapshots loaded bit-exact")
            if not any(f"/snapshots/{name}/{ack['generation']}/" in p for p in chunk_flips):
                continue
            try:
                store.verify(name)
            except IntegrityError:
                self.counts["final: damaged snapshots that verify refuses"] += 1
            except SnapshotNotFoundError:
                pass  # reported as lost by the load
            else:
                self.violate("damage is detected", f"{kind} '{name}': a chunk was flipped and "
                                                   "verify() says OK")

    def overwrites(self, store: Any) -> None:
        """An overwrite name loads as its newest acknowledged save, or as a save begun
        after it (killed between commit and journal)."""
        for name in sorted({a["name"] for a in self.acks if a["name"].startswith("ow-")}):
            newest = max(a["seed"] for a in self.acks if a["name"] == name)
            if (got := self.load(store, "embedded", name, "plain")) is None:
                continue
            seed = got.get("step") if isinstance(got, dict) else None
            if seed not in {e["seed"] for e in self.events("begin") if e.get("name") == name} \
                    or seed < newest:
                self.violate("overwrite keeps the newest commit",
                             f"'{name}' holds step {seed}; newest acknowledged {newest}")
            else:
                self.compare("embedded", name, got, W.expected_state("plain", seed),
                             "final: overwrite names loaded bit-exact")

    def during_run(self) -> None:
        """The verifier's loads and listings during the run, judged with every journal."""
        for e in self.events("verify"):
            key, outcome = (e["store"], e["name"]), e["outcome"]
            self.counts[f"run: verify {outcome}"] += 1
            if outcome == "ok":
                self.counts["bytes verified: snapshots (during run)"] += int(e.get("bytes", 0))
            elif outcome == "wrong":
                self.violate("damage is detected" if self.damaged(*key) else LOADED_WRONG,
                             f"{key} loaded wrong during the run: {e.get('diff')}", "wrong")
            elif key not in self.removed and (
                    outcome == "missing" or (outcome == "integrity" and not self.damaged(*key))
                    or (outcome == "error" and e["store"] == "embedded")):
                self.violate(LOADED_WRONG, f"{key}: {outcome} during the run: {e.get('error')}")
        for e in self.events("list"):
            self.counts[f"run: list {e['outcome']}"] += 1
            if e["outcome"] != "ok":
                self.violate("one damaged snapshot fails alone",
                             f"list() failed during the run: {e['error']}")

    def gc(self, label: str, config: str, roots: list[Path], store: str) -> None:
        """No acknowledged generation swept (by the gc member, on the embedded store, or
        by a final gc); every generation folder left is the committed newest of its name."""
        sweeps = [(e["swept"], e["deleted"], "gc swept", "run: gc sweeps")
                  for e in self.events("gc", "gc") if store == "embedded"]
        try:
            with SnapshotStore(config) as s:
                sweeps.append((s.gc().swept_generations, [], f"{label}: final gc swept",
                               "final gc: generations swept"))
        except Exception as exc:
            self.violate("gc leaves no orphan", f"{label}: final gc failed: "
                                                f"{type(exc).__name__}: {exc}")
        acked = {(a["name"], a["generation"]) for a in self.acks if a.get("store") == store
                 and not a["name"].startswith("ow-") and (store, a["name"]) not in self.removed}
        for swept, deleted, what, counted in sweeps:
            self.counts[counted] += len(swept)
            for name, _, gen in (item.partition(":")[2].partition("/") for item in swept):
                if (name, gen) in acked:
                    self.violate("gc deletes nothing committed", f"{what} {name}/{gen}")
            for name in deleted:
                self.violate("gc deletes nothing committed", f"gc deleted snapshot {name} "
                                                             "(no retention is configured)")
        primary = roots[0] / "snapshots"
        for entry in (e for root in roots if (root / "snapshots").is_dir()
                      for e in sorted((root / "snapshots").iterdir())):
            if entry.is_symlink():
                self.counts["planted symlinks still in place"] += 1
                continue
            gens = sorted(g.name for g in entry.iterdir() if not g.is_symlink()) \
                if entry.is_dir() else []
            committed = sorted(p.parent.name for p in (primary / entry.name).glob(f"*/{MANIFEST}"))
            newest = committed[-1] if committed else None
            for gen in [g for g in gens if g != newest] if gens else [None]:
                self.violate("gc leaves no orphan", f"{label}: {entry} holds {gen or 'nothing'} "
                                                    f"(committed newest: {newest})", "orphans")
        self.counts[f"orphan check: {label}"] += 1

    # -- KV -----------------------------------------------------------------------------
    def kv(self, member: str, label: str, pools: Iterable[Any], strict_misses: bool) -> None:
        """The member's reads during the run, then every acknowledged block read back
        (from the first pool that has it): right bytes, or missing for a reason."""
        for e in self.events("kv-wrong", member):
            self.violate("no KV get returns wrong bytes", f"{label} during the run ({e['via']}): "
                         f"{len(e['keys'])} blocks, e.g. {e['keys'][0]}")
            self.counts["wrong"] += len(e["keys"])
        for e in self.events("kv-miss", member):
            self.counts[f"run: {label} KV misses"] += 1
            if strict_misses and e["key"] not in self.damaged_keys | self.evicted:
                self.violate("KV misses only for damaged or evicted blocks",
                             f"{label}: block {e['key']} missed during the run ({e['via']})")
        for e in {e["pid"]: e for e in self.events("kv-counts", member)}.values():  # the last
            for k in ("puts", "put_blocks", "gets", "blocks_read", "misses"):
                self.counts[f"run: {label} KV {k}"] += int(e[k])
            self.counts["bytes verified: KV (during run)"] += int(e["bytes_verified"])
        keys = list(dict.fromkeys(k for e in self.events("kv-ack", member) for k in e["keys"]))
        found: dict[str, bytes] = {}
        for pool in pools:
            with pool:
                todo = [k for k in keys if k not in found]
                for batch in (todo[i:i + BATCH] for i in range(0, len(todo), BATCH)):
                    got = pool.get_blocks([bytes.fromhex(k) for k in batch])
                    found.update((k, bytes(v)) for k, v in zip(batch, got, strict=True)
                                 if v is not None)
        for key in keys:
            if key not in found:
                why = ("missing, damaged on purpose" if key in self.damaged_keys else
                       "missing, evicted (device full)" if key in self.evicted else "lost")
                self.counts[f"final: {label} KV blocks {why}"] += 1
                self.counts["lost"] += why == "lost"
            elif found[key] != W.block_value(bytes.fromhex(key)):
                self.violate("no KV get returns wrong bytes", f"{label}: block {key} final read "
                                                              "wrong", "wrong")
            else:
                self.counts[f"final: {label} KV blocks read back"] += 1
                self.counts["bytes verified: KV (final)"] += W.KV_BLOCK_BYTES
        if lost := self.counts[f"final: {label} KV blocks lost"]:
            self.violate("KV misses only for damaged or evicted blocks",
                         f"{label}: {lost} acknowledged blocks found nowhere")


def run_checks(phase: str, run: Path) -> dict[str, Any]:
    """``remote`` (nodes up): the saves through the nodes and the cluster's blocks;
    ``local`` (nodes stopped): the embedded store, the verifier's results, gc on every
    store, the embedded pool's blocks, raw exceptions."""
    c, raw = Checks(run), []
    nodes = W.read_json(c.paths["nodes"])
    if phase == "remote":
        with RemoteSnapshotStore(nodes["base"], timeout_s=120.0) as store:
            c.snapshots(store, "remote")
        c.kv("kv-cluster", "cluster", (RemoteKVPool([url], **W.KV_ARGS, poll_s=None,
                                                    timeout_s=30.0) for url in nodes["urls"]),
             strict_misses=False)
    else:
        config = str(c.paths["embedded_config"])
        with SnapshotStore(config) as store:
            c.snapshots(store, "embedded")
            c.overwrites(store)
        c.during_run()
        c.gc("embedded", config, c.roots["embedded"], "embedded")
        for root in c.roots["remote"]:
            c.gc(root.parent.name, str(root.parent / "isolane.yaml"), [root], "remote")
        c.kv("kv", "embedded", [KVPool(config, **W.KV_ARGS, memory_budget=0)], strict_misses=True)
        raw = c.events("raw")
    c.counts["raw (non-isolane) exceptions"] += len(raw)
    for e in raw[:20]:
        c.violate("errors are IsolaneErrors", f"{e['op']}: {e['error'][:300]}")
    return {"violations": c.violations, "counts": +c.counts,
            "raw": [{"op": e["op"], "error": e["error"]} for e in raw[:50]]}


# -- the faults: each returns a record of exactly what it damaged (JSON), so that the
# checks can tell a snapshot or block damaged on purpose from a lost one -----------------
def flip(rng: random.Random, kind: str, files: list[Path], mask: int,
         aim: Callable[[Path], tuple[int, dict[str, Any]] | None]) -> dict[str, Any] | None:
    """XOR one byte of one of ``files`` (up to five tried) with ``mask``, at the offset
    ``aim`` picks (with fields for the record), or None when there is nothing to aim at."""
    rng.shuffle(files)
    for path in files[:5]:
        with contextlib.suppress(OSError, IndexError):  # a file gone or cut short meanwhile
            if (aimed := aim(path)) is None:
                continue
            offset, fields = aimed
            st = os.lstat(path)
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
            try:
                old = os.pread(fd, 1, offset)
                os.pwrite(fd, bytes([old[0] ^ mask]), offset)
            finally:
                os.close(fd)
            return {"kind": kind, **fields, "path": str(path), "dev": st.st_dev,
                    "ino": st.st_ino, "offset": offset, "byte": old[0] ^ mask}
    return None


def inode(path: Path) -> tuple[int, int] | None:
    with contextlib.suppress(OSError):
        return path.stat().st_dev, path.stat().st_ino
    return None


def snapshot_files(roots: list[Path]) -> list[Path]:
    return [p for root in roots for p in W.regular_files(root / "snapshots")]


def flip_chunk(rng: random.Random, roots: list[Path]) -> dict[str, Any] | None:
    """A byte of a chunk file; records the other paths of its inode too (the hard links
    of incremental saves)."""
    chunks = [p for p in snapshot_files(roots)
              if p.name not in NOT_CHUNKS and not p.name.endswith(".tmp")]
    record = flip(rng, "chunk", chunks, 0xFF, lambda p: (
        rng.randrange(p.stat().st_size), {}) if p.stat().st_size else None)
    if record is not None:
        record["links"] = [str(p) for p in chunks if inode(p) == (record["dev"], record["ino"])]
    return record


def flip_manifest_digit(rng: random.Random, roots: list[Path]) -> dict[str, Any] | None:
    """A digit of a manifest (``0`` <-> ``1``, ...): still valid JSON, the damage that
    only a checksum of the manifest itself catches."""
    def aim(path: Path) -> tuple[int, dict[str, Any]] | None:
        digits = [i for i, b in enumerate(path.read_bytes()) if 0x30 <= b <= 0x39]
        return (rng.choice(digits), {}) if digits else None
    return flip(rng, "manifest", [p for p in snapshot_files(roots) if p.name == MANIFEST],
                0x01, aim)


def flip_segment(rng: random.Random, roots: list[Path]) -> dict[str, Any] | None:
    """A byte inside the value of a KV record; records its key. Records are found by the
    documented framing (no checksum check: the soak only needs to aim)."""
    def aim(path: Path) -> tuple[int, dict[str, Any]] | None:
        data, pos, records = path.read_bytes(), SEGMENT_HEADER_BYTES, []
        while pos + RECORD_HEADER.size <= len(data):
            _csum, flags, _res, klen, vlen, _ts = RECORD_HEADER.unpack_from(data, pos)
            delta, nbytes = record_geometry(klen, vlen)
            if flags not in (FLAG_PUT, FLAG_TOMBSTONE) or not 0 < klen <= 1024 \
                    or pos + nbytes > len(data):
                break
            if flags == FLAG_PUT and vlen:
                records.append((pos + delta, vlen, data[pos + RECORD_HEADER.size:][:klen]))
            pos += nbytes
        if not records:
            return None
        value_at, vlen, key = rng.choice(records)
        return value_at + rng.randrange(vlen), {"key": key.hex()}
    return flip(rng, "segment", [p for root in roots for p in W.regular_files(root / "kvpool")
                                 if p.suffix in (".live", ".sealed")], 0xFF, aim)


def plant_symlink(rng: random.Random, roots: list[Path], canary: Path, n: int
                  ) -> dict[str, Any] | None:
    """A symlink into the canary tree where the store deletes: as a snapshot name, or
    inside a snapshot's generation folder."""
    targets = sorted(p for p in canary.iterdir() if p.is_dir())
    snaps = rng.choice(roots) / "snapshots"
    if not snaps.is_dir() or not targets:
        return None
    target = rng.choice(targets)
    gens = [g for s in sorted(snaps.iterdir()) if s.is_dir() and not s.is_symlink()
            for g in sorted(s.iterdir()) if g.is_dir() and not g.is_symlink()]
    link = (rng.choice(gens) if gens and rng.random() < 0.5 else snaps) / f"planted-{n}"
    try:
        link.symlink_to(target, target_is_directory=True)
    except OSError:
        return None
    return {"kind": "symlink", "path": str(link), "target": str(target)}


def unmount(folder: Path) -> None:
    subprocess.run(["umount", "-l", str(folder)], capture_output=True, check=False)


def make_canary(folder: Path, seed: int) -> None:
    """Folders of files beside the stores: the soak's symlinks point into them."""
    rng = random.Random(seed)
    for d in range(4):
        sub = folder / f"dir{d}"
        (sub / "nested").mkdir(parents=True, exist_ok=True)
        for f in range(3):
            (sub / f"file{f}.bin").write_bytes(rng.randbytes(rng.randint(1, 5000)))
        (sub / "nested" / "deep.txt").write_text(f"canary {d}\n")
        (sub / "isolane.json").write_text('{"looks": "like a manifest"}')
    (folder / "top.txt").write_text("canary top\n")


def tree_digest(folder: Path) -> dict[str, str]:
    """Every entry under ``folder`` (links not followed) -> type and content hash."""
    out: dict[str, str] = {}
    for base, dirs, files in os.walk(folder, followlinks=False):
        for p in (Path(base) / name for name in dirs + files):
            mode = f"{os.lstat(p).st_mode:o}"
            out[str(p.relative_to(folder))] = (
                "link:" + os.readlink(p) if p.is_symlink() else f"dir:{mode}" if p.is_dir()
                else f"file:{mode}:" + hashlib.sha256(p.read_bytes()).hexdigest())
    return out


# -- the results: counted from the journals and the checks, written as markdown ------
def summarize(journals: dict[str, list[dict[str, Any]]], checks: list[dict[str, Any]],
              findings: list[dict[str, str]], **run: Any) -> dict[str, Any]:
    """The run in numbers: operations from the journals, faults, the checks' counts."""
    counts: Counter[str] = Counter()
    for check in checks:
        counts.update(check.get("counts", {}))

    def events(member: str, ev: str) -> list[dict[str, Any]]:
        return [e for e in journals.get(member, []) if e["ev"] == ev]

    ops: list[tuple[str, int, str]] = []
    for member in SAVERS:
        errors = Counter(e["error"].split(":")[0] for e in events(member, "fail"))
        ops.append((f"save ({member}) acknowledged / failed", len(events(member, "ack")),
                    f"{sum(errors.values())} failed"
                    + "".join(f", {n} {k}" for k, n in errors.most_common(4))))
    verify = Counter(e["outcome"] for e in events("verify", "verify"))
    ops += [("gc runs", len(events("gc", "gc")), f"{len(events('gc', 'gc-fail'))} failed"),
            ("rm", len(events("rm", "rm-done")), f"{len(events('rm', 'rm-fail'))} failed"),
            ("verify loads (during run)", sum(verify.values()),
             ", ".join(f"{n} {k}" for k, n in sorted(verify.items())))]
    for label in ("embedded", "cluster"):
        ops += [(f"KV puts ({label})", counts[f"run: {label} KV puts"],
                 f"{counts[f'run: {label} KV put_blocks']} blocks acknowledged"),
                (f"KV gets ({label})", counts[f"run: {label} KV gets"],
                 f"{counts[f'run: {label} KV blocks_read']} blocks read and checked, "
                 f"{counts[f'run: {label} KV misses']} misses")]
    joins = events("chaos", "membership-done")
    ops.append(("node joins / leaves", len(joins), ", ".join(
        f"{e['action']} ({'moved' if e.get('moved') else 'not moved'})" for e in joins)))
    faults = events("chaos", "fault")
    violations = [*findings, *[v for c in checks for v in c.get("violations", [])]]
    return {**run, "operations": ops,
            "kills": dict(Counter(e["target"].split("-")[0] if e["target"].startswith("node")
                                  else e["target"] for e in faults
                                  if e["fault"] == "kill" and "target" in e)),
            "faults": dict(Counter(e["fault"] for e in faults if "skipped" not in e)),
            "faults_skipped": dict(Counter(e["fault"] for e in faults if "skipped" in e)),
            "filled_bytes": sum(int(e.get("bytes", 0)) for e in faults
                                if e["fault"] == "fill-disk"),
            "bytes_verified": sum(n for k, n in counts.items() if k.startswith("bytes verified")),
            "lost": counts["lost"], "wrong": counts["wrong"], "orphans": counts["orphans"],
            "violations": violations, "by_invariant": dict(Counter(
                v["invariant"] for v in violations)), "counts": dict(counts),
            "raw": [r for c in checks for r in c.get("raw", [])]}


def headline_rows(r: dict[str, Any], *, command: str, when: str, machine: str
                  ) -> list[Result]:
    """The results page's rows: the invariants held, the bytes checked, the canary."""
    run = {"area": "Robustness", "machine": machine, "date": when, "command": command}
    return [
        Result(measure=f"violations of {len(INVARIANTS)} invariants in {r['minutes']:g} "
                       f"minutes of chaos, seed {r['seed']} (lost, wrong, orphaned, hung)",
               value=len(r["violations"]), unit="violations", target="0",
               met=not r["violations"], **run),
        Result(measure="bytes read back and checked", value=round(r["bytes_verified"] / 1e9, 2),
               unit="GB", **run),
        Result(measure="entries changed in a canary tree beside the stores",
               value=r["canary_changed"], unit=f"of {r['canary_entries']}", target="0",
               met=not r["canary_changed"], **run),
    ]


def report_markdown(r: dict[str, Any], *, command: str, when: str, machine: str) -> str:
    c = r.get("cluster") or {}
    faults = [*(f"SIGKILL {target} {n}" for target, n in sorted(r["kills"].items())),
              *(f"{kind} {n}" for kind, n in sorted(r["faults"].items()) if kind != "kill"),
              f"{r['filled_bytes']:,} bytes written to fill the disk"]
    skipped = ", ".join(f"{n} {k}" for k, n in sorted(r["faults_skipped"].items())) or "none"
    cluster = ("did not run" if not c else ", ".join(
        f"{e['fault']} ({', '.join(f'{k} {v}' for k, v in e.items() if k.endswith('_s'))})"
        for e in c["events"])
               + f"; {c['clients']} clients, {c['puts']} prompts acknowledged, "
               f"{c['blocks_checked']} blocks checked, {c['wrong']} wrong, {c['errors']} calls "
               f"failed with an IsolaneError, {c['registered']} nodes registered at the end, "
               f"share of blocks served after the churn {c['served_share_after']}")
    lines = [
        "## Chaos soak (`benchmarks/soak.py`)", "",
        f"`{command}` — {when}, {r.get('wall_s', '?')} s wall. {machine}", "",
        f"{r['minutes']:g} minutes of chaos on seed {r['seed']} (see the module's docstring); "
        f"disk full: {r['disk_full']}. Not a timing: the numbers of operations depend on "
        "the machine's load.", "",
        f"**Result: {'PASS' if not r['violations'] else 'FAIL'}** — lost = {r['lost']}, "
        f"wrong = {r['wrong']}, orphans = {r['orphans']}, canary entries changed = "
        f"{r['canary_changed']} of {r['canary_entries']}, bytes verified = "
        f"{r['bytes_verified'] / 1e9:.2f} GB, violations = {len(r['violations'])}.", "",
        C.markdown_table(["invariant", "violations"],
                       [(name, r["by_invariant"].get(name, 0)) for name in INVARIANTS]), "",
        C.markdown_table(["operation", "count", "detail"], r["operations"]), "",
        f"Faults injected: {', '.join(faults)}; without a target at that moment: {skipped}.",
        "", f"Cluster through etcd: {cluster}.", "",
        C.markdown_table(["final check", "count"], sorted(
            (k, v) for k, v in r["counts"].items() if not k.startswith("run: ")))]
    seen: Counter[str] = Counter()
    for v in r["violations"]:
        seen[v["invariant"]] += 1
        if seen[v["invariant"]] <= 5:
            lines.append(f"- VIOLATION {v['invariant']}: {v['detail'][:400]}")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0, help="chaos time (default 10)")
    ap.add_argument("--seed", type=int, default=11, help="the fault schedule (default 11)")
    ap.add_argument("--dir", type=Path, default=C.REPO_ROOT / ".bench" / "soak",
                    help="scratch folder (default .bench/soak; deleted unless --keep)")
    ap.add_argument("--out", type=Path, help="docs/BENCHMARKS.md records the rows in "
                    "benchmarks/results/soak.json; another file gets the report")
    ap.add_argument("--json", type=Path, help="write the results as JSON")
    ap.add_argument("--fault-every", type=float, default=3.0,
                    help="mean seconds between faults (default 3)")
    ap.add_argument("--keep", action="store_true", help="keep the run folder")
    _quick.add_argument(ap)
    args = ap.parse_args(argv)
    if args.quick:  # every member and fault kind, a fault a second, for 15 s
        _quick.enter(args, ap, files=())
        args.minutes, args.fault_every = 0.25, 1.0
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Every child (workers, torchrun ranks, nodes) imports this tree's isolane.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(C.REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    run = args.dir.resolve() / f"run-{args.seed}"
    soak = Soak(args, run)
    wall = time.monotonic()
    try:
        soak.setup()
        print(f"[soak] {args.minutes} min, seed {args.seed}, in {run}; disk full: "
              f"{soak.tmpfs_note}", flush=True)
        soak.start_all()
        threads = [threading.Thread(target=f, daemon=True)
                   for f in (soak.monitor, soak.chaos, soak.membership)]
        for t in threads:
            t.start()
        time.sleep(max(0.0, soak.started_at + args.minutes * 60 - time.monotonic()))
        print("[soak] chaos over: stopping members, checking", flush=True)
        t0 = time.monotonic()
        cluster_end = threading.Thread(target=soak.finish_cluster, daemon=True)
        cluster_end.start()
        soak.shutdown()
        slowest = ", ".join(f"{name} {s:.0f} s" for name, s in
                            sorted(soak.stop_s.items(), key=lambda kv: -kv[1])[:3])
        print(f"[soak] members stopped in {time.monotonic() - t0:.0f} s (slowest: {slowest})",
              flush=True)
        for t in threads:
            t.join(200)
        cluster_end.join()
        print(f"[soak] cluster phase ended {time.monotonic() - t0:.0f} s after the chaos",
              flush=True)
        result = soak.finish()
    finally:
        soak.cleanup()
    result["wall_s"] = round(time.monotonic() - wall, 1)
    where = {"command": C.command_line(), "when": C.now_text(),
             "machine": C.machine_description(args.dir, {"torch": torch.__version__})}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    C.publish("soak", report_markdown(result, **where), headline_rows(result, **where),
              args.out)
    if not args.keep:
        shutil.rmtree(run, ignore_errors=True)
    return 1 if result["violations"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
