"""A lost node on real nodes (``bench_cluster.py --node-loss``): the share of the cached
prefix tokens clients still serve after one of ``--loss-nodes`` ``isolane serve``
processes is SIGKILLed, per placement, with stored copies beside it.

One client per placement, each in its own namespace, stores the same prompts of
``BLOCKS`` blocks (``CHUNK_TOKENS`` tokens a block, S = ``SEGMENT_BLOCKS``):

- ``chain-affine segments``: the cluster client as shipped (``ClusterRouter``, default
  options): a chain's segments on its home node, spilling only over the load bound;
- ``whole chain``: ``routing.RendezvousRouter``, a chain on the node of its first key;
- ``segments by own digest``: the placement before chain-affine segments (version 2),
  each segment on the owner of its own digest: the same client with a router that
  passes the segment's own digest as its home (``OwnDigestRouter``, benchmark only).

Then, for every node in turn: it is SIGKILLed, every client restores every prompt
(``get``, each answer checked against the stored tensor for the tokens it returned), the
node is started again on its port and folder, and the clients read everything back
before the next node dies. Share = tokens served with the node dead / tokens served
before, the mean over which node died (``--quick``: the first node only); with one
copy of each block ``(N - 1) / N`` is the most a placement keeps. Stored copies = keys
listed by the nodes' chain indexes over the prompts' blocks.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import _common as C
import torch
from _nodes import Nodes, _die_with_parent

import isolane
from isolane.client.kv_pool import RemoteKVPool
from isolane.cluster.router import ClusterOptions, ClusterRouter
from isolane.cluster.routing import RendezvousRouter
from isolane.wire.chain_list import decode_chain_list

SECTION = "cluster-node-loss"
CHUNK_TOKENS = 16
BLOCKS = 32
SEGMENT_BLOCKS = 4
ROW_VALUES = 256  # float32 values a token: 1 KiB, 16 KiB a block
TARGET = 0.9
PLACEMENTS = ("chain-affine segments", "whole chain", "segments by own digest")


class OwnDigestRouter(ClusterRouter):
    """The placement before chain-affine segments: every segment at its own digest."""

    def place(self, digest: bytes, home: bytes | None = None) -> str:
        return super().place(digest, digest)

    def read_candidates(self, digest: bytes, home: bytes | None = None) -> list[str]:
        return super().read_candidates(digest, digest)


@dataclass
class LossRun:
    placement: str
    nodes: int
    prompts: int
    before: int = 0  # tokens served with every node up
    after: list[int] = field(default_factory=list)  # per dead node
    stored_keys: int = 0
    unique_keys: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def share(self) -> float:
        return statistics.mean(self.after) / self.before if self.before and self.after \
            else 0.0

    @property
    def ideal(self) -> float:
        return (self.nodes - 1) / self.nodes

    @property
    def stored(self) -> float:
        return self.stored_keys / self.unique_keys if self.unique_keys else 0.0


def prompt(p: int) -> list[int]:
    return [p * 100_000 + i for i in range(BLOCKS * CHUNK_TOKENS)]


def kv_of(p: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(p)
    return torch.randn(BLOCKS * CHUNK_TOKENS, ROW_VALUES, generator=gen)


def make_pool(placement: str, urls: list[str]) -> RemoteKVPool:
    ns = "loss-" + placement.replace(" ", "-")
    common: dict[str, Any] = {"namespace": ns, "chunk_tokens": CHUNK_TOKENS, "token_dim": 0}
    options = ClusterOptions(segment_blocks=SEGMENT_BLOCKS)
    if placement == "whole chain":
        return RemoteKVPool(urls, router=RendezvousRouter(urls), **common)
    pool = RemoteKVPool(urls, cluster=options, **common)
    if placement == "segments by own digest":
        # Benchmark-only emulation of the earlier placement: the same client, with a
        # router that places and reads each segment by its own digest.
        own = OwnDigestRouter(urls, options)
        pool.cluster = own
        pool.router = own
        pool._nodes.cluster = own
    return pool


def served(pool: RemoteKVPool, prompts: int, run: LossRun) -> int:
    total = 0
    for p in range(prompts):
        n, kv = pool.get(prompt(p))
        if n and (kv is None or not torch.equal(kv, kv_of(p)[:n])):
            run.errors.append(f"{run.placement}: prompt {p} came back different")
        total += n
    return total


def restart(nodes: Nodes, i: int) -> None:
    """Start node ``i`` again with its command (same port, same folder)."""
    old = nodes.procs[i]
    log = open(nodes.folder / f"node-{i}" / "node.log", "ab")  # noqa: SIM115 - closed below
    nodes.procs[i] = subprocess.Popen(old.args, stdin=subprocess.DEVNULL, stdout=log,
                                      stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
    log.close()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(nodes.urls[i] + "/healthz", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"node {nodes.urls[i]} did not come back")


def listed_keys(url: str, namespace: str) -> int:
    try:
        with urllib.request.urlopen(f"{url}/v1/kv/{namespace}/chains", timeout=30) as resp:
            return sum(len(keys) for _, keys in decode_chain_list(resp.read()))
    except OSError:
        return 0  # no such namespace on that node: nothing stored there


def run_loss(args: argparse.Namespace, log: Callable[[str], None] = print
             ) -> tuple[list[LossRun], str]:
    n_nodes = args.loss_nodes
    prompts = 6 if args.quick else 30
    folder = args.dir / "node-loss"
    block_bytes = CHUNK_TOKENS * ROW_VALUES * 4
    budget = 3 * prompts * BLOCKS * block_bytes + (64 << 20)
    began = time.perf_counter()
    nodes = Nodes(folder, budget, n_nodes)
    runs = [LossRun(name, n_nodes, prompts) for name in PLACEMENTS]
    pools: list[RemoteKVPool] = []
    try:
        nodes.wait_ready()
        pools = [make_pool(name, nodes.urls) for name in PLACEMENTS]
        for run, pool in zip(runs, pools, strict=True):
            for p in range(prompts):
                if pool.put(prompt(p), kv_of(p)) != BLOCKS:
                    raise RuntimeError(f"{run.placement}: prompt {p} not stored whole")
            run.before = served(pool, prompts, run)
            run.unique_keys = prompts * BLOCKS
            run.stored_keys = sum(listed_keys(u, pool.namespace) for u in nodes.urls)
        for i in range(1 if args.quick else n_nodes):  # quick: one loss, one restart
            os.kill(nodes.procs[i].pid, signal.SIGKILL)
            nodes.procs[i].wait()
            for run, pool in zip(runs, pools, strict=True):
                run.after.append(served(pool, prompts, run))
                log(f"  node {i} dead: {run.placement:24} served {run.after[-1]} of "
                    f"{run.before} tokens")
            restart(nodes, i)
            for run, pool in zip(runs, pools, strict=True):  # back before the next loss
                deadline = time.monotonic() + 30
                while served(pool, prompts, run) < run.before:
                    if time.monotonic() > deadline:
                        run.errors.append(f"{run.placement}: not served whole after node "
                                          f"{i} came back")
                        break
                    time.sleep(0.5)
    finally:
        for pool in pools:
            pool.close()
        nodes.stop()
    total = time.perf_counter() - began
    return runs, render_loss(runs, args, n_nodes, prompts, total)


def render_loss(runs: list[LossRun], args: argparse.Namespace, n_nodes: int, prompts: int,
                total_s: float) -> str:
    machine = C.machine_description(args.dir, {"isolane": isolane.__version__,
                                               "torch": torch.__version__})
    rows = []
    for r in runs:
        rows.append([f"`{r.placement}`", f"{r.before:,}",
                     ", ".join(f"{a:,}" for a in r.after),
                     f"{r.share * 100:.1f} %",
                     f"{TARGET * r.ideal * 100:.1f} % "
                     + ("met" if r.share >= TARGET * r.ideal else "not met"),
                     f"{r.stored:.3f}x", "ok" if not r.errors else "; ".join(r.errors[:3])])
    return "\n".join([
        "## Cluster on loopback: a lost node (`benchmarks/bench_cluster.py --node-loss`)", "",
        f"Command: `{C.command_line()}`  ", f"Date: {C.now_text()}  ", f"Machine: {machine}",
        "",
        f"{n_nodes} `isolane serve` nodes on 127.0.0.1, {prompts} prompts of {BLOCKS} blocks "
        f"({CHUNK_TOKENS} tokens a block, S = {SEGMENT_BLOCKS}) per placement, each "
        "node SIGKILLed in turn and started again ({total:.0f} s in all). Served = tokens "
        "restored by `get` (checked against the stored tensor); the share is the mean over "
        "which node died of served after over served before; the target is "
        f"{TARGET:g} x (N - 1) / N. Stored copies: keys in the nodes' chain indexes over "
        "the prompts' blocks.".format(total=total_s), "",
        C.markdown_table(["placement", "tokens served, all up", "served, each node dead",
                          "share after a loss", "target", "stored copies", "check"], rows),
    ])


def runs_json(runs: list[LossRun]) -> list[dict[str, Any]]:
    return [{**asdict(r), "share": r.share, "stored": r.stored} for r in runs]


def headline_rows(runs: list[LossRun], where: dict[str, str]) -> list[Any]:
    import _results

    mine = next(r for r in runs if r.placement == PLACEMENTS[0])
    before = next(r for r in runs if r.placement == PLACEMENTS[2])
    return [
        _results.Result(
            area="Cluster and routing",
            measure=f"prefix tokens served after 1 of {mine.nodes} real nodes is SIGKILLed, "
                    f"prompts of {BLOCKS} blocks",
            value=round(mine.share * 100, 1), unit="%", peer="one copy's limit (N-1)/N",
            peer_value=round(mine.ideal * 100, 1),
            ratio=round(mine.share / mine.ideal * 100, 1), ratio_unit="%",
            target=f">= {TARGET * 100:g} %", met=mine.share >= TARGET * mine.ideal,
            why=f"segments by their own digests (before): {before.share * 100:.1f} %",
            **where),
        _results.Result(
            area="Cluster and routing",
            measure=f"stored block copies, {mine.nodes} real nodes",
            value=round(mine.stored, 3), unit="x unique blocks", target="<= 1.1x",
            met=mine.stored <= 1.1, **where),
    ]
