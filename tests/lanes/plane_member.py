"""A member process of a host lane plane, for the multi-process tests.

    python -m tests.lanes.plane_member CONFIG.yaml ROLE SECONDS OUT.jsonl [options]

ROLE ``reader``: KV gets that each take ``--read-ms`` (a sleep in the read lane's
worker: a read as slow as one behind a crowded disk), from ``--threads`` callers.
ROLE ``writer``: checkpoint writes of ``--chunk-mib`` MiB each, back to back (the
bytes are charged to the governor's bucket as a real write's would be).
ROLE ``forker``: joins as a writer, then forks a child that writes too.

Every 50 ms it appends a JSON line to OUT: the time (CLOCK_MONOTONIC, shared by all
processes), its pid, its write bucket's rate, the bytes it wrote so far and the
governor's host view. A line ``{"ready": ...}`` comes first once it has joined.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from typing import Any

from isolane.config import load_config
from isolane.lanes import JobKind, LaneScheduler
from isolane.lanes.host_governor import HostGovernor


def report(out: Any, scheduler: LaneScheduler, done: list[int], **extra: Any) -> None:
    gov = scheduler.stats()["governor"]
    out.write(json.dumps({"t": time.monotonic(), "pid": os.getpid(),
                          "rate": scheduler.lanes["write"].bucket.rate  # type: ignore[union-attr]
                          if scheduler.lanes["write"].bucket else None,
                          "done": done[0], "host": gov.get("host"),
                          "read_p99_ms": gov.get("read_p99_ms"), **extra}) + "\n")
    out.flush()


def work(scheduler: LaneScheduler, role: str, args: argparse.Namespace, stop: threading.Event,
         done: list[int]) -> list[threading.Thread]:
    lock = threading.Lock()

    def reader() -> None:
        lane = scheduler.lane(JobKind.KV_GET)
        while not stop.is_set():
            lane.submit_sized(4096, time.sleep, args.read_ms / 1e3).result()

    def writer() -> None:
        lane = scheduler.lane(JobKind.CHECKPOINT_WRITE)
        nbytes = args.chunk_mib << 20
        while not stop.is_set():
            lane.submit_sized(nbytes, lambda: None).result()
            with lock:
                done[0] += nbytes

    target = reader if role == "reader" else writer
    threads = [threading.Thread(target=target, daemon=True) for _ in range(args.threads)]
    for thread in threads:
        thread.start()
    return threads


def run(role: str, args: argparse.Namespace, out_path: str) -> None:
    config = load_config(args.config)
    scheduler = LaneScheduler(config)
    stop = threading.Event()
    done = [0]
    with open(out_path, "a") as out:
        threads = work(scheduler, "reader" if role == "reader" else "writer", args, stop, done)
        governor = scheduler.governor
        deadline = time.monotonic() + 5
        while (isinstance(governor, HostGovernor) and not governor.joined
               and time.monotonic() < deadline):
            time.sleep(0.01)
        report(out, scheduler, done, ready=True,
               slot=governor.plane.slot if isinstance(governor, HostGovernor) else None)
        end = time.monotonic() + args.seconds
        child = 0
        while time.monotonic() < end:
            time.sleep(0.05)
            report(out, scheduler, done)
            if role == "forker" and not child:
                child = fork_child(args, out_path)
        stop.set()
        for thread in threads:
            thread.join()
    scheduler.close()
    if child:
        os.waitpid(child, 0)


def fork_child(args: argparse.Namespace, out_path: str) -> int:
    pid = os.fork()
    if pid:
        return pid
    try:  # the child: the same objects, inherited; it must join as itself
        run("writer", argparse.Namespace(**{**vars(args), "seconds": 1.0}), out_path)
    finally:
        os._exit(0)
    return 0  # unreachable


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("config")
    p.add_argument("role", choices=["reader", "writer", "forker"])
    p.add_argument("seconds", type=float)
    p.add_argument("out")
    p.add_argument("--read-ms", type=float, default=20.0)
    p.add_argument("--chunk-mib", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    run(args.role, args, args.out)


if __name__ == "__main__":
    main()
