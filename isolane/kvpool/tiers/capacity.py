"""The KV pool's capacity tier: cold sealed segments on object storage (S3 via fsspec).

Demotion uploads a sealed segment file whole, then its index (the live keys and their
record locations at that moment, in the hint-file encoding of ``keydir.py``); only
then may the local copy go. Reads fetch byte ranges of the remote segment
(``cat_ranges``), coalesced like local reads, and check every record's checksum.

Remote layout, below ``<capacity URL>/kvpool/<namespace>/``::

    d<device>-seg-<id:08d>-<tag>.sealed   the segment file, byte for byte
    d<device>-seg-<id:08d>-<tag>.index    its live keys (hint encoding), written after it

A ``tiers.base.Tier`` (read side and deletes; filled by ``upload``, not block by block).
Thread-safe. Every method may raise ``StorageError`` when the server is unreachable;
the pool turns that into misses (reads) or a retry later (demotion).
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from isolane.kvpool.log.coalesce import coalesce_ranges
from isolane.kvpool.log.keydir import Location, SegmentShare, decode_hint, encode_hint
from isolane.kvpool.log.reader import verify_members
from isolane.kvpool.tiers.base import Block, Tier
from isolane.storage.base import BlobStore, ByteRange

SEGMENT_SUFFIX = ".sealed"
INDEX_SUFFIX = ".index"


@dataclass(frozen=True)
class RemoteSegment:
    name: str  # "d<device>-seg-<id:08d>"
    data_bytes: int


class CapacityTier(Tier):
    name = "capacity"

    def __init__(self, store: BlobStore, prefix: str) -> None:
        self.store = store
        self.prefix = prefix.rstrip("/")
        self._lock = threading.Lock()
        self._where: dict[bytes, tuple[RemoteSegment, Location]] = {}
        self._segments: dict[str, tuple[RemoteSegment, list[Location]]] = {}

    def _key(self, name: str, suffix: str) -> str:
        return f"{self.prefix}/{name}{suffix}"

    # -- index -------------------------------------------------------------------------------
    def load(self) -> int:
        """Read every remote index; returns the keys known remotely."""
        names = {n.removesuffix(INDEX_SUFFIX) for n in self.store.children(self.prefix)
                 if n.endswith(INDEX_SUFFIX)}
        for name in sorted(names):
            data_bytes = self.store.size(self._key(name, SEGMENT_SUFFIX))
            raw = self.store.read(self._key(name, INDEX_SUFFIX))
            share = decode_hint(raw, _segment_id(name), data_bytes)
            self._remember(RemoteSegment(name, data_bytes), share)
        return len(self._where)

    def _remember(self, segment: RemoteSegment, share: SegmentShare) -> None:
        locations = [Location.from_entry(k, e) for k, e in zip(share.keys, share.entries,
                                                               strict=True)]
        with self._lock:
            self._segments[segment.name] = (segment, locations)
            for loc in locations:
                self._where[loc.key] = (segment, loc)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._where

    def contains_many(self, keys: Sequence[bytes]) -> npt.NDArray[np.bool_]:
        with self._lock:
            where = self._where
            return np.fromiter((k in where for k in keys), bool, len(keys))

    def __len__(self) -> int:
        with self._lock:
            return len(self._where)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(seg.data_bytes for seg, _ in self._segments.values())

    # -- demotion ----------------------------------------------------------------------------
    def upload(self, device: int, segment_id: int, data: bytes,
               locations: Sequence[Location]) -> None:
        """Store one sealed segment and then its index (the commit of the upload)."""
        # A random tag: a reopened log may reuse the id of a segment demoted earlier.
        name = f"d{device}-seg-{segment_id:08d}-{secrets.token_hex(4)}"
        self.store.write(self._key(name, SEGMENT_SUFFIX), data)
        entries = [(segment_id, loc.record_offset, loc.value_offset, loc.value_length,
                    loc.record_end, loc.checksum, loc.timestamp_ns) for loc in locations]
        share = SegmentShare([loc.key for loc in locations], entries, [],
                             sum(loc.record_end - loc.record_offset for loc in locations))
        self.store.write_atomic(self._key(name, INDEX_SUFFIX),
                                encode_hint(segment_id, len(data), share))
        self._remember(RemoteSegment(name, len(data)), share)

    def delete_many(self, keys: Sequence[bytes]) -> list[bool]:
        held: list[bool] = self.contains_many(keys).tolist()
        if any(held):
            self.forget([k for k, h in zip(keys, held, strict=True) if h])
        return held

    def forget(self, keys: Sequence[bytes]) -> None:
        """Deleted keys: rewrite the index of every remote segment that holds one (a key
        promoted and demoted again can sit in several)."""
        gone = set(keys)
        with self._lock:
            for key in gone:
                self._where.pop(key, None)
            touched = {name: (segment, [loc for loc in locs if loc.key not in gone])
                       for name, (segment, locs) in self._segments.items()
                       if any(loc.key in gone for loc in locs)}
            self._segments.update(touched)
        for name, (segment, kept) in touched.items():
            if kept:
                entries = [(_segment_id(name), loc.record_offset, loc.value_offset,
                            loc.value_length, loc.record_end, loc.checksum,
                            loc.timestamp_ns) for loc in kept]
                share = SegmentShare([loc.key for loc in kept], entries, [],
                                     sum(loc.record_end - loc.record_offset for loc in kept))
                self.store.write_atomic(self._key(name, INDEX_SUFFIX),
                                        encode_hint(_segment_id(name), segment.data_bytes,
                                                    share))
            else:  # index first: a crash in between leaves an orphan file, not a live key
                self.store.delete(self._key(name, INDEX_SUFFIX))
                self.store.delete(self._key(name, SEGMENT_SUFFIX))
                with self._lock:
                    self._segments.pop(name, None)

    # -- reads -------------------------------------------------------------------------------
    def get_many(self, keys: Sequence[bytes]) -> list[Block | None]:
        return list(self.read(keys))

    def read(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Values of ``keys`` (None: not here, or damaged — a damaged key is forgotten)."""
        with self._lock:
            found = [self._where.get(k) for k in keys]
        out: list[bytes | None] = [None] * len(keys)
        by_segment: dict[str, list[int]] = {}
        for i, item in enumerate(found):
            if item is not None:
                by_segment.setdefault(item[0].name, []).append(i)
        requests: list[tuple[str, ByteRange]] = []
        plan = []
        for name, positions in by_segment.items():
            locations: list[Location | None] = [found[i][1] for i in positions]  # type: ignore[index]
            for rng in coalesce_ranges(locations):
                requests.append((self._key(name, SEGMENT_SUFFIX), ByteRange(rng.start, rng.end)))
                plan.append((positions, rng))
        runs = self.store.read_ranges(requests)
        damaged = []
        for (positions, rng), run in zip(plan, runs, strict=True):
            outcome = verify_members(memoryview(run), rng)
            for member_pos, value in outcome.values.items():
                out[positions[member_pos]] = bytes(value)
            members = dict(rng.members)
            damaged += [members[member_pos].key for member_pos, _ in outcome.damaged]
        if damaged:
            self.forget(damaged)
        return out


def _segment_id(name: str) -> int:
    return int(name.split("-")[2])
