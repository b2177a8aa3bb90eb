"""``isolane demo``'s isolation part: a trainer process and an inference process on
one host config, with the host lane plane off and on.

The inference process restores KV prefixes from the pool (device reads: no memory
tier, O_DIRECT); the trainer saves incremental checkpoints with ``save_async`` in a
loop. Three runs of ``seconds`` each: inference alone (its p99 sets the SLO, 1.5x),
both with ``qos.host_plane: false`` (today's per-process lanes: the trainer's
governor never sees a KV read) and both with the plane on (the trainer's writes
follow the host governor). The table shows, per run, how many restores were timed,
their p50/p99, the save throughput (committed saves; in brackets what the write lane
wrote) and how many processes each one saw in its host plane (inference / trainer).
Workers: ``isolane.cli.demo_workers``.
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


def plane_members(inference: dict[str, Any], trainer: dict[str, Any] | None) -> str:
    """The processes the host plane held, as each process saw it ("-": no plane)."""
    seen = [inference.get("members", 0), *([trainer.get("members", 0)] if trainer else [])]
    return "-" if not any(seen) else " / ".join(str(n) for n in seen)


def run_isolation_demo(target: str, seconds: float, *, say: Callable[[str], None]) -> None:
    t0 = time.monotonic()
    say("isolation: an inference process restores KV prefixes (64 KiB blocks, device "
        "reads) while a trainer process saves incremental checkpoints (save_async) on "
        "the same host config")
    fill = _spawn("fill", target, 5.0, True, 0.0)
    _result(fill, "fill", 300)
    idle = run_pair(target, 5.0, True, seconds, trainer=False)["inference"]
    if not idle["count"]:
        raise IsolaneError(f"no KV restore finished inside the {seconds:g} s run of the "
                           "inference process alone: the machine is overloaded; rerun "
                           "with a longer --isolation-seconds")
    slo_ms = max(0.2, idle["p99"] * SLO_FACTOR)
    say(f"  inference alone: KV restore p99 {idle['p99']:.2f} ms -> SLO "
        f"(qos.read_p99_slo_ms) {slo_ms:.2f} ms = {SLO_FACTOR:g}x")
    off = run_pair(target, slo_ms, False, seconds)
    on = run_pair(target, slo_ms, True, seconds)
    rows = [["inference alone", str(idle["count"]), f"{idle['p50']:.2f}",
             f"{idle['p99']:.2f}", "1.00x", "-", plane_members(idle, None)]]
    for label, run in (("host plane off (per-process lanes)", off),
                       ("host plane on", on)):
        inf, tr = run["inference"], run["trainer"]
        measured = bool(inf["count"])
        rows.append([label, str(inf["count"]),
                     f"{inf['p50']:.2f}" if measured else "-",
                     f"{inf['p99']:.2f}" if measured else "-",
                     f"{inf['p99'] / idle['p99']:.2f}x" if measured else "-",
                     f"{tr['logical_gbps']:.2f} ({tr['moved_gb'] / seconds:.2f} written)",
                     plane_members(inf, tr)])
    say(table(["run", "KV restores", "KV p50 ms", "KV p99 ms", "p99 vs alone",
               "save GB/s", "plane members"], rows, right=range(1, 6)))
    p99_on = on["inference"].get("p99")
    verdict = ("no KV restore finished inside the run with the plane on: the machine is "
               "overloaded" if p99_on is None else
               "the host plane kept the KV p99 within the SLO" if p99_on <= slo_ms else
               "the KV p99 stayed over the SLO even with the plane: on this machine part "
               "of the tail is CPU, which no write rate removes (see docs/BENCHMARKS.md)")
    say(f"  {verdict}; isolation part took {time.monotonic() - t0:.0f} s")
