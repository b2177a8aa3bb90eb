"""The KV pool behind an inference engine's paged KV cache, without the engine.

This is the logic of vLLM's v1 KV connector (``vllm_connector.py`` adapts vLLM's objects
to it) on plain values, so it is tested against real paged tensors without vLLM:

- scheduler side, ``PoolConnectorScheduler``: ``matched_tokens`` (how many prompt tokens
  beyond the engine's own prefix cache the pool can fill), ``allocated`` (the engine gave
  the request blocks for them), ``build_plan`` (per engine step: what the workers load
  and store) and ``finished``;
- worker side, ``PoolConnectorWorker``: ``register`` (layer name -> paged buffer, in model
  order), ``load`` (before the forward: pool -> paged buffers), ``save_layer`` (during
  the forward: gathers the layer's new tokens) and ``flush`` (after it: one ``put`` per
  request with every layer).

Transfers are synchronous: ``load`` returns with the KV in the buffers and ``flush``
with it in the pool, so the engine may reuse or free the blocks right after. Stored
requests: the full pool blocks of the prompt tokens computed by the end of a step, for
requests new in that step or resumed after a preemption (a prompt prefilled in several
chunks stores what its first chunk computed). A block that fails to load (evicted or
damaged meanwhile) is reported by ``load`` so the engine recomputes it.

Keys: a request's blocks are keyed by its tokens and its ``KVContext`` (LoRA adapter,
``cache_salt``, multimodal inputs). A request whose KV cannot be keyed (prompt
embeddings instead of token ids) matches 0 tokens and is never stored.

Resumed requests: a request preempted and scheduled again asks the pool again
(``matched_tokens``); what it is then granted is loaded in the step that resumes it,
exactly once, whether the engine reports it among the new requests (vLLM's V2 model
runner) or among the resumed cached ones (V1). A grant the engine does not schedule in
the step it was made stays pending until it is, or the request finishes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from isolane.errors import InvalidArgumentError
from isolane.kvpool.keys import KVContext
from isolane.kvpool.paged import (
    PagedLayout,
    detect_layout,
    gather_layer,
    plan_load,
    plan_save,
    scatter_layer,
    slot_mapping,
)

log = logging.getLogger(__name__)


class KVPoolLike(Protocol):
    chunk_tokens: int

    def put(self, token_ids: torch.Tensor, kv: torch.Tensor, *,
            context: KVContext | None = None) -> int: ...

    def get(self, token_ids: torch.Tensor, *, context: KVContext | None = None
            ) -> tuple[int, torch.Tensor | None]: ...

    def lookup(self, token_ids: torch.Tensor, *, context: KVContext | None = None) -> int: ...


@dataclass(frozen=True)
class LoadSpec:
    """Load tokens ``[start, stop)`` of ``token_ids`` from the pool into ``block_ids``."""

    req_id: str
    token_ids: torch.Tensor
    block_ids: tuple[int, ...]
    start: int
    stop: int
    context: KVContext | None = None


@dataclass(frozen=True)
class SaveSpec:
    """Store tokens ``[0, stop)`` of ``token_ids`` (whole pool blocks) from ``block_ids``."""

    req_id: str
    token_ids: torch.Tensor
    block_ids: tuple[int, ...]
    stop: int
    context: KVContext | None = None


@dataclass(frozen=True)
class ConnectorPlan:
    """What the workers do in one engine step (vLLM's connector metadata)."""

    loads: tuple[LoadSpec, ...] = ()
    saves: tuple[SaveSpec, ...] = ()


@dataclass(frozen=True)
class ScheduledRequest:
    """A request scheduled for the first time in a step, or resumed after a preemption
    (then ``block_ids`` are all its blocks), as the scheduler reports it. ``prompt_ids``
    None: the ones ``matched_tokens`` was given."""

    req_id: str
    prompt_ids: Sequence[int] | None
    block_ids: Sequence[int]
    computed_tokens: int  # already in the paged cache (engine prefix cache + pool load)
    scheduled_tokens: int  # computed in this step


@dataclass(frozen=True)
class _Asked:
    """What ``matched_tokens`` was told of a request, for the plans that follow."""

    token_ids: torch.Tensor
    context: KVContext | None
    keyable: bool
    computed: int
    external: int


def _ids(prompt_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(prompt_ids, dtype=torch.int64).flatten()


class PoolConnectorScheduler:
    """Scheduler side. Thread-compatible (the engine's scheduler calls it from one thread)."""

    def __init__(self, pool: KVPoolLike, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self._asked: dict[str, _Asked] = {}
        self._to_load: dict[str, int] = {}  # req -> external tokens with blocks allocated

    def matched_tokens(self, req_id: str, prompt_ids: Sequence[int] | torch.Tensor,
                       computed_tokens: int, context: KVContext | None = None,
                       keyable: bool = True) -> int:
        """Prompt tokens past ``computed_tokens`` the pool can fill (whole engine blocks,
        never the last prompt token); 0 for a request that cannot be keyed (its KV then
        is never stored either). Side-effect free for the pool; may be called again
        (a resumed request is asked again)."""
        ids = _ids(prompt_ids)
        external = 0
        if keyable:
            external = plan_load(ids.numel(), self.pool.lookup(ids, context=context),
                                 computed_tokens, self.block_size)
        self._asked[req_id] = _Asked(ids, context, keyable, computed_tokens, external)
        return external

    def allocated(self, req_id: str, external_tokens: int) -> None:
        """The engine allocated blocks for ``external_tokens`` pool tokens (0: none)."""
        if external_tokens > 0:
            self._to_load[req_id] = external_tokens

    def build_plan(self, scheduled: Sequence[ScheduledRequest]) -> ConnectorPlan:
        """Loads for the scheduled requests given pool tokens since the last plan (each
        grant is loaded once); saves of their full blocks computed by the end of this
        step. ``scheduled``: the step's new and resumed requests."""
        loads, saves = [], []
        for req in scheduled:
            asked = self._asked.get(req.req_id)
            if req.prompt_ids is not None:
                ids = _ids(req.prompt_ids)
            elif asked is not None:
                ids = asked.token_ids
            else:
                continue  # never asked about: nothing to load, no tokens to key a save
            context = asked.context if asked is not None else None
            external = self._to_load.pop(req.req_id, 0)
            if external:
                start = asked.computed if asked is not None else req.computed_tokens - external
                loads.append(LoadSpec(req.req_id, ids, tuple(req.block_ids), start,
                                      start + external, context))
            if asked is not None and not asked.keyable:
                continue
            done = min(ids.numel(), req.computed_tokens + req.scheduled_tokens)
            stop = plan_save(done, self.pool.lookup(ids[:done], context=context),
                             self.pool.chunk_tokens)
            if stop:
                saves.append(SaveSpec(req.req_id, ids, tuple(req.block_ids), stop, context))
        if self._to_load:
            log.warning("KV pool tokens granted to requests not scheduled in this step "
                        "(loaded when they are): %s", sorted(self._to_load))
        return ConnectorPlan(tuple(loads), tuple(saves))

    def finished(self, req_id: str) -> None:
        self._asked.pop(req_id, None)
        self._to_load.pop(req_id, None)


@dataclass
class _Gathered:
    spec: SaveSpec
    layers: dict[int, torch.Tensor] = field(default_factory=dict)


class PoolConnectorWorker:
    """Worker side: one per engine worker (tensor-parallel rank), owning no buffers."""

    def __init__(self, pool: KVPoolLike, layout: PagedLayout | None = None) -> None:
        self.pool = pool
        self.layout = layout
        self._layers: dict[str, tuple[int, torch.Tensor]] = {}
        self._gathered: dict[str, _Gathered] = {}
        self._lock = threading.Lock()

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Layer name -> paged buffer, in the model's layer order (the pool's layer axis)."""
        if not kv_caches:
            raise InvalidArgumentError("no KV cache layers to register")
        first = next(iter(kv_caches.values()))
        self.layout = self.layout or detect_layout(first)
        self._layers = {name: (i, t) for i, (name, t) in enumerate(kv_caches.items())}

    def load(self, plan: ConnectorPlan) -> set[int]:
        """Fill the planned tokens from the pool; returns the ids of the blocks that
        could not be loaded (the engine must recompute them)."""
        failed: set[int] = set()
        for spec in plan.loads:
            n, kv = self.pool.get(spec.token_ids[:spec.stop], context=spec.context)
            stop = min(n, spec.stop)
            if stop > spec.start and kv is not None:
                self._check_layers(kv)
                slots = slot_mapping(spec.block_ids, self._block_size, spec.start, stop)
                for index, buffer in self._layers.values():
                    scatter_layer(buffer, slots, kv[index, :, spec.start:stop], self._layout)
            if stop < spec.stop:  # evicted or damaged since the scheduler looked
                bs = self._block_size
                failed.update(spec.block_ids[p // bs]
                              for p in range(max(stop, spec.start), spec.stop))
        return failed

    def save_layer(self, layer_name: str, kv_layer: torch.Tensor, plan: ConnectorPlan) -> None:
        """Gather this layer's tokens of the planned saves (a copy, on the CPU)."""
        if not plan.saves:
            return
        index = self._layers[layer_name][0]
        with self._lock:
            for spec in plan.saves:
                slots = slot_mapping(spec.block_ids, self._block_size, 0, spec.stop)
                entry = self._gathered.setdefault(spec.req_id, _Gathered(spec))
                entry.layers[index] = gather_layer(kv_layer, slots, self._layout).cpu()

    def flush(self) -> int:
        """Store the gathered requests (every layer present); returns blocks stored."""
        with self._lock:
            gathered, self._gathered = self._gathered, {}
        stored = 0
        for entry in gathered.values():
            if len(entry.layers) != len(self._layers):
                log.warning("request %s: %d of %d layers gathered, not stored",
                            entry.spec.req_id, len(entry.layers), len(self._layers))
                continue
            kv = torch.stack([entry.layers[i] for i in range(len(self._layers))])
            stored += self.pool.put(entry.spec.token_ids[:entry.spec.stop], kv,
                                    context=entry.spec.context)
        return stored

    @property
    def _block_size(self) -> int:
        return int(next(iter(self._layers.values()))[1].shape[2])

    @property
    def _layout(self) -> PagedLayout:
        if self.layout is None:
            raise InvalidArgumentError("register the KV caches before loading or saving")
        return self.layout

    def _check_layers(self, kv: torch.Tensor) -> None:
        if kv.shape[0] != len(self._layers):
            raise InvalidArgumentError(
                f"the pool's KV has {kv.shape[0]} layers, the engine {len(self._layers)}: "
                "use one namespace per model and tensor-parallel layout")
