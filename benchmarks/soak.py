"""Chaos soak: trainers, gc, rm, inference and storage nodes under SIGKILLs, full disks
and flipped bytes, for a bounded time; then every invariant is checked.

    python benchmarks/soak.py --minutes 10 --seed 11 --out docs/BENCHMARKS.md  # records its rows
    python benchmarks/soak.py --quick    # 15 s of chaos: the smoke test (tests/test_soak.py)

Members (each a real process, started again after every kill): trainers saving in a
loop on the embedded store (sync, async, incremental, overwrite), a 2-rank torchrun
job (gloo), a trainer saving through three ``isolane serve`` nodes, gc and rm running
concurrently, a verifier loading acknowledged snapshots, inference processes putting
and getting KV prompts on the embedded pool and through the nodes, and a fourth node
that joins and leaves. A chaos thread on ``--seed`` SIGKILLs random members and
restarts them, fills a small tmpfs that holds one checkpoint and one KV device, flips
bytes in chunk, manifest and segment files (recording each) and plants symlinks into a
canary tree beside the stores. The schedule of faults is fixed by the seed; what they
hit depends on timing. Beside them, from the start, a cluster through etcd: a real etcd,
three nodes registered there and two KV client processes on
``KVPool.connect("etcd://...")``, while its own schedule SIGKILLs a node and restarts
it, SIGSTOPs another past its lease and resumes it, and restarts etcd. Members are in
``_soak_worker.py``.

Invariants (checked here once every member stopped): every acknowledged save loads
bit-exact, or fails with
IntegrityError only if its bytes were damaged on purpose; no KV get returns wrong bytes,
and an acknowledged block is missing only if it was damaged or evicted; gc deletes
nothing committed and leaves no orphan; the canary tree is unchanged; no process hangs
in an operation or fails to stop; no member exits by itself; no cluster client
crashes and every node is back in etcd and in every client's ring at the end (the share
of blocks served after the churn is reported). Exit code 1 when
any is violated. The run folder (``--dir``) is deleted afterwards unless ``--keep``.
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
import struct
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import yaml

from benchmarks import _quick
from benchmarks._common import (
    REPO_ROOT,
    command_line,
    machine_description,
    markdown_table,
    now_text,
    replace_section,
)
from benchmarks._results import Result, is_page, write_results
from benchmarks._soak_worker import (
    CLIENTS,
    KV_BLOCK_BYTES,
    KV_CHUNK_TOKENS,
    KV_NAMESPACE,
    KV_TOKEN_DIM,
    LEASE_TTL_S,
    PREFIX,
    Journal,
    block_value,
    differences,
    expected_state,
    read_journals,
    read_json,
    regular_files,
    run_paths,
    write_json,
)
from isolane.snapshot.manifest import MANIFEST, PART_MANIFEST, WRITING_MARKER
from tests.support.node import NodeProcess, write_node_config
from tests.support.procs import die_with_parent, free_ports

HERE = Path(__file__).resolve().parent
WORKERS = {"sync": "sync", "async": "async", "incremental": "incremental",
           "overwrite": "overwrite", "race-a": "race", "race-b": "race", "remote": "remote",
           "gc": "gc", "rm": "rm", "verify": "verify", "kv": "kv", "kv-cluster": "kv-cluster"}
TMPFS_MIB = 96
SNAPSHOT_SECTION = {"chunk_bytes": "1MiB", "pack_threshold": "64KiB",
                    "staging_budget": "16MiB", "gc_grace_s": 10}
GC_GRACE_S = 10
FAULT_WEIGHTS = {"kill": 45, "flip-chunk": 15, "flip-segment": 15, "flip-manifest": 7,
                 "fill-disk": 12, "symlink": 3}
OP_TIMEOUT_S = 180.0  # an operation running longer is a hang
# A member must exit this soon after SIGTERM: above the 150 s an operation in flight may
# take within the clients' timeouts and retries (_soak_worker.remote_store).
STOP_TIMEOUT_S = 240.0
NODE_START_S = 240.0  # two dozen processes import torch at once on a shared machine


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
                                         stdin=subprocess.DEVNULL, cwd=REPO_ROOT,
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
        try:
            kids = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text()
        except OSError:
            return []
        return [int(p) for p in kids.split()]

    def log_tail(self, lines: int = 15) -> str:
        return log_tail(self.log, lines)


@dataclass
class Soak:
    args: argparse.Namespace
    run: Path
    paths: dict[str, Path] = field(default_factory=dict)
    members: dict[str, Member] = field(default_factory=dict)
    nodes: dict[str, NodeProcess] = field(default_factory=dict)
    node_roots: dict[str, Path] = field(default_factory=dict)
    tmpfs: Path | None = None
    tmpfs_note: str = ""
    findings: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: threading.Event = field(default_factory=threading.Event)
    timers: list[threading.Thread] = field(default_factory=list)
    node_down: dict[str, float] = field(default_factory=dict)
    node_starting: set[str] = field(default_factory=set)
    stop_s: dict[str, float] = field(default_factory=dict)  # SIGTERM to exit, by member
    fill_active: Path | None = None
    journal: Journal | None = None
    cluster: ClusterPhase | None = None
    cluster_result: dict[str, Any] = field(default_factory=dict)
    cluster_thread: threading.Thread = field(init=False)
    started_at: float = 0.0
    wall_started: float = field(default_factory=time.time)
    stopped_at: float = 0.0
    # PR_SET_PDEATHSIG kills a child when the *thread* that started it ends: every
    # (re)start from another thread runs in this one, which lives until cleanup.
    starter: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="soak-starter"))

    def __post_init__(self) -> None:
        self.cluster_thread = threading.Thread(target=self.cluster_chaos, daemon=True)

    # -- set-up ------------------------------------------------------------------------
    def setup(self) -> None:
        if self.run.exists():
            shutil.rmtree(self.run)
        self.paths = run_paths(self.run)
        for key in ("journal", "hb", "ctl", "logs", "stores", "canary"):
            self.paths[key].mkdir(parents=True, exist_ok=True)
        self.journal = Journal(self.paths["journal"] / "chaos.jsonl")
        make_canary(self.paths["canary"], self.args.seed)
        write_json(self.run / "canary-before.json", tree_digest(self.paths["canary"]))
        emb = self.paths["stores"] / "embedded"
        small = emb / "small"
        why = mount_tmpfs(small, TMPFS_MIB)
        if why is None:
            self.tmpfs = small
            self.tmpfs_note = f"tmpfs of {TMPFS_MIB} MiB (mount -t tmpfs)"
        else:
            small.mkdir(parents=True, exist_ok=True)
            self.tmpfs_note = f"not injected: mount -t tmpfs failed ({why})"
        config = {
            "home": str(emb / "home"),
            "device_groups": {
                "checkpoint": {"role": "write", "devices": [str(emb / "ckpt0"),
                                                            str(small / "ckpt1")],
                               "inflight_bytes": "64MiB"},
                "kv": {"role": "read", "devices": [str(emb / "kv0"), str(small / "kv1")],
                       "memory_budget": "16MiB", "inflight_bytes": "64MiB"}},
            "snapshot": SNAPSHOT_SECTION, "kvpool": {"segment_bytes": "1MiB"}}
        self.paths["embedded_config"].write_text(yaml.safe_dump(config))
        ports = free_ports(4)
        urls = []
        for i, port in enumerate(ports, 1):
            folder = self.paths["stores"] / f"node-{i}"
            cfg = write_node_config(folder, snapshot=SNAPSHOT_SECTION)
            node = NodeProcess(cfg, port=port, startup_timeout_s=NODE_START_S)
            node.log_path = self.paths["logs"] / f"node-{i}.log"
            self.nodes[f"node-{i}"] = node
            self.node_roots[f"node-{i}"] = folder
            urls.append(node.url)
        write_json(self.paths["nodes"], {"base": urls[:3], "joiner": urls[3],
                                         "roots": {n: str(p) for n, p in self.node_roots.items()},
                                         "urls": {n: node.url for n, node in self.nodes.items()}})
        write_json(self.paths["members"], {"version": 0, "members": urls[:3]})
        for name, role in WORKERS.items():
            self.members[name] = Member(name, [sys.executable, str(HERE / "_soak_worker.py"),
                                               role, str(self.run), name, str(self.args.seed)],
                                        self.paths["logs"] / f"{name}.log")
        port = free_ports(1)[0]
        self.members["dist"] = Member("dist", [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-addr", "127.0.0.1", "--master-port", str(port), "--max-restarts", "0",
            str(HERE / "_soak_worker.py"), "dist", str(self.run)], self.paths["logs"] / "dist.log")
        self.cluster = ClusterPhase(self.run / "cluster", self.args.seed, self.start_from_thread,
                                    self.note, self.finding)

    def start_all(self) -> None:
        for i in range(1, 4):
            self.nodes[f"node-{i}"].launch()
        assert self.cluster is not None
        self.cluster.launch()
        for m in self.members.values():  # start-up overlaps: the nodes answer soon enough
            m.start()
        for i in range(1, 4):
            self.nodes[f"node-{i}"].wait_ready()
        self.cluster.wait_ready()
        # The cluster phase has its own nodes, etcd and clients: its schedule runs while
        # the members start, and ends while they stop.
        self.cluster_thread.start()
        # The clock starts once every member runs its first operation (start-up of a
        # dozen Python processes importing torch takes a while on a busy machine).
        wanted = [*WORKERS, "dist-rank0", "dist-rank1"]
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if all((self.paths["hb"] / name).exists() for name in wanted):
                break
            dead = [m.name for m in self.members.values() if not m.alive]
            if dead:
                raise RuntimeError(f"members died during start-up: {dead}; see "
                                   f"{self.paths['logs']}")
            time.sleep(0.2)
        self.started_at = time.monotonic()
        startup = round(time.time() - self.wall_started, 1)
        self.note("clock", startup_s=startup)
        print(f"[soak] members up after {startup} s; chaos starts", flush=True)

    def note(self, event: str, **fields: Any) -> None:
        assert self.journal is not None
        self.journal.write(event, **fields)

    def finding(self, invariant: str, detail: str) -> None:
        with self.lock:
            self.findings.append({"invariant": invariant, "detail": detail})
        self.note("finding", invariant=invariant, detail=detail)
        print(f"[soak] VIOLATION {invariant}: {detail}", flush=True)

    # -- the monitor: exits and hangs ----------------------------------------------------
    def monitor(self) -> None:
        while not self.done.wait(0.5):
            with self.lock:
                members = list(self.members.values())
            for m in members:
                if m.alive or m.stopping or m.proc is None:
                    continue
                code = m.proc.returncode
                if m.killed:
                    continue  # the chaos thread restarts it
                if m.name == "dist" and code != 0:
                    # a rank hit by a kill ends the job; a job that ended alone is a finding
                    pass
                self.finding("no member exits by itself",
                             f"{m.name} exited with {code}: {m.log_tail(8)}")
                self.start_from_thread(m.start)
            self.check_hangs()

    def check_hangs(self) -> None:
        now = time.time()
        for hb in self.paths["hb"].iterdir():
            state = read_json(hb)
            if not state or state.get("op") is None:
                continue
            age = now - float(state["since"])
            if age < OP_TIMEOUT_S:
                continue
            pid = int(state["pid"])
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                continue
            self.finding("no process hangs", f"{hb.name} (pid {pid}) in '{state['op']}' for "
                                              f"{age:.0f} s; killed")
            write_json(hb, {"op": None, "since": now, "pid": pid})
            member = self.members.get(hb.name.split("-rank")[0])
            if member is not None:
                member.killed = True
                self.later(1.0, member.start)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def later(self, delay_s: float, fn: Any,
              wait: subprocess.Popen[bytes] | None = None) -> None:
        """``fn()`` in the starter thread after ``delay_s`` (and ``wait`` has exited)."""
        def run() -> None:
            if wait is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    wait.wait(120)
            if delay_s:
                time.sleep(delay_s)
            try:
                self.start_from_thread(fn)
            except Exception as exc:  # a restart that failed is a finding, not a crash
                self.finding("members restart", f"{getattr(fn, '__qualname__', fn)}: {exc}")
        t = threading.Thread(target=run, daemon=True)
        t.start()
        self.timers.append(t)

    def start_node(self, name: str) -> None:
        """Start a node; the chaos thread leaves it alone until it answers."""
        with self.lock:
            self.node_starting.add(name)
        try:
            self.nodes[name].start()
        finally:
            with self.lock:
                self.node_starting.discard(name)

    def start_from_thread(self, fn: Any) -> Any:
        return self.starter.submit(fn).result()

    # -- chaos ------------------------------------------------------------------------------
    def chaos(self) -> None:
        rng = random.Random(self.args.seed)
        deadline = self.started_at + self.args.minutes * 60
        n = 0
        while True:
            wait = rng.uniform(0.5, 1.5) * self.args.fault_every
            if self.done.wait(wait) or time.monotonic() > deadline:
                return
            n += 1
            kinds, weights = zip(*FAULT_WEIGHTS.items(), strict=True)
            # every kind once first, so that a short run injects each of them too
            kind = kinds[n - 1] if n <= len(kinds) else rng.choices(kinds, weights)[0]
            snaps, kv = self.snapshot_roots(), self.kv_roots()
            try:
                if kind == "kill":
                    record = self.fault_kill(rng)
                elif kind == "fill-disk":
                    record = self.fault_fill_disk(rng, n)
                elif kind == "flip-chunk":
                    record = with_links(flip_chunk(rng, snaps), snaps)
                elif kind == "flip-manifest":
                    record = flip_manifest_digit(rng, snaps)
                elif kind == "flip-segment":
                    record = flip_segment(rng, kv)
                else:
                    record = plant_symlink(rng, snaps[:2], self.paths["canary"], n)
            except OSError as exc:  # a file vanished under us (gc, rm): try again later
                record = {"skipped": f"{type(exc).__name__}: {exc}"}
            self.note("fault", fault=kind, n=n, **(record or {"skipped": "no target"}))

    def fault_kill(self, rng: random.Random) -> dict[str, Any] | None:
        with self.lock:
            targets = sorted([m for m in self.members.values() if m.alive and not m.killed],
                             key=lambda m: m.name)
            nodes = sorted(name for name, node in self.nodes.items() if node.running
                           and name not in self.node_down and name not in self.node_starting)
        names = [m.name for m in targets] + nodes
        if not names:
            return None
        victim = rng.choice(names)
        delay = rng.uniform(0.3, 2.5)
        if victim in self.nodes:
            node = self.nodes[victim]
            pid = node.pid
            self.node_down[victim] = time.time()
            node.kill()

            def restart(name: str = victim) -> None:
                if self.done.is_set() and name == "node-4":
                    return
                self.start_node(name)
                self.note("node-up", node=name, down_s=time.time() - self.node_down.pop(name))
            self.later(delay, restart)
            return {"target": victim, "pid": pid, "restart_s": round(delay, 2)}
        member = self.members[victim]
        pids = member.victims()
        if not pids:
            return None
        pid = rng.choice(pids)
        member.killed = True
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

        def restart_member(m: Member = member) -> None:
            if not self.done.is_set() and not m.stopping:
                m.start()
        self.later(delay, restart_member, wait=member.proc)
        return {"target": victim, "pid": pid, "restart_s": round(delay, 2)}

    def snapshot_roots(self) -> list[Path]:
        emb = self.paths["stores"] / "embedded"
        return [emb / "ckpt0", emb / "small" / "ckpt1",
                *(root / "ckpt" for root in self.node_roots.values())]

    def kv_roots(self) -> list[Path]:
        emb = self.paths["stores"] / "embedded"
        return [emb / "kv0", emb / "small" / "kv1",
                *(root / "kv" for root in self.node_roots.values())]

    def fault_fill_disk(self, rng: random.Random, n: int) -> dict[str, Any] | None:
        if self.tmpfs is None:
            return None
        path = self.tmpfs / f"filler-{n}"
        self.fill_active = path
        written = fill_disk(self.tmpfs, path.name)
        hold = rng.uniform(2.0, 6.0)
        self.done.wait(hold)
        path.unlink(missing_ok=True)
        self.fill_active = None
        return {"bytes": written, "held_s": round(hold, 2)}

    # -- join and leave -------------------------------------------------------------------
    def membership(self) -> None:
        duration = self.args.minutes * 60
        cycles = 1 if self.args.minutes < 3 else 2
        plan = []
        for c in range(cycles):
            plan += [("join", (0.15 + c * 0.45) * duration),
                     ("leave", (0.35 + c * 0.45) * duration)]
        base = read_json(self.paths["nodes"])["base"]
        joiner = self.nodes["node-4"]
        version = 0
        for action, at in plan:
            if self.done.wait(max(0.0, self.started_at + at - time.monotonic())):
                return
            version += 1
            if action == "join":
                try:
                    self.start_from_thread(lambda: self.start_node("node-4"))
                except Exception as exc:
                    self.finding("members restart", f"node-4 did not start: {exc}")
                    continue
                write_json(self.paths["members"], {"version": version,
                                                   "members": [*base, joiner.url]})
            else:
                write_json(self.paths["members"], {"version": version, "members": base})
            self.note("membership", action=action, version=version)
            ack = self.paths["ctl"] / f"members-ack-{version}"
            deadline = time.monotonic() + 180
            while not ack.exists() and time.monotonic() < deadline and not self.done.is_set():
                time.sleep(0.2)
            self.note("membership-done", action=action, version=version,
                      acked=ack.exists(), moved=(read_json(ack) or {}).get("moved"))
            if action == "leave" and "node-4" not in self.node_down:
                with contextlib.suppress(Exception):
                    joiner.stop(30)

    # -- the end --------------------------------------------------------------------------
    def shutdown(self) -> None:
        self.done.set()
        t0 = time.monotonic()
        for t in self.timers:
            t.join(120)
        self.note("timers-joined", seconds=round(time.monotonic() - t0, 2))
        if self.fill_active is not None:
            self.fill_active.unlink(missing_ok=True)
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
        for m in waiting:  # hung: where, then killed
            if m.proc is None:
                continue
            with contextlib.suppress(ProcessLookupError):
                m.proc.send_signal(signal.SIGUSR1)  # the worker dumps its stacks
            time.sleep(2.0)
            self.finding("no process hangs", f"{m.name} did not stop within "
                                              f"{STOP_TIMEOUT_S} s of SIGTERM; "
                                              f"killed. {m.log_tail(60)}")
            m.proc.kill()
            m.proc.wait()
        for m in self.members.values():
            if m.proc is None or m in waiting:
                continue
            code = m.proc.returncode
            if code == -signal.SIGTERM and not self.began(m):
                continue  # restarted just before the stop: SIGTERM came before any code ran
            if code != 0 and not m.killed:
                self.finding("members exit cleanly", f"{m.name} exited with {code} after "
                                                      f"SIGTERM: {m.log_tail(8)}")
        self.note("stopped", seconds={k: round(v, 2) for k, v in self.stop_s.items()})
        self.stopped_at = time.monotonic()

    def began(self, m: Member) -> bool:
        """Whether the member's current process got as far as its first journal line."""
        pid = m.proc.pid if m.proc is not None else None
        events = read_journals(self.paths["journal"]).get(m.name, [])
        return any(e["ev"] == "start" and e["pid"] == pid for e in events)

    def check(self, phase: str) -> dict[str, Any]:
        try:
            return run_checks(phase, self.run)
        except Exception as exc:  # a check that broke is a finding, not a crash
            self.finding("final check runs", f"check {phase}: {type(exc).__name__}: {exc}: "
                                              f"{traceback.format_exc()[-1500:]}")
            return {"violations": [], "counts": {}}

    def cluster_chaos(self) -> None:
        assert self.cluster is not None
        try:
            self.cluster.run()
        except Exception as exc:  # a schedule that broke is a finding, not a crash
            self.finding("final check runs", f"cluster phase: {type(exc).__name__}: {exc}")

    def finish_cluster(self) -> None:
        """The cluster's fault schedule runs out (it is not cut short), then its clients
        read everything once more and the cluster is judged."""
        assert self.cluster is not None
        self.cluster_thread.join()
        try:
            self.cluster_result = self.cluster.finish()
        except Exception as exc:  # a finish that broke is a finding, not a crash
            self.finding("final check runs", f"cluster phase: {type(exc).__name__}: {exc}")

    def finish(self) -> dict[str, Any]:
        for name, node in self.nodes.items():
            if not node.running:
                node.start()
            self.node_down.pop(name, None)
        t0 = time.monotonic()
        remote = self.check("remote")
        print(f"[soak] remote check {time.monotonic() - t0:.0f} s", flush=True)
        for name, node in self.nodes.items():
            code = node.stop(60)
            if code != 0:
                self.finding("members exit cleanly", f"{name} exited with {code} after SIGTERM")
        # Leftovers younger than the gc grace period are spared: wait it out since the
        # last writer stopped.
        time.sleep(max(0.0, self.stopped_at + GC_GRACE_S + 1 - time.monotonic()))
        t0 = time.monotonic()
        local = self.check("local")
        print(f"[soak] local check {time.monotonic() - t0:.0f} s", flush=True)
        if self.tmpfs is not None:
            if self.args.keep:  # for a post-mortem: the tmpfs goes with the unmount
                shutil.copytree(self.tmpfs, self.tmpfs.with_name("small-copy"), symlinks=True)
            unmount(self.tmpfs)
            self.tmpfs = None
        for name, node in self.nodes.items():
            text = node.log_path.read_text(errors="replace")
            if "Traceback" in text:
                at = text.index("Traceback")
                self.finding("nodes log no tracebacks",
                             f"{name}: {text.count('Traceback')}, the first: "
                             f"{text[at:at + 600]}")
        before = read_json(self.run / "canary-before.json")
        after = tree_digest(self.paths["canary"])
        changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
        if changed:
            self.finding("nothing outside the stores changes",
                         f"{len(changed)} canary entries changed: {changed[:8]}")
        journals = read_journals(self.paths["journal"])
        return summarize(journals, [remote, local], self.findings, canary_changed=len(changed),
                         canary_entries=len(before), disk_full=self.tmpfs_note,
                         minutes=self.args.minutes, seed=self.args.seed,
                         starts={m.name: m.starts for m in self.members.values()},
                         cluster=self.cluster_result)

    def cleanup(self) -> None:
        self.done.set()
        for m in self.members.values():
            if m.alive and m.proc is not None:
                m.proc.kill()
                m.proc.wait()
        for node in self.nodes.values():
            node.kill()
        if self.cluster is not None:
            self.cluster.cleanup()
        self.starter.shutdown(wait=True)
        if self.tmpfs is not None:
            unmount(self.tmpfs)


# -- the cluster phase: three nodes found through a real etcd, KV clients on
# KVPool.connect("etcd://..."), a node SIGKILLed and restarted, one SIGSTOPped past
# its lease and resumed, etcd restarted. No wrong byte ever (a miss is fine), no client
# crash, every node back in etcd and in every client's ring at the end. --------------
class ClusterPhase:
    """Starts etcd, the nodes and the clients; runs the fault schedule; judges the end.

    ``start_in`` runs a callable in the soak's starter thread (children die with the
    thread that started them); ``note`` journals, ``finding`` records a violation."""

    def __init__(self, folder: Path, seed: int, start_in: Callable[[Any], Any],
                 note: Callable[..., None], finding: Callable[[str, str], None]) -> None:
        from tests.support.etcd import EtcdServer
        from tests.support.node import NodeProcess, write_node_config

        self.folder, self.seed = folder, seed
        self.start_in, self.note, self.finding = start_in, note, finding
        folder.mkdir(parents=True, exist_ok=True)
        self.etcd = EtcdServer(folder / "etcd")
        self.url = self.etcd.url(PREFIX)
        section = {"etcd": {"url": self.url, "lease_ttl_s": LEASE_TTL_S}}
        self.nodes = []
        for i in range(1, 4):
            node = NodeProcess(write_node_config(folder / f"node-{i}", cluster=section),
                               args=("--cluster", self.url), startup_timeout_s=NODE_START_S)
            node.log_path = folder / f"node-{i}.log"
            self.nodes.append(node)
        self.clients: dict[str, subprocess.Popen[bytes]] = {}
        self.events: list[dict[str, Any]] = []

    def launch(self) -> None:
        self.start_in(self.etcd.start)
        for node in self.nodes:
            self.start_in(node.launch)

    def _start_client(self, name: str) -> None:
        from tests.support.procs import die_with_parent

        with open(self.folder / f"{name}.log", "ab") as log:
            self.clients[name] = subprocess.Popen(
                [sys.executable, str(HERE / "_soak_worker.py"), "etcd-client", str(self.folder),
                 name, self.url, str(self.seed)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                preexec_fn=die_with_parent)

    def wait_ready(self) -> None:
        """Every node answers and is registered; then the clients start (a client on an
        empty prefix is refused: it names the command that starts a node)."""
        for node in self.nodes:
            node.wait_ready()
        urls = {n.url for n in self.nodes}
        if self.wait_for("every node registered", lambda: self.registered() == urls, 30.0) \
                is None:
            raise RuntimeError(f"nodes not registered in etcd: {self.registered()}")
        for name in CLIENTS:
            self.start_in(lambda name=name: self._start_client(name))

    def ready(self) -> bool:
        """Every client has acknowledged a prompt (the chaos may begin)."""
        return all((read_json(self.folder / f"status-{n}.json") or {}).get("acked", 0) > 0
                   for n in CLIENTS)

    # -- the schedule ----------------------------------------------------------------------
    def registered(self) -> set[str]:
        """Node URLs registered in etcd now (empty while etcd does not answer)."""
        try:
            keys = self.etcd.ctl("get", "--prefix", f"{PREFIX}/nodes/", "--keys-only")
        except (RuntimeError, OSError, subprocess.TimeoutExpired):
            return set()
        from urllib.parse import unquote

        return {unquote(k.rsplit("/", 1)[1]) for k in keys.split()}

    def wait_for(self, what: str, test: Callable[[], bool], timeout_s: float) -> float | None:
        """Seconds until ``test()`` held, or None (journaled) when it did not in time."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if test():
                return round(time.monotonic() - t0, 2)
            time.sleep(0.2)
        self.note("cluster-timeout", what=what, timeout_s=timeout_s)
        return None

    def step(self, fault: str, **fields: Any) -> None:
        event = {"fault": fault, **fields}
        self.events.append(event)
        self.note("cluster-fault", **event)

    def run(self) -> None:
        """The faults in order, each waited out: kill, stop, etcd restart."""
        rng = random.Random(self.seed)
        ttl = LEASE_TTL_S
        self.wait_for("clients ready", self.ready, 120.0)
        time.sleep(2.0)  # prompts on every node before the first fault
        killed, paused = rng.sample(self.nodes, 2)
        killed.kill()  # SIGKILL: no withdrawal, the lease expires
        gone = self.wait_for("killed node leaves", lambda: killed.url not in self.registered(),
                             ttl + 10.0)
        self.start_in(killed.launch)
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
        self.start_in(self.etcd.start)
        back = self.wait_for("every node registered after the etcd restart",
                             lambda: len(self.registered()) == len(self.nodes), 60.0)
        self.step("etcd restart", down_s=ttl + 1.0, all_back_s=back)
        urls = sorted(n.url for n in self.nodes)
        settled = self.wait_for("every client sees every node", lambda: all(
            (read_json(self.folder / f"status-{n}.json") or {}).get("nodes") == urls
            for n in CLIENTS), 30.0)
        self.note("cluster-settled", seconds=settled)

    # -- the end ---------------------------------------------------------------------------
    def finish(self) -> dict[str, Any]:
        """Clients read everything once more and exit; then the invariants."""
        urls = sorted(n.url for n in self.nodes)
        for node in self.nodes:
            if node.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(node.pid, signal.SIGCONT)
            if not node.running:
                self.start_in(node.start)
        registered = self.registered()
        write_json(self.folder / "phase", "final")
        results: dict[str, Any] = {}
        for name, proc in self.clients.items():
            try:
                code = proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
                self.finding("no cluster client crashes", f"{name} did not finish in 120 s")
            result = read_json(self.folder / f"result-{name}.json")
            if code != 0 or result is None:
                self.finding("no cluster client crashes", f"{name} exited {code}: "
                             f"{log_tail(self.folder / f'{name}.log')}")
                continue
            results[name] = result
            for raw in result["raw"][:5]:
                self.finding("errors are IsolaneErrors", f"{name}: {raw}")
            if result["wrong"]:
                self.finding("no KV get returns wrong bytes",
                             f"{name} (etcd cluster): {len(result['wrong'])} blocks, e.g. "
                             f"{result['wrong'][0]}")
            if result["final_nodes"] != urls:
                self.finding("every node back in the membership",
                             f"{name} ends with {result['final_nodes']}, not {urls}")
        if sorted(registered) != urls:
            self.finding("every node back in the membership",
                         f"etcd holds {sorted(registered)}, not {urls}")
        for i, node in enumerate(self.nodes, 1):
            code = node.stop(60) if node.running else None
            if code not in (0, None):
                self.finding("members exit cleanly", f"etcd node-{i} exited with {code}")
            text = node.log_path.read_text(errors="replace")
            if "Traceback" in text:
                at = text.index("Traceback")
                self.finding("nodes log no tracebacks",
                             f"etcd node-{i}: {text[at:at + 600]}")
        self.etcd.kill()
        return summarize_cluster(results, self.events, registered=len(registered))

    def cleanup(self) -> None:
        for proc in self.clients.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for node in self.nodes:
            if node.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(node.pid, signal.SIGCONT)
            node.kill()
        self.etcd.kill()


def summarize_cluster(results: dict[str, Any], events: list[dict[str, Any]], *,
                      registered: int) -> dict[str, Any]:
    def total(key: str) -> int:
        return sum(len(r[key]) if key == "wrong" else r[key] for r in results.values())

    return {"events": events, "clients": len(results), "registered": registered,
            **{k: total(k) for k in ("puts", "errors", "wrong", "blocks_checked")},
            "served_share_after": round(total("served_final") / total("asked_final"), 4)
            if total("asked_final") else None}


def log_tail(path: Path, lines: int = 12) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# -- the checks, once every member has stopped ------------------------------------------
BATCH = 256


class Evidence:
    """What the journals say was done on purpose: damage, evictions, removals."""

    def __init__(self, run: Path) -> None:
        self.run = run
        self.paths = run_paths(run)
        self.journals = read_journals(self.paths["journal"])
        faults = [ev for ev in self.journals.get("chaos", []) if ev["ev"] == "fault"]
        self.file_flips = [ev for ev in faults if ev["fault"] in ("flip-chunk", "flip-manifest")
                           and "ino" in ev]
        self.flipped_paths = {p for ev in self.file_flips
                              for p in [ev["path"], *ev.get("links", [])]}
        self.damaged_keys = {ev["key"] for ev in faults if ev["fault"] == "flip-segment"
                             and "key" in ev}
        self.evicted = {k for evs in self.journals.values() for ev in evs
                        if ev["ev"] == "evicted" for k in ev["keys"]}
        self.removed = {(ev["store"], ev["name"]) for evs in self.journals.values()
                        for ev in evs if ev["ev"] == "rm-intent"}
        self.acks = [dict(ev, member=m) for m, evs in self.journals.items() for ev in evs
                     if ev["ev"] == "ack"]
        nodes = read_json(self.paths["nodes"])
        self.node_roots = [Path(p) for p in nodes["roots"].values()]
        self.node_urls = list(nodes["urls"].values())
        emb = self.paths["stores"] / "embedded"
        self.embedded_roots = [emb / "ckpt0", emb / "small" / "ckpt1"]

    def roots(self, store: str) -> list[Path]:
        return self.embedded_roots if store == "embedded" else [r / "ckpt" for r in
                                                                self.node_roots]

    def damaged(self, store: str, name: str) -> bool:
        """Whether a recorded flip hit a file of snapshot ``name`` (by path at the time,
        or by the inode of a file it holds now, as hard links share it)."""
        marker = f"/snapshots/{name}/"
        if any(marker in p for p in self.flipped_paths):
            return True
        inodes = {(ev["dev"], ev["ino"]): ev for ev in self.file_flips}
        for root in self.roots(store):
            for p in regular_files(root / "snapshots" / name):
                try:
                    st = p.stat()
                except OSError:
                    continue
                ev = inodes.get((st.st_dev, st.st_ino))
                if ev is not None:
                    return True
        return False


class CheckResult:
    def __init__(self) -> None:
        self.violations: list[dict[str, str]] = []
        self.counts: Counter[str] = Counter()

    def violate(self, invariant: str, detail: str) -> None:
        self.violations.append({"invariant": invariant, "detail": detail})

    def lost(self, detail: str) -> None:
        """An acknowledged save that does not load back."""
        self.violate("acknowledged saves load bit-exact", detail)
        self.counts["lost"] += 1

    def to_json(self) -> dict[str, Any]:
        return {"violations": self.violations, "counts": dict(self.counts)}


# -- snapshots ------------------------------------------------------------------------------
def check_load(res: CheckResult, ev: Evidence, store: Any, store_kind: str, ack: dict[str, Any]
               ) -> None:
    from isolane.errors import IntegrityError, SnapshotNotFoundError

    name = ack["name"]
    try:
        got = store.load(name, shard=(0, 1)) if ack["kind"] == "dist" else store.load(name)
    except IntegrityError as exc:
        if ev.damaged(store_kind, name):
            res.counts["final: damaged on purpose, IntegrityError"] += 1
        else:
            res.violate("acknowledged saves load bit-exact",
                        f"{store_kind} '{name}': IntegrityError without recorded damage: {exc}")
        return
    except SnapshotNotFoundError:
        res.lost(f"{store_kind} '{name}' (generation {ack.get('generation')}) is gone: lost")
        return
    except Exception as exc:
        res.lost(f"{store_kind} '{name}': {type(exc).__name__}: {exc}")
        return
    diff = differences(got, expected_state(ack["kind"], ack["seed"]))
    if diff:
        if ev.damaged(store_kind, name):
            res.violate("damage is detected", f"{store_kind} '{name}' was damaged on purpose "
                        f"and loaded without an IntegrityError, wrong: {diff[:3]}")
        else:
            res.violate("acknowledged saves load bit-exact", f"{store_kind} '{name}': {diff[:3]}")
        res.counts["wrong"] += 1
        return
    res.counts["final: snapshots loaded bit-exact"] += 1
    res.counts["bytes verified: snapshots (final)"] += int(ack["bytes"])


def check_snapshots(res: CheckResult, ev: Evidence, store: Any, store_kind: str) -> None:
    by_name: dict[str, list[dict[str, Any]]] = {}
    for ack in ev.acks:
        if ack.get("store") == store_kind and not ack["name"].startswith("ow-"):
            by_name.setdefault(ack["name"], []).append(ack)
    for name, acks in by_name.items():
        if len(acks) > 1:
            res.violate("one save wins a new name", f"{store_kind} '{name}' acknowledged to "
                        f"{len(acks)} savers: {[a['member'] for a in acks]}")
    for ack in ev.acks:
        if ack.get("store") != store_kind or ack["name"].startswith("ow-"):
            continue
        if (store_kind, ack["name"]) in ev.removed:
            res.counts["final: removed by rm (skipped)"] += 1
            continue
        check_load(res, ev, store, store_kind, ack)


def check_overwrites(res: CheckResult, ev: Evidence, store: Any) -> None:
    """The overwrite trainer's name loads as its newest acknowledged save or as a save
    that started after it (killed between commit and journal)."""
    from isolane.errors import IntegrityError

    names = sorted({a["name"] for a in ev.acks if a["name"].startswith("ow-")})
    for name in names:
        acked = [a["seed"] for a in ev.acks if a["name"] == name]
        begun = {e["seed"] for evs in ev.journals.values() for e in evs
                 if e["ev"] == "begin" and e.get("name") == name}
        try:
            got = store.load(name)
        except IntegrityError as exc:
            if not ev.damaged("embedded", name):
                res.violate("acknowledged saves load bit-exact",
                            f"overwrite '{name}': IntegrityError without damage: {exc}")
            continue
        except Exception as exc:
            res.lost(f"overwrite '{name}': {type(exc).__name__}: {exc}")
            continue
        seed = got.get("step") if isinstance(got, dict) else None
        if seed not in begun or seed < max(acked):
            res.violate("overwrite keeps the newest commit",
                        f"'{name}' holds step {seed}; newest acknowledged {max(acked)}")
            continue
        diff = differences(got, expected_state("plain", seed))
        if diff:
            res.violate("acknowledged saves load bit-exact", f"overwrite '{name}': {diff[:3]}")
            res.counts["wrong"] += 1
        else:
            res.counts["final: overwrite names loaded bit-exact"] += 1


def check_verifier(res: CheckResult, ev: Evidence) -> None:
    """The verifier's loads during the run, judged with the complete journals."""
    for e in ev.journals.get("verify", []):
        if e["ev"] != "verify":
            continue
        outcome, key = e["outcome"], (e["store"], e["name"])
        res.counts[f"run: verify {outcome}"] += 1
        if outcome == "ok":
            res.counts["bytes verified: snapshots (during run)"] += int(e.get("bytes", 0))
        elif outcome == "wrong":
            if ev.damaged(e["store"], e["name"]):
                res.violate("damage is detected", f"{key}: damaged and loaded wrong during the "
                            f"run without an IntegrityError: {e.get('diff')}")
            else:
                res.violate("acknowledged saves load bit-exact", f"{key} during the run: "
                            f"{e.get('diff')}")
            res.counts["wrong"] += 1
        elif outcome == "missing" and key not in ev.removed:
            res.violate("acknowledged saves load bit-exact",
                        f"{key} missing during the run, never removed: {e.get('error')}")
        elif outcome == "integrity" and not ev.damaged(*key) and key not in ev.removed:
            res.violate("acknowledged saves load bit-exact",
                        f"{key}: IntegrityError during the run without damage: {e.get('error')}")
        elif outcome == "error" and e["store"] == "embedded" and key not in ev.removed:
            res.violate("acknowledged saves load bit-exact",
                        f"{key}: load failed during the run: {e.get('error')}")


def check_listing(res: CheckResult, ev: Evidence) -> None:
    for e in ev.journals.get("verify", []):
        if e["ev"] == "list":
            res.counts[f"run: list {e['outcome']}"] += 1
            if e["outcome"] != "ok":
                res.violate("one damaged snapshot fails alone",
                            f"list() failed during the run: {e['error']}")


def check_damage_detected(res: CheckResult, ev: Evidence, store: Any, store_kind: str) -> None:
    """Every acknowledged snapshot with a flipped chunk in its generation: verify raises."""
    from isolane.errors import IntegrityError, SnapshotNotFoundError

    chunk_flips = [e for e in ev.file_flips if e["fault"] == "flip-chunk"]
    for ack in ev.acks:
        if ack.get("store") != store_kind or ack["name"].startswith("ow-") \
                or (store_kind, ack["name"]) in ev.removed:
            continue
        folder = f"/snapshots/{ack['name']}/{ack['generation']}/"
        if not any(folder in p for e in chunk_flips for p in [e["path"], *e.get("links", [])]):
            continue
        try:
            store.verify(ack["name"])
        except IntegrityError:
            res.counts["final: damaged snapshots that verify refuses"] += 1
        except SnapshotNotFoundError:
            pass  # reported as lost by check_snapshots
        else:
            res.violate("damage is detected", f"{store_kind} '{ack['name']}': a chunk was "
                        "flipped and verify() says OK")


def check_gc_journal(res: CheckResult, ev: Evidence) -> None:
    acked = {(a["name"], a["generation"]) for a in ev.acks if a.get("store") == "embedded"
             and not a["name"].startswith("ow-")}
    for e in ev.journals.get("gc", []):
        if e["ev"] != "gc":
            continue
        res.counts["run: gc sweeps"] += len(e["swept"])
        for item in e["swept"]:
            rest = item.partition(":")[2]
            name, _, gen = rest.partition("/")
            if (name, gen) in acked and ("embedded", name) not in ev.removed:
                res.violate("gc deletes nothing committed",
                            f"gc swept acknowledged {name}/{gen}")
        for name in e["deleted"]:
            res.violate("gc deletes nothing committed", f"gc deleted snapshot {name} "
                        "(no retention is configured)")


def final_gc_and_orphans(res: CheckResult, ev: Evidence, label: str, config: Any,
                         roots: list[Path], acked_store: str | None) -> None:
    from isolane import SnapshotStore

    acked = {(a["name"], a["generation"]) for a in ev.acks if a.get("store") == acked_store}
    with SnapshotStore(config) as store:
        try:
            report = store.gc()
        except Exception as exc:
            res.violate("gc leaves no orphan", f"{label}: final gc failed: "
                        f"{type(exc).__name__}: {exc}")
            return
    for item in report.swept_generations:
        name, _, gen = item.partition(":")[2].partition("/")
        res.counts["final gc: generations swept"] += 1
        if (name, gen) in acked and (acked_store, name) not in ev.removed \
                and not name.startswith("ow-"):
            res.violate("gc deletes nothing committed", f"{label}: final gc swept acknowledged "
                        f"{name}/{gen}")
    # Orphans: every generation folder left must be the committed newest of its name.
    primary = roots[0] / "snapshots"
    for root in roots:
        snaps = root / "snapshots"
        if not snaps.is_dir():
            continue
        for entry in sorted(snaps.iterdir()):
            if entry.is_symlink():
                res.counts["planted symlinks still in place"] += 1
                continue
            gens = sorted(g.name for g in entry.iterdir() if not g.is_symlink()) \
                if entry.is_dir() else []
            if not gens:
                res.violate("gc leaves no orphan", f"{label}: empty folder {entry}")
                res.counts["orphans"] += 1
                continue
            committed = sorted(g.name for g in (primary / entry.name).iterdir()
                               if (g / "isolane.json").exists()) \
                if (primary / entry.name).is_dir() else []
            newest = committed[-1] if committed else None
            for gen in gens:
                if gen != newest:
                    res.violate("gc leaves no orphan", f"{label}: {entry / gen} "
                                f"(committed newest: {newest})")
                    res.counts["orphans"] += 1
    res.counts[f"orphan check: {label}"] += 1


# -- KV ---------------------------------------------------------------------------------------
def acked_keys(ev: Evidence, member: str) -> list[str]:
    return list(dict.fromkeys(k for e in ev.journals.get(member, []) if e["ev"] == "kv-ack"
                              for k in e["keys"]))


def run_kv_events(res: CheckResult, ev: Evidence, member: str, strict_misses: bool) -> None:
    label = "embedded" if member == "kv" else "cluster"
    for e in ev.journals.get(member, []):
        if e["ev"] == "kv-wrong":
            res.violate("no KV get returns wrong bytes", f"{label} during the run ({e['via']}): "
                        f"{len(e['keys'])} blocks, e.g. {e['keys'][0]}")
            res.counts["wrong"] += len(e["keys"])
        elif e["ev"] == "kv-miss":
            res.counts[f"run: {label} KV misses"] += 1
            if strict_misses and e["key"] not in ev.damaged_keys | ev.evicted:
                res.violate("KV misses only for damaged or evicted blocks",
                            f"{label}: block {e['key']} missed during the run ({e['via']})")
    last: dict[int, dict[str, Any]] = {}
    for e in ev.journals.get(member, []):
        if e["ev"] == "kv-counts":
            last[e["pid"]] = e
    for e in last.values():
        for k in ("puts", "put_blocks", "gets", "blocks_read", "misses"):
            res.counts[f"run: {label} KV {k}"] += int(e[k])
        res.counts["bytes verified: KV (during run)"] += int(e["bytes_verified"])


def judge_blocks(res: CheckResult, ev: Evidence, label: str, keys: list[str],
                 found: dict[str, bytes | None]) -> None:
    for key in keys:
        value = found.get(key)
        if value is None:
            if key in ev.damaged_keys:
                res.counts[f"final: {label} KV blocks missing, damaged on purpose"] += 1
            elif key in ev.evicted:
                res.counts[f"final: {label} KV blocks missing, evicted (device full)"] += 1
            else:
                res.counts["lost"] += 1
                res.counts[f"final: {label} KV blocks lost"] += 1
        elif value != block_value(bytes.fromhex(key)):
            res.counts["wrong"] += 1
            res.violate("no KV get returns wrong bytes", f"{label}: block {key} final read wrong")
        else:
            res.counts[f"final: {label} KV blocks read back"] += 1
            res.counts["bytes verified: KV (final)"] += KV_BLOCK_BYTES
    lost = res.counts[f"final: {label} KV blocks lost"]
    if lost:
        res.violate("KV misses only for damaged or evicted blocks",
                    f"{label}: {lost} acknowledged blocks found nowhere")


def check_cluster_kv(res: CheckResult, ev: Evidence) -> None:
    from isolane.client.kv_pool import RemoteKVPool

    keys = acked_keys(ev, "kv-cluster")
    found: dict[str, bytes | None] = {}
    for url in ev.node_urls:  # on any node: moves and reroutes put blocks elsewhere
        with RemoteKVPool([url], namespace=KV_NAMESPACE, chunk_tokens=KV_CHUNK_TOKENS,
                          token_dim=KV_TOKEN_DIM, poll_s=None, timeout_s=30.0) as pool:
            todo = [k for k in keys if found.get(k) is None]
            for i in range(0, len(todo), BATCH):
                batch = todo[i:i + BATCH]
                for k, v in zip(batch, pool.get_blocks([bytes.fromhex(k) for k in batch]),
                                strict=True):
                    if v is not None:
                        if bytes(v) != block_value(bytes.fromhex(k)):
                            res.counts["wrong"] += 1
                            res.violate("no KV get returns wrong bytes",
                                        f"cluster: block {k} wrong on {url}")
                        found[k] = bytes(v)
    judge_blocks(res, ev, "cluster", keys, found)


def check_embedded_kv(res: CheckResult, ev: Evidence) -> None:
    from isolane.kvpool.pool import KVPool

    keys = acked_keys(ev, "kv")
    found: dict[str, bytes | None] = {}
    with KVPool(str(ev.paths["embedded_config"]), namespace=KV_NAMESPACE,
                chunk_tokens=KV_CHUNK_TOKENS, token_dim=KV_TOKEN_DIM, memory_budget=0) as pool:
        for i in range(0, len(keys), BATCH):
            batch = keys[i:i + BATCH]
            for k, v in zip(batch, pool.get_blocks([bytes.fromhex(k) for k in batch]),
                            strict=True):
                found[k] = None if v is None else bytes(v)
    judge_blocks(res, ev, "embedded", keys, found)


def run_checks(phase: str, run: Path) -> dict[str, Any]:
    """``remote`` (nodes up): every acknowledged save through the nodes loads bit-exact,
    every acknowledged block of the cluster is on some node with the right bytes.
    ``local`` (nodes stopped): the embedded store's acknowledged saves, the overwrite
    names, the verifier's results, gc's sweeps, a final gc and the orphan check on every
    store, every acknowledged block of the embedded pool. Misses and integrity errors are
    excused only by the fault journal or the pool's eviction journal, deletions only by
    rm's journal."""
    ev = Evidence(run)
    res = CheckResult()
    if phase == "remote":
        from isolane.client.snapshot_store import RemoteSnapshotStore

        store = RemoteSnapshotStore(read_json(ev.paths["nodes"])["base"], timeout_s=120.0)
        check_snapshots(res, ev, store, "remote")
        check_damage_detected(res, ev, store, "remote")
        store.close()
        check_cluster_kv(res, ev)
        run_kv_events(res, ev, "kv-cluster", strict_misses=False)
    else:
        from isolane import SnapshotStore

        config = str(ev.paths["embedded_config"])
        with SnapshotStore(config) as store:
            check_snapshots(res, ev, store, "embedded")
            check_damage_detected(res, ev, store, "embedded")
            check_overwrites(res, ev, store)
        check_verifier(res, ev)
        check_listing(res, ev)
        check_gc_journal(res, ev)
        final_gc_and_orphans(res, ev, "embedded", config, ev.embedded_roots, "embedded")
        for root in ev.node_roots:
            final_gc_and_orphans(res, ev, root.name, str(root / "isolane.yaml"),
                                 [root / "ckpt"], "remote")
        check_embedded_kv(res, ev)
        run_kv_events(res, ev, "kv", strict_misses=True)
    raw = [e for evs in ev.journals.values() for e in evs if e["ev"] == "raw"] \
        if phase == "local" else []
    if raw:
        res.counts["raw (non-isolane) exceptions"] = len(raw)
        for e in raw[:20]:
            res.violate("errors are IsolaneErrors", f"{e['op']}: {e['error'][:300]}")
    return {**res.to_json(), "raw": [{"op": e["op"], "error": e["error"]} for e in raw[:50]]}


def with_links(record: dict[str, Any] | None, roots: list[Path]) -> dict[str, Any] | None:
    """Add every other path of the flipped file's inode (hard links of incremental saves)."""
    if record is None:
        return None
    links = []
    for root in roots:
        for p in regular_files(root / "snapshots"):
            with contextlib.suppress(OSError):
                st = p.stat()
                if (st.st_dev, st.st_ino) == (record["dev"], record["ino"]):
                    links.append(str(p))
    return {**record, "links": links}


# -- the faults: each returns a record (JSON-able) of exactly what it damaged, so that
# the final check can tell a deliberately damaged snapshot or block from a lost one --------
SEGMENT_HEADER_BYTES_AT = 10  # uint16: where the first record starts
RECORD_HEADER = struct.Struct("<QBBHIQ")  # checksum, flags, reserved, key_len, value_len, ts
RECORD_ALIGN = 64
# Not chunk data: a rank's part manifest is merged into the snapshot's at commit (a flip
# in it after that is harmless, so no verify can be asked to see it).
NOT_CHUNKS = {MANIFEST, "zarr.json", WRITING_MARKER, PART_MANIFEST}


def _align(n: int) -> int:
    return -(-n // RECORD_ALIGN) * RECORD_ALIGN




def snapshot_files(roots: list[Path]) -> tuple[list[Path], list[Path]]:
    """(chunk files, manifests) under the ``snapshots`` folder of each root."""
    chunks, manifests = [], []
    for root in roots:
        for p in regular_files(root / "snapshots"):
            if p.name == MANIFEST:
                manifests.append(p)
            elif p.name not in NOT_CHUNKS and not p.name.endswith(".tmp"):
                chunks.append(p)
    return chunks, manifests


def segment_files(roots: list[Path]) -> list[Path]:
    return [p for root in roots for p in regular_files(root / "kvpool")
            if p.suffix in (".live", ".sealed")]


def _flip_at(path: Path, offset: int, mask: int) -> dict[str, Any]:
    st = os.lstat(path)
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    try:
        old = os.pread(fd, 1, offset)
        if len(old) != 1:
            raise OSError(errno.EINVAL, f"{path} has no byte at {offset}")
        new = old[0] ^ mask
        os.pwrite(fd, bytes([new]), offset)
    finally:
        os.close(fd)
    return {"path": str(path), "dev": st.st_dev, "ino": st.st_ino, "offset": offset,
            "byte": new}


def flip_chunk(rng: random.Random, roots: list[Path]) -> dict[str, Any] | None:
    chunks, _ = snapshot_files(roots)
    chunks = [p for p in chunks if _size(p) > 0]
    if not chunks:
        return None
    path = rng.choice(chunks)
    return {"kind": "chunk", **_flip_at(path, rng.randrange(_size(path)), 0xFF)}


def flip_manifest_digit(rng: random.Random, roots: list[Path]) -> dict[str, Any] | None:
    """Change one digit of a manifest (``0`` <-> ``1``, ...): still valid JSON, the
    damage that only a checksum of the manifest itself catches."""
    _, manifests = snapshot_files(roots)
    rng.shuffle(manifests)
    for path in manifests[:5]:
        try:
            data = path.read_bytes()
        except OSError:
            continue
        digits = [i for i, b in enumerate(data) if 0x30 <= b <= 0x39]
        if digits:
            return {"kind": "manifest", **_flip_at(path, rng.choice(digits), 0x01)}
    return None


def segment_records(path: Path) -> list[tuple[int, int, int, bytes]]:
    """(record offset, value offset, value length, key) of each put record, walked by
    the documented framing (no checksum check: the soak only needs to aim)."""
    data = path.read_bytes()
    if len(data) < 64:
        return []
    pos = int.from_bytes(data[SEGMENT_HEADER_BYTES_AT:SEGMENT_HEADER_BYTES_AT + 2], "little")
    out = []
    while pos + RECORD_HEADER.size <= len(data):
        _csum, flags, _res, klen, vlen, _ts = RECORD_HEADER.unpack_from(data, pos)
        if flags not in (1, 2) or not 0 < klen <= 1024:
            break
        delta = _align(RECORD_HEADER.size + klen)
        end = pos + _align(delta + vlen)
        if end > len(data):
            break
        if flags == 1 and vlen:
            key = data[pos + RECORD_HEADER.size:pos + RECORD_HEADER.size + klen]
            out.append((pos, pos + delta, vlen, key))
        pos = end
    return out


def flip_segment(rng: random.Random, roots: list[Path]) -> dict[str, Any] | None:
    """Flip one byte inside the value of a random KV record; records its key."""
    files = segment_files(roots)
    rng.shuffle(files)
    for path in files[:5]:
        try:
            records = segment_records(path)
        except OSError:
            continue
        if not records:
            continue
        _start, value_at, vlen, key = rng.choice(records)
        return {"kind": "segment", "key": key.hex(),
                **_flip_at(path, value_at + rng.randrange(vlen), 0xFF)}
    return None


def plant_symlink(rng: random.Random, roots: list[Path], canary: Path, n: int
                  ) -> dict[str, Any] | None:
    """A symlink into the canary tree where the store deletes: as a snapshot name, or
    inside a snapshot's generation folder."""
    targets = sorted(p for p in canary.iterdir() if p.is_dir())
    root = rng.choice(roots)
    snaps = root / "snapshots"
    if not snaps.is_dir() or not targets:
        return None
    target = rng.choice(targets)
    gens = [g for s in sorted(snaps.iterdir()) if s.is_dir() and not s.is_symlink()
            for g in sorted(s.iterdir()) if g.is_dir() and not g.is_symlink()]
    if gens and rng.random() < 0.5:
        link = rng.choice(gens) / f"planted-{n}"
    else:
        link = snaps / f"planted-{n}"
    try:
        link.symlink_to(target, target_is_directory=True)
    except OSError:
        return None
    return {"kind": "symlink", "path": str(link), "target": str(target)}


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


# -- a full disk ----------------------------------------------------------------------------
def mount_tmpfs(folder: Path, size_mib: int) -> str | None:
    """Mount a tmpfs of ``size_mib`` at ``folder``; None on success, else why not."""
    folder.mkdir(parents=True, exist_ok=True)
    run = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m,mode=0700",
                          "tmpfs", str(folder)], capture_output=True, text=True)
    if run.returncode != 0:
        return (run.stderr or run.stdout).strip() or f"mount exited {run.returncode}"
    return None


def unmount(folder: Path) -> None:
    subprocess.run(["umount", "-l", str(folder)], capture_output=True, check=False)


def fill_disk(folder: Path, name: str) -> int:
    """Write ``folder/name`` until the device says ENOSPC; returns the bytes written."""
    path = folder / name
    written = 0
    block = b"\xa5" * (1 << 20)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        while True:
            try:
                n = os.write(fd, block)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                if len(block) == 1:
                    return written
                block = block[:len(block) // 2]
                continue
            written += n
    finally:
        os.close(fd)


# -- the canary -----------------------------------------------------------------------------
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
        for name in dirs + files:
            p = Path(base) / name
            rel = str(p.relative_to(folder))
            st = os.lstat(p)
            if os.path.islink(p):
                out[rel] = "link:" + os.readlink(p)
            elif p.is_dir():
                out[rel] = f"dir:{st.st_mode:o}"
            else:
                out[rel] = f"file:{st.st_mode:o}:" + hashlib.sha256(p.read_bytes()).hexdigest()
    return out


# -- the results: counted from the journals and the checks, written as markdown ------
INVARIANTS = (
    "acknowledged saves load bit-exact",
    "damage is detected",
    "one damaged snapshot fails alone",
    "overwrite keeps the newest commit",
    "one save wins a new name",
    "no KV get returns wrong bytes",
    "KV misses only for damaged or evicted blocks",
    "gc deletes nothing committed",
    "gc leaves no orphan",
    "nothing outside the stores changes",
    "no process hangs",
    "no member exits by itself",
    "no cluster client crashes",
    "every node back in the membership",
    "members exit cleanly",
    "members restart",
    "nodes log no tracebacks",
    "errors are IsolaneErrors",
    "final check runs",
)
SAVERS = ("sync", "async", "incremental", "overwrite", "race-a", "race-b", "dist", "remote")


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
        markdown_table(["invariant", "violations"],
                       [(name, r["by_invariant"].get(name, 0)) for name in INVARIANTS]), "",
        markdown_table(["operation", "count", "detail"], r["operations"]), "",
        f"Faults injected: {', '.join(faults)}; without a target at that moment: {skipped}.",
        "", f"Cluster through etcd: {cluster}.", "",
        markdown_table(["final check", "count"], sorted(
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
    ap.add_argument("--dir", type=Path, default=REPO_ROOT / ".bench" / "soak",
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
        [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
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
        end = soak.started_at + args.minutes * 60
        while time.monotonic() < end:
            time.sleep(1.0)
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
    where = {"command": command_line(), "when": now_text(),
             "machine": machine_description(args.dir, {"torch": torch.__version__})}
    text = report_markdown(result, **where)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if args.out and is_page(args.out):
        write_results("soak", headline_rows(result, **where))
    elif args.out:
        replace_section(args.out, "soak", text)
    if not args.keep:
        shutil.rmtree(run, ignore_errors=True)
    return 1 if result["violations"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
