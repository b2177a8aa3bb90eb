"""IsolaneConnectorV1 inside the real vllm package (installed by scripts/setup; a missing
vllm fails these tests, it never skips them). See ``vllm_engine.py`` for what is real."""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from isolane.errors import InvalidArgumentError
from tests.integrations.vllm_engine import (
    BLOCK,
    LATENT,
    LAYER_NAMES,
    LAYERS,
    Engine,
    close_pools,
    documented_kv_transfer_config,
    make_request,
    model_runner,
    require_vllm,
    vllm_config,
)

CHUNK = 32
PROMPT = [(i * 37 + 11) % 500 for i in range(100)]  # 3 pool blocks (96 tokens) + a tail
SYNC = {"isolane_async_load": False, "isolane_async_save": False}
MODES = {"sync": SYNC, "async": {}}  # async: the documented defaults

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_vllm()
    return tmp_path_factory.mktemp("vllm-model")


@pytest.fixture
def extra(tmp_path: Path) -> Iterator[dict[str, Any]]:
    yield {"isolane_pool": str(tmp_path / "pool"), "isolane_namespace": "tiny-llama",
           "isolane_chunk_tokens": CHUNK}
    close_pools()


def until_scheduled(engine: Engine, req_id: str, max_steps: int = 20) -> tuple[Any, int]:
    """Step until vLLM schedules the request: ``(that step, steps it waited)``."""
    for waited in range(max_steps):
        step = engine.step()
        if req_id in step.output.num_scheduled_tokens:
            return step, waited
        engine.drain()
    raise AssertionError(f"request {req_id} not scheduled in {max_steps} steps")



def store_in_fresh_engine(model_root: Path, extra: dict[str, Any], request: Any) -> None:
    """Run ``request`` to the end in an engine of its own, which stores its KV in the
    pool, and close that engine (the next engine starts as after a restart)."""
    first = Engine(model_root, extra)
    first.add(request)
    first.run()
    first.close()


def test_no_abstract_method_is_left_and_the_signatures_match_vllms() -> None:
    require_vllm()
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from isolane.integrations.vllm.connector import IsolaneConnectorV1

    assert not inspect.isabstract(IsolaneConnectorV1), IsolaneConnectorV1.__abstractmethods__
    overridden = [name for name, member in vars(IsolaneConnectorV1).items()
                  if callable(member) and hasattr(KVConnectorBase_V1, name)
                  and not name.startswith("__")]
    assert {"start_load_kv", "get_num_new_matched_tokens", "build_connector_meta",
            "get_block_ids_with_load_errors"} <= set(overridden)
    for name in [*overridden, "__init__"]:
        ours = inspect.signature(getattr(IsolaneConnectorV1, name))
        theirs = inspect.signature(getattr(KVConnectorBase_V1, name))
        assert [(p.name, p.kind) for p in ours.parameters.values()] == \
            [(p.name, p.kind) for p in theirs.parameters.values()], name


def test_the_factory_builds_both_roles_from_the_documented_config(
        model_root: Path, extra: dict[str, Any]) -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from isolane.integrations.vllm.connector import IsolaneConnectorV1

    documented = documented_kv_transfer_config()
    assert documented["kv_connector"] == "IsolaneConnectorV1"
    assert documented["kv_role"] == "kv_both"
    engine = Engine(model_root, extra)  # builds the worker role through the factory
    scheduler_side = KVConnectorFactory.create_connector(
        engine.config, KVConnectorRole.SCHEDULER, engine.kv_cache_config)
    assert isinstance(engine.worker, IsolaneConnectorV1)
    assert isinstance(scheduler_side, IsolaneConnectorV1)
    assert isinstance(engine.scheduler.connector, IsolaneConnectorV1)
    assert engine.worker._worker is not None and scheduler_side._scheduler is not None
    # vLLM's own buffers: rank 4, K and V packed in the last axis
    assert all(engine.kv_caches[n].dim() == 4 for n in LAYER_NAMES)
    assert engine.worker._worker.layout == "packed"


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
@pytest.mark.parametrize("mode", MODES)
def test_kv_stored_by_one_engine_loads_bit_for_bit_into_a_fresh_one(
        model_root: Path, extra: dict[str, Any], layout: str, mode: str) -> None:
    extra = {**extra, **MODES[mode]}
    first = Engine(model_root, extra, layout=layout)
    first.add(make_request("a", PROMPT))
    first.run()
    first.close()  # the engine is gone; the pool's files stay

    second = Engine(model_root, extra, layout=layout)  # empty prefix cache, zeroed buffers
    second.add(make_request("b", [*PROMPT[:96], 1, 2, 3, 4, 5, 6]))
    step, waited = until_scheduled(second, "b")
    assert (waited >= 1) if mode == "async" else (waited == 0)  # async: parked to load
    (new,) = step.output.scheduled_new_reqs
    assert new.num_computed_tokens == 96  # the pool's three blocks, no vLLM prefix hit
    assert second.slots_match_reference("b", 102) == []  # loaded 0-95, computed 96-101
    second.close()


def test_async_store_holds_the_blocks_and_async_load_parks_the_request(
        model_root: Path, extra: dict[str, Any]) -> None:
    """The documented defaults: the save runs on the connector's thread with the
    request's blocks held (``delay_free_blocks``) until ``get_finished`` reports it;
    a fresh engine's vLLM parks the request in WAITING_FOR_REMOTE_KVS while its load
    runs there, and resumes it once reported."""
    from vllm.v1.request import RequestStatus

    first = Engine(model_root, extra)
    all_free = first.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    gate = threading.Event()
    transfers = first.worker._worker.transfers
    transfers.submit_save("gate", lambda: gate.wait(60))  # the thread is busy
    first.add(make_request("a", PROMPT, max_tokens=3))
    for _ in range(3):
        first.step()
    request = first.requests["a"]
    assert request.is_finished()
    assert transfers.saves_pending("a")
    for _ in range(2):  # finished, but its save has not run: vLLM keeps its blocks
        first.step()
        assert "a" in first.scheduler.requests
        assert first.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() < all_free
    gate.set()
    first.drain()
    first.step()
    assert first.last_transfers.finished_sending == {"a"}
    assert "a" not in first.scheduler.requests
    assert first.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == all_free
    first.close()

    second = Engine(model_root, extra)
    connector = second.scheduler.connector
    assert connector.get_num_new_matched_tokens(make_request("x", PROMPT), 0) == (96, True)
    second.add(make_request("b", PROMPT))
    step = second.step()
    assert step.output.num_scheduled_tokens == {}  # nothing to compute while it loads
    assert second.requests["b"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (load,) = step.output.kv_connector_metadata.plan.loads
    assert load.background and (load.start, load.stop) == (0, 96)
    second.drain()
    step, _ = until_scheduled(second, "b")
    (new,) = step.output.scheduled_new_reqs
    assert new.num_computed_tokens == 96
    assert second.requests["b"].status == RequestStatus.RUNNING
    assert second.slots_match_reference("b", len(PROMPT)) == []
    second.run()
    assert second.requests["b"].is_finished()
    second.close()


def test_a_request_aborted_while_its_load_runs_keeps_its_blocks_until_it_ends(
        model_root: Path, extra: dict[str, Any]) -> None:
    from vllm.v1.request import RequestStatus

    store_in_fresh_engine(model_root, extra, make_request("a", PROMPT))

    second = Engine(model_root, extra)
    all_free = second.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    pool = second.worker._worker.pool
    entered, release, gets = threading.Event(), threading.Event(), []
    real_get = pool.get

    def slow_get(*args: Any, **kwargs: Any) -> Any:
        gets.append(args)
        entered.set()
        assert release.wait(60)
        return real_get(*args, **kwargs)

    pool.get = slow_get  # the loads of "b" then "c" queue on the connector's thread
    second.add(make_request("b", PROMPT))
    second.add(make_request("c", [*PROMPT[:96], 9, 9, 9]))
    second.step()
    assert entered.wait(60)  # b's load is running, c's queued behind it
    second.scheduler.finish_requests(["b", "c"], RequestStatus.FINISHED_ABORTED)
    second.step()  # the worker hears of the aborts; b's load is still in flight
    for req_id in ("b", "c"):  # vLLM frees the blocks only once the load is reported
        assert req_id in second.scheduler.requests
    assert second.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() < all_free
    release.set()
    second.drain()
    second.step()
    assert second.last_transfers.finished_recving == {"b", "c"}
    assert len(gets) == 1  # c's load was dropped before it ran
    assert not second.scheduler.requests
    assert second.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == all_free
    second.add(make_request("d", PROMPT))  # the engine goes on
    second.run()
    assert second.requests["d"].is_finished()
    second.close()


@pytest.mark.parametrize("runner", [0, 1])
@pytest.mark.parametrize("mode", MODES)
def test_a_preempted_request_resumes_with_its_kv(model_root: Path, extra: dict[str, Any],
                                                 runner: int, mode: str) -> None:
    with model_runner(runner):
        engine = Engine(model_root, {**extra, **MODES[mode]})
        assert engine.config.use_v2_model_runner is bool(runner)
        engine.add(make_request("a", PROMPT, max_tokens=6))
        engine.step()  # prefill: the pool now holds 96 tokens
        engine.drain()
        engine.step()  # one decode
        # preempt everything and drop vLLM's own prefix cache: only the pool can help
        engine.scheduler.reset_prefix_cache(reset_running_requests=True)
        for block in engine.kv_caches.values():
            block.zero_()
        step, _ = until_scheduled(engine, "a")
        resumed = Engine.computed_before(step.output, "a")
        assert resumed == 96, "the resumed request should be granted the pool's 96 tokens"
        assert engine.slots_match_reference("a", len(PROMPT)) == []
        engine.run()
        assert engine.requests["a"].is_finished()
        engine.close()


def test_a_preempted_requests_pending_save_runs_before_its_blocks_are_reused(
        model_root: Path, extra: dict[str, Any]) -> None:
    """Preemption hands a request's blocks back at once (no request_finished, no
    delay): the worker must finish its background save before the next forward, which
    may write another request's KV there."""
    engine = Engine(model_root, extra)
    transfers = engine.worker._worker.transfers
    transfers.submit_save("gate", lambda: time.sleep(0.5))  # a's save waits behind this
    engine.add(make_request("a", PROMPT, max_tokens=6))
    engine.step()  # prefill; a's save is queued
    assert transfers.saves_pending("a")
    engine.scheduler.reset_prefix_cache(reset_running_requests=True)

    def overwrite(_out: Any) -> None:  # what the forward of another request may do
        for block in engine.kv_caches.values():
            block.fill_(-1.0)

    engine.step(between=overwrite)
    engine.drain()
    engine.close()

    fresh = Engine(model_root, extra)  # what the pool holds for a's prompt
    fresh.add(make_request("b", PROMPT))
    step, _ = until_scheduled(fresh, "b")
    assert Engine.computed_before(step.output, "b") == 96
    assert fresh.slots_match_reference("b", len(PROMPT)) == []
    fresh.close()


def test_a_block_lost_between_lookup_and_load_is_reported_and_recomputed(
        model_root: Path, extra: dict[str, Any]) -> None:
    extra = {**extra, **SYNC}
    store_in_fresh_engine(model_root, extra, make_request("a", PROMPT))

    second = Engine(model_root, extra)
    second.add(make_request("b", PROMPT))

    def evict(_out: Any) -> None:  # after the scheduler granted 96 tokens
        pool = second.worker._worker.pool
        pool.delete(torch.tensor(PROMPT[:96]))

    step = second.step(between=evict)
    assert step.load_errors, "the lost blocks must be reported to vLLM"
    blocks = second.block_ids("b")
    assert step.load_errors <= set(blocks[:96 // BLOCK])
    request = second.requests["b"]
    assert request.num_computed_tokens < 96  # vLLM rolled back to recompute them
    second.step()  # the recomputation
    assert request.num_computed_tokens >= len(PROMPT)
    assert second.slots_match_reference("b", len(PROMPT)) == []
    second.run()
    assert request.is_finished()
    second.close()


def test_a_failed_async_load_is_reported_with_the_request_and_recomputed(
        model_root: Path, extra: dict[str, Any]) -> None:
    from vllm.v1.request import RequestStatus

    store_in_fresh_engine(model_root, extra, make_request("a", PROMPT))

    second = Engine(model_root, extra)
    second.add(make_request("b", PROMPT))

    def evict(_out: Any) -> None:  # after vLLM parked b for a 96-token load
        second.worker._worker.pool.delete(torch.tensor(PROMPT[:96]))

    step = second.step(between=evict)
    assert second.requests["b"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    second.drain()
    reported = step if step.load_errors else second.step()
    assert reported.load_errors == set(second.block_ids("b")[:96 // BLOCK])
    assert second.last_transfers.finished_recving == {"b"}  # in the same pass
    step, _ = until_scheduled(second, "b")
    assert Engine.computed_before(step.output, "b") == 0  # vLLM recomputes it all
    assert second.slots_match_reference("b", len(PROMPT)) == []
    second.run()
    assert second.requests["b"].is_finished()
    second.close()


def test_cache_salt_isolates_tenants_and_prompt_embeddings_are_never_keyed(
        model_root: Path, extra: dict[str, Any]) -> None:
    store_in_fresh_engine(model_root, extra, make_request("a", PROMPT, cache_salt="tenant-a"))

    second = Engine(model_root, extra)
    connector = second.scheduler.connector
    other = make_request("b", PROMPT, cache_salt="tenant-b")
    same = make_request("c", PROMPT, cache_salt="tenant-a")
    unsalted = make_request("d", PROMPT)
    assert connector.get_num_new_matched_tokens(other, 0) == (0, False)
    assert connector.get_num_new_matched_tokens(unsalted, 0) == (0, False)
    assert connector.get_num_new_matched_tokens(same, 0) == (96, True)  # async: default
    embeds = make_request("e", None, prompt_embeds=torch.zeros(len(PROMPT), 8))
    assert connector.get_num_new_matched_tokens(embeds, 0) == (0, False)
    second.close()


def test_lora_and_multimodal_inputs_change_the_request_context() -> None:
    require_vllm()
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    from isolane.integrations.vllm.connector import request_context

    plain = request_context(make_request("p", PROMPT))
    assert plain == (None, True)
    lora_a = request_context(make_request("a", PROMPT, lora_request=LoRARequest("a", 1, "/l/a")))
    lora_b = request_context(make_request("b", PROMPT, lora_request=LoRARequest("b", 2, "/l/b")))
    assert lora_a[0] is not None and lora_a[0] != lora_b[0]

    def image(identifier: str, offset: int) -> Any:
        return MultiModalFeatureSpec(data=None, modality="image", identifier=identifier,
                                     mm_position=PlaceholderRange(offset=offset, length=20))

    one = request_context(make_request("m1", PROMPT, mm_features=[image("img-1", 10)]))
    two = request_context(make_request("m2", PROMPT, mm_features=[image("img-2", 10)]))
    moved = request_context(make_request("m3", PROMPT, mm_features=[image("img-1", 30)]))
    assert len({one[0], two[0], moved[0]}) == 3 and one[1] and two[1]


def test_hybrid_kv_cache_groups_are_refused_when_the_connector_is_made(
        model_root: Path, extra: dict[str, Any]) -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    config = vllm_config(model_root, extra)
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=16,
                             dtype=torch.float32)
    mamba = MambaSpec(block_size=BLOCK, shapes=((16,), (16,)),
                      dtypes=(torch.float32, torch.float32))
    hybrid = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["attn"], full), KVCacheGroupSpec(["mamba"], mamba)])
    with pytest.raises(InvalidArgumentError, match=r"group 1: MambaSpec \(1 layers, e.g. mamba"):
        KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, hybrid)
    window = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["swa"], SlidingWindowSpec(block_size=BLOCK, num_kv_heads=2,
                                                    head_size=16, dtype=torch.float32,
                                                    sliding_window=64))])
    with pytest.raises(InvalidArgumentError,
                       match=r"group 0: SlidingWindowSpec.*--disable-hybrid"):
        KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, window)


@pytest.mark.parametrize("mode", MODES)
def test_mla_latents_round_trip_bit_for_bit_keyed_once_for_every_rank(
        model_root: Path, extra: dict[str, Any], mode: str) -> None:
    """vLLM's own MLAAttentionSpec allocation ([blocks, 1, block_size, latent] a layer):
    stored by one engine, loaded bit for bit by a fresh one; the keys are those of TP
    rank 0 of 1 whatever the engine's TP size (one copy serves every rank)."""
    extra = {**extra, **MODES[mode], "isolane_namespace": "tiny-mla"}
    first = Engine(model_root, extra, mla=True)
    assert all(first.kv_caches[n].shape[1:] == (1, BLOCK, LATENT) for n in LAYER_NAMES)
    assert first.worker._worker.layout == "mla" and first.worker._worker.stores
    first.add(make_request("a", PROMPT))
    first.run()
    first.close()

    second = Engine(model_root, extra, mla=True)
    pool = second.worker._worker.pool
    assert (pool.tp_rank, pool.tp_size) == (0, 1)
    assert pool.layout == ("float32", (LAYERS, 1, 1, LATENT))  # one latent, not K and V
    second.add(make_request("b", [*PROMPT[:96], 1, 2, 3, 4, 5, 6]))
    step, _ = until_scheduled(second, "b")
    (new,) = step.output.scheduled_new_reqs
    assert new.num_computed_tokens == 96
    assert second.slots_match_reference("b", 102) == []
    second.close()


def test_an_mla_rank_that_does_not_store_still_loads(model_root: Path, tmp_path: Path
                                                      ) -> None:
    """The worker of a TP rank other than 0 (``stores=False``) plans no save of its own
    and loads what rank 0 stored."""
    extra = {"isolane_pool": str(tmp_path / "pool"), "isolane_namespace": "tiny-mla",
             "isolane_chunk_tokens": CHUNK, **SYNC}
    engine = Engine(model_root, extra, mla=True)
    engine.worker._worker.stores = False  # as on rank 1
    engine.add(make_request("a", PROMPT))
    engine.run()
    pool = engine.worker._worker.pool
    assert pool.lookup(torch.tensor(PROMPT)) == 0  # nothing stored by this rank
    kv = torch.stack([torch.stack([engine.reference(layer, t, p) for p, t in
                                   enumerate(PROMPT[:96])]).unsqueeze(0)
                      for layer in range(LAYERS)])  # [layers, 1, tokens, 1, latent]
    assert pool.put(torch.tensor(PROMPT[:96]), kv) == 3  # what rank 0 stores
    engine.close()
    again = Engine(model_root, extra, mla=True)
    again.worker._worker.stores = False
    again.add(make_request("b", PROMPT))
    step, _ = until_scheduled(again, "b")
    assert step.output.scheduled_new_reqs[0].num_computed_tokens == 96
    assert again.slots_match_reference("b", len(PROMPT)) == []
    again.close()


@pytest.mark.parametrize("mode", MODES)
def test_a_step_whose_load_failed_stores_nothing_of_that_request(
        model_root: Path, extra: dict[str, Any], mode: str) -> None:
    """The step that fails to load a request's pool blocks still runs its forward and
    its planned save; storing then would put the unloaded (zero) slots into the pool
    under the request's keys."""
    extra = {**extra, **MODES[mode]}
    # stores 96 tokens: 3 pool blocks
    store_in_fresh_engine(model_root, extra, make_request("a", PROMPT))

    longer = [*PROMPT[:96], *[(i * 53 + 5) % 500 for i in range(70)]]  # 5 pool blocks + 6
    second = Engine(model_root, extra)
    second.add(make_request("b", longer))

    def evict(_out: Any) -> None:  # after the scheduler granted 96 tokens, planned a save
        second.worker._worker.pool.delete(torch.tensor(PROMPT[:96]))

    step = second.step(between=evict)
    second.drain()
    assert step.load_errors or second.step().load_errors
    second.run()
    second.close()

    third = Engine(model_root, extra)  # whatever the pool holds now must be the real KV
    third.add(make_request("c", longer))
    step, _ = until_scheduled(third, "c")
    (new,) = step.output.scheduled_new_reqs
    assert third.slots_match_reference("c", len(longer)) == [], \
        f"{new.num_computed_tokens} tokens loaded from the pool"
    third.close()


@pytest.mark.parametrize("mode", MODES)
def test_a_grant_that_ends_inside_a_pool_block_loads_without_errors(
        model_root: Path, extra: dict[str, Any], mode: str) -> None:
    """A 96-token prompt stored as 3 pool blocks is granted 80 tokens (never its last
    token, whole vLLM blocks): the load must read the third pool block for its first
    16 tokens, not report them as lost."""
    extra = {**extra, **MODES[mode]}
    store_in_fresh_engine(model_root, extra, make_request("a", PROMPT[:96]))

    second = Engine(model_root, extra)
    second.add(make_request("b", PROMPT[:96]))
    errors: set[int] = set()
    for _ in range(6):
        step = second.step()
        errors |= step.load_errors
        if "b" in step.output.num_scheduled_tokens:
            break
        second.drain()
    assert errors == set()
    assert Engine.computed_before(step.output, "b") == 80
    assert second.slots_match_reference("b", 96) == []
    second.close()


def test_sliding_window_layers_are_stored_once_vllm_turns_the_hybrid_allocator_off(
        model_root: Path, extra: dict[str, Any]) -> None:
    """A model mixing sliding-window and full layers (Gemma-like), with the connector:
    vLLM turns its hybrid allocator off for a connector without SupportsHMA, its planner
    then makes one full-attention group, and the connector takes it."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.kv_cache_planning import (
        get_kv_cache_config_from_groups,
        get_kv_cache_groups,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from isolane.integrations.vllm.connector import IsolaneConnectorV1

    config = vllm_config(model_root, extra)
    assert config.scheduler_config.disable_hybrid_kv_cache_manager
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=16,
                             dtype=torch.float32)
    window = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=2, head_size=16,
                               dtype=torch.float32, sliding_window=64)
    groups = get_kv_cache_groups(config, {LAYER_NAMES[0]: window, LAYER_NAMES[1]: full})
    kv_cache_config = get_kv_cache_config_from_groups(config, groups,
                                                      64 * LAYERS * full.page_size_bytes)
    assert [type(g.kv_cache_spec).__name__ for g in kv_cache_config.kv_cache_groups] == \
        ["FullAttentionSpec"]
    connector = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER,
                                                    kv_cache_config)
    assert isinstance(connector, IsolaneConnectorV1)
