"""The writing marker: a live writer owns a generation folder, so gc leaves it alone.

``_writing.json`` ({pid, pid_start, host, started}) sits in a generation folder (and
in a rank's part folder on a write group where the generation has no marker: another
host's) while its save is in flight (``retention.should_sweep``).

On a local disk the folder and its marker appear in one step. Writing the marker into
a folder made first would leave, if the writer died between the two, a folder with
neither manifest nor marker: gc cannot tell that from a save about to write its
marker, and keeps it for ``gc_grace_s``. So the folder is built as
``.<leaf>.writing-<pid>-<pid start>-<host digest>`` beside where it goes, the marker
written inside, and the folder renamed into place. The temporary folder's name says
who builds it: gc removes one whose builder is gone (``sweep_dead_builds``) and
never mistakes it for a foreign entry. Object stores have no folders: the marker is
one object that appears whole.

Nothing here is fsynced: the marker speaks to gc about a process that lives, and after
a crash of the host no writer lives. A generation whose marker did not survive one is
a generation without a marker (swept after ``gc_grace_s``), one whose marker did names
a dead process (swept at once); either way nothing committed depends on it, and a save
makes its folders durable itself, with its data, before its manifest.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import socket
import time
from pathlib import Path

from isolane import bounded_json
from isolane.errors import CapacityError
from isolane.lanes.procinfo import is_alive, start_ticks
from isolane.snapshot.manifest import WRITING_MARKER
from isolane.storage.base import BlobStore
from isolane.storage.files import remove_tree

log = logging.getLogger(__name__)

# fullmatch; <leaf> is a generation or a rank part (names.GENERATION, "rank-<r>")
BUILDING = re.compile(r"\.(?P<leaf>[0-9a-z-]{1,40})\.writing-(?P<pid>\d{1,10})"
                      r"-(?P<start>\d{1,20})-(?P<host>[0-9a-f]{8})")


def host_digest() -> str:
    """Eight hex digits naming this host in a folder name (hostnames may hold any byte)."""
    return hashlib.blake2b(socket.gethostname().encode(), digest_size=4).hexdigest()


def mark_writing(store: BlobStore, prefix: str) -> None:
    """Publish the marker of this process at ``prefix`` (creating the folder with it)."""
    pid = os.getpid()  # with its start time: a later process may get the same pid
    start = start_ticks(pid)
    marker = json.dumps({"pid": pid, "pid_start": start, "host": socket.gethostname(),
                         "started": time.time()}).encode()
    folder = store.local_path(prefix)
    if folder is None:
        store.write_atomic(f"{prefix}/{WRITING_MARKER}", marker)
        return
    _publish_folder(store, prefix, Path(folder), marker, f"{pid}-{start}-{host_digest()}")


def _publish_folder(store: BlobStore, prefix: str, folder: Path, marker: bytes,
                    builder: str) -> None:
    parent = folder.parent
    building = parent / f".{folder.name}.writing-{builder}"
    try:
        for attempt in range(3):
            parent.mkdir(parents=True, exist_ok=True)
            try:
                os.mkdir(building)
                break
            except FileNotFoundError:
                if attempt == 2:  # gc's rmdir of an empty name folder won each time
                    raise
        fd = os.open(building / WRITING_MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(marker)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.rename(building, folder)  # onto nothing or an empty folder: one step
    except OSError as exc:
        with contextlib.suppress(OSError):
            remove_tree(building, within=parent)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise CapacityError(exc.errno, f"device of {parent} is full while starting a "
                                "save; free space or run 'isolane gc' to drop old "
                                "snapshots") from exc
        if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
            raise
        # The folder exists with something in it already (not a fresh generation):
        # no window to close, the marker goes in beside what is there.
        store.write_atomic(f"{prefix}/{WRITING_MARKER}", marker)


def read_marker(store: BlobStore, prefix: str) -> dict[str, object] | None:
    """The writing marker at ``prefix``, or None when there is none (or it cannot be
    read: gc then judges the folder as one without a marker)."""
    try:
        raw = bounded_json.loads(store.read(f"{prefix}/{WRITING_MARKER}"))
    except (FileNotFoundError, NotADirectoryError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def marked_on_this_host(marker: dict[str, object] | None) -> bool:
    return marker is not None and marker.get("host") == socket.gethostname()


def unmark_writing(store: BlobStore, prefix: str) -> None:
    store.delete(f"{prefix}/{WRITING_MARKER}")


def builder_alive(entry: str, *, grace_s: float, now: float, mtime: float) -> bool:
    """Whether the process named by a ``BUILDING`` folder name may still publish it: on
    this host its (pid, start) is probed; from another host (a shared filesystem) it is
    trusted for ``grace_s`` after the folder last changed."""
    found = BUILDING.fullmatch(entry)
    if found is None:
        return True  # not ours to judge
    if found["host"] == host_digest():
        return is_alive(int(found["pid"]), int(found["start"]))
    return now - mtime < grace_s


def sweep_dead_builds(store: BlobStore, prefix: str, grace_s: float) -> list[str]:
    """Remove the folders under ``prefix`` (a name's folder) that a dead writer was
    building; returns their names. Local stores only (object stores have none)."""
    folder = store.local_path(prefix)
    if folder is None:
        return []
    now = time.time()
    swept = []
    for entry in store.children(prefix):
        if not BUILDING.fullmatch(entry):
            continue
        path = Path(folder) / entry
        try:
            mtime = os.lstat(path).st_mtime
        except FileNotFoundError:
            continue  # published (renamed) or swept meanwhile
        if not builder_alive(entry, grace_s=grace_s, now=now, mtime=mtime):
            remove_tree(path, within=folder)
            log.info("removed %s: its writer died before publishing it", path)
            swept.append(entry)
    return swept
