"""A KV namespace's files on a device: its folder and its ``namespace.json``.

``<device>/kvpool/<folder of namespace>/`` (``namespaces.namespace_folder``) holds the
namespace's ``segments/`` (the segment log) and, on the read group's first device, its
``namespace.json``: the layout the first put fixed, so that a fresh process computes
the same keys::

    {"dtype": "bfloat16", "shape": [32, 2, 8, 128], "chunk_tokens": 256, "token_dim": 2}

It is written once, atomically (``storage.files.atomic_write``), and read without
following a symbolic link; the pool never reads, writes or deletes through a link
inside its store.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import torch

from isolane import bounded_json
from isolane.errors import IntegrityError, StorageError
from isolane.kvpool.namespaces import namespace_folder
from isolane.storage.files import atomic_write

META_FILE = "namespace.json"


@dataclass(frozen=True)
class NamespaceMeta:
    """A namespace's ``namespace.json``: its layout, fixed by the first put."""

    dtype: str
    shape: tuple[int, ...]
    chunk_tokens: int
    token_dim: int


def read_namespace_meta(path: Path, namespace: str) -> NamespaceMeta | None:
    """The namespace file at ``path``, None when there is none; ``IntegrityError`` naming
    the file and the way out when it does not parse (it is never followed as a link)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StorageError(exc.errno, f"cannot read the KV namespace file {path}: "
                           f"{exc.strerror}; check its permissions (a symbolic link is "
                           "refused: replace it by the file)") from None
    with open(fd, "rb") as f:
        raw = f.read(1 << 16)
    try:
        meta = bounded_json.loads(raw)
        dtype, shape = meta["dtype"], tuple(meta["shape"])
        chunk_tokens, token_dim = meta["chunk_tokens"], meta["token_dim"]
        if not (isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype)
                and all(type(d) is int and d > 0 for d in shape)
                and type(chunk_tokens) is int and chunk_tokens > 0
                and type(token_dim) is int and -len(shape) - 1 <= token_dim <= len(shape)):
            raise ValueError("fields out of range")
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise IntegrityError(f"KV namespace file {path}", f"unreadable ({exc})",
                             hint=f"drop the namespace with 'isolane kv evict --namespace "
                             f"{namespace}' (its blocks are recomputed)") from None
    return NamespaceMeta(dtype, shape, chunk_tokens, token_dim)


def write_namespace_meta(path: Path, meta: NamespaceMeta) -> None:
    """Write ``namespace.json`` at ``path`` atomically (its folder is created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps({"dtype": meta.dtype, "shape": list(meta.shape),
                                   "chunk_tokens": meta.chunk_tokens,
                                   "token_dim": meta.token_dim}))


def meta_path(device: str | os.PathLike[str], namespace: str) -> Path:
    """Where the namespace file of ``namespace`` is on ``device`` (the first one)."""
    return Path(device) / "kvpool" / namespace_folder(namespace) / META_FILE


def namespace_dir(device: str | os.PathLike[str], namespace: str) -> Path:
    """``<device>/kvpool/<folder of namespace>``, refused (StorageError) when it or its
    ``segments`` folder is a symbolic link: the pool never reads, writes or deletes
    through a link inside its store."""
    folder = Path(device) / "kvpool" / namespace_folder(namespace)
    for path in (folder, folder / "segments"):
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            break
        if stat.S_ISLNK(mode):
            raise StorageError(f"{path} is a symbolic link: isolane never follows links "
                               f"inside its KV pool; remove the link (its target is not "
                               f"part of namespace '{namespace}')")
    return folder
