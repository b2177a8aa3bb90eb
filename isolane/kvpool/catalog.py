"""The KV namespaces stored on a config's read group: open, list, count, drop.

What the ``isolane kv`` commands and a node's pool registry call: ``open_namespace``
opens a stored namespace with the ``chunk_tokens``/``token_dim`` it was stored with
(an unknown one is refused, never created), ``list_namespaces`` describes every one,
``count_blocks`` and ``drop_namespace`` work on one. Each opens the namespace's
segment logs, so a process holding them (a running node) makes them fail.
"""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path
from typing import Any

from isolane.config import Config, target_config
from isolane.errors import (
    IntegrityError,
    InvalidNameError,
    IsolaneError,
    KeyNotFoundError,
    StorageError,
)
from isolane.kvpool.api import shape_with_tokens
from isolane.kvpool.log.segment_log import SegmentLog
from isolane.kvpool.namespace_files import META_FILE, namespace_dir, read_namespace_meta
from isolane.kvpool.namespaces import check_namespace, namespace_from_folder
from isolane.kvpool.pool import KVPool
from isolane.lanes.scheduler import LaneScheduler
from isolane.storage.files import remove_tree

log = logging.getLogger(__name__)


def open_namespace(config: Config | str | os.PathLike[str] | None, namespace: str, *,
                   memory_budget: int | None = 0,
                   scheduler: LaneScheduler | None = None) -> KVPool:
    """Open a stored namespace with the chunk_tokens/token_dim it was stored with.
    An unknown namespace raises ``KeyNotFoundError`` and creates nothing (a bare
    ``KVPool(config, namespace=typo)`` would start an empty one); an invalid name
    ``InvalidNameError``; an unreadable ``namespace.json`` ``IntegrityError``."""
    config = target_config(config, "read")
    check_namespace(namespace)
    device = Path(config.require_group("read").devices[0])
    meta = read_namespace_meta(namespace_dir(device, namespace) / META_FILE, namespace)
    if meta is None:
        raise KeyNotFoundError(f"KV namespace '{namespace}' not found; run 'isolane kv ls' "
                               "to list namespaces")
    return KVPool(config, namespace=namespace, chunk_tokens=meta.chunk_tokens,
                  token_dim=meta.token_dim, memory_budget=memory_budget, scheduler=scheduler)


def list_namespaces(config: Config | str | os.PathLike[str] | None = None,
                    problems: list[IsolaneError] | None = None) -> list[dict[str, Any]]:
    """Every namespace stored on the read group: blocks and bytes per device and tier.
    Opens each namespace's logs briefly (fails if a running node holds them).

    A folder that is not a namespace isolane wrote (a name that does not decode, a
    symbolic link) or a namespace whose ``namespace.json`` is unreadable is left out
    and described in ``problems`` (when given; else the first one is raised)."""
    config = target_config(config, "read")
    names: set[str] = set()
    found: dict[str, IsolaneError] = {}  # one report per problem, not per device

    def problem(exc: IsolaneError) -> None:
        if problems is None:
            raise exc
        found.setdefault(str(exc), exc)

    for device in config.require_group("read").devices:
        root = Path(device) / "kvpool"
        if not root.is_dir():
            continue
        for entry in sorted(os.scandir(root), key=lambda e: e.name):
            if entry.is_symlink():
                problem(StorageError(f"{entry.path} is a symbolic link: isolane never "
                                     "follows links inside its KV pool; remove the link"))
                continue
            if not os.path.lexists(Path(entry.path) / "namespace.json"):
                continue
            try:
                names.add(namespace_from_folder(entry.name, str(root)))
            except InvalidNameError as exc:
                problem(exc)
    out = []
    for name in sorted(names):
        try:
            pool = open_namespace(config, name)
        except (IntegrityError, StorageError) as exc:
            if isinstance(exc, StorageError) and exc.errno == errno.EBUSY:
                raise  # open in a running node: the whole listing is refused
            problem(exc)
            continue
        with pool:
            stats = pool.stats()
            dtype, shape = pool.layout or ("", ())
            block_shape = shape_with_tokens(shape, pool.token_dim, pool.chunk_tokens)
        out.append({"namespace": name, "dtype": dtype, "block_shape": block_shape,
                    "blocks": sum(d["blocks"] for d in stats["disk"]),
                    "disk_bytes": sum(d["bytes"] for d in stats["disk"]),
                    "devices": stats["disk"], "capacity": stats["capacity"]})
    if problems is not None:
        problems.extend(found.values())
    return out


def count_blocks(config: Config | str | os.PathLike[str] | None, namespace: str) -> int:
    """Blocks of ``namespace`` on the read group's disks, counted through its segment
    logs (so a process holding them makes this fail); works on a namespace whose
    ``namespace.json`` is damaged too. KeyNotFoundError for an unknown namespace."""
    config = target_config(config, "read")
    try:
        with open_namespace(config, namespace) as pool:
            return sum(len(lg) for lg in pool.logs)
    except IntegrityError as exc:  # a damaged namespace.json: the logs still open
        log.warning("%s", exc)
    blocks = 0
    for device in config.require_group("read").devices:
        folder = namespace_dir(device, namespace) / "segments"
        if folder.is_dir():
            with SegmentLog(folder) as segment_log:
                blocks += len(segment_log)
    return blocks


def drop_namespace(config: Config | str | os.PathLike[str] | None, namespace: str) -> int:
    """Delete every block of ``namespace`` on every device; returns the blocks dropped.
    Refuses (StorageError) while another process has the namespace open. Deletes only
    inside each device's ``kvpool`` folder, never through a symbolic link."""
    config = target_config(config, "read")
    blocks = count_blocks(config, namespace)
    for device in config.require_group("read").devices:
        root = Path(device) / "kvpool"
        remove_tree(namespace_dir(device, namespace), within=root)
    return blocks
