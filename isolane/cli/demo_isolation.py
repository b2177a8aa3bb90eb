"""``isolane demo``'s isolation part: a trainer process and an inference process on
one host config, with the host lane plane off and on.

The inference process restores KV prefixes from the pool (device reads: no memory
tier, O_DIRECT); the trainer saves incremental checkpoints with ``save_async`` in a
loop. Three runs of ``seconds`` each: inference alone (its p99 sets the SLO, 1.5x),
both with ``qos.host_plane: false`` (today's per-process lanes: the trainer's
governor never sees a KV read) and both with the plane on (the trainer's writes
follow the host governor). Workers: ``isolane.cli.demo_workers``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from isolane.cli.render import table
from isolane.errors import IsolaneError

SLO_FACTOR = 1.5


def _spawn(role: str, target: str, slo_ms: float, plane: bool,
           seconds: float) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "isolane.cli.demo_workers", role, target, f"{slo_ms:.3f}",
         "on" if plane else "off", f"{seconds:.3f}"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ})


def _result(proc: subprocess.Popen[str], role: str, timeout_s: float) -> dict[str, Any]:
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise IsolaneError(f"the demo's {role} process did not finish in {timeout_s:.0f} s; "
                           "is the machine overloaded? rerun with --isolation-seconds 5") from None
    if proc.returncode != 0:
        raise IsolaneError(f"the demo's {role} process failed (exit {proc.returncode}); "
                           "its error is printed above")
    value: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return value


def run_pair(target: str, slo_ms: float, plane: bool, seconds: float, *,
             inference: bool = True, trainer: bool = True) -> dict[str, Any]:
    """Start the processes, wait until each is set up, start them together."""
    roles = [r for r, on in (("trainer", trainer), ("inference", inference)) if on]
    procs = {role: _spawn(role, target, slo_ms, plane, seconds) for role in roles}
    try:
        for role, proc in procs.items():
            if proc.stdout is None or not proc.stdout.readline():
                raise IsolaneError(f"the demo's {role} process failed to start; its error "
                                   "is printed above")
        start_at = time.monotonic() + 0.2
        for proc in procs.values():
            if proc.stdin is not None:
                proc.stdin.write(f"{start_at}\n")
                proc.stdin.flush()
        return {role: _result(proc, role, seconds + 120) for role, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def run_isolation_demo(target: str, seconds: float, *, say: Callable[[str], None]) -> None:
    t0 = time.monotonic()
    say("isolation: an inference process restores KV prefixes (64 KiB blocks, device "
        "reads) while a trainer process saves incremental checkpoints (save_async) on "
        "the same host config")
    fill = _spawn("fill", target, 5.0, True, 0.0)
    _result(fill, "fill", 300)
    idle = run_pair(target, 5.0, True, seconds, trainer=False)["inference"]
    slo_ms = max(0.2, idle["p99"] * SLO_FACTOR)
    say(f"  inference alone: KV restore p99 {idle['p99']:.2f} ms -> SLO "
        f"(qos.read_p99_slo_ms) {slo_ms:.2f} ms = {SLO_FACTOR:g}x")
    off = run_pair(target, slo_ms, False, seconds)
    on = run_pair(target, slo_ms, True, seconds)
    rows = [["inference alone", f"{idle['p50']:.2f}", f"{idle['p99']:.2f}", "1.00x", "-"]]
    for label, run in (("host plane off (per-process lanes)", off),
                       ("host plane on", on)):
        inf, tr = run["inference"], run["trainer"]
        rows.append([label, f"{inf['p50']:.2f}", f"{inf['p99']:.2f}",
                     f"{inf['p99'] / idle['p99']:.2f}x",
                     f"{tr['logical_gbps']:.2f} ({tr['written_gbps']:.2f} written)"])
    say(table(["run", "KV p50 ms", "KV p99 ms", "p99 vs alone", "save GB/s"], rows,
              right=range(1, 4)))
    verdict = ("the host plane kept the KV p99 within the SLO" if on["inference"]["p99"]
               <= slo_ms else "the KV p99 stayed over the SLO even with the plane: on "
               "this machine part of the tail is CPU, which no write rate removes (see "
               "docs/BENCHMARKS.md)")
    say(f"  {verdict}; isolation part took {time.monotonic() - t0:.0f} s")
