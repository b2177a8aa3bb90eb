"""Chaos soak: trainers, gc, rm, inference and storage nodes under SIGKILLs, full disks
and flipped bytes, for a bounded time; then every invariant is checked.

    python benchmarks/soak.py --minutes 10 --seed 11 --out docs/BENCHMARKS.md  # records its rows
    python benchmarks/soak.py --quick    # 15 s of chaos (tests/test_soak.py runs a minute)

Members (each a real process, started again after every kill): trainers saving in a
loop on the embedded store (sync, async, incremental, overwrite), a 2-rank torchrun
job (gloo), a trainer saving through three ``isolane serve`` nodes, gc and rm running
concurrently, a verifier loading acknowledged snapshots, inference processes putting
and getting KV prompts on the embedded pool and through the nodes, and a fourth node
that joins and leaves. A chaos thread on ``--seed`` SIGKILLs random members and
restarts them, fills a small tmpfs that holds one checkpoint and one KV device, flips
bytes in chunk, manifest and segment files (recording each) and plants symlinks into a
canary tree beside the stores. The schedule of faults is fixed by the seed; what they
hit depends on timing. Beside them, a cluster through etcd (``_soak_cluster.py``): a
real etcd, three nodes registered there and two KV client processes on
``KVPool.connect("etcd://...")``, while its own schedule SIGKILLs a node and restarts
it, SIGSTOPs another past its lease and resumes it, and restarts etcd.

Invariants (``_soak_check.py``): every acknowledged save loads bit-exact, or fails with
IntegrityError only if its bytes were damaged on purpose; no KV get returns wrong bytes,
and an acknowledged block is missing only if it was damaged or evicted; gc deletes
nothing committed and leaves no orphan; the canary tree is unchanged; no process hangs
past ``--op-timeout`` or fails to stop; no member exits by itself; no cluster client
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
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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
from benchmarks._soak_cluster import ClusterPhase
from benchmarks._soak_data import (
    Journal,
    read_journals,
    read_json,
    regular_files,
    run_paths,
    write_json,
)
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
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def py_spy_dump(pid: int | None) -> str:
    """The Python stacks of a live process, when py-spy is installed (diagnosis only)."""
    exe = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if exe is None or pid is None:
        return "(py-spy not installed: no stacks)"
    try:
        out = subprocess.run([exe, "dump", "--pid", str(pid)], capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"(py-spy failed: {exc})"
    return (out.stdout + out.stderr)[-6000:]


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
    started_at: float = 0.0
    wall_started: float = field(default_factory=time.time)
    stopped_at: float = 0.0
    # PR_SET_PDEATHSIG kills a child when the *thread* that started it ends: every
    # (re)start from another thread runs in this one, which lives until cleanup.
    starter: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="soak-starter"))

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
            node = NodeProcess(cfg, port=port, startup_timeout_s=90.0)
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
            if age < self.args.op_timeout:
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
    @property
    def weights(self) -> dict[str, float]:
        out = dict(FAULT_WEIGHTS)
        for item in filter(None, (self.args.fault_weights or "").split(",")):
            kind, _, weight = item.partition("=")
            if kind not in out:
                raise SystemExit(f"--fault-weights: unknown fault {kind!r}; one of {list(out)}")
            out[kind] = float(weight)
        return out

    def chaos(self) -> None:
        rng = random.Random(self.args.seed)
        deadline = self.started_at + self.args.minutes * 60
        n = 0
        while True:
            wait = rng.uniform(0.5, 1.5) * self.args.fault_every
            if self.done.wait(wait) or time.monotonic() > deadline:
                return
            n += 1
            kinds, weights = zip(*self.weights.items(), strict=True)
            kind = rng.choices(kinds, weights)[0]
            try:
                record = getattr(self, "fault_" + kind.replace("-", "_"))(rng, n)
            except OSError as exc:  # a file vanished under us (gc, rm): try again later
                record = {"skipped": f"{type(exc).__name__}: {exc}"}
            self.note("fault", fault=kind, n=n, **(record or {"skipped": "no target"}))

    def fault_kill(self, rng: random.Random, n: int) -> dict[str, Any] | None:
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

    def fault_flip_chunk(self, rng: random.Random, n: int) -> dict[str, Any] | None:
        return with_links(flip_chunk(rng, self.snapshot_roots()), self.snapshot_roots())

    def fault_flip_manifest(self, rng: random.Random, n: int) -> dict[str, Any] | None:
        return flip_manifest_digit(rng, self.snapshot_roots())

    def fault_flip_segment(self, rng: random.Random, n: int) -> dict[str, Any] | None:
        return flip_segment(rng, self.kv_roots())

    def fault_symlink(self, rng: random.Random, n: int) -> dict[str, Any] | None:
        return plant_symlink(rng, self.snapshot_roots()[:2], self.paths["canary"], n)

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
        while waiting and time.monotonic() - sent < self.args.stop_timeout:
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
            nodes = "".join(f"\n--- {name} (pid {node.pid}) ---\n{py_spy_dump(node.pid)}"
                            for name, node in self.nodes.items() if node.running)
            self.finding("no process hangs", f"{m.name} did not stop within "
                                              f"{self.args.stop_timeout} s of SIGTERM; "
                                              f"killed. {m.log_tail(60)}{nodes}")
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
        out = self.run / f"check-{phase}.json"
        proc = subprocess.run([sys.executable, str(HERE / "_soak_check.py"), phase,
                               str(self.run), str(out)], cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=self.args.check_timeout)
        (self.paths["logs"] / f"check-{phase}.log").write_text(proc.stdout + proc.stderr)
        result = read_json(out)
        if proc.returncode != 0 or result is None:
            self.finding("final check runs", f"check {phase} exited {proc.returncode}: "
                                              f"{(proc.stdout + proc.stderr)[-2000:]}")
            return {"violations": [], "counts": {}}
        return dict(result)

    def cluster_chaos(self) -> None:
        assert self.cluster is not None
        try:
            self.cluster.run(self.done.is_set)
        except Exception as exc:  # a schedule that broke is a finding, not a crash
            self.finding("final check runs", f"cluster phase: {type(exc).__name__}: {exc}")

    def finish(self) -> dict[str, Any]:
        assert self.cluster is not None
        t0 = time.monotonic()
        self.cluster_result = self.cluster.finish()
        print(f"[soak] cluster check {time.monotonic() - t0:.0f} s", flush=True)
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
                         canary_entries=len(before), tmpfs_note=self.tmpfs_note,
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


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("torch", "aiohttp"):
        with contextlib.suppress(PackageNotFoundError):
            out[name] = version(name)
    return out


# -- the faults: each returns a record (JSON-able) of exactly what it damaged, so that
# the final check can tell a deliberately damaged snapshot or block from a lost one --------
SEGMENT_HEADER_BYTES_AT = 10  # uint16: where the first record starts
RECORD_HEADER = struct.Struct("<QBBHIQ")  # checksum, flags, reserved, key_len, value_len, ts
RECORD_ALIGN = 64
MANIFEST = "isolane.json"
NOT_CHUNKS = {MANIFEST, "zarr.json", "_writing.json", "isolane.part.json"}


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
              findings: list[dict[str, str]], *, canary_changed: int, canary_entries: int,
              tmpfs_note: str, minutes: float, seed: int, starts: dict[str, int],
              cluster: dict[str, Any]) -> dict[str, Any]:
    counts: Counter[str] = Counter()
    for check in checks:
        counts.update(check.get("counts", {}))
    ops: list[tuple[str, int, str]] = []
    for member in SAVERS:
        evs = journals.get(member, [])
        acked = [e for e in evs if e["ev"] == "ack"]
        failed = [e for e in evs if e["ev"] == "fail"]
        linked = sum(int(e.get("linked", 0)) for e in acked)
        errors = Counter(e["error"].split(":")[0] for e in failed)
        detail = ", ".join(f"{n} {k}" for k, n in errors.most_common(4))
        if member == "incremental":
            detail = f"{linked / 1e6:.0f} MB linked from parents" + (f"; {detail}" if detail
                                                                     else "")
        ops.append((f"save ({member}) acknowledged / failed", len(acked),
                    f"{len(failed)} failed" + (f": {detail}" if detail else "")))
    gc = journals.get("gc", [])
    ops.append(("gc runs", sum(e["ev"] == "gc" for e in gc),
                f"{sum(len(e['swept']) for e in gc if e['ev'] == 'gc')} generations swept, "
                f"{sum(e['ev'] == 'gc-fail' for e in gc)} runs failed"))
    rm = journals.get("rm", [])
    ops.append(("rm", sum(e["ev"] == "rm-done" for e in rm),
                f"{sum(e['ev'] == 'rm-fail' for e in rm)} failed"))
    verify = Counter(e["outcome"] for e in journals.get("verify", []) if e["ev"] == "verify")
    ops.append(("verify loads (during run)", sum(verify.values()),
                ", ".join(f"{n} {k}" for k, n in sorted(verify.items()))))
    for label in ("embedded", "cluster"):
        ops.append((f"KV puts ({label})", counts[f"run: {label} KV puts"],
                    f"{counts[f'run: {label} KV put_blocks']} blocks acknowledged"))
        ops.append((f"KV gets ({label})", counts[f"run: {label} KV gets"],
                    f"{counts[f'run: {label} KV blocks_read']} blocks read and checked, "
                    f"{counts[f'run: {label} KV misses']} misses"))
    members = [e for e in journals.get("chaos", []) if e["ev"] == "membership-done"]
    ops.append(("node joins / leaves", len(members),
                ", ".join(f"{e['action']} ({'moved' if e.get('moved') else 'not moved'})"
                          for e in members)))
    faults = [e for e in journals.get("chaos", []) if e["ev"] == "fault"]
    kills = Counter(e["target"].split("-")[0] if e["target"].startswith("node") else e["target"]
                    for e in faults if e["fault"] == "kill" and "target" in e)
    injected = Counter(e["fault"] for e in faults if "skipped" not in e)
    skipped = Counter(e["fault"] for e in faults if "skipped" in e)
    filled = sum(int(e.get("bytes", 0)) for e in faults if e["fault"] == "fill-disk")
    violations = [*findings, *[v for c in checks for v in c.get("violations", [])]]
    by_invariant = Counter(v["invariant"] for v in violations)
    bytes_verified = sum(n for k, n in counts.items() if k.startswith("bytes verified"))
    raw = [r for c in checks for r in c.get("raw", [])]
    return {
        "minutes": minutes, "seed": seed, "disk_full": tmpfs_note,
        "operations": ops, "kills": dict(kills), "faults": dict(injected),
        "faults_skipped": dict(skipped), "filled_bytes": filled,
        "bytes_verified": bytes_verified, "lost": counts["lost"], "wrong": counts["wrong"],
        "orphans": counts["orphans"], "canary_changed": canary_changed,
        "canary_entries": canary_entries, "violations": violations,
        "by_invariant": dict(by_invariant), "counts": dict(counts), "raw": raw,
        "starts": starts, "cluster": cluster,
    }


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
    ok = not r["violations"]
    lines = [
        "## Chaos soak (`benchmarks/soak.py`)", "",
        f"`{command}` — {when}, {r.get('wall_s', '?')} s wall. {machine}", "",
        f"{r['minutes']:g} minutes of chaos on seed {r['seed']}: trainers (sync, async, "
        "incremental, overwrite, a 2-rank torchrun job with gloo) on the embedded store, a "
        "trainer through three `isolane serve` nodes, gc and rm running concurrently, a "
        "verifier loading acknowledged snapshots, inference putting and getting KV prompts "
        "on the embedded pool and through the nodes, a fourth node joining and leaving; "
        "beside them three nodes found through etcd under node kills, a stop and an etcd "
        "restart. "
        "Disk full: " + r["disk_full"] + " holding the second checkpoint and KV device of "
        "the embedded store. KV values are derived from their keys, state dicts from their "
        "seeds, so every byte read back is checked. Not a timing benchmark: the numbers "
        "of operations depend on the machine's load.", "",
        f"**Result: {'PASS' if ok else 'FAIL'}** — lost = {r['lost']}, wrong = {r['wrong']}, "
        f"orphans = {r['orphans']}, canary entries changed = {r['canary_changed']} of "
        f"{r['canary_entries']}, bytes verified = {r['bytes_verified'] / 1e9:.2f} GB, "
        f"violations = {len(r['violations'])}.", "",
        "### Invariants", "",
        markdown_table(["invariant", "violations"],
                       [(name, r["by_invariant"].get(name, 0)) for name in INVARIANTS]),
        "", "### Operations", "",
        markdown_table(["operation", "count", "detail"], r["operations"]),
        "", "### Faults injected", "",
        markdown_table(["fault", "count"], [
            *[(f"SIGKILL {target}", n) for target, n in sorted(r["kills"].items())],
            *[(kind, n) for kind, n in sorted(r["faults"].items()) if kind != "kill"],
            ("disk filled to ENOSPC (bytes written in total)", r["filled_bytes"]),
        ]), "",
        "Faults without a target at that moment (e.g. no file yet): " + (", ".join(
            f"{n} {k}" for k, n in sorted(r["faults_skipped"].items())) or "none") + ".", "",
        *cluster_markdown(r.get("cluster") or {}),
        "### Final check", "",
        markdown_table(["count", "value"], sorted(
            (k, v) for k, v in r["counts"].items() if not k.startswith("run: "))),
    ]
    if r["violations"]:
        lines += ["", "### Violations", ""]
        seen: Counter[str] = Counter()
        for v in r["violations"]:
            seen[v["invariant"]] += 1
            if seen[v["invariant"]] <= 5:
                lines.append(f"- {v['invariant']}: {v['detail'][:400]}")
        more = {k: n - 5 for k, n in seen.items() if n > 5}
        if more:
            lines.append("- and " + ", ".join(f"{n} more of '{k}'" for k, n in more.items()))
    return "\n".join(lines) + "\n"


def cluster_markdown(c: dict[str, Any]) -> list[str]:
    """The etcd cluster phase: its faults, and the share of blocks served per window."""
    if not c:
        return ["### Cluster through etcd", "", "(did not run)", ""]
    rows = [(w, n_gets, asked, served, "-" if not asked else f"{served / asked:.1%}", full)
            for w, (asked, served, n_gets, full) in c["windows"].items()]
    faults = [(e["fault"], e.get("node", "etcd"),
               ", ".join(f"{k} {v}" for k, v in e.items() if k.endswith("_s")))
              for e in c["events"]]
    return [
        "### Cluster through etcd", "",
        f"Three `isolane serve --cluster etcd://...` nodes (2 s leases) and {c['clients']} "
        "client processes on `KVPool.connect(\"etcd://...\")` putting and reading 8-block "
        f"prompts: {c['puts']} prompts acknowledged, {c['blocks_checked']} blocks read and "
        f"checked, {c['wrong']} wrong, {c['errors']} calls failed with an IsolaneError; "
        f"{c['registered']} nodes registered in etcd at the end. Served share after the "
        f"churn (every acknowledged prompt read once more): **{c['served_share_after']}**.",
        "", markdown_table(["fault", "target", "seconds (left / back)"], faults), "",
        markdown_table(["window", "gets", "blocks asked", "blocks served", "share",
                        "full hits"], rows), ""]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0, help="chaos time (default 10)")
    ap.add_argument("--seed", type=int, default=11, help="the fault schedule (default 11)")
    ap.add_argument("--dir", type=Path, default=REPO_ROOT / ".bench" / "soak",
                    help="scratch folder (default .bench/soak; deleted unless --keep)")
    ap.add_argument("--out", type=Path, help="rewrite the soak section of this markdown file")
    ap.add_argument("--json", type=Path, help="write the results as JSON")
    ap.add_argument("--fault-every", type=float, default=3.0,
                    help="mean seconds between faults (default 3)")
    ap.add_argument("--fault-weights", help="e.g. 'symlink=20,kill=0' (defaults: " +
                    ", ".join(f"{k}={v}" for k, v in FAULT_WEIGHTS.items()) + ")")
    ap.add_argument("--op-timeout", type=float, default=180.0,
                    help="an operation running longer is a hang (default 180 s)")
    ap.add_argument("--stop-timeout", type=float, default=240.0,
                    help="a member must exit this soon after SIGTERM (default 240 s: "
                    "above the 150 s an operation in flight may take within the "
                    "clients' timeouts and retries, see _soak_worker.remote_store)")
    ap.add_argument("--check-timeout", type=float, default=900.0)
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
                   for f in (soak.monitor, soak.chaos, soak.membership, soak.cluster_chaos)]
        for t in threads:
            t.start()
        end = soak.started_at + args.minutes * 60
        while time.monotonic() < end or threads[-1].is_alive():  # the cluster faults run out
            time.sleep(1.0)
        print("[soak] chaos over: stopping members, checking", flush=True)
        t0 = time.monotonic()
        soak.shutdown()
        slowest = ", ".join(f"{name} {s:.0f} s" for name, s in
                            sorted(soak.stop_s.items(), key=lambda kv: -kv[1])[:3])
        print(f"[soak] members stopped in {time.monotonic() - t0:.0f} s (slowest: {slowest})",
              flush=True)
        for t in threads:
            t.join(200)
        result = soak.finish()
    finally:
        soak.cleanup()
    result["wall_s"] = round(time.monotonic() - wall, 1)
    where = {"command": command_line(), "when": now_text(),
             "machine": machine_description(args.dir, _versions())}
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
