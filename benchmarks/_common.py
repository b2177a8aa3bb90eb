"""Shared benchmark utilities: timing, durability, page cache, RSS, machine facts, reports.

Nothing here knows about checkpoints or KV blocks, so every benchmark in this folder
(snapshot, KV pool, ...) measures and reports the same way:

- times are wall-clock ``time.perf_counter`` seconds; a measurement is repeated and
  its median reported next to the individual runs (machines are shared and noisy);
- sizes and rates use decimal units (1 GB = 10**9 bytes);
- "durable" means every file written and its directories were fsynced;
- child processes report one JSON object on a line that starts with ``RESULT_PREFIX``.

Linux only (``/proc``); dropping the page cache needs root and is reported when refused.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import re
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import _results

from isolane.storage.files import fsync_path

REPO_ROOT = Path(__file__).resolve().parent.parent
GB = 10**9
RESULT_PREFIX = "BENCH-RESULT "

T = TypeVar("T")


def ensure_repo_importable() -> None:
    """Put the repository root first on ``sys.path`` (for an uninstalled ``isolane``)."""
    root = str(REPO_ROOT)
    if root not in sys.path:
        sys.path.insert(0, root)


# -- timing ------------------------------------------------------------------------------
def timed(fn: Callable[[], T]) -> tuple[float, T]:
    """Run ``fn`` once; return (seconds, its result)."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


@dataclass
class Samples:
    """Repeated measurements of one quantity, in seconds (or any unit)."""

    values: list[float] = field(default_factory=list)

    def add(self, value: float) -> None:
        self.values.append(value)

    def __bool__(self) -> bool:
        return bool(self.values)

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    def runs_text(self, digits: int = 2) -> str:
        return ", ".join(f"{v:.{digits}f}" for v in self.values)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


class TimedThreads:
    """``count`` threads running ``work(t, wait_start)``: each sets itself up, then calls
    ``wait_start()``, which returns once every thread (and ``run``) is there, with the
    ``time.perf_counter()`` deadline to work until. ``run(seconds)`` releases them and
    returns the wall seconds until the last one ended."""

    def __init__(self, count: int, work: Callable[[int, Callable[[], float]], None], *,
                 start_timeout_s: float = 120.0) -> None:
        self._barrier = threading.Barrier(count + 1, timeout=start_timeout_s)
        self._stop_at = 0.0
        self._threads = [threading.Thread(target=work, args=(t, self._wait_start))
                         for t in range(count)]
        for thread in self._threads:
            thread.start()

    def _wait_start(self) -> float:
        self._barrier.wait()
        return self._stop_at

    def run(self, seconds: float) -> float:
        began = time.perf_counter()
        self._stop_at = began + seconds
        self._barrier.wait()
        for thread in self._threads:
            thread.join()
        return time.perf_counter() - began


def p50_p99_ms(latencies_s: Sequence[Sequence[float]]) -> tuple[float, float]:
    """Median and 99th percentile in ms of every thread's latencies (NaN when none)."""
    flat = sorted(x for lat in latencies_s for x in lat)
    if not flat:
        return math.nan, math.nan
    return flat[len(flat) // 2] * 1000, flat[min(len(flat) - 1, int(len(flat) * 0.99))] * 1000


def own_cpu_s() -> float:
    """User + system CPU seconds of this process so far, every thread."""
    times = os.times()
    return times.user + times.system


def process_cpu_s(pids: Sequence[int | None]) -> float:
    """User + system CPU seconds of ``pids`` so far (``/proc/<pid>/stat``; a process
    that is gone counts 0)."""
    ticks = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        ticks += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    return ticks / os.sysconf("SC_CLK_TCK")


# -- durability and the page cache -------------------------------------------------------
def fsync_tree(path: Path) -> None:
    """fsync ``path`` (a file or a folder with everything under it) and its parent folder."""
    path = Path(path)
    if path.is_dir():
        for dirpath, _dirs, files in os.walk(path):
            for name in files:
                fsync_path(Path(dirpath, name))
            fsync_path(Path(dirpath))
    elif path.exists():
        fsync_path(path)
    fsync_path(path.parent)


def remove_path(path: Path) -> None:
    """Delete a file or folder if present, then flush so the next timing starts clean."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
    os.sync()


def drop_page_cache(level: int = 3) -> bool:
    """``sync; echo LEVEL > /proc/sys/vm/drop_caches``: 3 drops the page cache and the
    slab (dentries, inodes, ext4's extent-status cache), 1 the page cache only; False
    (and no exception) without root."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write(f"{level}\n")
    except OSError:
        return False
    return True


# -- memory ------------------------------------------------------------------------------
def proc_number(path: str, name: str) -> int:
    """The number after ``name:`` in a ``/proc`` file such as ``/proc/meminfo`` (in the
    file's own unit, kB there), 0 when the file or the line is missing."""
    try:
        text = Path(path).read_text()
    except OSError:
        return 0
    match = re.search(rf"^{name}:\s+(\d+)", text, re.MULTILINE)
    return int(match.group(1)) if match else 0


def current_rss_bytes() -> int:
    return proc_number("/proc/self/status", "VmRSS") * 1024


def hwm_rss_bytes() -> int:
    """``VmHWM``: the address space's RSS high-water mark (what ``ru_maxrss`` reads)."""
    return proc_number("/proc/self/status", "VmHWM") * 1024


def reset_peak_rss() -> bool:
    """Reset the RSS high-water mark to the current RSS (Linux >= 4.0); False if refused.

    Lets a child measure the peak of one phase (a save) without the phase before it
    (building the state dict) counting.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


# -- child processes ---------------------------------------------------------------------
def emit_result(result: dict[str, Any]) -> None:
    """Print a child's result for ``run_child``; call once, last."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def run_child(argv: Sequence[str], *, timeout_s: float = 3600) -> dict[str, Any]:
    """Run ``python argv...`` in a fresh interpreter; return the JSON it emitted.

    Raises RuntimeError with the tail of its stderr when it fails or emits nothing.
    """
    cmd = [sys.executable, *argv]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX) and proc.returncode == 0:
            result: dict[str, Any] = json.loads(line[len(RESULT_PREFIX):])
            return result
    tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
    raise RuntimeError(f"child {shlex.join(cmd)} exited with {proc.returncode}:\n{tail}")


# -- the physical limit ------------------------------------------------------------------
@dataclass(frozen=True)
class WriteLimit:
    tool: str       # "dd" or "fio"
    command: str    # the exact command, for the report
    seconds: float  # dd: wall clock of the whole command, until fsync returned
    nbytes: int
    stdout: str = ""


def measure_dd_write(path: Path, nbytes: int, *, block_mib: int = 64) -> WriteLimit:
    """Sequential O_DIRECT write of ``nbytes`` (rounded up to whole blocks) with dd."""
    count = max(1, -(-nbytes // (block_mib << 20)))
    cmd = ["dd", "if=/dev/zero", f"of={path}", f"bs={block_mib}M", f"count={count}",
           "oflag=direct", "conv=fsync", "status=none"]
    return _timed_command("dd", cmd, path, count * (block_mib << 20))


def measure_fio_write(path: Path, nbytes: int, *, block_mib: int = 64,
                      iodepth: int = 4) -> WriteLimit | None:
    """Sequential O_DIRECT write with fio (random buffers, libaio, ``iodepth`` requests in
    flight, fsync at the end); None when fio is not installed.

    ``seconds`` is fio's own write runtime, not the wall clock: fio spends ~0.5 s before
    its first write filling its buffers with random bytes.
    """
    if shutil.which("fio") is None:
        return None
    size = max(1, -(-nbytes // (block_mib << 20))) * (block_mib << 20)
    cmd = ["fio", "--name=seqwrite", f"--filename={path}", "--rw=write", f"--bs={block_mib}M",
           f"--size={size}", "--direct=1", "--ioengine=libaio", f"--iodepth={iodepth}",
           "--fallocate=none", "--end_fsync=1", "--output-format=json"]
    limit = _timed_command("fio", cmd, path, size)
    write = json.loads(limit.stdout)["jobs"][0]["write"]
    return WriteLimit("fio", limit.command, write["runtime"] / 1000, write["io_bytes"])


def _timed_command(tool: str, cmd: list[str], path: Path, nbytes: int) -> WriteLimit:
    remove_path(path)
    try:
        seconds, proc = timed(lambda: subprocess.run(cmd, capture_output=True, text=True,
                                                     check=False))
        if proc.returncode != 0:
            raise RuntimeError(f"{shlex.join(cmd)} failed: {proc.stderr.strip()[-500:]}")
    finally:
        remove_path(path)
    return WriteLimit(tool, shlex.join(cmd), seconds, nbytes, proc.stdout)


# After a big scratch file is deleted, the disk (ext4 mounted with ``discard``) still trims
# its blocks for a while after ``sync`` returned: timed writes start after settle().
SETTLE_S = 0.5


def settle() -> None:
    os.sync()
    time.sleep(SETTLE_S)


def warm_memory(nbytes: int, *, random: bool = False) -> Any:
    """Private anonymous memory (page-aligned, for O_DIRECT) advised MADV_HUGEPAGE, every
    page touched; ``random``: filled with random bytes (an ``mmap.mmap``)."""
    import mmap

    import numpy as np

    buf = mmap.mmap(-1, max(nbytes, mmap.PAGESIZE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(mmap.MADV_HUGEPAGE)
    view = np.frombuffer(buf, dtype=np.uint8)
    if random:
        view[:] = np.random.default_rng(13).integers(0, 256, len(buf), dtype=np.uint8)
    else:
        view[::mmap.PAGESIZE] = 0
    return buf


def pwrite_loop(path: Path, nbytes: int, source: memoryview, block: int, threads: int
                ) -> float:
    """The simplest fast writer: ``nbytes`` (whole blocks of ``source``, page-aligned) O_DIRECT
    into a new file, thread k writing blocks k, k + threads, ...; seconds until the final
    fsync returned, scaled to ``nbytes``."""
    from concurrent.futures import ThreadPoolExecutor

    blocks = -(-nbytes // block)
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    try:
        def run(first: int) -> None:
            for b in range(first, blocks, threads):
                done = 0
                while done < block:
                    done += os.pwrite(fd, source[done:block], b * block + done)

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(run, range(threads)))
        os.fsync(fd)
    finally:
        os.close(fd)
    return (time.perf_counter() - start) * nbytes / (blocks * block)


# -- engine servers on loopback (the GPU smoke scripts) ------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until_healthy(proc: subprocess.Popen[bytes], port: int, name: str, log: Path,
                       timeout_s: float) -> subprocess.Popen[bytes]:
    """Return ``proc`` once ``/health`` answers; exit naming ``log`` if it dies or the
    time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited with {proc.returncode}; see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc
        except OSError:
            time.sleep(1)
    proc.terminate()
    raise SystemExit(f"{name} did not become healthy in {timeout_s:.0f} s; see {log}")


def stop_server(proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# -- machine facts -----------------------------------------------------------------------
@dataclass(frozen=True)
class Filesystem:
    device: str
    fstype: str
    mount_point: str


def filesystem_of(path: Path) -> Filesystem:
    """The mount that holds ``path`` (longest mount-point prefix in /proc/self/mounts)."""
    target = os.path.realpath(path)
    best = Filesystem("?", "?", "/")
    best_len = -1
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return best
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        device, mount_point, fstype = parts[0], parts[1].replace("\\040", " "), parts[2]
        inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) > best_len:
            best, best_len = Filesystem(device, fstype, mount_point), len(mount_point)
    return best


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine_description(target_dir: Path, packages: dict[str, str]) -> str:
    """One markdown paragraph: CPUs, memory, filesystem of ``target_dir``, versions."""
    fs = filesystem_of(target_dir)
    versions = ", ".join(f"{name} {version}" for name, version in packages.items())
    return (
        f"{os.cpu_count()} CPUs (`nproc`; {cpu_model()}), "
        f"{proc_number('/proc/meminfo', 'MemTotal') / 2**20:.1f} GiB RAM; "
        f"target folder `{target_dir}` on "
        f"{fs.device} ({fs.fstype}, mounted at {fs.mount_point}); "
        f"Linux {platform.release()}; Python {platform.python_version()}"
        + (f", {versions}." if versions else ".")
    )


def isolane_revision() -> str:
    """The checkout's commit, and whether ``isolane/`` has uncommitted changes."""
    try:
        head = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain",
                                "isolane"], capture_output=True, text=True,
                               check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown revision"
    return f"commit {head}" + (" with uncommitted changes in `isolane/`" if dirty else "")


def now_text() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def command_line() -> str:
    """The command that started this process, as a user would type it."""
    exe = "python" if Path(sys.executable).name.startswith("python") else sys.executable
    return shlex.join([exe, *sys.argv])


# -- reports -----------------------------------------------------------------------------
def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    def cell(value: object) -> str:
        return "" if value is None else str(value).replace("|", "\\|")

    lines = ["| " + " | ".join(headers) + " |",
             "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt_seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if value < 1 else f"{value:.2f}"


def fmt_rate(nbytes: int, seconds: float | None) -> str:
    if not seconds:
        return "-"
    return f"{nbytes / seconds / GB:.2f}"


def fmt_ratio(value: float | None, *, percent: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value * 100:.0f} %" if percent else f"{value:.2f}x"


def fmt_gb(nbytes: float) -> str:
    return f"{nbytes / GB:.2f} GB"


def section_markers(section: str) -> tuple[str, str]:
    return f"<!-- bench:{section} -->", f"<!-- /bench:{section} -->"


def replace_section(path: Path, section: str, body: str) -> None:
    """Write ``body`` between the section's markers in ``path``; other text is kept.

    Creates the file (with a title) when missing and appends the section when the
    markers are absent. The file is replaced atomically. docs/BENCHMARKS.md is left
    alone (stderr says so): it is rendered from the results files, never in sections.
    """
    if _results.is_page(path):
        print(f"{path} is rendered from benchmarks/results/ by benchmarks/report.py: "
              f"section '{section}' is not copied into it", file=sys.stderr, flush=True)
        return
    begin, end = section_markers(section)
    block = f"{begin}\n{body.strip()}\n{end}"
    path = Path(path)
    if path.exists():
        text = path.read_text()
    else:
        text = ("# Benchmarks\n\nGenerated by the scripts in `benchmarks/`; each section is "
                "rewritten by its own script between its markers.\n")
    start, stop = text.find(begin), text.find(end)
    if start != -1 and stop != -1 and stop > start:
        text = text[:start] + block + text[stop + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def print_report(report: str, out: Path | None, section: str) -> None:
    """Print ``report``; with ``out``, also (re)write its section there (stderr says so).

    docs/BENCHMARKS.md gets no section: a benchmark records its rows there with
    ``_results.write_results`` when ``--out`` names the page.
    """
    print(report, flush=True)
    if out:
        replace_section(out, section, report)
        if not _results.is_page(out):
            print(f"wrote section '{section}' of {out}", file=sys.stderr, flush=True)
