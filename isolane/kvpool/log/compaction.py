"""Pure decisions of the KV segment log: rotation, compaction, eviction (no I/O).

``SegmentLog`` (``isolane.kvpool.log.segment_log``) asks these before it touches a file, the
way Bitcask asks ``check_write`` and ``should_merge``. Each is a plain function of sizes
and ids, so the policy is tested without disks and can be swapped without reading the
I/O code.
"""

from __future__ import annotations

from collections.abc import Sequence


def should_rotate(live_bytes: int, batch_bytes: int, segment_bytes: int,
                  empty_bytes: int) -> bool:
    """Seal the live segment before appending a batch of ``batch_bytes``?

    ``live_bytes`` is the live segment's size, ``empty_bytes`` the size of a segment
    holding no record (its header). Yes when the batch would take the segment past
    ``segment_bytes`` and the segment already holds records. A batch is never split: one
    larger than ``segment_bytes`` goes alone into a fresh segment, which then exceeds
    the target size (its blocks stay contiguous, one range read).
    """
    return live_bytes > empty_bytes and live_bytes + batch_bytes > segment_bytes


def should_compact(live_bytes: int, total_bytes: int, min_live_ratio: float) -> bool:
    """Is a sealed segment worth compacting: less than ``min_live_ratio`` of it live?

    ``live_bytes`` counts the records the key directory still points at, ``total_bytes``
    the segment file. An empty file is never worth it; a fully dead one always is.
    """
    if total_bytes <= 0:
        return False
    return live_bytes < min_live_ratio * total_bytes


def plan_eviction(sealed: Sequence[tuple[int, int]], total_bytes: int,
                  target_bytes: int, *, at_least: int = 0) -> list[int]:
    """Ids of the whole sealed segments to drop, oldest first.

    ``sealed`` lists ``(segment_id, file_bytes)`` oldest first; the live segment is
    never in it. Drops segments until ``total_bytes`` is at most ``target_bytes`` and at
    least ``at_least`` bytes were freed (the device-full path asks for room for one
    batch), or until nothing sealed is left.
    """
    chosen: list[int] = []
    freed = 0
    for segment_id, size in sealed:
        if total_bytes - freed <= target_bytes and freed >= at_least:
            break
        chosen.append(segment_id)
        freed += size
    return chosen


def should_keep_tombstone(tombstone_segment: int, oldest_segment: int) -> bool:
    """Must compaction copy a tombstone forward?

    Only while a segment older than the tombstone's exists: only there can a put of the
    deleted key still lie, and only it could resurrect the key on reopen.
    """
    return oldest_segment < tombstone_segment
