"""How snapshots are shown: tables for people, dicts for ``--json``.

Imports nothing heavy (no torch): the types come in only for the type checker.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from isolane.cli.progress import human_bytes

if TYPE_CHECKING:
    from isolane.snapshot import SnapshotInfo
    from isolane.snapshot.catalog import DamagedSnapshot
    from isolane.snapshot.manifest import TensorRecord


def local_time(timestamp: float) -> str:
    return datetime.datetime.fromtimestamp(timestamp).strftime("%Y-%m-%d %H:%M:%S")


def where(info: SnapshotInfo) -> str:
    """``local``, ``local+mirror`` (a mirrored copy exists) or ``mirror`` (only there)."""
    if info.location == "local" and info.mirrored:
        return "local+mirror"
    return info.location


def info_dict(info: SnapshotInfo) -> dict[str, Any]:
    """``SnapshotInfo`` as JSON-ready data, plus ``created`` in local ISO time."""
    out = info.to_dict()
    out["created"] = datetime.datetime.fromtimestamp(info.committed_at).isoformat(
        timespec="seconds")
    out["where"] = where(info)
    return out


def table(headers: Sequence[str], rows: Sequence[Sequence[str]],
          right: Sequence[int] = ()) -> str:
    """Columns padded to their widest cell; column indexes in ``right`` right-aligned."""
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()

    return "\n".join([line(headers), *(line(r) for r in rows)])


def snapshot_table(infos: Sequence[SnapshotInfo], damaged: Sequence[DamagedSnapshot] = ()
                   ) -> str:
    """Healthy snapshots, then the damaged ones marked ``DAMAGED`` (sizes unknown)."""
    rows = [(i.name, local_time(i.committed_at), human_bytes(i.logical_bytes),
             human_bytes(i.written_bytes), str(i.tensors), where(i)) for i in infos]
    rows += [(d.name, "DAMAGED", "?", "?", "?", d.location) for d in damaged]
    return table(("NAME", "CREATED", "SIZE", "WRITTEN", "TENSORS", "WHERE"), rows,
                 right=(2, 3, 4))


def shape_text(shape: Sequence[int]) -> str:
    return "(" + ", ".join(str(d) for d in shape) + (",)" if len(shape) == 1 else ")")


def tensor_table(records: Sequence[TensorRecord]) -> str:
    rows = [(r.key, r.dtype, shape_text(r.shape)) for r in records]
    return table(("KEY", "DTYPE", "SHAPE"), rows)


def tensor_dicts(records: Sequence[TensorRecord]) -> list[dict[str, Any]]:
    return [{"key": r.key, "dtype": r.dtype, "shape": list(r.shape)} for r in records]


def show_text(info: SnapshotInfo, path: str, records: Sequence[TensorRecord]) -> str:
    parent = (f"{info.parent['name']} (generation {info.parent['generation']})"
              if info.parent else "-")
    fields = [
        ("name", info.name),
        ("generation", info.generation),
        ("created", local_time(info.committed_at)),
        ("where", where(info)),
        ("path", path),
        ("size", f"{human_bytes(info.logical_bytes)} (stored {human_bytes(info.stored_bytes)}"
                 f", written {human_bytes(info.written_bytes)}, linked "
                 f"{human_bytes(info.linked_bytes)})"),
        ("tensors", str(info.tensors)),
        ("parent", parent),
        ("metadata", _metadata_text(info.metadata)),
    ]
    width = max(len(k) for k, _ in fields) + 1
    head = "\n".join(f"{(k + ':').ljust(width)} {v}" for k, v in fields)
    return head + "\n\n" + tensor_table(records) if records else head


def _metadata_text(metadata: dict[str, Any]) -> str:
    import json

    return json.dumps(metadata, sort_keys=True) if metadata else "-"
