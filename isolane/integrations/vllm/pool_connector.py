"""The KV pool behind an inference engine's paged KV cache, without the engine.

This is the logic of vLLM's v1 KV connector (``connector.py`` adapts vLLM's objects
to it) on plain values, so it is tested against real paged tensors without vLLM:

- scheduler side, ``PoolConnectorScheduler``: ``matched_tokens`` (how many prompt tokens
  beyond the engine's own prefix cache the pool can fill), ``allocated`` (the engine gave
  the request blocks for them), ``build_plan`` (per engine step: what the workers load
  and store) and ``finished``;
- worker side, ``PoolConnectorWorker``: ``register`` (layer name -> paged buffer, in model
  order), ``load`` (before the forward: pool -> paged buffers), ``save_layer`` (during
  the forward: gathers the layer's new tokens) and ``flush`` (after it: one ``put`` per
  request with every layer).

Transfers are synchronous here unless asked otherwise: ``load`` returns with the KV in
the buffers and ``flush`` with it in the pool, so the engine may reuse or free the
blocks right after. With ``async_load``/``async_save`` (the vLLM adapter's defaults)
they run on one background thread (``transfers.py``) instead, off the engine's step:

- an asynchronous grant (``loads_async``) is loaded while the engine holds the request
  back (vLLM: ``WAITING_FOR_REMOTE_KVS``): the plan of the step that allocated its
  blocks carries a background ``LoadSpec``, ``start_background`` queues it, and
  ``finished`` reports the request (and any block it could not fill) once it ran. A
  request dropped before its load ran is skipped and reported all the same: the engine
  holds its blocks until then;
- a background save gathers the request's blocks on that thread, so the blocks must
  stay put until it ran: a finished request with saves planned is held (``finished``
  returns True, vLLM's ``delay_free_blocks``) and listed in the next plan's
  ``release``; the worker reports it (``finished``) once its saves ran. A preempted
  request's blocks go back to the engine at once, so the worker waits for its saves
  before the next forward (``handle_preemptions``, the plan's ``preempted``);
- a step whose load of a request failed (synchronous or not) stores nothing of that
  request: its slots there are not the request's KV.

Stored
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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from isolane.errors import InvalidArgumentError
from isolane.integrations.vllm.paged import (
    PagedLayout,
    check_mla_buffer,
    detect_layout,
    gather_layer,
    plan_load,
    plan_save,
    scatter_layer,
    slot_mapping,
)
from isolane.integrations.vllm.transfers import Transfers
from isolane.kvpool.api import KVPoolAPI
from isolane.kvpool.keys import KVContext

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.005  # an idle engine step waits this long at most for a transfer


@dataclass(frozen=True)
class LoadSpec:
    """Load tokens ``[start, stop)`` of ``token_ids`` from the pool into ``block_ids``."""

    req_id: str
    token_ids: torch.Tensor
    block_ids: tuple[int, ...]
    start: int
    stop: int
    context: KVContext | None = None
    background: bool = False  # loaded off the step while the engine holds the request


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
    preempted: tuple[str, ...] = ()  # wait for their saves before the forward
    release: tuple[str, ...] = ()  # finished, blocks held: report once their saves ran
    dropped: tuple[str, ...] = ()  # background loads cancelled before reaching the worker
    background_saves: bool = False
    idle: bool = False  # the engine computes nothing in this step


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

    def __init__(self, pool: KVPoolAPI, block_size: int, *, async_load: bool = False,
                 async_save: bool = False) -> None:
        self.pool = pool
        self.block_size = block_size
        self.async_load = async_load
        self.async_save = async_save
        self._asked: dict[str, _Asked] = {}
        self._to_load: dict[str, int] = {}  # req -> external tokens with blocks allocated
        self._background: dict[str, tuple[int, tuple[int, ...]]] = {}  # async, unplanned
        self._loading: set[str] = set()  # background loads planned, not reported done
        self._saving: set[str] = set()  # background saves planned (since admission)
        self._held: set[str] = set()  # finished, blocks held until their saves ran
        self._release: list[str] = []  # for the next plan
        self._dropped: list[str] = []

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

    def loads_async(self, external_tokens: int) -> bool:
        """Whether a grant of ``external_tokens`` is loaded in the background."""
        return self.async_load and external_tokens > 0

    def allocated(self, req_id: str, external_tokens: int,
                  block_ids: Sequence[int] = ()) -> None:
        """The engine allocated blocks for ``external_tokens`` pool tokens (0: none);
        ``block_ids``: the request's blocks (needed for a background load, which runs
        before the engine schedules the request)."""
        if external_tokens <= 0:
            return
        if self.loads_async(external_tokens):
            self._background[req_id] = (external_tokens, tuple(block_ids))
        else:
            self._to_load[req_id] = external_tokens

    def build_plan(self, scheduled: Sequence[ScheduledRequest],
                   preempted: Sequence[str] = (), idle: bool = False) -> ConnectorPlan:
        """Loads for the scheduled requests given pool tokens since the last plan (each
        grant is loaded once) and the background loads allocated since; saves of the
        scheduled requests' full blocks computed by the end of this step.
        ``scheduled``: the step's new and resumed requests; ``preempted``: the requests
        preempted since the last plan; ``idle``: the step computes no token."""
        loads, saves = [], []
        for req_id, (external, block_ids) in self._background.items():
            asked = self._asked.get(req_id)
            if asked is None:
                continue  # never asked about (finished() drops both together)
            loads.append(LoadSpec(req_id, asked.token_ids, block_ids, asked.computed,
                                  asked.computed + external, asked.context, background=True))
            self._loading.add(req_id)
        self._background.clear()
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
                if self.async_save:
                    self._saving.add(req.req_id)
        if self._to_load:
            log.warning("KV pool tokens granted to requests not scheduled in this step "
                        "(loaded when they are): %s", sorted(self._to_load))
        plan = ConnectorPlan(tuple(loads), tuple(saves), tuple(preempted),
                             tuple(self._release), tuple(self._dropped), self.async_save,
                             idle)
        self._release, self._dropped = [], []
        return plan

    def finished(self, req_id: str, has_blocks: bool = True) -> bool:
        """The request finished (or was aborted); True: keep its blocks until the
        worker reports its saves done (``transfers_done``). ``has_blocks``: False when
        the engine already took them back (a preempted request dropped while waiting)."""
        self._asked.pop(req_id, None)
        self._to_load.pop(req_id, None)
        saving = req_id in self._saving
        self._saving.discard(req_id)
        if self._background.pop(req_id, None) is not None:
            # the engine waits for this load to be reported: tell the worker to
            self._dropped.append(req_id)
            return False
        if req_id in self._loading:
            return False  # the engine holds the blocks until the load is reported
        if saving and has_blocks:
            self._held.add(req_id)
            self._release.append(req_id)
            return True
        return False

    def transfers_done(self, saved: Iterable[str], loaded: Iterable[str]) -> None:
        """The workers' report: requests released after their saves, loads finished."""
        self._held.difference_update(saved)
        self._loading.difference_update(loaded)

    def holds_blocks(self) -> bool:
        """Whether finished requests' blocks are held for saves still running (they come
        back to the engine soon: better than preempting a running request)."""
        return bool(self._held)


@dataclass
class _Gathered:
    spec: SaveSpec
    layers: dict[int, torch.Tensor] = field(default_factory=dict)


class PoolConnectorWorker:
    """Worker side: one per engine worker (tensor-parallel rank), owning no buffers.

    Per step, in the engine's order: ``handle_preemptions``, ``load`` (synchronous
    loads), the forward with ``save_layer`` per layer, ``start_background`` (background
    loads, which may start after the forward), ``flush`` or ``save_background``, then
    ``finished``."""

    def __init__(self, pool: KVPoolAPI, layout: PagedLayout | None = None, *,
                 stores: bool = True) -> None:
        """``stores`` False: this rank loads but never stores (MLA's latent is the same
        on every tensor-parallel rank: one rank's copy serves them all)."""
        self.pool = pool
        self.layout = layout
        self.stores = stores
        self._layers: dict[str, tuple[int, torch.Tensor]] = {}
        self._gathered: dict[str, _Gathered] = {}
        self._lock = threading.Lock()
        self._failed_now: set[str] = set()  # requests whose load failed in this step
        self._release: set[str] = set()  # held by the scheduler until their saves ran
        self._transfers: Transfers | None = None

    @property
    def transfers(self) -> Transfers:
        """The background transfers (started on first use)."""
        if self._transfers is None:
            self._transfers = Transfers()
        return self._transfers

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Layer name -> paged buffer, in the model's layer order (the pool's layer axis)."""
        if not kv_caches:
            raise InvalidArgumentError("no KV cache layers to register")
        first = next(iter(kv_caches.values()))
        self.layout = self.layout or detect_layout(first)
        if self.layout == "mla":
            for buffer in kv_caches.values():
                check_mla_buffer(buffer)
        self._layers = {name: (i, t) for i, (name, t) in enumerate(kv_caches.items())}

    def handle_preemptions(self, plan: ConnectorPlan) -> None:
        """Before the forward: the preempted requests' blocks are the engine's again
        (another request may write them in this forward), so their saves must have run."""
        if plan.preempted and self._transfers is not None:
            self._transfers.wait_saves(plan.preempted)

    def load(self, plan: ConnectorPlan) -> set[int]:
        """Fill the planned synchronous loads from the pool; returns the ids of the
        blocks that could not be loaded (the engine must recompute them). Starts the
        step: call it every step, before the forward."""
        failed: set[int] = set()
        self._failed_now = set()
        for spec in plan.loads:
            if spec.background:
                continue
            bad = self._load_one(spec)
            if bad:
                failed |= bad
                self._failed_now.add(spec.req_id)
        return failed

    def start_background(self, plan: ConnectorPlan) -> None:
        """Queue the plan's background loads; take note of what it releases."""
        self._release.update(plan.release)
        transfers = self.transfers if (plan.dropped or any(
            s.background for s in plan.loads)) else None
        if transfers is None:
            return
        for req_id in plan.dropped:
            transfers.report_loaded(req_id)
        for spec in plan.loads:
            if spec.background:
                blocks = spec.block_ids[spec.start // self._block_size:
                                        -(-spec.stop // self._block_size)]
                transfers.submit_load(spec.req_id, partial(self._load_one, spec), blocks)

    def _load_one(self, spec: LoadSpec) -> set[int]:
        """Load one spec; the blocks it could not fill."""
        ct = self.pool.chunk_tokens  # the pool returns whole blocks: ask for the one
        n, kv = self.pool.get(spec.token_ids[:-(-spec.stop // ct) * ct],  # holding stop
                              context=spec.context)
        stop = min(n, spec.stop)
        if stop > spec.start and kv is not None:
            self._check_layers(kv)
            slots = slot_mapping(spec.block_ids, self._block_size, spec.start, stop)
            for index, buffer in self._layers.values():
                scatter_layer(buffer, slots, kv[index, :, spec.start:stop], self._layout)
                _device_sync(buffer)
        if stop >= spec.stop:
            return set()
        bs = self._block_size  # evicted or damaged since the scheduler looked
        return {spec.block_ids[p // bs] for p in range(max(stop, spec.start), spec.stop)}

    def save_layer(self, layer_name: str, kv_layer: torch.Tensor, plan: ConnectorPlan) -> None:
        """Gather this layer's tokens of the planned saves (a copy, on the CPU); with
        background saves, nothing (the background thread gathers every layer)."""
        if not plan.saves or plan.background_saves or not self.stores:
            return
        index = self._layers[layer_name][0]
        with self._lock:
            for spec in plan.saves:
                if spec.req_id in self._failed_now:
                    continue
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

    def save_background(self, plan: ConnectorPlan) -> None:
        """After the forward: queue the plan's saves (gathered and stored on the
        background thread; the scheduler keeps the blocks until ``finished`` reports the
        request)."""
        if not plan.saves or not self.stores:
            return
        first = next(iter(self._layers.values()))[1]
        event = _device_event(first)
        for spec in plan.saves:
            if spec.req_id not in self._failed_now:
                self.transfers.submit_save(spec.req_id, partial(self._store_one, spec, event))

    def _store_one(self, spec: SaveSpec, event: Any) -> None:
        if event is not None:
            event.synchronize()  # the forward that wrote these slots is done
        slots = slot_mapping(spec.block_ids, self._block_size, 0, spec.stop)
        kv = torch.stack([gather_layer(buffer, slots, self._layout).cpu()
                          for _, buffer in self._layers.values()])  # in layer order
        self.pool.put(spec.token_ids[:spec.stop], kv, context=spec.context)

    def finished(self, finished_req_ids: Iterable[str] = (), idle: bool = False
                 ) -> tuple[set[str], set[str], set[int]]:
        """``(saved, loaded, failed_blocks)``: the released requests whose saves ran
        (their blocks may go back), the requests whose background loads ran (or were
        skipped: ``finished_req_ids`` are dropped from the queue), and the blocks those
        loads could not fill. ``idle``: the step computed nothing (the engine waits for
        these transfers); then wait up to ``IDLE_WAIT_S`` for one of them to finish."""
        if self._transfers is None:
            saved, self._release = self._release, set()
            return saved, set(), set()
        transfers = self._transfers
        transfers.drop_loads(finished_req_ids)
        if idle:
            transfers.wait_any(IDLE_WAIT_S)
        loaded, failed = transfers.take_loaded()
        saved = {r for r in self._release if not transfers.saves_pending(r)}
        self._release -= saved
        return saved, loaded, failed

    def close(self) -> None:
        """Finish the queued transfers and stop the background thread."""
        if self._transfers is not None:
            self._transfers.close()

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


def _device_event(buffer: torch.Tensor) -> Any:
    """An event after the work queued so far on a GPU buffer's stream (None on the CPU,
    where the forward is done when it returns)."""
    if not buffer.is_cuda:
        return None
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record()
    return event


def _device_sync(buffer: torch.Tensor) -> None:
    """Wait for this thread's copies into a GPU buffer (nothing to wait for on the CPU)."""
    if buffer.is_cuda:
        torch.cuda.current_stream(buffer.device).synchronize()
