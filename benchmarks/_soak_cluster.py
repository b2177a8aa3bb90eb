"""The soak's cluster phase: three ``isolane serve`` nodes that find each other through a
real etcd, KV clients in other processes on ``KVPool.connect("etcd://...")``, and a
schedule of cluster faults: a node SIGKILLed and restarted, one SIGSTOPped past its
lease and resumed, etcd itself restarted.

The parent side (``ClusterPhase``) runs in ``soak.py``; each client is this file run as
a script (``_soak_cluster.py <phase folder> <name> <etcd url> <seed>``). A client puts
prompts whose block bytes derive from their keys and reads acknowledged ones back,
checking every block it gets; it counts blocks asked and served per window (``before``,
``churn``, ``after`` the faults, told by the parent in ``phase``), and on ``final``
settles, reads every acknowledged prompt once more and writes ``result-<name>.json``.
Invariants: no wrong byte ever (a miss is fine), no client crash, every node back in
etcd and in every client's ring at the end.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._soak_data import (
    KV_CHUNK_TOKENS,
    KV_TOKEN_DIM,
    block_bytes_of,
    block_value,
    kv_tensor,
    layout_tensor,
    read_json,
    write_json,
)

PREFIX = "/soak"
NAMESPACE = "soak-cluster"
LEASE_TTL_S = 2  # short: a dead node leaves within seconds, so quick runs stay quick
PROMPT_BLOCKS = 8  # two segments of the default segment_blocks (4): spread over nodes
CLIENTS = ("etcd-client-a", "etcd-client-b")
WINDOWS = ("before", "churn", "after")


# -- the parent side ------------------------------------------------------------------------
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
                               args=("--cluster", self.url), startup_timeout_s=120.0)
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
                [sys.executable, __file__, str(self.folder), name, self.url, str(self.seed)],
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

    def run(self, stop: Callable[[], bool]) -> None:
        """The faults in order, each waited out: kill, stop, etcd restart."""
        rng = random.Random(self.seed)
        ttl = LEASE_TTL_S
        write_json(self.folder / "phase", "before")
        self.wait_for("clients ready", self.ready, 120.0)
        time.sleep(2.0)
        write_json(self.folder / "phase", "churn")
        killed, paused = rng.sample(self.nodes, 2)
        if stop():
            return
        killed.kill()  # SIGKILL: no withdrawal, the lease expires
        gone = self.wait_for("killed node leaves", lambda: killed.url not in self.registered(),
                             ttl + 10.0)
        self.start_in(killed.launch)
        killed.wait_ready()
        back = self.wait_for("killed node back", lambda: killed.url in self.registered(), 60.0)
        self.step("SIGKILL node and restart", node=killed.url, left_s=gone, back_s=back)
        if stop():
            return
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
        if stop():
            return
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
        write_json(self.folder / "phase", "after")
        time.sleep(2.0)

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
                             f"{_tail(self.folder / f'{name}.log')}")
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
    windows = {w: [sum(r["windows"][w][k] for r in results.values())
                   for k in ("asked", "served", "gets", "full")] for w in (*WINDOWS, "final")}
    return {"events": events, "clients": len(results), "registered": registered,
            "puts": sum(r["puts"] for r in results.values()),
            "errors": sum(r["errors"] for r in results.values()),
            "wrong": sum(len(r["wrong"]) for r in results.values()),
            "blocks_checked": sum(r["blocks_checked"] for r in results.values()),
            "windows": windows,
            "served_share_after": share(*windows["final"][:2])}


def share(asked: int, served: int) -> float | None:
    return round(served / asked, 4) if asked else None


def _tail(path: Path, lines: int = 12) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# -- a client (this file as a script) -------------------------------------------------------
def client_main(folder: Path, name: str, url: str, seed: int) -> None:
    from isolane import KVPool
    from isolane.errors import IsolaneError

    rng = random.Random(f"{seed}-{name}")
    windows = {w: {"asked": 0, "served": 0, "gets": 0, "full": 0} for w in (*WINDOWS, "final")}
    out: dict[str, Any] = {"puts": 0, "errors": 0, "wrong": [], "raw": [], "blocks_checked": 0}
    pool = KVPool.connect(url, namespace=NAMESPACE, chunk_tokens=KV_CHUNK_TOKENS,
                          token_dim=KV_TOKEN_DIM, timeout_s=3.0, put_timeout_s=10.0,
                          poll_s=0.5)

    def call(fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except IsolaneError:
            out["errors"] += 1
        except Exception as exc:  # a raw error is a finding; the client carries on
            out["raw"].append(f"{type(exc).__name__}: {exc}: {traceback.format_exc()[-800:]}")
        return None

    def read(tokens: list[int], window: str) -> None:
        keys = pool.block_keys(tokens)
        got = call(pool.get, tokens)
        counts = windows[window]
        counts["gets"] += 1
        counts["asked"] += len(keys)
        if got is None:
            return
        n = got[0] // KV_CHUNK_TOKENS
        for i in range(n):
            if block_bytes_of(got[1], i) != block_value(keys[i]):
                out["wrong"].append(keys[i].hex())
        out["blocks_checked"] += n
        counts["served"] += n
        counts["full"] += n == len(keys)

    call(pool.put, [1], layout_tensor())
    acked: list[list[int]] = []
    while True:
        window = read_json(folder / "phase") or "before"
        if window == "final":
            break
        tokens = [rng.randrange(1, 50_000) for _ in range(KV_CHUNK_TOKENS * PROMPT_BLOCKS)]
        stored = call(pool.put, tokens, kv_tensor(pool.block_keys(tokens)))
        if stored == PROMPT_BLOCKS:
            acked.append(tokens)
            out["puts"] += 1
        if acked:
            read(rng.choice(acked), window)
        write_json(folder / f"status-{name}.json", {"acked": len(acked),
                                                   "nodes": sorted(pool.nodes)})
        time.sleep(0.05)
    # Settled: every node in the ring and probed up, no move in flight; then read all.
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline:
        state = pool.membership()
        if len(pool.nodes) == 3 and not state.get("moves_in_flight") \
                and state.get("reachable_share") == 1:
            break
        time.sleep(0.2)
    for tokens in acked:
        read(tokens, "final")
    write_json(folder / f"result-{name}.json", {
        **out, "windows": windows, "final_nodes": sorted(pool.nodes),
        "membership": pool.membership()})
    pool.close()


if __name__ == "__main__":
    client_main(Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]))
