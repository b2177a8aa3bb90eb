"""Demotion: the oldest sealed segments of the disk tier move to the capacity tier.

The one place two tiers meet (tiers never call each other): each device's sealed
segments, oldest first, are uploaded whole with their live keys
(``CapacityTier.upload``, which commits with the index) and only then evicted from the
device, until the device holds at most the target. The pool decides when (a put that
left a device over its budget, or ``KVPool.demote``).
"""

from __future__ import annotations

from isolane.kvpool.tiers.capacity import CapacityTier
from isolane.kvpool.tiers.disk import DiskTier


def demote_segments(disk: DiskTier, capacity: CapacityTier, target_bytes: int) -> int:
    """Move sealed segments until every device holds at most ``target_bytes``; returns
    the segments moved (a segment with no live key is evicted without an upload)."""
    moved = 0
    for device, segment_log in enumerate(disk.logs):
        for info in segment_log.segments():
            if segment_log.total_bytes <= target_bytes:
                break
            if info.state != "sealed":
                continue
            locations = segment_log.live_locations(info.segment_id)
            if locations:
                capacity.upload(device, info.segment_id, info.path.read_bytes(), locations)
            segment_log.evict_segment(info.segment_id)
            moved += 1
    return moved
