"""Where a snapshot upload lands before it is saved: a temporary file, then a mapping.

An upload can be far larger than memory, and ``SnapshotStore.save`` takes tensors. So
the node writes the received tensor bytes into a spool file (each tensor 64-byte
aligned) through the write lane, and once the whole stream has checked out maps the
file copy-on-write and hands ``save`` tensors that view the mapping. The file is
unlinked as soon as it is mapped (the mapping keeps the data until the last tensor
goes), and removed at once on any failure, so a truncated upload leaves nothing;
``sweep`` removes leftovers of a node that was killed.

Not thread-safe: one upload, one spool, driven from one task.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import secrets
import shutil
from collections.abc import Sequence
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

import xxhash

from isolane.errors import CapacityError
from isolane.lanes.scheduler import LaneHandle
from isolane.service.snapstream import TensorEntry

log = logging.getLogger(__name__)
ALIGN = 64
SUFFIX = ".upload"


def plan_offsets(entries: Sequence[TensorEntry]) -> tuple[dict[int, int], int]:
    """Each tensor's offset in the spool file (64-byte aligned) and the file's size."""
    offsets: dict[int, int] = {}
    end = 0
    for entry in entries:
        start = -(-end // ALIGN) * ALIGN
        offsets[entry.id] = start
        end = start + entry.nbytes
    return offsets, end


def sweep(folder: Path) -> int:
    """Remove spool files left by a node that died mid-upload; returns how many.

    Only regular files named ``*.upload`` are the node's: a symbolic link is unlinked
    (its target untouched) and reported, a folder is reported and left alone."""
    removed = 0
    try:
        entries = list(os.scandir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return 0
    for entry in entries:
        if not entry.name.endswith(SUFFIX):
            continue
        if entry.is_symlink():
            log.warning("symbolic link %s in the spool folder: removed the link, its "
                        "target was not touched", entry.path)
            os.unlink(entry.path)
        elif entry.is_file(follow_symlinks=False):
            os.unlink(entry.path)
            removed += 1
        else:
            log.warning("%s in the spool folder is not a spool file; left alone", entry.path)
    return removed


class UploadSpool:
    """One upload's spool file in ``folder``, ``size`` bytes."""

    def __init__(self, folder: Path, size: int, lane: LaneHandle, executor: Executor) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(folder).free
        if size > free:
            raise CapacityError(f"the upload needs {size} bytes of spool space in {folder}, "
                                f"{free} are free; free space there or start the node with "
                                "--spool-dir on a bigger disk")
        self.path = folder / f"{os.getpid()}-{secrets.token_hex(6)}{SUFFIX}"
        self.size = size
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(self._fd, size)  # sparse: the mapping covers every offset
        self._lane = lane
        self._executor = executor
        self._pending: asyncio.Future[Any] | None = None

    async def write(self, offset: int, data: bytes, digest: xxhash.xxh3_64 | None = None
                    ) -> None:
        """Write ``data`` at ``offset`` on the write lane, after adding it to ``digest``
        (off the event loop). One piece stays in flight while the caller receives the
        next, so the digest sees the pieces in order."""
        await self.flush()
        loop = asyncio.get_running_loop()
        self._pending = loop.run_in_executor(self._executor, self._write_on_lane, offset, data,
                                             digest)

    def _write_on_lane(self, offset: int, data: bytes, digest: xxhash.xxh3_64 | None) -> None:
        if digest is not None:
            digest.update(data)
        # submit_sized may block on the lane's byte budget: never on the event loop.
        self._lane.submit_sized(len(data), _pwrite_all, self._fd, data, offset).result()

    async def flush(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            await pending

    def map(self) -> mmap.mmap | bytearray:
        """The file mapped copy-on-write (tensors view it); the file itself is gone."""
        try:
            if self.size == 0:
                return bytearray()
            return mmap.mmap(self._fd, self.size, flags=mmap.MAP_PRIVATE,
                             prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            self.discard()

    def discard(self) -> None:
        """Close and remove the file (idempotent). Only with no write pending: use
        ``abort`` otherwise (a lane thread may still hold the descriptor)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            self.path.unlink(missing_ok=True)

    async def abort(self) -> None:
        """Wait out a pending write, then discard."""
        try:
            await self.flush()
        except OSError as exc:
            log.warning("spool write failed while aborting an upload: %s", exc)
        finally:
            self.discard()


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


