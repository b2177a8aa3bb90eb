"""vLLM v1 KV connector backed by an isolane KV pool (imports vLLM; see ``pool_connector.py``).

Enable it with vLLM's KV transfer config (docs/INTEGRATIONS.md has the full command)::

    --kv-transfer-config '{"kv_connector": "IsolaneConnectorV1",
      "kv_connector_module_path": "isolane.integrations.vllm.connector",
      "kv_role": "kv_both",
      "kv_connector_extra_config": {"isolane_pool": "/mnt/nvme2/kv",
                                    "isolane_namespace": "llama-3.1-8b-bf16",
                                    "isolane_chunk_tokens": 256}}'

``isolane_pool`` is a folder or a config file (the embedded ``KVPool``), or storage node
URLs, comma-separated (``RemoteKVPool``; token from ``ISOLANE_TOKEN``); ``isolane_layout``
(``packed``/``flashinfer``/``flash``) overrides the paged layout detected from the
buffers' shapes. This class only translates vLLM's objects (``Request``,
``SchedulerOutput``, the paged ``kv_caches``) into ``PoolConnectorScheduler``/
``PoolConnectorWorker`` calls, where the logic lives.

vLLM creates one connector for the scheduler and one per worker. With the embedded pool
they must share a process (one GPU: vLLM's in-process executor), so both roles use one
``KVPool`` instance per folder and namespace, kept here: a second instance would not see
the blocks the first stores. Several worker processes (tensor or pipeline parallelism)
need a pool every process reaches: storage node URLs.

Transfers: ``isolane_async_load`` and ``isolane_async_save`` (both on by default, like
vLLM's own offloading connector) move loads and saves to a background thread
(``pool_connector.py`` has the protocol): ``get_num_new_matched_tokens`` returns
``(n, True)`` and vLLM parks the request in ``WAITING_FOR_REMOTE_KVS`` until
``get_finished`` reports it loaded; saves are gathered and stored on that thread, and
``request_finished`` returns ``delay_free_blocks=True`` for a request with saves
planned, until ``get_finished`` reports it sent. Off, both run inside the step
(``start_load_kv`` and ``wait_for_save`` return with the transfer done).

Keys: a request's ``KVContext`` holds what vLLM's own prefix hash covers besides the
tokens (the LoRA adapter's name and path, ``cache_salt``, each multimodal item's hash,
position and length); prompt embeddings cannot be keyed: such requests match 0 tokens
and are not stored. The pipeline-parallel stage joins the namespace
(``<namespace>@pp<rank>of<size>`` when there are several). Models with more than one
KV cache group (hybrid: Mamba/linear attention next to attention, or sliding-window
groups under the hybrid allocator) are refused at start, naming the groups: the
connector does not declare ``SupportsHMA``. MLA models (``MLAAttentionSpec``: one latent
a token, the same on every tensor-parallel rank) are stored once: keyed as TP rank 0 of
1 and written by rank 0 only; every rank loads it.

Tested against the real ``vllm`` package (``tests/integrations/test_vllm_real.py``):
written for vLLM 0.26+ (rank-4 packed buffers, ``__init__(vllm_config, role,
kv_cache_config)``), checked in CI with vLLM 0.33.0; the 5-D buffers of 0.22-0.25 are
still understood.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch

from isolane.config import is_node_target
from isolane.errors import InvalidArgumentError, InvalidNameError, MissingDependencyError
from isolane.integrations.vllm.paged import LAYOUTS, SUPPORTED, PagedLayout
from isolane.integrations.vllm.pool_connector import (
    ConnectorPlan,
    PoolConnectorScheduler,
    PoolConnectorWorker,
    ScheduledRequest,
)
from isolane.kvpool.api import KVPoolAPI
from isolane.kvpool.keys import KVContext
from isolane.kvpool.namespaces import check_namespace
from isolane.opening import open_kv_pool

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )
except ImportError as exc:  # the adapter is useless without vLLM: say how to get it
    raise MissingDependencyError("vllm", "isolane.integrations.vllm.connector") from exc

_pools: dict[tuple[str, str, int, int, int], KVPoolAPI] = {}  # see the module docstring
_pools_lock = threading.Lock()


def _stage(namespace: str, pp_rank: int, pp_size: int) -> str:
    """The namespace of one pipeline-parallel stage (its layers only)."""
    return namespace if pp_size == 1 else f"{namespace}@pp{pp_rank}of{pp_size}"


def shared_pool(path: str, namespace: str, chunk_tokens: int, tp_rank: int, tp_size: int
                ) -> KVPoolAPI:
    """The process's pool for these values: ``isolane.open_kv_pool(path)`` — a
    ``RemoteKVPool`` for node URLs (comma-separated), else the embedded pool on the
    folder or config file."""
    key = (path if is_node_target(path) else os.path.realpath(path), namespace,
           chunk_tokens, tp_rank, tp_size)
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None:
            pool = open_kv_pool(path, namespace=namespace, chunk_tokens=chunk_tokens,
                                tp_rank=tp_rank, tp_size=tp_size)
            _pools[key] = pool
        return pool


def close_shared_pools() -> None:
    """Close and forget the process's pools (an engine shutting down, or a test making a
    fresh engine in the same process)."""
    with _pools_lock:
        pools = list(_pools.values())
        _pools.clear()
    for pool in pools:
        close = getattr(pool, "close", None)
        if callable(close):
            close()


class IsolanePlan(KVConnectorMetadata):  # type: ignore[misc,unused-ignore]
    """The per-step plan, as vLLM's connector metadata."""

    def __init__(self, plan: ConnectorPlan) -> None:
        self.plan = plan


def request_context(request: Any) -> tuple[KVContext | None, bool]:
    """``(context, keyable)`` of a vLLM ``Request``: what its KV depends on besides the
    token ids, and whether it can be keyed at all (prompt embeddings cannot)."""
    if getattr(request, "prompt_embeds", None) is not None or request.prompt_token_ids is None:
        return None, False
    lora = getattr(request, "lora_request", None)
    items = []
    for feature in getattr(request, "mm_features", None) or ():
        identifier = getattr(feature, "identifier", None)
        if identifier is None:
            return None, False  # an input vLLM itself could not hash
        position = feature.mm_position
        items.append((str(identifier), int(position.offset), int(position.length)))
    context = KVContext(lora_name=lora.lora_name if lora else None,
                        lora_path=(lora.lora_path or "") if lora else None,
                        cache_salt=getattr(request, "cache_salt", None) or None,
                        mm_items=tuple(items))
    return (context or None), True


STORED_SPECS = ("FullAttentionSpec", "MLAAttentionSpec")
"""The KV cache specs the connector stores (exact classes: a subclass such as sliding
window or chunked local attention keeps only some blocks of a request)."""


def _describe_group(index: int, group: Any) -> str:
    names = list(getattr(group, "layer_names", None) or ())
    first = f", e.g. {names[0]}" if names else ""
    return f"group {index}: {type(group.kv_cache_spec).__name__} ({len(names)} layers{first})"


def attention_kind(kv_cache_config: Any) -> str:
    """``"mla"`` or ``"full"``: the one KV cache group the connector stores, or an error
    naming the groups it cannot (raised when the engine makes its connectors, before
    any request: never wrong KV, never a late failure)."""
    if kv_cache_config is None:
        return "full"
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    kinds = [type(g.kv_cache_spec).__name__ for g in groups]
    if len(groups) == 1 and kinds[0] in STORED_SPECS:
        return "mla" if kinds[0] == "MLAAttentionSpec" else "full"
    described = "; ".join(_describe_group(i, g) for i, g in enumerate(groups))
    raise InvalidArgumentError(
        f"IsolaneConnectorV1 stores one KV cache group of full attention or MLA; this "
        f"model has {len(groups)}: {described}. Sliding-window layers are stored once "
        "vLLM's hybrid allocator is off (--disable-hybrid-kv-cache-manager: they become "
        "full-attention layers); Mamba/linear-attention state cannot be stored: serve "
        "such a model without the connector")


def _flag(extra: Any, key: str, default: bool) -> bool:
    value = extra.get_from_extra_config(key, default)
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"kv_connector_extra_config {key!r} must be true or "
                                   f"false (JSON), got {value!r}")
    return value


class IsolaneConnectorV1(KVConnectorBase_V1):  # type: ignore[misc,unused-ignore]
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        kind = attention_kind(kv_cache_config)
        extra = vllm_config.kv_transfer_config
        path = extra.get_from_extra_config("isolane_pool", None)
        if not path or not isinstance(path, str):
            raise InvalidArgumentError("kv_connector_extra_config needs 'isolane_pool': the "
                                       "KV pool's folder or config file, or node URLs")
        model = vllm_config.model_config
        namespace = extra.get_from_extra_config("isolane_namespace", None) or \
            f"{model.model}-{str(model.dtype).removeprefix('torch.')}".lstrip("/")
        try:
            check_namespace(namespace)
        except InvalidNameError as exc:
            raise InvalidNameError(f"kv_connector_extra_config 'isolane_namespace' (default: "
                                   f"'<model>-<dtype>'): {exc}") from None
        try:
            chunk_tokens = int(extra.get_from_extra_config("isolane_chunk_tokens", 256))
        except (TypeError, ValueError):
            raise InvalidArgumentError("kv_connector_extra_config 'isolane_chunk_tokens' "
                                       "must be a whole number, e.g. 256") from None
        async_load = _flag(extra, "isolane_async_load", True)
        async_save = _flag(extra, "isolane_async_save", True)
        layout = extra.get_from_extra_config("isolane_layout", None)
        if layout is not None and layout not in LAYOUTS:
            raise InvalidArgumentError(f"isolane_layout must be one of {LAYOUTS}, got "
                                       f"{layout!r}; supported: {SUPPORTED}")
        if (layout == "mla") != (kind == "mla") and layout is not None:
            raise InvalidArgumentError(
                f"isolane_layout {layout!r} does not fit this model's KV cache "
                f"({'MLA' if kind == 'mla' else 'full attention'}); leave it out")
        if kind == "mla":
            layout = "mla"
        parallel = vllm_config.parallel_config
        tp_size = int(parallel.tensor_parallel_size)
        pp_size = int(getattr(parallel, "pipeline_parallel_size", 1) or 1)
        block_size = int(vllm_config.cache_config.block_size)
        # MLA's latent is the same on every tensor-parallel rank: one copy, keyed as
        # rank 0 of 1 (so a TP 2 engine and a TP 8 one share it), stored by rank 0
        key_size = 1 if kind == "mla" else tp_size
        if role == KVConnectorRole.SCHEDULER:
            # all ranks store the same tokens: rank 0's keys answer for the request
            pool = shared_pool(path, _stage(namespace, 0, pp_size), chunk_tokens, 0,
                               key_size)
            self._scheduler: PoolConnectorScheduler | None = PoolConnectorScheduler(
                pool, block_size, async_load=async_load, async_save=async_save)
            self._worker: PoolConnectorWorker | None = None
        else:
            from vllm.distributed.parallel_state import (
                get_pp_group,
                get_tensor_model_parallel_rank,
            )

            pp_rank = get_pp_group().rank_in_group if pp_size > 1 else 0
            tp_rank = get_tensor_model_parallel_rank()
            pool = shared_pool(path, _stage(namespace, pp_rank, pp_size), chunk_tokens,
                               0 if kind == "mla" else tp_rank, key_size)
            self._scheduler = None
            self._worker = PoolConnectorWorker(pool, layout,
                                               stores=kind != "mla" or tp_rank == 0)
        self._load_errors: set[int] = set()

    @property
    def requires_kv_delivery(self) -> bool:
        """A cache, not a hand-off: a save dropped by a preemption is a later miss."""
        return False

    # -- worker side ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._require_worker().register(kv_caches)

    def _plan(self) -> ConnectorPlan:
        meta = self._get_connector_metadata()
        if not isinstance(meta, IsolanePlan):
            raise InvalidArgumentError(f"unexpected connector metadata {type(meta).__name__}")
        return meta.plan

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        if isinstance(kv_connector_metadata, IsolanePlan):
            self._require_worker().handle_preemptions(kv_connector_metadata.plan)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        worker, plan = self._require_worker(), self._plan()
        self._load_errors |= worker.load(plan)  # synchronous loads, before the forward
        worker.start_background(plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # synchronous loads are done; background ones are not this step's

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        self._require_worker().save_layer(layer_name, kv_layer, self._plan())

    def wait_for_save(self) -> None:
        worker, plan = self._require_worker(), self._plan()
        if plan.background_saves:
            worker.save_background(plan)
        else:
            worker.flush()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        idle = self.has_connector_metadata() and self._plan().idle
        saved, loaded, failed = self._require_worker().finished(finished_req_ids, idle)
        self._load_errors |= failed  # reported in the same pass as the requests
        return saved or None, loaded or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()

    # -- scheduler side ------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        context, keyable = request_context(request)
        scheduler = self._require_scheduler()
        n = scheduler.matched_tokens(
            request.request_id, list(request.prompt_token_ids or []), num_computed_tokens,
            context, keyable)
        return n, scheduler.loads_async(n)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int
                                 ) -> None:
        block_ids = blocks.get_block_ids()[0] if num_external_tokens > 0 else ()
        self._require_scheduler().allocated(request.request_id, num_external_tokens,
                                            list(block_ids))

    def build_connector_meta(self, scheduler_output: Any) -> IsolanePlan:
        tokens = scheduler_output.num_scheduled_tokens
        # new requests; with the V2 model runner, resumed ones are among them too
        scheduled = [ScheduledRequest(
            req.req_id, list(req.prompt_token_ids or []), list(req.block_ids[0]),
            int(req.num_computed_tokens), int(tokens.get(req.req_id, 0)))
            for req in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs  # V1: resumed ones are here
        resumed = getattr(cached, "resumed_req_ids", None) or ()
        for i, req_id in enumerate(cached.req_ids):
            block_ids = cached.new_block_ids[i]
            if req_id in resumed and block_ids is not None:
                scheduled.append(ScheduledRequest(
                    req_id, None, list(block_ids[0]), int(cached.num_computed_tokens[i]),
                    int(tokens.get(req_id, 0))))
        preempted = sorted(getattr(scheduler_output, "preempted_req_ids", None) or ())
        idle = not scheduler_output.total_num_scheduled_tokens
        return IsolanePlan(self._require_scheduler().build_plan(scheduled, preempted, idle))

    def update_connector_output(self, connector_output: Any) -> None:
        self._require_scheduler().transfers_done(connector_output.finished_sending or (),
                                                 connector_output.finished_recving or ())

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        return self._require_scheduler().finished(request.request_id, bool(block_ids)), None

    def has_pending_block_frees(self) -> bool:
        return self._scheduler is not None and self._scheduler.holds_blocks()

    def _require_worker(self) -> PoolConnectorWorker:
        if self._worker is None:
            raise InvalidArgumentError("a worker-side method was called on the scheduler's "
                                       "connector")
        return self._worker

    def _require_scheduler(self) -> PoolConnectorScheduler:
        if self._scheduler is None:
            raise InvalidArgumentError("a scheduler-side method was called on a worker's "
                                       "connector")
        return self._scheduler


__all__ = ["IsolaneConnectorV1", "PagedLayout"]
