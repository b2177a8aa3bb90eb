"""Shared benchmark utilities: timing, durability, page cache, RSS, machine facts, reports.

Times are ``time.perf_counter`` seconds, repeated and reported as medians (machines are
shared and noisy); sizes in decimal units (1 GB = 10**9 bytes); "durable" means every
file written and its folders were fsynced. Linux only (``/proc``); dropping the page
cache needs root and is reported when refused.
"""

from __future__ import annotations

import datetime as _dt
import mmap
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import _results

from isolane.storage.files import fsync_path

REPO_ROOT = Path(__file__).resolve().parent.parent
GB = 10**9
T = TypeVar("T")


def ensure_repo_importable() -> None:
    """Put the repository root first on ``sys.path`` (for an uninstalled ``isolane``)."""
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))


# -- timing ------------------------------------------------------------------------------
def timed(fn: Callable[[], T]) -> tuple[float, T]:
    """Run ``fn`` once; return (seconds, its result)."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


@dataclass
class Samples:
    """Repeated measurements of one quantity."""

    values: list[float] = field(default_factory=list)

    def add(self, value: float) -> None:
        self.values.append(value)

    def __bool__(self) -> bool:
        return bool(self.values)

    @property
    def median(self) -> float:
        return statistics.median(self.values)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


class TimedThreads:
    """``count`` threads running ``work(t, wait_start)``; ``wait_start()`` returns the
    ``perf_counter`` deadline once all are set up and ``run(seconds)`` released them;
    ``run`` returns the wall seconds until the last one ended."""

    def __init__(self, count: int, work: Callable[[int, Callable[[], float]], None]) -> None:
        self._barrier = threading.Barrier(count + 1, timeout=120.0)
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


def own_cpu_s() -> float:
    """User + system CPU seconds of this process so far, every thread."""
    times = os.times()
    return times.user + times.system


def process_cpu_s(pids: Sequence[int | None]) -> float:
    """User + system CPU seconds of ``pids`` so far (a process that is gone counts 0)."""
    ticks = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        ticks += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    return ticks / os.sysconf("SC_CLK_TCK")


# -- durability, the page cache, memory --------------------------------------------------
def fsync_tree(path: Path) -> None:
    """fsync ``path`` (a file, or a folder and everything under it) and its parent."""
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
    """``sync; echo LEVEL > /proc/sys/vm/drop_caches`` (3: with the slab); False without root."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write(f"{level}\n")
    except OSError:
        return False
    return True


def proc_number(path: str, name: str) -> int:
    """The number after ``name:`` in a ``/proc`` file (in its own unit), 0 when missing."""
    try:
        match = re.search(rf"^{name}:\s+(\d+)", Path(path).read_text(), re.MULTILINE)
    except OSError:
        return 0
    return int(match.group(1)) if match else 0


def current_rss_bytes() -> int:
    return proc_number("/proc/self/status", "VmRSS") * 1024


def warm_memory(nbytes: int, *, random: bool = False) -> Any:
    """Page-aligned (O_DIRECT) anonymous huge-page memory, touched or ``random``."""
    import numpy as np

    buf = mmap.mmap(-1, max(nbytes, mmap.PAGESIZE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(mmap.MADV_HUGEPAGE)
    view = np.frombuffer(buf, dtype=np.uint8)
    if random:
        view[:] = np.random.default_rng(13).integers(0, 256, len(buf), dtype=np.uint8)
    else:
        view[::mmap.PAGESIZE] = 0
    return buf


# -- the device's write limit, by the simplest writers -----------------------------------
# After a big scratch file is deleted, the disk (ext4 mounted with ``discard``) still trims
# its blocks for a while after ``sync`` returned: timed writes start after settle().
def settle() -> None:
    os.sync()
    time.sleep(0.5)


WRITE_LIMIT = "pwrite loop, 64 MiB O_DIRECT, 4 threads"
_LIMIT_BLOCK, _LIMIT_THREADS = 64 << 20, 4


def write_limit(path: Path, nbytes: int) -> float:
    """Seconds for ``WRITE_LIMIT`` to write ``nbytes`` of random bytes into a new file at
    ``path`` until its fsync returned (thread k writes blocks k, k + 4, ...); the file is
    removed after, and the disk settled before."""
    block, threads, blocks = _LIMIT_BLOCK, _LIMIT_THREADS, -(-nbytes // _LIMIT_BLOCK)
    buf = warm_memory(block, random=True)
    source = memoryview(buf)
    settle()
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
        return (time.perf_counter() - start) * nbytes / (blocks * block)
    finally:
        os.close(fd)
        source.release()
        buf.close()
        path.unlink(missing_ok=True)
        settle()


# -- engine servers on loopback ----------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until_healthy(proc: subprocess.Popen[bytes], port: int, name: str, log: Path,
                       timeout_s: float) -> subprocess.Popen[bytes]:
    """``proc`` once ``/health`` answers; exit naming ``log`` if it dies or times out."""
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
def machine_description(target_dir: Path, packages: dict[str, str]) -> str:
    """One markdown paragraph: CPUs, memory, filesystem of ``target_dir``, versions."""
    target = os.path.realpath(target_dir)
    try:
        mounts = [(p[0], p[1].replace("\\040", " "), p[2]) for line in
                  Path("/proc/self/mounts").read_text().splitlines() if len(p := line.split()) > 2]
    except OSError:
        mounts = []
    device, mount, fstype = max(  # the mount holding target_dir: the longest prefix
        (m for m in mounts if target == m[1] or target.startswith(m[1].rstrip("/") + "/")),
        key=lambda m: len(m[1]), default=("?", "/", "?"))
    try:
        cpu = next(line.split(":", 1)[1].strip()
                   for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor() or "unknown CPU"
    versions = ", ".join(f"{name} {version}" for name, version in packages.items())
    return (
        f"{os.cpu_count()} CPUs (`nproc`; {cpu}), "
        f"{proc_number('/proc/meminfo', 'MemTotal') / 2**20:.1f} GiB RAM; "
        f"target folder `{target_dir}` on {device} ({fstype}, mounted at {mount}); "
        f"Linux {platform.release()}; Python {platform.python_version()}"
        + (f", {versions}." if versions else "."))


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

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt_gb(nbytes: float) -> str:
    return f"{nbytes / GB:.2f} GB"


def replace_section(path: Path, section: str, body: str) -> None:
    """Write ``body`` between the section's markers in ``path`` (atomically), keeping the
    rest; creates the file or appends the section when missing. docs/BENCHMARKS.md is
    left alone (stderr says so): it is rendered from the results files."""
    if _results.is_page(path):
        print(f"{path} is rendered from benchmarks/results/ by benchmarks/report.py: "
              f"section '{section}' is not copied into it", file=sys.stderr, flush=True)
        return
    begin, end = f"<!-- bench:{section} -->", f"<!-- /bench:{section} -->"
    block = f"{begin}\n{body.strip()}\n{end}"
    path = Path(path)
    text = path.read_text() if path.exists() else (
        "# Benchmarks\n\nGenerated by the scripts in `benchmarks/`; each section is "
        "rewritten by its own script between its markers.\n")
    start, stop = text.find(begin), text.find(end)
    if start != -1 and stop > start:
        text = text[:start] + block + text[stop + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def print_report(report: str, out: Path | None, section: str) -> None:
    """Print ``report``; with ``out`` (not the generated page), also (re)write its section
    there."""
    print(report, flush=True)
    if out:
        replace_section(out, section, report)
        if not _results.is_page(out):
            print(f"wrote section '{section}' of {out}", file=sys.stderr, flush=True)


def run_facts(folder: Path, packages: dict[str, str]) -> dict[str, str]:
    """The machine (``folder``'s disk, ``packages``' versions), date and command every
    recorded row carries."""
    return {"machine": machine_description(folder, packages), "date": now_text(),
            "command": command_line()}


def report_head(title: str, facts: dict[str, str]) -> list[str]:
    return [f"## {title}", "", f"Command: `{facts['command']}`  ", f"Date: {facts['date']}  ",
            f"Machine: {facts['machine']}", ""]


def publish(bench: str, body: str, rows: Sequence[_results.Result], out: Path | None) -> None:
    """Print the report, ending with the rows it records; ``out`` the page: record them in
    results/<bench>.json and render the page; another file: write the report there as the
    section ``bench``."""
    print_report(body.rstrip() + "\n\n" + _results.rows_markdown(rows), out, bench)
    if rows and out and _results.is_page(out):
        _results.write_results(bench, rows)
