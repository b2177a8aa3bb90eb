"""Which lane runs which kind of job (pure)."""

from __future__ import annotations

from enum import Enum
from typing import Literal

LaneName = Literal["write", "read", "background"]


class JobKind(Enum):
    CHECKPOINT_WRITE = "checkpoint_write"
    CHECKPOINT_READ = "checkpoint_read"
    KV_GET = "kv_get"
    KV_PUT = "kv_put"
    MIRROR = "mirror"
    DEMOTE = "demote"
    COMPACT = "compact"
    MIGRATE = "migrate"


_LANE_OF: dict[JobKind, LaneName] = {
    JobKind.CHECKPOINT_WRITE: "write",
    JobKind.CHECKPOINT_READ: "write",
    JobKind.KV_GET: "read",
    JobKind.KV_PUT: "read",
    JobKind.MIRROR: "background",
    JobKind.DEMOTE: "background",
    JobKind.COMPACT: "background",
    JobKind.MIGRATE: "background",
}


def lane_for(kind: JobKind) -> LaneName:
    """Checkpoint I/O -> write lane, KV I/O -> read lane, everything else -> background."""
    return _LANE_OF[kind]
