"""State dicts in the files users bring and take away.

Reading (``isolane save SRC``):

==========================  ==========================================================
SRC                         read as
==========================  ==========================================================
``*.pt``/``*.pth``/``*.bin``  ``torch.load(weights_only=True, map_location="cpu")``: plain
                            containers of tensors and numbers only; a file holding any
                            other object is refused, never unpickled
``*.safetensors``           ``safetensors.torch.load_file`` (flat ``str -> tensor``)
a folder                    a Hugging Face model folder: every ``*.safetensors`` in it,
                            else every ``pytorch_model*.bin``, ``*.pt`` and ``*.pth``;
                            their tensors merged into one flat dict; a key found in two
                            files is refused
==========================  ==========================================================

Writing (``isolane restore NAME DEST``), chosen by DEST's suffix:

- ``.pt``: ``torch.save`` of the state dict exactly as saved (nesting, non-tensor
  leaves, tied tensors).
- ``.safetensors``: safetensors holds a flat ``str -> tensor`` map, so nested dicts and
  lists are flattened with ``.``-joined keys (``optimizer.state.0.exp_avg``). A
  non-tensor leaf (a step count, a learning rate, a string) is refused with its key:
  restore to ``.pt`` instead, or pick tensor subtrees with ``--keys``. Putting such
  leaves into the safetensors header metadata was considered and rejected: it would
  silently turn ints, tuples and dtypes into JSON strings that no loader gives back.
  Tensors sharing memory (tied weights) are written as separate copies, since
  safetensors refuses shared storage.

Either way the file is written to a temporary name in DEST's folder, fsynced and
renamed, so a crash never leaves a half-written DEST.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from isolane.errors import IsolaneError
from isolane.storage.files import atomic_write

TORCH_SUFFIXES = (".pt", ".pth", ".bin")
SAFETENSORS_SUFFIX = ".safetensors"
SOURCE_SUFFIXES = (*TORCH_SUFFIXES, SAFETENSORS_SUFFIX)
DEST_SUFFIXES = (".pt", SAFETENSORS_SUFFIX)
FOLDER_TORCH_PATTERNS = ("pytorch_model*.bin", "*.pt", "*.pth")

DestFormat = Literal["pt", "safetensors"]


class FormatError(IsolaneError, ValueError):
    """A file cannot be read or written in the format its name asks for."""


class SourceNotFoundError(IsolaneError, FileNotFoundError):
    def __init__(self, path: Path) -> None:
        super().__init__(f"{path} does not exist; give a .pt/.pth/.bin/.safetensors file "
                         "or a model folder")


class DestinationExistsError(IsolaneError, FileExistsError):
    def __init__(self, path: Path) -> None:
        super().__init__(f"{path} already exists; pass --overwrite to replace it, or "
                         "choose another DEST")


@dataclass(frozen=True)
class Source:
    """What ``read_source`` found: the state and the files it came from."""

    state: Any
    files: tuple[Path, ...]


# -- reading -------------------------------------------------------------------------------

def read_source(path: Path) -> Source:
    """Read a torch file, a safetensors file or a model folder (see the module doc)."""
    if not path.exists():
        raise SourceNotFoundError(path)
    if path.is_dir():
        files = model_folder_files(path)
        return Source(merge_state_dicts((f, read_file(f)) for f in files), files)
    return Source(read_file(path), (path,))


def read_file(path: Path) -> Any:
    suffix = path.suffix.lower()
    if suffix in TORCH_SUFFIXES:
        return read_torch_file(path)
    if suffix == SAFETENSORS_SUFFIX:
        return read_safetensors_file(path)
    raise FormatError(f"{path}: unsupported file type {path.suffix or '(no suffix)'!r}; "
                      f"isolane reads {', '.join(SOURCE_SUFFIXES)} files and model folders")


def read_torch_file(path: Path) -> Any:
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except OSError:
        raise
    except pickle.UnpicklingError as exc:
        raise FormatError(
            f"{path} holds objects other than tensors and plain containers "
            f"({_unpickling_reason(exc)}); isolane reads torch files with weights_only=True "
            "and never unpickles arbitrary objects — save model.state_dict() (and "
            "optimizer.state_dict()) instead of whole objects, or convert the file to "
            ".safetensors") from None
    except (RuntimeError, KeyError, EOFError, ValueError, TypeError, AttributeError,
            IndexError) as exc:
        raise FormatError(f"{path} is not a readable torch file ({type(exc).__name__}: "
                          f"{exc})") from None


def _unpickling_reason(exc: pickle.UnpicklingError) -> str:
    for line in str(exc).splitlines():
        line = line.strip()
        if "Unsupported global" in line:
            return line.split(" was not", 1)[0].removeprefix("WeightsUnpickler error: ")
    return "refused by weights_only"


def read_safetensors_file(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path, device="cpu")
    except SafetensorError as exc:
        raise FormatError(f"{path} is not a readable safetensors file: {exc}") from None


def model_folder_files(folder: Path) -> tuple[Path, ...]:
    """The weight files of a model folder: its ``*.safetensors``, else its torch files."""
    found = sorted(p for p in folder.glob(f"*{SAFETENSORS_SUFFIX}") if p.is_file())
    if not found:
        found = sorted({p for pattern in FOLDER_TORCH_PATTERNS for p in folder.glob(pattern)
                        if p.is_file()})
    if not found:
        raise FormatError(f"folder {folder} holds no *.safetensors, pytorch_model*.bin, *.pt "
                          "or *.pth files; point SRC at a model folder or a weight file")
    return tuple(found)


def merge_state_dicts(parts: Iterable[tuple[Path, Any]]) -> dict[Any, Any]:
    """One flat dict from the shards of a model folder; a key in two files is refused."""
    merged: dict[Any, Any] = {}
    origin: dict[Any, Path] = {}
    for path, part in parts:
        if not isinstance(part, Mapping):
            raise FormatError(f"{path} holds a {type(part).__name__}, not a state dict; a "
                              "model folder's files must each hold a dict of tensors")
        for key, value in part.items():
            if key in origin:
                raise FormatError(f"key {key!r} is in both {origin[key].name} and "
                                  f"{path.name} (folder {path.parent}); remove the duplicate "
                                  "file or save the files one by one")
            origin[key] = path
            merged[key] = value
    return merged


# -- writing -------------------------------------------------------------------------------

def dest_format(path: Path) -> DestFormat:
    suffix = path.suffix.lower()
    if suffix == ".pt":
        return "pt"
    if suffix == SAFETENSORS_SUFFIX:
        return "safetensors"
    raise FormatError(f"cannot write {path}: DEST must end in {' or '.join(DEST_SUFFIXES)} "
                      "(torch.save or safetensors)")


def check_dest(path: Path, *, overwrite: bool) -> DestFormat:
    """Refuse a DEST we would not write, before any snapshot bytes are read."""
    fmt = dest_format(path)
    if path.is_dir():
        raise FormatError(f"{path} is a folder; DEST must be a file path")
    if path.exists() and not overwrite:
        raise DestinationExistsError(path)
    parent = path.parent
    if not parent.is_dir():
        raise FormatError(f"folder {parent} does not exist; create it first")
    return fmt


def write_state(state: Any, path: Path, *, overwrite: bool) -> int:
    """Write ``state`` in the format DEST's suffix names; returns the file's size."""
    fmt = check_dest(path, overwrite=overwrite)
    if fmt == "pt":
        write_atomic(path, lambda tmp: torch.save(state, tmp), overwrite=overwrite)
    else:
        from safetensors.torch import save_file

        tensors = safetensors_tensors(state)
        write_atomic(path, lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}),
                     overwrite=overwrite)
    return path.stat().st_size


def flatten_tensors(state: Any) -> dict[str, torch.Tensor]:
    """Nested dicts/lists/tuples -> ``{"a.b.0": tensor}``; refuses non-tensor leaves."""
    out: dict[str, torch.Tensor] = {}

    def walk(value: Any, path: tuple[str, ...]) -> None:
        key = ".".join(path)
        if isinstance(value, torch.Tensor):
            if not path:
                raise FormatError("the snapshot is a single tensor, not a dict; safetensors "
                                  "needs names — restore to .pt instead")
            if key in out:
                raise FormatError(f"two leaves flatten to the same safetensors key {key!r}; "
                                  "restore to .pt instead")
            out[key] = value
        elif isinstance(value, Mapping):
            for k, v in value.items():
                walk(v, (*path, str(k)))
        elif isinstance(value, list | tuple):
            for i, v in enumerate(value):
                walk(v, (*path, str(i)))
        else:
            raise FormatError(
                f"key {key or '(root)'!r} holds a {type(value).__name__} ({value!r:.40}), not "
                "a tensor; safetensors stores tensors only — restore to .pt, or pick tensor "
                "subtrees with --keys")

    walk(state, ())
    return out


def safetensors_tensors(state: Any) -> dict[str, torch.Tensor]:
    """Flatten and make every tensor its own contiguous CPU memory (safetensors
    refuses tensors that share storage, such as tied weights)."""
    seen: set[tuple[int, torch.device]] = set()
    out: dict[str, torch.Tensor] = {}
    for key, tensor in flatten_tensors(state).items():
        tensor = tensor.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        storage = (tensor.untyped_storage().data_ptr(), tensor.device)
        if storage in seen or not tensor.is_contiguous():
            tensor = tensor.clone(memory_format=torch.contiguous_format)
        seen.add(storage)
        out[key] = tensor
    return out


def write_atomic(path: Path, write: Callable[[Path], None], *, overwrite: bool) -> None:
    """``write(tmp)`` into a temporary file beside ``path``, then publish it durably
    (``isolane.storage.files.atomic_write``); without ``overwrite`` an existing DEST,
    even one that appeared meanwhile, is never replaced."""
    try:
        atomic_write(path, write, overwrite=overwrite)
    except FileExistsError:
        raise DestinationExistsError(path) from None


def tensor_bytes(state: Any) -> int:
    """Bytes held by the tensors of a nested state (each shared storage counted once)."""
    seen: set[tuple[int, int, int]] = set()
    total = 0

    def walk(value: Any) -> None:
        nonlocal total
        if isinstance(value, torch.Tensor):
            ident = (value.untyped_storage().data_ptr(), int(value.storage_offset()),
                     value.numel())
            if ident not in seen:
                seen.add(ident)
                total += value.numel() * value.element_size()
        elif isinstance(value, Mapping):
            for v in value.values():
                walk(v)
        elif isinstance(value, list | tuple):
            for v in value:
                walk(v)

    walk(state)
    return total
