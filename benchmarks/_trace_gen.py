"""Generated heavy-tailed KV traces for the routing benchmark, next to the Mooncake one.

Each generator is deterministic (numpy ``default_rng(seed)``) and returns a ``Trace`` of
requests in timestamp order over one hour; a request is the list of its blocks' prefix
ids, as in the Mooncake trace (equal ids: the same prefix, so an id stands for one
block at one position after one prefix). Block ids are allocated from a counter, so
ids never collide between prefixes. The shapes:

- ``zipf-chains``: 3,000 prompts whose lengths follow a Zipf law (``P(L) ~ L^-1.6``,
  2 to 1,024 blocks: the top 5 % of the prompts hold about three quarters of the blocks); each
  request re-reads one prompt, picked with Zipf popularity (s = 0.8), and adds one new
  block (a new question). Long prompts are where whole-chain placement piles a lot of
  blocks on one node.
- ``shared-docs``: a shared system block, then one of 1,000 documents (lengths
  log-normal, median 24 blocks, clipped to 2..400; Zipf popularity s = 1.1), then a
  short unique suffix of 1 to 3 blocks: many short questions about long shared
  documents (RAG, code review).
- ``agent-loops``: 250 agent sessions starting at random times; a session has a
  4-block tool prefix shared by every session (a framework's system prompt and tool
  schemas), a context of its own (log-normal, median 40 blocks, clipped to 4..600),
  then tool-loop turns (1 + geometric, mean 12, at most 60) a few seconds apart: each
  turn re-reads the whole context and appends 1 to 3 blocks (a tool result and the
  model's next step). All sessions share their first 4 blocks, so a routing digest of
  the first ``k <= 4`` blocks does not tell them apart.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from _trace import Trace

HOUR_MS = 3_600_000


class _Ids:
    """Fresh block ids."""

    def __init__(self) -> None:
        self.next = 1

    def take(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def _finish(name: str, description: str, rows: list[tuple[int, list[int]]]) -> Trace:
    rows.sort(key=lambda r: r[0])
    requests = [ids for _, ids in rows]
    unique = len({h for ids in requests for h in ids})
    return Trace(requests, [t for t, _ in rows], sum(map(len, requests)), unique,
                 name=name, description=description)


def zipf_chains(seed: int = 1) -> Trace:
    rng = np.random.default_rng(seed)
    ids = _Ids()
    n_prompts, n_requests = 3000, 6000
    lengths = np.minimum(1024, 1 + rng.zipf(1.6, n_prompts))
    prompts = [ids.take(int(n)) for n in lengths]
    ranks = rng.permutation(n_prompts) + 1.0
    weights = ranks ** -0.8
    picks = rng.choice(n_prompts, size=n_requests, p=weights / weights.sum())
    times = np.sort(rng.uniform(0, HOUR_MS, n_requests)).astype(np.int64)
    rows = [(int(t), prompts[int(c)] + ids.take(1)) for t, c in zip(times, picks, strict=True)]
    return _finish("zipf-chains", "Zipf prompt lengths (2..1,024 blocks), Zipf popularity "
                   "s = 0.8, one new block a request", rows)


def shared_docs(seed: int = 2) -> Trace:
    rng = np.random.default_rng(seed)
    ids = _Ids()
    system = ids.take(1)
    n_docs, n_requests = 1000, 8000
    lengths = np.clip(np.round(rng.lognormal(np.log(24), 1.0, n_docs)), 2, 400).astype(int)
    docs = [ids.take(int(n)) for n in lengths]
    ranks = rng.permutation(n_docs) + 1.0
    weights = ranks ** -1.1
    picks = rng.choice(n_docs, size=n_requests, p=weights / weights.sum())
    suffix = rng.integers(1, 4, n_requests)
    times = np.sort(rng.uniform(0, HOUR_MS, n_requests)).astype(np.int64)
    rows = [(int(t), system + docs[int(d)] + ids.take(int(q)))
            for t, d, q in zip(times, picks, suffix, strict=True)]
    return _finish("shared-docs", "a shared system block, one of 1,000 documents (median 24 "
                   "blocks, Zipf s = 1.1), a unique 1-3 block question", rows)


def agent_loops(seed: int = 3) -> Trace:
    rng = np.random.default_rng(seed)
    ids = _Ids()
    tools = ids.take(4)
    rows: list[tuple[int, list[int]]] = []
    for _ in range(250):
        context = tools + ids.take(int(np.clip(round(rng.lognormal(np.log(40), 0.9)),
                                               4, 600)))
        turns = min(60, 1 + int(rng.geometric(1 / 12)))
        t = float(rng.uniform(0, HOUR_MS * 0.9))
        for _ in range(turns):
            rows.append((int(t), list(context)))
            context = context + ids.take(int(rng.integers(1, 4)))
            t += float(rng.exponential(4000.0))
    return _finish("agent-loops", "250 sessions behind a shared 4-block tool prefix, a "
                   "context of their own (median 40 blocks), tool-loop turns that re-read "
                   "it all and append 1-3 blocks", rows)


GENERATORS: dict[str, Callable[[], Trace]] = {
    "zipf-chains": zipf_chains, "shared-docs": shared_docs, "agent-loops": agent_loops}
