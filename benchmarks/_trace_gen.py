"""Generated heavy-tailed KV traces for the routing benchmark, next to the Mooncake one.

Deterministic (numpy ``default_rng(seed)``), one hour of requests, each the list of its
blocks' prefix ids as in the Mooncake trace; ids come from a counter, so they never
collide between prefixes.

- ``zipf-chains``: 3,000 prompts of Zipf lengths (``P(L) ~ L^-1.6``, 2 to 1,024 blocks:
  the top 5 % hold about three quarters of the blocks); a request re-reads one (Zipf
  popularity s = 0.8) and adds a new block. Whole-chain placement piles long ones up.
- ``shared-docs``: a shared system block, one of 1,000 documents (log-normal lengths,
  median 24 blocks, 2..400; Zipf s = 1.1), a unique 1-3 block question (RAG, review).
- ``agent-loops``: 250 sessions behind a 4-block tool prefix all share, a context of
  their own (log-normal, median 40, 4..600), then 1 + geometric (mean 12, at most 60)
  tool-loop turns seconds apart that re-read it all and append 1-3 blocks. A routing
  digest of the first ``k <= 4`` blocks does not tell the sessions apart.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from _trace import Trace, trace_of

HOUR_MS = 3_600_000


class _Ids:
    """Fresh block ids."""

    def __init__(self) -> None:
        self.next = 1

    def take(self, n: int) -> list[int]:
        self.next += n
        return list(range(self.next - n, self.next))


def _popular(rng: np.random.Generator, n: int, picks: int, s: float) -> np.ndarray:
    """``picks`` draws from ``n`` items of Zipf(``s``) popularity, ranks shuffled."""
    weights = (rng.permutation(n) + 1.0) ** -s
    return rng.choice(n, size=picks, p=weights / weights.sum())


def _times(rng: np.random.Generator, n: int) -> np.ndarray:
    return np.sort(rng.uniform(0, HOUR_MS, n)).astype(np.int64)


def zipf_chains(seed: int = 1) -> Trace:
    rng = np.random.default_rng(seed)
    ids = _Ids()
    n_prompts, n_requests = 3000, 6000
    lengths = np.minimum(1024, 1 + rng.zipf(1.6, n_prompts))
    prompts = [ids.take(int(n)) for n in lengths]
    picks = _popular(rng, n_prompts, n_requests, 0.8)
    rows = [(int(t), prompts[int(c)] + ids.take(1))
            for t, c in zip(_times(rng, n_requests), picks, strict=True)]
    return trace_of("zipf-chains", "Zipf prompt lengths (2..1,024 blocks), Zipf popularity "
                    "s = 0.8, one new block a request", rows)


def shared_docs(seed: int = 2) -> Trace:
    rng = np.random.default_rng(seed)
    ids = _Ids()
    system = ids.take(1)
    n_docs, n_requests = 1000, 8000
    lengths = np.clip(np.round(rng.lognormal(np.log(24), 1.0, n_docs)), 2, 400).astype(int)
    docs = [ids.take(int(n)) for n in lengths]
    picks = _popular(rng, n_docs, n_requests, 1.1)
    suffix = rng.integers(1, 4, n_requests)
    rows = [(int(t), system + docs[int(d)] + ids.take(int(q)))
            for t, d, q in zip(_times(rng, n_requests), picks, suffix, strict=True)]
    return trace_of("shared-docs", "a shared system block, one of 1,000 documents (median 24 "
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
    return trace_of("agent-loops", "250 sessions behind a shared 4-block tool prefix, a "
                    "context of their own (median 40 blocks), tool-loop turns that re-read "
                    "it all and append 1-3 blocks", rows)


GENERATORS: dict[str, Callable[[], Trace]] = {
    "zipf-chains": zipf_chains, "shared-docs": shared_docs, "agent-loops": agent_loops}
