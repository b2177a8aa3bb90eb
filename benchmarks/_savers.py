"""The systems under test behind one small interface, so isolane plugs in like a peer.

Call order for every ``Saver``: construct on an empty folder -> ``save`` (any number of
times, distinct names) -> ``restore_modes`` loaders -> ``close``. The benchmark makes a
save durable by fsyncing ``output(name)`` inside the timing (free for a system that
already synced), and deletes the folder afterwards. Not thread-safe.

Systems: ``torch`` (torch.save), ``safetensors`` (save_file), ``dcp1``/``dcp4``
(torch.distributed.checkpoint with 1 or 4 writer threads), ``isolane`` (SnapshotStore).
"""

from __future__ import annotations

import json
import shutil
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from _statedicts import iter_leaves, path_text, set_path

StateDict = Mapping[str, Any]

# single-process DCP: torch says so once per call; the benchmark knows
warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled")


@dataclass(frozen=True)
class RestoreMode:
    """One way to restore a save. ``load(name, template)`` returns the state dict;
    ``template`` is a preallocated copy for loaders that fill one in place, else None."""

    label: str
    load: Callable[[str, dict[str, Any] | None], Mapping[Any, Any]]
    needs_template: bool = False
    note: str = ""


class Pending(Protocol):
    def result(self) -> object: ...


@runtime_checkable
class AsyncSaving(Protocol):
    """A saver whose ``save_async`` returns once the state dict may be mutated again."""

    def save_async(self, state_dict: StateDict, name: str) -> Pending: ...


class Saver(ABC):
    key: str = ""
    label: str = ""
    async_label: str = ""   # the row label of ``save_async``, for savers that have one
    async_note: str = ""
    note: str = ""
    incremental = False     # later saves may reuse earlier ones: keep them
    reuses_buffers = False  # keeps state across saves: a second save is measured too

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)

    @abstractmethod
    def save(self, state_dict: StateDict, name: str) -> None: ...

    @abstractmethod
    def output(self, name: str) -> Path:
        """The file or folder that ``save(..., name)`` wrote (fsynced by the benchmark)."""

    @abstractmethod
    def restore_modes(self) -> list[RestoreMode]: ...

    def remove(self, name: str) -> None:
        path = self.output(name)
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)

    def close(self) -> None:  # noqa: B027 - most savers hold nothing open
        pass


class TorchSaver(Saver):
    key, label = "torch", "torch.save"

    def output(self, name: str) -> Path:
        return self.folder / f"{name}.pt"

    def save(self, state_dict: StateDict, name: str) -> None:
        torch.save(state_dict, self.output(name))

    def restore_modes(self) -> list[RestoreMode]:
        return [
            RestoreMode("torch.load(weights_only=True)",
                        lambda name, _: torch.load(self.output(name), weights_only=True)),
            RestoreMode("torch.load(weights_only=True, mmap=True)",
                        lambda name, _: torch.load(self.output(name), weights_only=True,
                                                   mmap=True),
                        note="lazy: pays its reads when the pages are touched"),
        ]


class SafetensorsSaver(Saver):
    key, label = "safetensors", "safetensors save_file"
    note = ("tensors only: the nested dict is flattened to '/'-joined keys and the "
            "non-tensor leaves are stored as JSON in the header metadata")
    META_KEY = "bench.non_tensor_leaves"

    def output(self, name: str) -> Path:
        return self.folder / f"{name}.safetensors"

    def save(self, state_dict: StateDict, name: str) -> None:
        from safetensors.torch import save_file

        tensors, other = {}, {}
        for path, leaf in iter_leaves(state_dict):
            if isinstance(leaf, torch.Tensor):
                tensors[path_text(path)] = leaf
            else:
                other[path_text(path)] = leaf
        save_file(tensors, str(self.output(name)), metadata={self.META_KEY: json.dumps(other)})

    def _load(self, name: str, _template: dict[str, Any] | None) -> dict[str, Any]:
        from safetensors import safe_open
        from safetensors.torch import load_file

        path = str(self.output(name))
        flat: dict[str, Any] = dict(load_file(path))
        with safe_open(path, framework="pt") as f:
            flat.update(json.loads((f.metadata() or {}).get(self.META_KEY, "{}")))
        nested: dict[str, Any] = {}
        for key, value in flat.items():
            set_path(nested, tuple(key.split("/")), value)
        return nested

    def restore_modes(self) -> list[RestoreMode]:
        return [RestoreMode("safetensors load_file", self._load)]


class DcpSaver(Saver):
    """torch.distributed.checkpoint in one process (``no_dist=True``: no process group)."""

    def __init__(self, folder: Path, threads: int) -> None:
        super().__init__(folder)
        self.threads = threads
        self.key = f"dcp{threads}"
        self.label = f"DCP save, thread_count={threads}"
        self.note = "no process group (no_dist=True); non-tensor leaves pickled by DCP"

    def output(self, name: str) -> Path:
        return self.folder / name

    def _writer(self, name: str) -> Any:
        from torch.distributed.checkpoint import FileSystemWriter

        return FileSystemWriter(self.output(name), thread_count=self.threads)

    def save(self, state_dict: StateDict, name: str) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(dict(state_dict), storage_writer=self._writer(name), no_dist=True)

    def _load(self, name: str, template: dict[str, Any] | None) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader

        if template is None:
            raise TypeError("DCP loads into a preallocated state dict; pass a template")
        dcp.load(template, storage_reader=FileSystemReader(self.output(name)), no_dist=True)
        return template

    def restore_modes(self) -> list[RestoreMode]:
        return [RestoreMode(f"DCP load (written with thread_count={self.threads})", self._load,
                            needs_template=True,
                            note="into a preallocated, already touched state dict")]


class DcpAsyncSaver(DcpSaver):
    """DCP that also offers ``dcp.async_save`` (stages a CPU copy, writes in a thread)."""

    def __init__(self, folder: Path, threads: int) -> None:
        super().__init__(folder, threads)
        self.async_label = f"DCP async_save, thread_count={threads}"
        self.async_note = ("default stager: a fresh CPU copy of the state dict on every "
                           "call (cache_staged_state_dict=False)")

    def save_async(self, state_dict: StateDict, name: str) -> Pending:
        import torch.distributed.checkpoint as dcp

        pending: Pending = dcp.async_save(dict(state_dict), storage_writer=self._writer(name),
                                          no_dist=True)
        return pending


class IsolaneSaver(Saver):
    key, label = "isolane", "isolane SnapshotStore.save"
    async_label = "isolane SnapshotStore.save_async"
    async_note = ("steady state: one save_async before it in the same process warmed the "
                  "staging buffers, as in a training loop that saves every N steps")
    incremental = True
    reuses_buffers = True
    change_detection = "hash"

    def __init__(self, folder: Path) -> None:
        from isolane.snapshot import SnapshotStore

        super().__init__(folder)
        self.store = SnapshotStore(str(self.folder))
        self._async_warm = False

    def output(self, name: str) -> Path:
        # The snapshot's own generation folder: linked chunks are hard links inside it.
        return Path(self.store.path(name))

    def save(self, state_dict: StateDict, name: str) -> None:
        self.store.save(state_dict, name, change_detection=self.change_detection)

    def prepare_async(self, state_dict: StateDict) -> None:
        """Outside the timing: first touch of fresh staging memory is paid once."""
        if not self._async_warm:
            self.store.save_async(state_dict, "warm-up-async", parent=False).result()
            self.store.delete("warm-up-async")
            self._async_warm = True

    def save_async(self, state_dict: StateDict, name: str) -> Pending:
        pending: Pending = self.store.save_async(state_dict, name, parent=False)
        return pending

    def restore_modes(self) -> list[RestoreMode]:
        return [
            RestoreMode("isolane SnapshotStore.load", lambda name, _: self.store.load(name)),
            RestoreMode("isolane SnapshotStore.load(mmap=True)",
                        lambda name, _: self.store.load(name, mmap=True),
                        note="private mappings of the chunk files, hash-checked at load"),
            RestoreMode("isolane SnapshotStore.load(into=...)",
                        lambda name, template: self.store.load(name, into=template),
                        needs_template=True,
                        note="into a preallocated, already touched state dict (as DCP)"),
        ]

    def remove(self, name: str) -> None:
        pass  # incremental: later snapshots link its chunks; the folder goes at the end

    def close(self) -> None:
        self.store.close()


class IsolaneVersionSaver(IsolaneSaver):
    """Trusts torch's version counters: tensors untouched since the last save are
    linked without being hashed (``change_detection="version"``)."""

    key = "isolane-version"
    label = "isolane SnapshotStore.save(change_detection='version')"
    async_label = "isolane SnapshotStore.save_async(change_detection='version')"
    change_detection = "version"


class IsolaneFsyncEachSaver(IsolaneSaver):
    """The A/B of ``writer.DEFER_CHUNK_FSYNC``: the same save with every chunk file
    fsynced by the lane thread that wrote it (instead of all of them together before
    the manifest). Saves only: no second save, async save or restores."""

    key = "isolane-fsync-each"
    label = "isolane SnapshotStore.save, each chunk file fsynced after its write"
    reuses_buffers = False
    save_only = True

    def save(self, state_dict: StateDict, name: str) -> None:
        import isolane.snapshot.writer as writer

        deferred = writer.DEFER_CHUNK_FSYNC
        writer.DEFER_CHUNK_FSYNC = False
        try:
            super().save(state_dict, name)
        finally:
            writer.DEFER_CHUNK_FSYNC = deferred

    def restore_modes(self) -> list[RestoreMode]:
        return []


def isolane_missing() -> str | None:
    """None when ``isolane.snapshot.SnapshotStore`` imports, else why not."""
    try:
        from isolane.snapshot import SnapshotStore  # noqa: F401
    except ImportError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


SYSTEMS: dict[str, Callable[[Path], Saver]] = {
    "torch": TorchSaver,
    "safetensors": SafetensorsSaver,
    "dcp1": lambda folder: DcpSaver(folder, 1),
    "dcp4": lambda folder: DcpAsyncSaver(folder, 4),
    "isolane": IsolaneSaver,
    "isolane-version": IsolaneVersionSaver,
    "isolane-fsync-each": IsolaneFsyncEachSaver,
}


def make_saver(key: str, folder: Path) -> Saver:
    try:
        factory = SYSTEMS[key]
    except KeyError:
        raise ValueError(f"unknown system {key!r}; choose from {', '.join(SYSTEMS)}") from None
    return factory(folder)
