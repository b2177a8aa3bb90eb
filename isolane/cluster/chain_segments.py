"""Chain segments: the unit of KV placement and migration (pure: no I/O).

A prompt's chain of blocks is cut into *segments* of ``S`` blocks (``cluster.
segment_blocks``; the last one may be shorter): blocks ``[i*S, (i+1)*S)`` form segment
``i``, named by its *segment digest*, a 16-byte name derived from the key of the
segment's *anchor block* and ``i`` (:func:`segment_digest`).

Chain-affine placement (version 3): every segment of a chain has the chain's *home
digest*, segment 0's digest. The home places it on the ring of nodes (``HashRing.owner``),
records it in the node's chain index (what a cluster moves on join/leave) and picks its
device on a node (``ring.device_for``), so a chain lives on one node and the loss of one
of ``N`` nodes costs about ``1/N`` of the cached prefixes (a prefix ends at its first
missing block: segments spread over nodes by their own digests, version 2, lost most of
every long prompt with any one node). A segment leaves its home when the home node is
over its load bound or write share, or when it starts past a small share of the home
node's cache (``chain_placement.spills``): it then goes along the walk of its own
digest, so the different continuations of a hot prefix still spread over the nodes
(``docs/FORMATS.md``, "KV chain segments"; measured by ``benchmarks/bench_routing.py``,
node-loss table). A restore of ``n`` blocks reads each node's segments as one request.

Anchor blocks: block keys are chained hashes, so a block's key names the whole prefix
up to it. Segment 0 is anchored at block ``min(k, n) - 1`` (the chain's routing digest,
``ring.prefix_digest``: chains sharing only a system block do not share a home),
segment ``i >= 1`` at its own first block ``i*S``: two chains share segment ``i`` only
when they share the prefix up to its start, so the continuations of a popular prefix
spill along different walks. An anchor never changes as a chain grows, except segment
0's (and so the home) while the chain is shorter than ``k`` blocks.

Segment digest (``docs/FORMATS.md``, "KV chain segments")::

    digest_i = xxh3_128(b"isolane-seg\\x01" || anchor key of segment i (16 bytes) || u32 le i)

as 16 big-endian bytes (``xxhash.xxh3_128_digest``, seed 0).

Which segment a block belongs to, and its anchor, depend on its position in the chain,
so an API that takes a later part of a chain also takes the chain's leading keys
(:func:`chain_offset`).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from isolane.cluster.ring import DEFAULT_PREFIX_BLOCKS, device_for
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


def segment_digest(anchor: bytes, index: int) -> bytes:
    """The placement digest of segment ``index`` whose anchor block has the key
    ``anchor`` (module docstring; :func:`anchor_position` says which block)."""
    if len(anchor) != 16:
        raise InvalidArgumentError(
            f"a segment's anchor is 16 bytes (a block key), got {len(anchor)}")
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < 1 << 32:
        raise InvalidArgumentError(f"a segment index is a whole number from 0 to 2**32 - 1, "
                                   f"got {index!r}")
    return xxhash.xxh3_128_digest(SEGMENT_TAG + bytes(anchor) + _INDEX.pack(index))


@dataclass(frozen=True)
class ChainSegment:
    """The part of a key list that falls into segment ``index`` of its chain:
    ``keys[start:stop]`` of the list planned. ``home``: the chain's home digest (segment
    0's digest), which places it on a node, records it there and moves it; ``digest``:
    its own digest, along whose walk it spills when the home node is over its load
    bound (module docstring)."""

    index: int
    start: int
    stop: int
    digest: bytes
    home: bytes

    def __len__(self) -> int:
        return self.stop - self.start


def anchor_position(index: int, n_blocks: int, segment_blocks: int,
                    prefix_blocks: int = DEFAULT_PREFIX_BLOCKS) -> int:
    """The chain position of the anchor block of segment ``index`` in a chain of (at
    least, as far as known) ``n_blocks`` blocks: ``min(k, n) - 1`` for segment 0, the
    segment's first block ``index * S`` after it."""
    if isinstance(prefix_blocks, bool) or not isinstance(prefix_blocks, int) \
            or prefix_blocks < 1:
        raise InvalidArgumentError(
            f"k (cluster.prefix_blocks) must be a whole number >= 1, got {prefix_blocks!r}")
    if index == 0:
        return min(prefix_blocks, n_blocks) - 1
    return index * segment_blocks


def plan_segments(keys: Sequence[bytes], segment_blocks: int, *,
                  chain: Sequence[bytes] | None = None,
                  prefix_blocks: int = DEFAULT_PREFIX_BLOCKS) -> list[ChainSegment]:
    """The segments of ``keys``, consecutive blocks of a chain, in chain order (start/
    stop index ``keys``). ``chain``: the chain's keys from its first block, when ``keys``
    do not start it (:func:`chain_offset`); ``prefix_blocks``: ``k`` of segment 0's anchor."""
    check_segment_blocks(segment_blocks)
    offset = chain_offset(keys, chain)
    n_chain = offset + len(keys)

    def key_at(position: int) -> bytes:  # offset <= len(chain): chain_offset
        return bytes(keys[position - offset] if position >= offset
                     else chain[position])  # type: ignore[index]

    out: list[ChainSegment] = []
    home = b""
    at = 0
    while at < len(keys):
        index = (offset + at) // segment_blocks
        stop = min(len(keys), (index + 1) * segment_blocks - offset)
        anchor = key_at(anchor_position(index, n_chain, segment_blocks, prefix_blocks))
        digest = segment_digest(anchor, index)
        if not home:
            home = digest if index == 0 else segment_digest(
                key_at(anchor_position(0, n_chain, segment_blocks, prefix_blocks)), 0)
        out.append(ChainSegment(index, at, stop, digest, home))
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
    segs = plan_segments(keys, segment_blocks)
    return [(device_for(s.digest, n_devices), s.start, s.stop) for s in segs]

