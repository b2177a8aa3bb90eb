"""How ``KeyDirectory`` finds the row of a key: key words, the seeded slot hash and the
open-addressing table of row numbers, probed key by key or for a whole batch at once.

A key is stored in the directory's columns as two little-endian u64 words (``key_words``:
the key zero-padded to 16 bytes, or BLAKE2b-128 of a longer key) and its length. The
table maps slots to row numbers (-1: empty), with linear probing from the key's home
slot; its size is a power of two kept at a load factor of at most 0.7 (``table_size``).
The home slot is a 64-bit mix (splitmix64's finalizer) of both words, seeded per process
(``SlotHash.random``), so crafted keys cannot build long probe chains offline.

Pure functions over numpy arrays (``insert_many`` writes the table it is given); the
columns and the per-key bookkeeping are ``keytable.KeyDirectory``'s.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

__all__ = ["MIN_TABLE_SIZE", "SHORT_KEY_BYTES", "U64", "SlotHash", "Slots", "insert_many",
           "key_id", "key_words", "mix", "mix_np", "place_rows", "probe_many", "table_size"]

U64: TypeAlias = npt.NDArray[np.uint64]
Slots: TypeAlias = npt.NDArray[np.int32]
"""The table: one row number per slot, -1 when empty."""
SHORT_KEY_BYTES = 16
"""Keys up to this length are stored in the words themselves (block keys are 16)."""
MIN_TABLE_SIZE = 2048
_M64 = (1 << 64) - 1
_C1 = 0xBF58476D1CE4E5B9
_C2 = 0x94D049BB133111EB


def key_id(key: bytes) -> bytes:
    """The 16 bytes that stand for ``key`` in the columns: the key zero-padded, or
    BLAKE2b-128 of a key longer than 16 bytes."""
    if len(key) <= SHORT_KEY_BYTES:
        return key.ljust(SHORT_KEY_BYTES, b"\0")
    return hashlib.blake2b(key, digest_size=SHORT_KEY_BYTES).digest()


def key_words(keys: list[bytes]) -> tuple[U64, U64, npt.NDArray[np.uint16]]:
    """Keys as the directory's columns: two little-endian u64 of the (zero-padded, or
    for keys over 16 bytes BLAKE2b-128) key, and the lengths. One ``join`` and one
    ``frombuffer`` when every key is 16 bytes (block keys)."""
    n = len(keys)
    joined = b"".join(keys)
    if len(joined) == SHORT_KEY_BYTES * n:
        lens = np.fromiter(map(len, keys), np.uint16, n)
        if n == 0 or int(lens.min()) == SHORT_KEY_BYTES:
            words = np.frombuffer(joined, "<u8").reshape(n, 2)
            return (words[:, 0].astype(np.uint64), words[:, 1].astype(np.uint64),
                    np.full(n, SHORT_KEY_BYTES, np.uint16))
    raw = np.frombuffer(b"".join(map(key_id, keys)), "<u8").reshape(n, 2)
    return (raw[:, 0].astype(np.uint64), raw[:, 1].astype(np.uint64),
            np.fromiter(map(len, keys), np.uint16, n))


def mix(z: int) -> int:
    z = ((z ^ (z >> 30)) * _C1) & _M64
    z = ((z ^ (z >> 27)) * _C2) & _M64
    return z ^ (z >> 31)


def mix_np(z: U64, scratch: U64 | None = None) -> U64:
    """``mix`` of every element, in place (``z`` is overwritten and returned): one
    temporary instead of a fresh array per step (a reopen hashes every key at once),
    ``scratch`` (as long as ``z``) when given."""
    t = np.empty_like(z) if scratch is None else scratch
    for shift, mul in ((30, _C1), (27, _C2)):
        np.right_shift(z, np.uint64(shift), out=t)
        np.bitwise_xor(z, t, out=z)
        np.multiply(z, np.uint64(mul), out=z)
    np.right_shift(z, np.uint64(31), out=t)
    return np.bitwise_xor(z, t, out=z)


@dataclass(frozen=True, slots=True)
class SlotHash:
    """The seeded hash of a key's two words; ``& (table size - 1)`` is its home slot."""

    s0: int
    s1: int

    @classmethod
    def random(cls) -> SlotHash:
        return cls(secrets.randbits(64), secrets.randbits(64))

    def home(self, a: int, b: int) -> int:
        """The hash of one key's words ``a``, ``b``."""
        return mix(mix(a ^ self.s0) ^ b ^ self.s1)

    def many(self, k0: U64, k1: U64) -> U64:
        """The hashes of many keys' words at once (the same values as ``home``)."""
        z = k0 ^ np.uint64(self.s0)
        t = np.empty_like(z)  # one scratch for both rounds: fresh pages cost
        mix_np(z, t)
        z ^= k1
        z ^= np.uint64(self.s1)
        return mix_np(z, t)


def table_size(rows: int) -> int:
    """A power of two that keeps ``rows`` at a load factor of at most 0.7."""
    size = MIN_TABLE_SIZE
    while rows * 10 > size * 7:
        size *= 2
    return size


def probe_many(table: Slots, hashes: U64, k0: U64, k1: U64, klen: npt.NDArray[np.uint16],
               c0: U64, c1: U64, cl: npt.NDArray[np.uint16],
               ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Rows of many keys of <= 16 bytes (-1: none), probing all of them at once, and
    the slot each probe ended at (the key's, or the empty slot that proves it absent).
    ``k0``/``k1``/``klen``: the keys' words (``key_words``), ``hashes`` their
    ``SlotHash.many``; ``c0``/``c1``/``cl``: the directory's key columns by row."""
    out = np.full(len(hashes), -1, np.int64)
    mask = len(table) - 1
    slot = (hashes & np.uint64(mask)).astype(np.int64)
    todo = np.arange(len(hashes))
    while len(todo):
        row = table[slot[todo]]
        filled = row >= 0
        if not filled.all():
            todo, row = todo[filled], row[filled]
        near = np.flatnonzero(c0[row] == k0[todo])  # the first word rejects almost all
        if len(near):
            r, t = row[near], todo[near]
            ok = (c1[r] == k1[t]) & (cl[r] == klen[t])
            out[t[ok]] = r[ok]
            keep = np.ones(len(todo), bool)
            keep[near[ok]] = False
            todo = todo[keep]
        slot[todo] = (slot[todo] + 1) & mask
    return out, slot


def insert_many(table: Slots, hashes: U64, rows: npt.NDArray[np.int64],
                start: npt.NDArray[np.int64] | None = None) -> None:
    """Give each of ``rows`` (keys not in ``table``) a slot, all at once, probing from
    its home slot or from ``start`` (where a probe for it ended); writes ``table``.
    Each round works on the rows still unplaced only (no array as long as ``rows``: a
    reopen inserts ~450k rows a segment of small blocks, in tens of rounds)."""
    mask = len(table) - 1
    slot = (hashes & np.uint64(mask)).astype(np.int64) if start is None else start.copy()
    todo = np.arange(len(rows))
    while len(todo):
        free = table[slot] < 0
        cand, cs = todo[free], slot[free]
        want = rows[cand]
        # Rows that want the same free slot: the last write wins, the rest probe on.
        table[cs] = want
        lost = table[cs] != want
        todo = np.concatenate((todo[~free], cand[lost]))
        slot = (np.concatenate((slot[~free], cs[lost])) + 1) & mask


def place_rows(hashes: U64, k0: U64, k1: U64, klen: npt.NDArray[np.uint16], size: int,
               ) -> tuple[Slots, npt.NDArray[np.int64]]:
    """A table of ``size`` slots for rows ``0..n-1`` (keys of <= 16 bytes in log order,
    ``hashes`` their ``SlotHash.many``) built at once, as inserting them one by one with
    the last row of each key winning would: returns the table and the rows it left out
    (each an older row of a key a later row has), sorted. The table numbers the rows
    that are kept ``0..m-1`` (row ``i`` less the left-out rows before it).

    Without probing: a key and its copies share a home slot, so rounds that pick the
    newest row of every home slot (``np.maximum.at``) rank the rows of each slot and
    drop the copies of each round's pick (only slots of two rows or more take part);
    then a slot's rows start at
    ``max(slot, where the rows of the slots before it end)`` (a prefix maximum over the
    slot counts) and sit there by rank. Rows that would run past the last slot wrap
    around through ``insert_many``.

    Arrays as long as the table are fresh pages, which cost more than the work on them
    in a fresh process (a reopen): there are two, the table and the slot counts, and
    every step on the slots works in place in them (``_slot_starts``)."""
    n = len(hashes)
    home = np.empty(n, np.int32)  # int32: half the traffic
    np.bitwise_and(hashes, np.uint64(size - 1), out=home, casting="unsafe")
    table = pick = np.full(size, -1, np.int32)  # every pick is reset: ends all -1 again
    counts = np.bincount(home, minlength=size).astype(np.int32)
    todo = np.flatnonzero(counts[home] > 1).astype(np.int32)  # alone in its slot: rank 0
    at = home[todo]
    dropped: list[npt.NDArray[np.int32]] = []
    ranked: list[npt.NDArray[np.int32]] = []  # the rows of rank 1, 2, ...
    rank = 0
    while len(todo):
        np.maximum.at(pick, at, todo)
        newest = pick[at]
        pick[at] = -1
        won = newest == todo
        if rank:
            ranked.append(todo[won])
        lost, by = todo[~won], newest[~won]
        near = np.flatnonzero(k0[lost] == k0[by])  # the first word rejects almost all
        if len(near):
            ln, bn = lost[near], by[near]
            same = near[(k1[ln] == k1[bn]) & (klen[ln] == klen[bn])]
            if len(same):
                dropped.append(lost[same])
                lost = np.delete(lost, same)
        todo, at = lost, home[lost]
        rank += 1
    gone = np.sort(np.concatenate(dropped)).astype(np.int64) if dropped else np.zeros(
        0, np.int64)
    if len(gone):
        counts -= np.bincount(home[gone], minlength=size).astype(np.int32)
    _slot_starts(counts, table)
    pos = counts[home]
    del counts
    pos += home
    for r, rows_r in enumerate(ranked, 1):
        pos[rows_r] += r
    table.fill(-1)
    keep: npt.NDArray[np.bool_] | None = None
    if len(gone):
        keep = np.ones(n, bool)
        keep[gone] = False
        pos = pos[keep]
    wrapped = np.flatnonzero(pos >= size)  # a kept row's number is its index in pos
    if len(wrapped):
        stay = np.ones(len(pos), bool)
        stay[wrapped] = False
        table[pos[stay]] = np.flatnonzero(stay).astype(np.int32)
        old = wrapped if keep is None else np.flatnonzero(keep)[wrapped]
        insert_many(table, hashes[old], wrapped, pos[wrapped].astype(np.int64) - size)
    else:
        table[pos] = np.arange(len(pos), dtype=np.int32)
    return table, gone


def _slot_starts(counts: Slots, scratch: Slots) -> None:
    """``start[t] - t`` for every slot ``t``, written over ``counts`` (the rows whose
    home is ``t``): ``start[t]``, where the rows of slot ``t`` begin, is
    ``max(t, where the rows of the slots before it end)``; the caller adds ``t`` (each
    row's home slot). ``scratch``, as long, is overwritten. In place: with ``before[t]``
    the rows of the slots before ``t``, ``d[t] = t - before[t]`` is a running sum of
    ``1 - counts`` shifted by one slot, and ``start[t] - t`` is ``max(d[..t]) - d[t]``."""
    d = scratch
    np.subtract(1, counts, out=d)
    np.cumsum(d, out=d)  # sum of 1 - counts[u] for u <= t: t + 1 - before[t] - counts[t]
    d += counts
    d -= 1
    np.maximum.accumulate(d, out=counts)
    counts -= d


def group_sum(keys: npt.NDArray[Any],
              values: npt.NDArray[Any]) -> list[tuple[int, int, int]]:
    """(key, sum of values, count) per distinct key (the key directory's per-segment live
    bytes and counts of a batch)."""
    uniq, inv, counts = np.unique(keys, return_inverse=True, return_counts=True)
    sums = np.bincount(inv, weights=values.astype(np.float64), minlength=len(uniq))
    return [(int(u), int(s), int(c)) for u, s, c in zip(uniq, sums, counts, strict=True)]
