"""Reading a prompt's cached prefix from the nodes that hold its chain segments.

A prompt's blocks are cut into chain segments (``cluster.chain_segments``), each with
its read candidates in order (previous owners while a move is pending, then the owner).
``read_prefix`` asks each segment's first candidate for it: one request per node for
all of its segments, the nodes at once (one thread each). Where that prefix ends, the
segment is completed from its other candidates, each asked only for the blocks after
what the ones before it had, and the rest is read one run of consecutive segments on
one node after another. No I/O of its own: the requests go through ``leading``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from isolane.cluster.chain_segments import ChainSegment

Leading = Callable[[str, Sequence[bytes]], list[bytes]]
"""``leading(node, keys)``: the leading blocks of ``keys`` that ``node`` holds."""


def read_prefix(keys: Sequence[bytes], segs: Sequence[ChainSegment],
                cands: Sequence[list[str]], leading: Leading) -> list[bytes]:
    """The longest stored prefix of ``keys`` (see the module docstring); ``segs`` are the
    chain segments of ``keys`` and ``cands[i]`` the live nodes to read ``segs[i]`` from."""
    out: list[bytes] = []
    runs: list[tuple[int, int]] = []  # segments [i, j) with the same first candidate
    i = 0
    while i < len(segs) and cands[i]:
        j = i + 1
        while j < len(segs) and cands[j][:1] == cands[i][:1]:
            j += 1
        runs.append((i, j))
        i = j
    if len(runs) > 1:
        # One request per node for all of its runs, the nodes asked at once. A node
        # answers the leading stored blocks of its list: the prefix ends at the first
        # position that some node did not bring back.
        lists: dict[str, list[int]] = {}
        for i, j in runs:
            lists.setdefault(cands[i][0], []).extend(range(segs[i].start, segs[j - 1].stop))
        nodes = list(lists)
        fetched = leading_many(leading, [(n, [keys[p] for p in lists[n]]) for n in nodes])
        value: dict[int, bytes] = {}
        for node, got in zip(nodes, fetched, strict=True):
            value.update(zip(lists[node], got, strict=False))
        while len(out) in value:
            out.append(value[len(out)])
    i = next((m for m, seg in enumerate(segs) if len(out) < seg.stop), len(segs))
    asked = len(runs) > 1  # segment i's first candidate already answered short
    while i < len(segs) and cands[i]:
        if asked:
            asked, m = False, i
        else:
            node = cands[i][0]
            j = i + 1
            while j < len(segs) and cands[j][:1] == [node]:
                j += 1
            out += leading(node, keys[len(out):segs[j - 1].stop])
            if len(out) == segs[j - 1].stop:
                i = j
                continue
            m = next(m for m in range(i, j) if len(out) < segs[m].stop)
        for other in cands[m][1:]:
            out += leading(other, keys[len(out):segs[m].stop])
            if len(out) == segs[m].stop:
                break
        if len(out) < segs[m].stop:
            break
        i = m + 1
    return out


def leading_many(leading: Leading, jobs: Sequence[tuple[str, Sequence[bytes]]]
                 ) -> list[list[bytes]]:
    """``leading`` of each ``(node, keys)`` at once: one thread per job after the first,
    which runs in the calling thread (threads, not a pool: nothing to shut down, nothing
    to break in a forked child). The first failure is raised once all have ended."""
    results: list[list[bytes]] = [[] for _ in jobs]
    failures: list[BaseException] = []

    def run(k: int) -> None:
        try:
            results[k] = leading(*jobs[k])
        except BaseException as exc:  # re-raised in the caller below
            failures.append(exc)

    threads = [threading.Thread(target=run, args=(k,), name="isolane-kv-restore",
                                daemon=True) for k in range(1, len(jobs))]
    for thread in threads:
        thread.start()
    run(0)
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]
    return results
