"""The host lane plane: one small shared-memory file per host config, a slot per process.

Every process that runs governed lanes on a host config (the trainer's ranks, the
inference workers, the CLI, ``isolane serve``) opens the same file and publishes its
KV read latencies, write demand and rates in a slot of its own; one elected member
turns the merged view into the host's write and background rates (see
``isolane.lanes.host_governor``). No daemon, no root: the file lives in ``/dev/shm``
(or ``qos.plane_dir``), is named by the uid and a digest of the config's devices,
created 0600 and checked on every open (regular file, ours, not writable by others,
right size, magic, version, geometry, config digest, CRC). Anything else is rebuilt
from scratch with one warning, never trusted. The layout is in
``isolane.lanes.plane_format`` and docs/FORMATS.md.

Join and leave take an flock on ``<plane>.lock`` for a moment; publishing rewrites
only the member's own slot. Nothing stays behind once no process uses the plane: the
last member out removes the file and its lock, and the next process to open a plane
in the folder removes those whose last member was killed (``plane_files``).

A member is who it claims while its pid runs with the start time it recorded
(``isolane.lanes.procinfo``): a SIGKILLed member is out of the merged view at the next
look and its slot is taken by the next process that needs one, so thousands of short-
lived processes never fill the 64 slots. A forked child never writes its parent's slot:
every write checks the pid that joined.

Thread-safe (one lock per plane object); fork-safe (the child forgets the slot).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import stat
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from isolane.config import Config, is_url
from isolane.errors import InvalidArgumentError
from isolane.lanes.forksafe import ForkSafe
from isolane.lanes.plane_files import plane_lock, remove_plane_files, sweep
from isolane.lanes.plane_format import (
    FILE_BYTES,
    GOV_BYTES,
    GOV_OFFSET,
    HEADER,
    SLOT_BYTES,
    SLOT_HEAD,
    SLOTS,
    Header,
    SlotRecord,
    check_header,
    fresh_file,
    pack_governor,
    slot_offset,
    unpack_governor,
)
from isolane.lanes.procinfo import is_alive, start_ticks

log = logging.getLogger(__name__)

DEFAULT_DIR = "/dev/shm"
PLANE_DIR_ENV = "ISOLANE_PLANE_DIR"  # overrides qos.plane_dir (tests keep planes apart)
STALE_S = 1.0  # a member whose heartbeat is older is left out of the host view
TORN_RETRIES = 4
_warned: set[str] = set()  # "says so once" per process and plane path


def config_digest(config: Config) -> bytes:
    """16 bytes naming a host config's devices (groups, roles, resolved paths)."""
    parts = []
    for group in sorted(config.device_groups.values(), key=lambda g: g.name):
        devices = [d if is_url(d) else os.path.realpath(d) for d in group.devices]
        parts.append(f"{group.role}\0{group.name}\0" + "\0".join(devices))
    return hashlib.blake2b("\n".join(parts).encode(), digest_size=16).digest()


def plane_path(config: Config) -> Path:
    """Where this config's plane lives: ``$ISOLANE_PLANE_DIR``, ``qos.plane_dir``, or
    /dev/shm (else ``<home>/.lanes``)."""
    folder = os.environ.get(PLANE_DIR_ENV) or config.qos.plane_dir
    if folder is None:
        folder = DEFAULT_DIR if os.path.isdir(DEFAULT_DIR) else str(Path(config.home) / ".lanes")
    name = f"isolane-lanes-{os.geteuid()}-{config_digest(config).hex()[:20]}.plane"
    return Path(folder) / name


class PlaneShrunkError(OSError):
    """The plane file is shorter than its layout: truncated under its members."""


def warn_once(key: str, message: str, *args: object) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message, *args)


@dataclass(frozen=True)
class Member:
    """A slot as another process sees it."""

    index: int
    record: SlotRecord
    alive: bool  # the pid runs and is the process that joined
    fresh: bool  # ... and its heartbeat is recent

    @property
    def pid(self) -> int:
        return self.record.pid


class HostPlane(ForkSafe):
    """The plane file of one host config, and this process's slot in it."""

    def __init__(self, path: Path, digest: bytes) -> None:
        self.path = path
        self.lock_path = path.with_name(path.name + ".lock")
        self.digest = digest
        self.rebuilds = 0  # times this process rebuilt the file (each warned)
        self.slot: int | None = None
        self.generation = 0
        self.joined_s = 0.0
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._fd = -1
        self._ino = -1
        self.lost = False  # the file shrank under us: per-process lanes from now on
        with self._locked():
            self._open_or_rebuild()
        super().__init__()

    @classmethod
    def open(cls, config: Config) -> HostPlane | None:
        """The plane of ``config``, or None (said once) where the folder is not ours to
        write: the process then runs with lanes of its own."""
        path = plane_path(config)
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            sweep(path.parent)  # planes whose last member was killed
            return cls(path, config_digest(config))
        except OSError as exc:
            warn_once(str(path), "no host lane plane at %s (%s): this process runs with "
                      "per-process lanes, so its governor sees only its own KV reads; "
                      "give it write access to %s or set qos.plane_dir", path,
                      exc.strerror or exc, path.parent)
            return None

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()
        self.slot = None  # the parent's: never ours to write

    # -- the file ----------------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with plane_lock(self.lock_path):
            yield

    def _why_unusable(self, fd: int) -> str | None:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return "not a regular file"
        if info.st_uid != os.geteuid():
            return f"owned by uid {info.st_uid}"
        if info.st_mode & 0o022:
            return f"writable by others (mode {info.st_mode & 0o777:o})"
        if info.st_size != FILE_BYTES:
            return f"truncated or resized ({info.st_size} bytes, expected {FILE_BYTES})"
        return check_header(os.pread(fd, HEADER.size + 4, 0), self.digest)

    def _open_or_rebuild(self) -> None:
        """Map the file at ``path``, rebuilding it if it is missing or not to be
        trusted. Call with the flock held."""
        reason: str | None = "missing"
        fd = -1
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            pass
        except OSError as exc:
            if exc.errno is None or not os.path.lexists(self.path):
                raise
            reason = f"cannot be opened ({exc.strerror})"  # e.g. a symlink: replace it
        if fd >= 0:
            reason = self._why_unusable(fd)
            if reason is not None:
                os.close(fd)
                fd = -1
        if fd < 0:
            if reason != "missing":
                self.rebuilds += 1
                log.warning("host lane plane %s: %s; rebuilt it (members rejoin on their "
                            "next heartbeat)", self.path, reason)
            fd = self._build()
        self._map(fd)

    def _build(self) -> int:
        # Not storage.files.atomic_write: the plane maps exactly the inode it wrote, so
        # it keeps the fd open across the rename (atomic_write closes it; reopening by
        # name could map a file another process put there), and the file is shared
        # memory, not durable state: no fsyncs under the flock. The temp name carries
        # the pid so that plane_files.sweep can remove a dead builder's leftover.
        tmp = self.path.with_name(f"{self.path.name}.tmp-{os.getpid()}")
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        try:
            os.fchmod(fd, 0o600)
            # Every page allocated now: a full /dev/shm fails this join, not a later write.
            os.posix_fallocate(fd, 0, FILE_BYTES)
            os.pwrite(fd, fresh_file(Header(self.digest, time.time())), 0)
            os.replace(tmp, self.path)  # replaces a symlink itself, never its target
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            raise
        return fd

    def _map(self, fd: int) -> None:
        old_fd = self._fd
        self._fd, self._ino = fd, os.fstat(fd).st_ino
        if old_fd >= 0:
            os.close(old_fd)

    # The file is read and written with pread/pwrite, not mapped: a mapping of a file
    # that another process truncates kills the reader with SIGBUS at its next access;
    # a read of it is only short, and the member then goes on alone (``_shrunk``).
    def read_bytes(self, offset: int, nbytes: int) -> bytes:
        """``nbytes`` of the plane at ``offset``; PlaneShrunkError when the file ends
        first (someone truncated it under us)."""
        if self._fd < 0:
            raise RuntimeError("host lane plane is closed")
        data = os.pread(self._fd, nbytes, offset)
        if len(data) < nbytes:
            raise PlaneShrunkError(f"{len(data)} of {nbytes} bytes at offset {offset}")
        return data

    def _write_bytes(self, offset: int, data: bytes) -> None:
        if os.fstat(self._fd).st_size != FILE_BYTES:  # never grow a truncated file back
            raise PlaneShrunkError(f"the file is {os.fstat(self._fd).st_size} bytes")
        os.pwrite(self._fd, data, offset)

    def _shrunk(self, exc: PlaneShrunkError) -> None:
        """Leave the plane for good (its slots cannot be trusted): per-process lanes."""
        if not self.lost:
            self.lost = True
            self.slot = None
            log.warning("host lane plane %s shrank under this process (%s): it runs with "
                        "per-process lanes from now on; remove the file and restart the "
                        "processes of this host config to share one again", self.path, exc)

    def check(self) -> bool:
        """Re-check the file (cheap: a stat and the header); rebuild or follow a
        rebuilt one. True when this process must rejoin (its slot is gone)."""
        if self.lost:
            return False
        try:
            info = os.stat(self.path, follow_symlinks=False)
            same = info.st_ino == self._ino
        except FileNotFoundError:
            same = False
        try:
            if same and info.st_size != FILE_BYTES:
                raise PlaneShrunkError(f"the file is {info.st_size} bytes")
            if same and check_header(self.read_bytes(0, HEADER.size + 4), self.digest) is None:
                return False
        except PlaneShrunkError as exc:
            self._shrunk(exc)
            return False
        with self._lock, self._locked():
            self._open_or_rebuild()
            self.slot = None
        return True

    # -- membership --------------------------------------------------------------------
    def join(self, now: float) -> int | None:
        """Claim a slot for this process (a free one, else a dead member's); None when
        all 64 are held by live processes."""
        pid = os.getpid()
        if self.lost:
            return None
        with self._lock:
            if self.slot is not None and self._pid == pid:
                return self.slot
            with self._locked(), self._guarded():
                if not self._is_current():  # removed or rebuilt since we mapped it
                    self._open_or_rebuild()
                for index in range(SLOTS):
                    state, owner, start = self._peek(index)
                    if state and is_alive(owner, start):
                        continue
                    old = SlotRecord.unpack(self._slot_bytes(index), with_bins=False)
                    generation = (old.generation if old else 0) + 1
                    record = SlotRecord(state=1, pid=pid, start_ticks=start_ticks(pid),
                                        generation=generation, joined_s=now, heartbeat_s=now)
                    self._write_slot(index, record.pack())
                    self.slot, self.generation, self._pid = index, generation, pid
                    self.joined_s = now
                    return index
        if self.lost:
            return None
        warn_once(f"{self.path}:full", "host lane plane %s: all %d slots are held by live "
                  "processes; this one runs with per-process lanes", self.path, SLOTS)
        return None

    def publish(self, record: SlotRecord) -> bool:
        """Rewrite this process's slot; False when it has none (not joined, or forked)."""
        with self._lock:
            if self.slot is None or self._pid != os.getpid():
                self.slot = None
                return False
            record.state, record.pid, record.generation = 1, self._pid, self.generation
            record.joined_s = self.joined_s
            record.start_ticks = start_ticks(self._pid) if not record.start_ticks else (
                record.start_ticks)
            with self._guarded():
                self._write_slot(self.slot, record.pack())
            return self.slot is not None

    def leave(self) -> None:
        """Free this process's slot (idempotent; a forked child frees nothing). The last
        member out (or an observer that never joined, seeing no member) removes the
        plane and its lock: they are memory in /dev/shm. A process joining meanwhile
        waits on the lock and then builds a fresh plane (see ``plane_files``)."""
        with self._lock:
            index, self.slot = self.slot, None
            if self._pid != os.getpid() or self._fd < 0 or self.lost:
                return
            with self._locked(), self._guarded():
                if index is not None:
                    state, owner, _start = self._peek(index)
                    old = SlotRecord.unpack(self._slot_bytes(index), with_bins=False)
                    if state and owner == self._pid and (
                            old is None or old.generation == self.generation):
                        self._write_slot(index, SlotRecord(generation=self.generation).pack())
                if self._is_current() and not any(
                        s and is_alive(p, t) for s, p, t in map(self._peek, range(SLOTS))):
                    remove_plane_files(self.path)

    def close(self) -> None:
        self.leave()
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def _is_current(self) -> bool:
        try:
            return os.stat(self.path, follow_symlinks=False).st_ino == self._ino
        except FileNotFoundError:
            return False

    # -- reading -----------------------------------------------------------------------
    def _peek(self, index: int) -> tuple[int, int, int]:
        """(state, pid, start) without the CRC: enough to skip a free slot."""
        state, pid, start = SLOT_HEAD.unpack_from(
            self.read_bytes(slot_offset(index), SLOT_HEAD.size))[:3]
        return int(state), int(pid), int(start)

    def _slot_bytes(self, index: int) -> bytes:
        return self.read_bytes(slot_offset(index), SLOT_BYTES)

    def _write_slot(self, index: int, data: bytes) -> None:
        self._write_bytes(slot_offset(index), data)

    @contextlib.contextmanager
    def _guarded(self) -> Iterator[None]:
        """Run a read or write of the file; a shrunk file turns this process alone."""
        try:
            yield
        except PlaneShrunkError as exc:
            self._shrunk(exc)

    def members(self, now: float, *, with_bins: bool = True,
                stale_s: float = STALE_S) -> list[Member]:
        """Every live member (the dead and the torn-beyond-retries are left out)."""
        with self._lock:  # check() may remap meanwhile
            if self.lost:
                return []
            try:
                return self._members(now, with_bins=with_bins, stale_s=stale_s)
            except PlaneShrunkError as exc:
                self._shrunk(exc)
                return []

    def _members(self, now: float, *, with_bins: bool, stale_s: float) -> list[Member]:
        out = []
        for index in range(SLOTS):
            state, pid, start = self._peek(index)
            if not state or not is_alive(pid, start):
                continue
            record = None
            for _ in range(TORN_RETRIES):  # its owner may be rewriting it right now
                record = SlotRecord.unpack(self._slot_bytes(index), with_bins=with_bins)
                if record is not None:
                    break
            if record is None or not record.state:
                continue
            out.append(Member(index, record, True, now - record.heartbeat_s <= stale_s))
        return out

    def read_governor(self) -> dict[str, Any] | None:
        """The elected member's block (None: none yet, or torn beyond retries)."""
        with self._lock, self._guarded():
            for _ in range(TORN_RETRIES):
                if self.lost:
                    break
                block = unpack_governor(self.read_bytes(GOV_OFFSET, GOV_BYTES))
                if block is not None:
                    return block
        return None

    def write_governor(self, block: dict[str, Any]) -> None:
        """Publish the elected member's block; the oldest decisions give way when it
        would not fit."""
        decisions = list(block.get("decisions") or [])
        while True:
            try:
                data = pack_governor({**block, "decisions": decisions})
                break
            except InvalidArgumentError:
                if not decisions:
                    raise
                decisions = decisions[1:]
        with self._lock, self._guarded():
            if not self.lost:
                self._write_bytes(GOV_OFFSET, data)
