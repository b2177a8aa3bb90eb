"""Which lane runs which kind of job, in which order, under which limit (pure)."""

from __future__ import annotations

from enum import Enum
from typing import Literal

LaneName = Literal["write", "read", "background"]
LANE_NAMES: tuple[LaneName, ...] = ("write", "read", "background")


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

# Lower runs first inside a lane: KV reads, KV writes, restores, checkpoint writes,
# background work. Only the order of kinds sharing a lane matters.
_PRIORITY: dict[JobKind, int] = {
    JobKind.KV_GET: 0,
    JobKind.KV_PUT: 1,
    JobKind.CHECKPOINT_READ: 2,
    JobKind.CHECKPOINT_WRITE: 3,
    JobKind.MIRROR: 4,
    JobKind.DEMOTE: 4,
    JobKind.COMPACT: 4,
    JobKind.MIGRATE: 4,
}

# What the governor's token buckets slow down. Restores are not: a job waiting for its
# checkpoint is as latency-bound as a KV read, and the knob is write bandwidth.
_GOVERNED = frozenset({JobKind.CHECKPOINT_WRITE, JobKind.MIRROR, JobKind.DEMOTE,
                       JobKind.COMPACT, JobKind.MIGRATE})

# The kind a job gets when submitted on a lane directly rather than through a handle.
DEFAULT_KIND: dict[LaneName, JobKind] = {
    "write": JobKind.CHECKPOINT_WRITE,
    "read": JobKind.KV_GET,
    "background": JobKind.MIRROR,
}


def lane_for(kind: JobKind) -> LaneName:
    """Checkpoint I/O -> write lane, KV I/O -> read lane, everything else -> background."""
    return _LANE_OF[kind]


def priority_of(kind: JobKind) -> int:
    """Queue order inside a lane (lower first): KV get < KV put < restore < checkpoint
    write < background."""
    return _PRIORITY[kind]


def is_governed(kind: JobKind) -> bool:
    """Whether the governor's token bucket meters this kind (checkpoint writes and all
    background work)."""
    return kind in _GOVERNED
