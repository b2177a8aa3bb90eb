"""A CPU stand-in for a vLLM engine built from the real vllm package's own parts.

Real: ``VllmConfig`` with the connector's ``KVTransferConfig``, the KV cache config from
vLLM's planner, the paged buffers from vLLM's ``allocate_kv_cache``, vLLM's
``KVConnectorFactory`` (both roles), its ``Scheduler`` and ``Request``s. Stand-in: the
model runner, which here does what a model runner does around the connector (bind the
plan, ``start_load_kv``, a forward that writes each scheduled token's KV into its slot
and calls ``save_kv_layer`` per layer, ``wait_for_save``, report load errors) with a
forward whose KV is a known function of (layer, token id, position), so a test can
check every slot bit for bit. vLLM's compiled kernels (``vllm._C``) are not needed.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
LAYERS, HEADS, HEAD_DIM, BLOCK = 2, 2, 16, 16
LATENT = 24  # an MLA engine's latent width a token (kv_lora_rank + rope dims)
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def require_vllm() -> Any:
    """The real vllm package, or a loud failure (never a skip): CI must test against it."""
    try:
        import vllm
        from vllm.distributed.kv_transfer.kv_connector.v1 import base  # noqa: F401
    except ImportError as exc:
        pytest.fail(f"the real vllm package is not importable ({exc}); scripts/setup "
                    "installs it (pinned, on the CPU torch wheel): run scripts/test, or "
                    "scripts/setup test,vllm", pytrace=False)
    return vllm


def documented_kv_transfer_config() -> dict[str, Any]:
    """The --kv-transfer-config JSON of the ``vllm serve`` line in docs/INTEGRATIONS.md."""
    text = (REPO / "docs" / "INTEGRATIONS.md").read_text()
    match = re.search(r"vllm serve [^\n]*--kv-transfer-config '(\{.*?\})'", text, re.S)
    assert match, "docs/INTEGRATIONS.md has no `vllm serve ... --kv-transfer-config` line"
    parsed: dict[str, Any] = json.loads(match.group(1))
    return parsed


def tiny_model_dir(root: Path) -> Path:
    """A tiny Llama config (no weights: nothing here runs the model)."""
    from transformers import LlamaConfig

    path = root / "tiny-llama"
    if not (path / "config.json").exists():
        LlamaConfig(vocab_size=512, hidden_size=HEADS * 2 * HEAD_DIM, intermediate_size=128,
                    num_hidden_layers=LAYERS, num_attention_heads=HEADS * 2,
                    num_key_value_heads=HEADS, head_dim=HEAD_DIM,
                    max_position_embeddings=4096,
                    architectures=["LlamaForCausalLM"]).save_pretrained(path)
    return path


_model_configs: dict[str, Any] = {}


def model_config(root: Path) -> Any:
    """vLLM's ModelConfig of the tiny model (slow to build: it inspects the model class
    in a subprocess), made once per process and folder."""
    from vllm.config import ModelConfig

    key = str(root)
    if key not in _model_configs:
        _model_configs[key] = ModelConfig(model=str(tiny_model_dir(root)), dtype="float32",
                                          seed=0, skip_tokenizer_init=True, max_model_len=4096)
    return _model_configs[key]


_distributed = False


def init_distributed(vllm_config: Any) -> None:
    """vLLM's process groups for one process (the worker role asks for its TP rank)."""
    global _distributed
    if _distributed:
        return
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        ensure_model_parallel_initialized(1, 1)
    _distributed = True


def vllm_config(root: Path, extra: dict[str, Any] | None, *, layout: str = "LBNHC",
                num_batched_tokens: int = 512) -> Any:
    """``extra`` None: no KV connector at all."""
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, SchedulerConfig, VllmConfig

    transfer = documented_kv_transfer_config()
    transfer["kv_connector_extra_config"] = {**transfer["kv_connector_extra_config"],
                                             **(extra or {})}
    cache = CacheConfig(block_size=BLOCK, gpu_memory_utilization=0.9,
                        enable_prefix_caching=True)
    cache.kv_cache_layout = layout  # what the engine core resolves before the connectors
    return VllmConfig(
        model_config=model_config(root),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=num_batched_tokens,
                                         max_model_len=4096, enable_chunked_prefill=True,
                                         is_encoder_decoder=False),
        cache_config=cache,
        kv_transfer_config=None if extra is None else KVTransferConfig(**transfer),
        device_config=DeviceConfig("cpu"))


def reference_kv(layer: int, token: int, position: int) -> torch.Tensor:
    """What the stand-in forward computes for one token: ``[heads, 2 * head_dim]``, K then
    V in the last axis (vLLM's packed page), a function of layer, token id and position."""
    base = torch.arange(HEADS * 2 * HEAD_DIM, dtype=torch.float32).view(HEADS, 2 * HEAD_DIM)
    return torch.sin(base * 0.37 + layer * 1.3 + token * 0.011 + position * 0.07)


def reference_latent(layer: int, token: int, position: int) -> torch.Tensor:
    """What the stand-in forward of an MLA engine computes for one token: ``[1, latent]``
    (vLLM's MLA page holds one latent a token)."""
    base = torch.arange(LATENT, dtype=torch.float32).view(1, LATENT)
    return torch.cos(base * 0.29 + layer * 0.7 + token * 0.013 + position * 0.05)


@dataclass
class StepResult:
    output: Any
    load_errors: set[int] = field(default_factory=set)


class Engine:
    """One engine: vLLM's scheduler and a worker connector over vLLM-allocated buffers."""

    def __init__(self, root: Path, extra: dict[str, Any] | None, *, layout: str = "LBNHC",
                 num_blocks: int = 64, num_batched_tokens: int = 512,
                 forward: str = "reference", mla: bool = False) -> None:
        """``extra`` None: an engine without a KV connector. ``forward``: "reference"
        writes ``reference_kv`` token by token (exact, slow); "bulk" writes every
        scheduled slot of a layer at once (for timing). ``mla``: the layers' KV cache
        spec is vLLM's ``MLAAttentionSpec`` (one latent a token, ``reference_latent``)."""
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.core.kv_cache_planning import (
            get_kv_cache_config_from_groups,
            get_kv_cache_groups,
        )
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.v1.worker.utils import allocate_kv_cache

        self.config = vllm_config(root, extra, layout=layout,
                                  num_batched_tokens=num_batched_tokens)
        spec = (MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=LATENT,
                                 dtype=torch.float32) if mla else
                FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM,
                                  dtype=torch.float32))
        self.reference = reference_latent if mla else reference_kv
        groups = get_kv_cache_groups(self.config, dict.fromkeys(LAYER_NAMES, spec))
        self.kv_cache_config = get_kv_cache_config_from_groups(
            self.config, groups, num_blocks * LAYERS * spec.page_size_bytes)
        self.kv_caches = allocate_kv_cache(self.kv_cache_config, torch.device("cpu"),
                                           KVCacheLayout[layout])
        init_distributed(self.config)
        self.forward = forward
        self.forward_s = 0.0  # a step that computes tokens also sleeps this long (a GPU)
        self.worker: Any = None
        if extra is not None:
            self.worker = KVConnectorFactory.create_connector(
                self.config, KVConnectorRole.WORKER, self.kv_cache_config)
            self.worker.register_kv_caches(self.kv_caches)
        self.config.cache_config.num_gpu_blocks = self.kv_cache_config.num_blocks
        self.scheduler = Scheduler(
            vllm_config=self.config, kv_cache_config=self.kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.config),
            block_size=BLOCK, log_stats=False)
        self.requests: dict[str, Any] = {}
        self.next_token = 7
        self.last_transfers: Any = None

    def add(self, request: Any) -> None:
        self.requests[request.request_id] = request
        self.scheduler.add_request(request)

    def block_ids(self, req_id: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])

    def step(self, *, between: Any = None) -> StepResult:
        """One engine step, in the order of vLLM's model runner around the connector
        (``handle_preemptions``; ``start_load_kv`` before the forward when the step has
        synchronous loads, else after it; ``save_kv_layer`` per layer; ``wait_for_save``;
        ``get_transfer_results``; ``get_block_ids_with_load_errors``).
        ``between(output)`` runs after scheduling and ``handle_preemptions``, before the
        loads and the forward (what it writes, the forward could have written)."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        out = self.scheduler.schedule()
        worker = self.worker
        if worker is not None:
            worker.handle_preemptions(out.kv_connector_metadata)
        if between is not None:
            between(out)
        errors: set[int] = set()
        connector_output = None
        if worker is not None:
            worker.bind_connector_metadata(out.kv_connector_metadata)
            if out.has_sync_kv_loads:
                worker.start_load_kv(None)
        for layer, name in enumerate(LAYER_NAMES):
            if worker is not None:
                worker.wait_for_layer_load(name)
            self._forward_layer(layer, self.kv_caches[name], out)
            if worker is not None:
                worker.save_kv_layer(name, self.kv_caches[name], None)
        if self.forward_s and out.num_scheduled_tokens:
            time.sleep(self.forward_s)  # the host waits for the device, the GIL is free
        if worker is not None:
            if not out.has_sync_kv_loads:
                worker.start_load_kv(None)
            worker.wait_for_save()
            results = worker.get_transfer_results(out.finished_req_ids)
            errors = worker.get_block_ids_with_load_errors()
            connector_output = KVConnectorOutput(
                finished_sending=results.finished_sending or None,
                finished_recving=results.finished_recving or None,
                failed_recving=results.failed_recving, invalid_block_ids=errors)
            worker.clear_connector_metadata()
        req_ids = list(out.num_scheduled_tokens)
        runner_output = ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[[self.next_token] for _ in req_ids],
            kv_connector_output=connector_output)
        self.scheduler.update_from_output(out, runner_output)
        self.last_transfers = connector_output
        return StepResult(out, errors)

    def drain(self) -> None:
        """Wait until the worker's background transfers ran (a test's determinism)."""
        if self.worker is not None and self.worker._worker._transfers is not None:
            assert self.worker._worker._transfers.drain(timeout=60)

    def _forward_layer(self, layer: int, buffer: torch.Tensor, out: Any) -> None:
        """Write the KV of every token scheduled in this step into its slot."""
        if self.forward == "bulk":
            self._bulk_forward_layer(layer, buffer, out)
            return
        for req_id, n in out.num_scheduled_tokens.items():
            request = self.requests[req_id]
            start = self.computed_before(out, req_id)
            blocks = self.block_ids(req_id)
            tokens = request.all_token_ids
            for pos in range(start, start + n):
                buffer[blocks[pos // BLOCK], :, pos % BLOCK] = self.reference(
                    layer, tokens[pos], pos)

    def _bulk_forward_layer(self, layer: int, buffer: torch.Tensor, out: Any) -> None:
        blocks_list, offsets_list = [], []
        for req_id, n in out.num_scheduled_tokens.items():
            start = self.computed_before(out, req_id)
            table = torch.tensor(self.block_ids(req_id))
            positions = torch.arange(start, start + n)
            blocks_list.append(table[positions // BLOCK])
            offsets_list.append(positions % BLOCK)
        if blocks_list:
            blocks, offsets = torch.cat(blocks_list), torch.cat(offsets_list)
            buffer[blocks, :, offsets] = float(layer + 1)

    @staticmethod
    def computed_before(out: Any, req_id: str) -> int:
        for new in out.scheduled_new_reqs:
            if new.req_id == req_id:
                return int(new.num_computed_tokens)
        cached = out.scheduled_cached_reqs
        return int(cached.num_computed_tokens[cached.req_ids.index(req_id)])

    def slots_match_reference(self, req_id: str, stop: int) -> list[int]:
        """Positions ``< stop`` of the request whose KV differs from the reference."""
        request = self.requests[req_id]
        blocks = self.block_ids(req_id)
        bad = []
        for layer, name in enumerate(LAYER_NAMES):
            buffer = self.kv_caches[name]
            for pos in range(stop):
                got = buffer[blocks[pos // BLOCK], :, pos % BLOCK]
                if not torch.equal(got, self.reference(layer, request.all_token_ids[pos], pos)):
                    bad.append(pos)
        return sorted(set(bad))

    def run(self, max_steps: int = 40) -> None:
        """Steps until every request finished and no block is held for a transfer; a
        step that scheduled nothing first waits for the background transfers."""
        for _ in range(max_steps):
            if not self.scheduler.has_requests():
                return
            if not self.step().output.num_scheduled_tokens:
                self.drain()
        raise AssertionError(f"requests left after {max_steps} steps")

    def close(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        close_pools()


def close_pools() -> None:
    """A fresh engine in this process must not reuse the last one's pool objects."""
    from isolane.integrations.vllm import connector as vllm_connector

    vllm_connector.close_shared_pools()


def make_request(req_id: str, prompt: list[int], *, max_tokens: int = 3, **kwargs: Any) -> Any:
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    params.update_from_generation_config({}, None)
    return Request(request_id=req_id, prompt_token_ids=prompt, sampling_params=params,
                   pooling_params=None, block_hasher=get_request_block_hasher(BLOCK, sha256),
                   **kwargs)


@contextmanager
def model_runner(version: int) -> Iterator[None]:
    """``VLLM_USE_V2_MODEL_RUNNER`` for the engines made inside (vLLM reads it when the
    config asks; the old value comes back after)."""
    old = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = str(version)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
        else:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = old
