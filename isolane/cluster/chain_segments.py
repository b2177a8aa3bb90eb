"""Chain segments: the unit of KV placement and migration (pure: no I/O).

A prompt's chain of blocks is cut into *segments* of ``S`` blocks (``cluster.
segment_blocks``; the last one may be shorter): blocks ``[i*S, (i+1)*S)`` form segment
``i``. Each segment is placed on its own by its *segment digest*, a 16-byte name derived
from the chain's routing digest (``ring.prefix_digest``) and ``i`` (:func:`segment_digest`):
on the ring of nodes (``HashRing.owner``, bounded loads), on the devices of a node
(``ring.device_for``) and in a node's chain index (what a cluster moves on join/leave).
So a restore of ``n`` blocks touches at most ``ceil(n / S)`` nodes and reads each segment
as one sequential range on its node, while one long chain spreads over several nodes
instead of filling one node's cache. ``S = 1`` is per-block placement; a very large
``S`` is whole-chain placement.

Segment digest (version 1; ``docs/FORMATS.md``, "KV chain segments")::

    digest_i = xxh3_128(b"isolane-seg\\x01" || chain_digest (16 bytes) || u32 le i)

as 16 big-endian bytes (``xxhash.xxh3_128_digest``, seed 0).

Which segment a block belongs to depends on its position in the chain, so an API that
takes a later part of a chain also takes the chain's leading keys (:func:`chain_offset`).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from isolane.cluster.ring import device_for, prefix_digest
from isolane.errors import InvalidArgumentError

SEGMENT_TAG = b"isolane-seg\x01"
"""Prefix of the hashed bytes of a segment digest (names the format's version)."""
DEFAULT_SEGMENT_BLOCKS = 4
"""``S`` (``cluster.segment_blocks``), chosen by ``benchmarks/bench_routing.py``."""
MAX_SEGMENT_BLOCKS = 1 << 20
_INDEX = struct.Struct("<I")


def check_segment_blocks(value: object) -> int:
    """``value`` as a valid ``S``, or InvalidArgumentError naming the field."""
    if isinstance(value, bool) or not isinstance(value, int) \
            or not 1 <= value <= MAX_SEGMENT_BLOCKS:
        raise InvalidArgumentError(
            f"segment_blocks (cluster.segment_blocks) must be a whole number from 1 to "
            f"{MAX_SEGMENT_BLOCKS}, got {value!r}")
    return value


def segment_digest(chain_digest: bytes, index: int) -> bytes:
    """The placement digest of segment ``index`` of the chain ``chain_digest``."""
    if len(chain_digest) != 16:
        raise InvalidArgumentError(
            f"a chain digest is 16 bytes (a block key), got {len(chain_digest)}")
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < 1 << 32:
        raise InvalidArgumentError(f"a segment index is a whole number from 0 to 2**32 - 1, "
                                   f"got {index!r}")
    return xxhash.xxh3_128_digest(SEGMENT_TAG + bytes(chain_digest) + _INDEX.pack(index))


@dataclass(frozen=True)
class ChainSegment:
    """The part of a key list that falls into segment ``index`` of its chain:
    ``keys[start:stop]`` of the list planned, placed by ``digest``."""

    index: int
    start: int
    stop: int
    digest: bytes

    def __len__(self) -> int:
        return self.stop - self.start


def plan_segments(chain_digest: bytes, n_keys: int, segment_blocks: int, *,
                  offset: int = 0) -> list[ChainSegment]:
    """The segments of ``n_keys`` consecutive blocks of a chain, the first of them block
    ``offset`` of the chain, in chain order (start/stop index the ``n_keys``)."""
    check_segment_blocks(segment_blocks)
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise InvalidArgumentError(f"offset must be a whole number >= 0, got {offset!r}")
    out: list[ChainSegment] = []
    at = 0
    while at < n_keys:
        index = (offset + at) // segment_blocks
        stop = min(n_keys, (index + 1) * segment_blocks - offset)
        out.append(ChainSegment(index, at, stop, segment_digest(chain_digest, index)))
        at = stop
    return out


def chain_offset(keys: Sequence[bytes], chain: Sequence[bytes] | None) -> int:
    """Where ``keys`` start in their chain: 0 without ``chain``; else the position of
    ``keys[0]`` in ``chain`` (the chain's keys from its first block, which may include
    ``keys``), or ``len(chain)`` when ``chain`` ends right before ``keys``."""
    if not chain or not keys:
        return 0
    first = bytes(keys[0])
    for i, key in enumerate(chain):
        if bytes(key) == first:
            return i
    return len(chain)


def segments_per_restore(n_blocks: int, segment_blocks: int) -> int:
    """``ceil(n / S)``: the most nodes (and requests) a restore of ``n`` blocks needs."""
    return -(-n_blocks // check_segment_blocks(segment_blocks))


def device_runs(keys: Sequence[bytes], n_devices: int, segment_blocks: int,
                digest: bytes | None = None) -> list[tuple[int, int, int]]:
    """``(device, start, stop)``: which of ``n_devices`` each run of ``keys`` goes to.
    With ``digest`` (a segment digest: the blocks are one segment, as a node receives
    them) all of them go to its device; else ``keys`` start a chain and each of its
    segments goes to the device of its digest (``ring.device_for``)."""
    if digest is not None:
        return [(device_for(digest, n_devices), 0, len(keys))] if keys else []
    if not keys:
        return []
    segs = plan_segments(prefix_digest(keys), len(keys), segment_blocks)
    return [(device_for(s.digest, n_devices), s.start, s.stop) for s in segs]
