"""PyTorch Lightning checkpoints through isolane (imports lightning).

``IsolaneCheckpointIO`` is a ``CheckpointIO`` plugin: ``Trainer(plugins=[IsolaneCheckpointIO
(store)])``. Each checkpoint Lightning writes (``ModelCheckpoint``, ``trainer.save_checkpoint``)
becomes the snapshot ``lightning-<hash of the folder>-<file stem>``, saved async by default:
``save_checkpoint`` returns once the tensors are staged. Once the snapshot has committed,
a background thread writes a small JSON **reference file** at the checkpoint's path::

    {"format": "isolane-checkpoint-ref", "version": 1, "snapshot": "<name>", "store": "<url>"}

so Lightning's file-based logic keeps working: ``ckpt_path="last"`` finds ``last.ckpt``,
``save_last="link"`` links to it, top-k pruning calls ``remove_checkpoint`` (which deletes the
snapshot and the file). A reference file exists only for a committed snapshot: a run
killed mid-save leaves the previous checkpoint in place.

``rng=True`` (default) adds the global RNG states (``capture_rng``) to each checkpoint under
``"isolane_rng"`` and restores them on load, which Lightning itself does not do; with it a
run resumed from an epoch-end checkpoint draws the same shuffles and dropout masks as an
uninterrupted one. ``load_checkpoint`` ignores ``map_location``: tensors load on the CPU
and Lightning moves model and optimizer states to their device.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

from isolane.errors import InvalidArgumentError, IsolaneError, SnapshotNotFoundError
from isolane.integrations.rng import capture_rng, restore_rng
from isolane.integrations.step_snapshots import (
    PendingSave,
    SnapshotTarget,
    check_async,
    start_save,
)
from isolane.storage.files import atomic_write

REF_FORMAT = "isolane-checkpoint-ref"
REF_VERSION = 1
RNG_KEY = "isolane_rng"
MAX_REF_BYTES = 1 << 16


def snapshot_name_for(path: str | os.PathLike[str]) -> str:
    """``lightning-<8 hex of the absolute folder>-<file stem>``, a valid snapshot name."""
    full = Path(path).absolute()
    digest = hashlib.blake2b(str(full.parent).encode(), digest_size=4).hexdigest()
    stem = re.sub(r"[^A-Za-z0-9._+=@-]", "_", full.stem)[:150] or "checkpoint"
    return f"lightning-{digest}-{stem}"


def write_ref(path: Path, name: str, store_url: str) -> None:
    """The reference file, replaced atomically and durably (``atomic_write``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps({"format": REF_FORMAT, "version": REF_VERSION,
                                   "snapshot": name, "store": store_url}))


def remove_referenced(store: SnapshotTarget, path: Path) -> None:
    """Delete the snapshot the reference file ``path`` names, then the file; nothing
    when there is no reference file (removing is idempotent)."""
    try:
        name = read_ref(path)
    except SnapshotNotFoundError:
        return
    with contextlib.suppress(SnapshotNotFoundError):
        store.delete(name)
    path.unlink(missing_ok=True)


def read_ref(path: Path) -> str:
    """The snapshot name in a reference file; a clear error for anything else."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_REF_BYTES + 1)
    except FileNotFoundError:
        raise SnapshotNotFoundError(str(path), "the checkpoint folder") from None
    try:
        ref = json.loads(raw) if len(raw) <= MAX_REF_BYTES else None
    except (UnicodeDecodeError, ValueError):
        ref = None
    if not isinstance(ref, dict) or ref.get("format") != REF_FORMAT:
        raise InvalidArgumentError(
            f"{path} is not an isolane checkpoint reference (was it written by another "
            "CheckpointIO?); load it without IsolaneCheckpointIO")
    if ref.get("version") != REF_VERSION:
        raise InvalidArgumentError(f"{path} is an isolane checkpoint reference of version "
                                   f"{ref.get('version')}; this isolane reads version "
                                   f"{REF_VERSION}: upgrade isolane")
    return str(ref["snapshot"])


class IsolaneCheckpointIO(CheckpointIO):
    """See the module docstring. Thread-safe for Lightning's use (one trainer)."""

    def __init__(self, store: SnapshotTarget, *, async_: bool = True, rng: bool = True) -> None:
        check_async(store, async_)
        self.store = store
        self.async_ = async_
        self.rng = rng
        self._lock = threading.Lock()
        self._pending: dict[str, list[Future[None]]] = {}  # path -> reference writes
        self._errors: list[BaseException] = []
        self._executor: ThreadPoolExecutor | None = None

    @property
    def _store_url(self) -> str:
        return str(getattr(self.store, "url", ""))

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike[str],
                        storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise InvalidArgumentError("IsolaneCheckpointIO takes no storage_options; "
                                       "configure the SnapshotStore instead")
        self._raise_errors()
        target = Path(path).absolute()
        name = snapshot_name_for(target)
        state = dict(checkpoint)
        if self.rng:
            state[RNG_KEY] = capture_rng()
        handle = start_save(self.store, state, name, {"lightning_path": str(target)},
                            self.async_)
        if handle is None:
            write_ref(target, name, self._store_url)
            return
        with self._lock:
            if self._executor is None:  # one thread: references land in save order
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="isolane-ckpt-ref")
            future = self._executor.submit(self._commit_ref, handle, target, name)
            self._pending.setdefault(str(target), []).append(future)

    def _commit_ref(self, handle: PendingSave, target: Path, name: str) -> None:
        try:
            handle.result()
            write_ref(target, name, self._store_url)
        except BaseException as exc:
            with self._lock:
                self._errors.append(exc)
            raise

    def load_checkpoint(self, path: str | os.PathLike[str], map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        target = Path(path).absolute()
        self._wait(str(target))
        state: dict[str, Any] = self.store.load(read_ref(target))
        rng_state = state.pop(RNG_KEY, None)
        if self.rng and rng_state is not None:
            restore_rng(rng_state)
        return state

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        target = Path(path).absolute()
        self._wait(str(target))
        remove_referenced(self.store, target)

    def teardown(self) -> None:
        """Wait for every save and reference write; raise the first error."""
        self._wait(None)
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
        self._raise_errors()

    def _wait(self, path: str | None) -> None:
        with self._lock:
            if path is None:
                futures = [f for fs in self._pending.values() for f in fs]
                self._pending.clear()
            else:
                futures = self._pending.pop(path, [])
        wait(futures)  # their errors were recorded by _commit_ref
        self._raise_errors()

    def _raise_errors(self) -> None:
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            raise IsolaneError(f"an async checkpoint save failed and was not committed: "
                               f"{errors[0]}") from errors[0]
