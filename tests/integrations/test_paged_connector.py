"""The vLLM-free connector logic against real torch tensors laid out as vLLM's paged KV
buffers, and a real KVPool."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from isolane.errors import InvalidArgumentError
from isolane.integrations.vllm.paged import (
    detect_layout,
    gather_layer,
    plan_load,
    plan_save,
    scatter_layer,
    slot_mapping,
)
from isolane.integrations.vllm.pool_connector import (
    ConnectorPlan,
    LoadSpec,
    PoolConnectorScheduler,
    PoolConnectorWorker,
    ScheduledRequest,
)
from isolane.kvpool.pool import KVPool

LAYERS, BLOCKS, BLOCK, HEADS, DIM, CHUNK = 3, 64, 16, 2, 8, 64


def paged(layout: str) -> torch.Tensor:
    """One layer's buffer as the backend allocates it; "hnd" is FlashAttention's logical
    shape over heads-first memory (vLLM's stride order), handed out as a permuted view;
    "packed" is vLLM 0.26+'s rank-4 page over LBHNC memory, "packed-nhd" over LBNHC."""
    if layout == "packed":
        return torch.zeros(BLOCKS, HEADS, BLOCK, 2 * DIM)
    if layout == "packed-nhd":
        return torch.zeros(BLOCKS, BLOCK, HEADS, 2 * DIM).permute(0, 2, 1, 3)
    if layout == "flash":
        return torch.zeros(2, BLOCKS, BLOCK, HEADS, DIM)
    if layout == "flashinfer":
        return torch.zeros(BLOCKS, 2, BLOCK, HEADS, DIM)
    return torch.zeros(2, BLOCKS, HEADS, BLOCK, DIM).permute(0, 1, 3, 2, 4)


def token_kv(layer: torch.Tensor, layout: str, block: int, offset: int) -> torch.Tensor:
    """[2, heads, dim] of one slot, read the obvious way (the reference)."""
    if layout.startswith("packed"):
        page = layer[block, :, offset]  # [heads, 2 * dim]: K then V
        return torch.stack([page[:, :DIM], page[:, DIM:]])
    if layout == "flashinfer":
        return layer[block, :, offset]
    return layer[:, block, offset]


def test_slot_mapping_follows_the_block_table() -> None:
    slots = slot_mapping([7, 2, 9], BLOCK, 14, 34)
    expected = [7 * 16 + 14, 7 * 16 + 15, *[2 * 16 + i for i in range(16)], 9 * 16, 9 * 16 + 1]
    assert slots.tolist() == expected
    with pytest.raises(InvalidArgumentError, match="need 4 blocks"):
        slot_mapping([7, 2, 9], BLOCK, 0, 49)


def kind_of(layout: str) -> str:
    return {"hnd": "flash", "packed-nhd": "packed"}.get(layout, layout)


@pytest.mark.parametrize("layout", ["flash", "flashinfer", "hnd", "packed", "packed-nhd"])
def test_gather_and_scatter_touch_exactly_the_request_slots(layout: str) -> None:
    kind = kind_of(layout)
    src, dst = paged(layout), paged(layout)
    src.copy_(torch.randn(src.shape))
    src_blocks, dst_blocks = [5, 11, 3], [40, 1, 22]
    n = 40
    kv = gather_layer(src, slot_mapping(src_blocks, BLOCK, 0, n), kind)
    assert kv.shape == (2, n, HEADS, DIM)
    for p in range(n):
        assert torch.equal(kv[:, p], token_kv(src, layout, src_blocks[p // BLOCK], p % BLOCK))
    scatter_layer(dst, slot_mapping(dst_blocks, BLOCK, 0, n), kv, kind)
    written = torch.zeros(BLOCKS, BLOCK, dtype=torch.bool)
    for p in range(n):
        block, offset = dst_blocks[p // BLOCK], p % BLOCK
        assert torch.equal(token_kv(dst, layout, block, offset), kv[:, p])
        written[block, offset] = True
    for block in range(BLOCKS):  # every other slot is still zero
        for offset in range(BLOCK):
            if not written[block, offset]:
                assert not token_kv(dst, layout, block, offset).any()


def test_layout_detection_and_plans() -> None:
    assert detect_layout(paged("flash")) == "flash"
    assert detect_layout(paged("flashinfer")) == "flashinfer"
    assert detect_layout(paged("packed")) == "packed"
    assert detect_layout(paged("packed-nhd")) == "packed"
    with pytest.raises(InvalidArgumentError, match="cannot tell"):
        detect_layout(torch.zeros(2, 2, 16, 2, 8))
    for shape in [(64, 16, 32), (2, 64, 16, 2, 8, 1), (64, 2, 16, 31)]:
        with pytest.raises(InvalidArgumentError, match=r"0\.26\+.*0\.24-0\.25.*0\.22") as err:
            detect_layout(torch.zeros(shape))
        assert str(list(shape)) in str(err.value)
    # 600-token prompt, 576 cached: the last token is left, engine blocks of 16
    assert plan_load(600, 576, 0, 16) == 576
    assert plan_load(576, 576, 0, 16) == 560  # never the last prompt token
    assert plan_load(600, 576, 320, 16) == 256  # the engine's own prefix cache had 320
    assert plan_load(600, 0, 0, 16) == 0 and plan_load(600, 100, 320, 16) == 0
    assert plan_save(600, 0, 64) == 576 and plan_save(600, 576, 64) == 0


class Engine:
    """Paged buffers for every layer, and prefill that writes 'computed' KV into them."""

    def __init__(self, layout: str) -> None:
        self.layout = layout
        self.kv_caches = {f"model.layers.{i}.self_attn.attn": paged(layout)
                          for i in range(LAYERS)}

    def prefill(self, blocks: list[int], start: int, stop: int, seed: int) -> torch.Tensor:
        """Write KV for tokens [start, stop); returns it as [layers, 2, T, heads, dim]."""
        g = torch.Generator().manual_seed(seed)
        kv = torch.randn(LAYERS, 2, stop - start, HEADS, DIM, generator=g)
        slots = slot_mapping(blocks, BLOCK, start, stop)
        kind = kind_of(self.layout)
        for i, buffer in enumerate(self.kv_caches.values()):
            scatter_layer(buffer, slots, kv[i], kind)  # type: ignore[arg-type]
        return kv

    def read(self, blocks: list[int], start: int, stop: int) -> torch.Tensor:
        slots = slot_mapping(blocks, BLOCK, start, stop)
        kind = kind_of(self.layout)
        return torch.stack([gather_layer(b, slots, kind)  # type: ignore[arg-type]
                            for b in self.kv_caches.values()])


def step(scheduler: PoolConnectorScheduler, worker: PoolConnectorWorker, engine: Engine,
         req: ScheduledRequest, external: int) -> tuple[ConnectorPlan, set[int]]:
    """One engine step as vLLM drives the connector around a forward pass."""
    scheduler.allocated(req.req_id, external)
    plan = scheduler.build_plan([req])
    failed = worker.load(plan)
    for name, buffer in engine.kv_caches.items():  # attention layers save as they finish
        worker.save_layer(name, buffer, plan)
    worker.flush()
    return plan, failed


def connected(pool: KVPool, layout: str
              ) -> tuple[Engine, PoolConnectorScheduler, PoolConnectorWorker]:
    """An engine of ``layout`` with both connector roles on ``pool``, its KV registered."""
    engine = Engine(layout)
    worker = PoolConnectorWorker(pool)
    worker.register(engine.kv_caches)
    return engine, PoolConnectorScheduler(pool, BLOCK), worker


@pytest.mark.parametrize("layout", ["flash", "flashinfer", "hnd", "packed", "packed-nhd"])
def test_second_request_gets_the_first_requests_kv_in_its_own_blocks(
        tmp_path: Path, layout: str) -> None:
    shared = torch.randint(0, 1000, (600,), generator=torch.Generator().manual_seed(1))
    prompt_a = shared.tolist()
    prompt_b = shared[:580].tolist() + [7] * 30
    with KVPool(tmp_path / "kv", namespace="paged", chunk_tokens=CHUNK) as pool:
        engine_a, engine_b = Engine(layout), Engine(layout)
        sched = PoolConnectorScheduler(pool, BLOCK)
        worker_a = PoolConnectorWorker(pool, None if layout != "hnd" else "flash")
        worker_a.register(engine_a.kv_caches)
        # request A: nothing cached; its prefill computes all 600 tokens in one step
        assert sched.matched_tokens("a", prompt_a, 0) == 0
        blocks_a = list(range(2, 2 + 38))
        kv_a = engine_a.prefill(blocks_a, 0, 600, seed=5)
        plan, _ = step(sched, worker_a, engine_a,
                       ScheduledRequest("a", prompt_a, blocks_a, 0, 600), 0)
        assert [s.stop for s in plan.saves] == [576] and not plan.loads
        assert pool.lookup(torch.tensor(prompt_a)) == 576
        # request B shares 580 tokens; the engine's prefix cache had its first 64 itself
        worker_b = PoolConnectorWorker(pool, None if layout != "hnd" else "flash")
        worker_b.register(engine_b.kv_caches)
        external = sched.matched_tokens("b", prompt_b, 64)
        assert external == 576 - 64
        blocks_b = torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(2))[:39].tolist()
        plan, failed = step(sched, worker_b, engine_b,
                            ScheduledRequest("b", prompt_b, blocks_b, 64 + external, 34),
                            external)
        assert failed == set()
        assert [(s.start, s.stop) for s in plan.loads] == [(64, 576)]
        torch.testing.assert_close(engine_b.read(blocks_b, 64, 576), kv_a[:, :, 64:576],
                                   rtol=0, atol=0)
        assert not engine_b.read(blocks_b, 0, 64).any()  # the engine's own tokens untouched
        assert not engine_b.read(blocks_b, 576, 610).any()  # left for the prefill


def test_blocks_gone_since_the_lookup_are_reported(tmp_path: Path) -> None:
    prompt = list(range(300))
    with KVPool(tmp_path / "kv", namespace="paged", chunk_tokens=CHUNK) as pool:
        engine, sched, worker = connected(pool, "flash")
        blocks = list(range(19))
        engine.prefill(blocks, 0, 300, seed=1)
        step(sched, worker, engine, ScheduledRequest("a", prompt, blocks, 0, 300), 0)
        external = sched.matched_tokens("b", prompt, 0)
        assert external == 256
        pool.delete(torch.tensor(prompt[:256]))  # evicted since the lookup
        sched.allocated("b", external)
        plan = sched.build_plan([ScheduledRequest("b", prompt, blocks, external, 44)])
        assert worker.load(plan) == set(range(16))  # all 16 engine blocks must be recomputed


def test_a_pool_of_another_model_is_refused(tmp_path: Path) -> None:
    with KVPool(tmp_path / "kv", namespace="paged", chunk_tokens=CHUNK) as pool:
        pool.put(torch.arange(64), torch.zeros(LAYERS + 1, 2, 64, HEADS, DIM))
        worker = PoolConnectorWorker(pool)
        worker.register(Engine("flash").kv_caches)
        plan = ConnectorPlan(loads=(LoadSpec("x", torch.arange(65), tuple(range(5)), 0, 64),))
        with pytest.raises(InvalidArgumentError, match="layers"):
            worker.load(plan)


def test_a_resumed_request_loads_its_grant_once_and_unkeyable_ones_never_match(
        tmp_path: Path) -> None:
    prompt = list(range(300))
    with KVPool(tmp_path / "kv", namespace="paged", chunk_tokens=CHUNK) as pool:
        engine, sched, worker = connected(pool, "packed")
        blocks = list(range(19))
        kv = engine.prefill(blocks, 0, 300, seed=3)
        step(sched, worker, engine, ScheduledRequest("a", prompt, blocks, 0, 300), 0)
        # preempted, then resumed in new blocks: asked again, granted, loaded once
        assert sched.matched_tokens("a", prompt, 0) == 256
        sched.allocated("a", 256)
        new_blocks = list(range(30, 49))
        resumed = ScheduledRequest("a", None, new_blocks, 256, 44)  # V1: no prompt given
        plan = sched.build_plan([resumed])
        assert [(s.start, s.stop) for s in plan.loads] == [(0, 256)]
        assert worker.load(plan) == set()
        torch.testing.assert_close(engine.read(new_blocks, 0, 256), kv[:, :, :256],
                                   rtol=0, atol=0)
        assert not sched.build_plan([resumed]).loads  # never twice for one grant
        # a grant not scheduled in its step waits for the step that schedules it
        assert sched.matched_tokens("c", prompt, 0) == 256
        sched.allocated("c", 256)
        assert not sched.build_plan([]).loads
        assert len(sched.build_plan([ScheduledRequest("c", prompt, blocks, 256, 44)]).loads) == 1
        # prompt embeddings: no match, no save
        assert sched.matched_tokens("e", prompt, 0, keyable=False) == 0
        assert sched.build_plan([ScheduledRequest("e", prompt, blocks, 0, 300)]) == \
            ConnectorPlan()


def test_requests_with_another_context_share_nothing(tmp_path: Path) -> None:
    from isolane.kvpool.keys import KVContext

    prompt = list(range(300))
    salted = KVContext(cache_salt="tenant-a")
    with KVPool(tmp_path / "kv", namespace="paged", chunk_tokens=CHUNK) as pool:
        engine, sched, worker = connected(pool, "packed")
        blocks = list(range(19))
        engine.prefill(blocks, 0, 300, seed=1)
        sched.matched_tokens("a", prompt, 0, salted)
        step(sched, worker, engine, ScheduledRequest("a", prompt, blocks, 0, 300), 0)
        assert pool.lookup(prompt, context=salted) == 256
        assert pool.lookup(prompt) == 0
        assert sched.matched_tokens("b", prompt, 0) == 0
        assert sched.matched_tokens("c", prompt, 0, KVContext(cache_salt="tenant-b")) == 0
        assert sched.matched_tokens("d", prompt, 0, KVContext(cache_salt="tenant-a")) == 256
