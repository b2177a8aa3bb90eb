"""The KV pool contract: what every KV pool promises, whatever it runs on.

In the manner of zarr's ``StoreTests``: ``KVPoolContract`` holds the tests, a module per
implementation subclasses it and provides ``open_pool`` (a factory: ``open_pool(
namespace=..., token_dim=...)`` returns a new pool on that implementation's storage,
closed after the test). Every test works in a namespace of its own, so one storage (one
folder, one node) can serve the whole class. The token-level API (put, lookup, get,
get_into, prefetch, delete, with or without a ``KVContext``) and the block-level API
(put_blocks, get_blocks, lookup_blocks, delete_blocks, block_keys) are tested the same
way on each; where two pools disagreed, the test here fixed the behaviour both keep.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any, ClassVar

import pytest
import torch

from isolane.errors import ConfigError, InvalidArgumentError, IsolaneError
from isolane.kvpool.api import KVPoolAPI, TokenLayer
from isolane.kvpool.keys import KEY_BYTES, KVContext

CT = 16  # chunk_tokens of every contract pool
OpenPool = Callable[..., Any]


def tokens(n: int, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50_000, (n,), generator=gen).tolist()


def kv_for(n: int, *, token_dim: int = 2, seed: int = 0,
           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A KV tensor of a small model: (layers=2, k/v=2, T, heads=2, head_dim=4), with
    the token dimension moved to ``token_dim``."""
    gen = torch.Generator().manual_seed(seed + 1)
    kv = torch.randn(2, 2, n, 2, 4, generator=gen).to(dtype)
    return kv.movedim(2, token_dim)


class KVPoolContract:
    """Tests every KV pool passes. Subclasses provide the ``open_pool`` fixture."""

    #: stats keys every pool reports
    STATS_KEYS: ClassVar[tuple[str, ...]] = ("namespace", "chunk_tokens")

    @pytest.fixture
    def open_pool(self) -> OpenPool:  # pragma: no cover - provided by subclasses
        raise NotImplementedError

    @pytest.fixture
    def ns(self) -> str:
        return "contract-" + secrets.token_hex(4)

    @pytest.fixture
    def pool(self, open_pool: OpenPool, ns: str) -> Any:
        return open_pool(namespace=ns)

    # -- the protocol ----------------------------------------------------------------------
    def test_keeps_the_kv_pool_protocol(self, pool: Any) -> None:
        # One protocol (kvpool.api), one token level: the integrations rely on both.
        assert isinstance(pool, KVPoolAPI) and isinstance(pool, TokenLayer)
        assert type(pool).put is TokenLayer.put and type(pool).get_into is TokenLayer.get_into

    # -- token level ---------------------------------------------------------------------
    def test_put_lookup_get_round_trip(self, pool: Any) -> None:
        ids = tokens(4 * CT + 5)
        kv = kv_for(len(ids))
        assert pool.put(ids, kv) == 4  # full blocks only
        assert pool.lookup(ids) == 4 * CT
        n, got = pool.get(ids)
        assert n == 4 * CT
        assert got is not None and got.dtype == kv.dtype
        assert torch.equal(got, kv.narrow(2, 0, 4 * CT))

    def test_put_again_stores_nothing_new(self, pool: Any) -> None:
        ids = tokens(2 * CT)
        assert pool.put(ids, kv_for(len(ids))) == 2
        assert pool.put(ids, kv_for(len(ids))) == 0

    def test_longer_prompt_finds_stored_prefix(self, pool: Any) -> None:
        ids = tokens(5 * CT)
        kv = kv_for(len(ids))
        pool.put(ids[:2 * CT], kv.narrow(2, 0, 2 * CT))
        assert pool.lookup(ids) == 2 * CT
        n, got = pool.get(ids)
        assert n == 2 * CT and got is not None
        assert torch.equal(got, kv.narrow(2, 0, 2 * CT))
        # a prompt diverging in its second block shares only the first
        other = ids[:CT] + tokens(CT, seed=9)
        assert pool.lookup(other) == CT

    def test_misses(self, pool: Any) -> None:
        ids = tokens(3 * CT)
        # before any put: no layout, nothing found
        assert pool.lookup(ids) == 0
        assert pool.get(ids) == (0, None)
        assert pool.get_into(ids, kv_for(len(ids))) == 0
        assert pool.block_keys(ids) == []
        pool.put(ids, kv_for(len(ids)))
        unknown = tokens(3 * CT, seed=5)
        assert pool.lookup(unknown) == 0
        assert pool.get(unknown) == (0, None)
        assert pool.get_into(unknown, kv_for(len(unknown))) == 0
        assert pool.lookup(ids[:CT - 1]) == 0  # less than a block

    def test_get_into(self, pool: Any) -> None:
        ids = tokens(3 * CT)
        kv = kv_for(len(ids))
        pool.put(ids[:2 * CT], kv.narrow(2, 0, 2 * CT))
        out = torch.zeros_like(kv)
        assert pool.get_into(ids, out) == 2 * CT
        assert torch.equal(out.narrow(2, 0, 2 * CT), kv.narrow(2, 0, 2 * CT))
        with pytest.raises(InvalidArgumentError, match="room"):
            pool.get_into(ids, torch.zeros_like(kv.narrow(2, 0, CT)))
        with pytest.raises(InvalidArgumentError, match="dtype"):
            pool.get_into(ids, torch.zeros_like(kv, dtype=torch.float16))
        with pytest.raises(InvalidArgumentError, match="shape"):
            pool.get_into(ids, torch.zeros(2, 2, 3 * CT, 2, 5))

    def test_prefetch_reports_the_cached_prefix(self, pool: Any) -> None:
        ids = tokens(3 * CT)
        pool.put(ids[:2 * CT], kv_for(2 * CT))
        assert pool.prefetch(ids).result(timeout=30) == 2 * CT
        assert pool.prefetch(tokens(2 * CT, seed=3)).result(timeout=30) == 0
        assert pool.get(ids)[0] == 2 * CT

    def test_delete(self, pool: Any) -> None:
        ids = tokens(3 * CT)
        pool.put(ids, kv_for(len(ids)))
        assert pool.delete(ids[:2 * CT]) == 2
        assert pool.lookup(ids) == 0
        assert pool.delete(ids[:2 * CT]) == 0
        assert pool.delete(ids) == 1
        assert pool.get(ids) == (0, None)

    def test_context_keys_apart(self, pool: Any) -> None:
        ids = tokens(2 * CT)
        kv = kv_for(len(ids))
        tenant = KVContext(cache_salt="tenant-a")
        lora = KVContext(lora_name="adapter", lora_path="/models/adapter")
        assert pool.put(ids, kv, context=tenant) == 2
        assert pool.lookup(ids) == 0
        assert pool.lookup(ids, context=lora) == 0
        assert pool.lookup(ids, context=tenant) == 2 * CT
        n, got = pool.get(ids, context=tenant)
        assert n == 2 * CT and got is not None and torch.equal(got, kv)
        out = torch.zeros_like(kv)
        assert pool.get_into(ids, out, context=tenant) == 2 * CT
        assert torch.equal(out, kv)
        assert pool.prefetch(ids, context=tenant).result(timeout=30) == 2 * CT
        assert pool.block_keys(ids, tenant) != pool.block_keys(ids)
        assert pool.block_keys(ids, KVContext()) == pool.block_keys(ids)
        assert pool.delete(ids) == 0
        assert pool.delete(ids, context=tenant) == 2
        assert pool.lookup(ids, context=tenant) == 0

    def test_bfloat16(self, pool: Any) -> None:
        ids = tokens(2 * CT)
        kv = kv_for(len(ids), dtype=torch.bfloat16)
        pool.put(ids, kv)
        n, got = pool.get(ids)
        assert n == 2 * CT and got is not None and got.dtype == torch.bfloat16
        assert torch.equal(got, kv)

    @pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
    def test_float8(self, pool: Any, dtype: torch.dtype) -> None:
        # FP8 KV caches (vLLM's kv_cache_dtype="fp8"): numpy has no such dtype, so the
        # bytes must not go through tensor.numpy().
        ids = tokens(2 * CT)
        kv = kv_for(len(ids), dtype=dtype)
        assert pool.put(ids, kv) == 2
        n, got = pool.get(ids)
        assert n == 2 * CT and got is not None and got.dtype == dtype
        assert torch.equal(got.view(torch.uint8), kv.view(torch.uint8))
        out = torch.empty_like(kv)
        assert pool.get_into(ids, out) == 2 * CT
        assert torch.equal(out.view(torch.uint8), kv.view(torch.uint8))

    def test_non_contiguous_kv(self, pool: Any) -> None:
        ids = tokens(2 * CT)
        kv = kv_for(len(ids)).transpose(3, 4).contiguous().transpose(3, 4)
        assert not kv.is_contiguous()
        pool.put(ids, kv)
        n, got = pool.get(ids)
        assert n == 2 * CT and got is not None and torch.equal(got, kv)

    # -- block level ---------------------------------------------------------------------
    def test_block_keys(self, pool: Any) -> None:
        ids = tokens(3 * CT + 1)
        pool.put(ids, kv_for(len(ids)))
        keys = pool.block_keys(ids)
        assert len(keys) == 3 and all(len(k) == KEY_BYTES for k in keys)
        assert len(set(keys)) == 3
        assert pool.block_keys(ids[:2 * CT]) == keys[:2]  # chained: a prefix's keys lead
        assert pool.block_keys(ids) == keys  # deterministic
        assert pool.block_keys(tokens(3 * CT, seed=4))[0] != keys[0]

    def test_blocks_round_trip(self, pool: Any) -> None:
        ids = tokens(3 * CT)
        kv = kv_for(len(ids))
        pool.put(ids[:CT], kv.narrow(2, 0, CT))  # fixes the layout
        keys = pool.block_keys(ids)
        blocks = [kv.narrow(2, i * CT, CT).contiguous() for i in range(3)]
        raw = [b.reshape(-1).view(torch.uint8).numpy().tobytes() for b in blocks]
        assert pool.put_blocks(keys, raw) == 2  # the first was stored by put
        assert pool.lookup_blocks(keys) == 3
        got = pool.get_blocks(keys)
        assert [bytes(g) if g is not None else None for g in got] == raw
        assert pool.get(ids)[0] == 3 * CT  # the token level sees block-level puts
        assert pool.delete_blocks(keys[1:2]) == 1
        assert pool.lookup_blocks(keys) == 1
        got = pool.get_blocks(keys)
        assert got[1] is None and got[0] is not None and got[2] is not None
        assert pool.delete_blocks(keys) == 2
        assert pool.lookup_blocks(keys) == 0
        assert pool.get_blocks(keys) == [None, None, None]
        assert pool.get_blocks([]) == [] and pool.lookup_blocks([]) == 0
        assert pool.delete_blocks([]) == 0 and pool.put_blocks([], []) == 0

    def test_put_blocks_refuses_bad_input(self, pool: Any) -> None:
        ids = tokens(2 * CT)
        kv = kv_for(len(ids))
        pool.put(ids[:CT], kv.narrow(2, 0, CT))
        keys = pool.block_keys(ids)
        block = kv.narrow(2, CT, CT).contiguous().reshape(-1).view(torch.uint8).numpy()
        with pytest.raises(InvalidArgumentError, match="bytes"):
            pool.put_blocks(keys[1:], [block.tobytes()[:-4]])
        with pytest.raises(InvalidArgumentError, match="keys"):
            pool.put_blocks(keys, [block.tobytes()])
        assert pool.lookup_blocks(keys) == 1  # nothing was stored

    def test_put_blocks_before_a_layout_is_refused(self, pool: Any) -> None:
        # Nothing can check a block's size before the namespace's layout is fixed: a
        # pool that stored it would drop it later as the wrong size, silently.
        with pytest.raises(InvalidArgumentError, match="layout"):
            pool.put_blocks([b"k" * KEY_BYTES], [b"abc"])
        assert pool.lookup_blocks([b"k" * KEY_BYTES]) == 0

    def test_adopt_layout_then_blocks_into_strided_views(self, pool: Any) -> None:
        # Block-level users with keys of their own (an engine's page hashes) fix the
        # layout without a put and read blocks straight into views of a larger buffer.
        assert pool.adopt_layout("bfloat16", (2, 2, 2, 4)) == ("bfloat16", (2, 2, 2, 4))
        assert pool.adopt_layout("float32", (8,)) == ("bfloat16", (2, 2, 2, 4))  # kept
        with pytest.raises(InvalidArgumentError, match="dtype"):
            pool.adopt_layout("no_such_dtype", (8,))
        host = torch.randn(2, 6, CT, 2, 2, 4).to(torch.bfloat16)  # 6 blocks, strided
        keys = [bytes([i]) * KEY_BYTES for i in range(1, 5)]
        sources = [host[:, i] for i in range(4)]
        assert not sources[0].is_contiguous()
        assert pool.put_blocks(keys[:3], [s.contiguous().view(torch.uint8).numpy()
                                          for s in sources[:3]]) == 3
        target = torch.zeros_like(host)
        assert pool.get_blocks_into(keys, [target[:, 5 - i] for i in range(4)]) == 3
        for i in range(3):
            assert torch.equal(target[:, 5 - i], sources[i])
        assert not target[:, :3].any()  # nothing written past the stored prefix
        with pytest.raises(InvalidArgumentError, match="bytes"):
            pool.get_blocks_into(keys[:1], [target[:, 0, :1]])
        with pytest.raises(InvalidArgumentError, match="destinations"):
            pool.get_blocks_into(keys, [target[:, 0]])
        assert pool.get_blocks_into([], []) == 0

    # -- namespaces ------------------------------------------------------------------------
    def test_namespaces_are_apart(self, open_pool: OpenPool, pool: Any, ns: str) -> None:
        ids = tokens(2 * CT)
        kv = kv_for(len(ids))
        pool.put(ids, kv)
        other = open_pool(namespace=ns + "-other")
        other.put(ids[:CT], kv.narrow(2, 0, CT))
        assert other.lookup(ids) == CT
        assert other.delete(ids) == 1
        assert pool.lookup(ids) == 2 * CT

    def test_reopened_namespace_keeps_blocks_and_layout(self, open_pool: OpenPool,
                                                         pool: Any, ns: str) -> None:
        ids = tokens(2 * CT)
        kv = kv_for(len(ids), dtype=torch.float16)
        pool.put(ids, kv)
        pool.close()
        again = open_pool(namespace=ns)
        assert again.layout == pool.layout == ("float16", (2, 2, 2, 4))
        n, got = again.get(ids)
        assert n == 2 * CT and got is not None and torch.equal(got, kv)

    # -- token_dim, dtype and shape ------------------------------------------------------------
    @pytest.mark.parametrize("token_dim", [0, 2, 4, -1, -3])
    def test_token_dim(self, open_pool: OpenPool, ns: str, token_dim: int) -> None:
        pool = open_pool(namespace=ns, token_dim=token_dim)
        ids = tokens(2 * CT + 3)
        kv = kv_for(len(ids), token_dim=token_dim % 5)
        assert pool.put(ids, kv) == 2
        n, got = pool.get(ids)
        assert n == 2 * CT and got is not None
        assert got.shape == kv.narrow(token_dim, 0, 2 * CT).shape
        assert torch.equal(got, kv.narrow(token_dim, 0, 2 * CT))
        out = torch.zeros_like(kv)
        assert pool.get_into(ids, out) == 2 * CT
        assert torch.equal(out.narrow(token_dim, 0, 2 * CT), got)

    def test_negative_token_dim_keys_as_its_positive_twin(self, open_pool: OpenPool,
                                                          ns: str) -> None:
        ids = tokens(2 * CT)
        kv = kv_for(len(ids))
        neg = open_pool(namespace=ns, token_dim=-3)
        neg.put(ids, kv)
        keys = neg.block_keys(ids)
        neg.close()
        pos = open_pool(namespace=ns, token_dim=2)  # the same namespace, the same layout
        assert pos.layout == ("float32", (2, 2, 2, 4))
        assert pos.block_keys(ids) == keys
        n, got = pos.get(ids)
        assert n == 2 * CT and got is not None and torch.equal(got, kv)
        pos.close()
        with pytest.raises(ConfigError, match="token_dim"):  # another dimension: refused
            open_pool(namespace=ns, token_dim=1).lookup(ids)

    @pytest.mark.parametrize("token_dim", [5, 7, -6])
    def test_token_dim_out_of_range_is_refused(self, open_pool: OpenPool, ns: str,
                                               token_dim: int) -> None:
        try:
            pool = open_pool(namespace=ns, token_dim=token_dim)
        except InvalidArgumentError as exc:  # refused at once: fine too
            assert "token_dim" in str(exc)
            return
        ids = tokens(2 * CT)
        with pytest.raises(InvalidArgumentError, match="token_dim"):
            pool.put(ids, kv_for(len(ids)))
        assert pool.layout is None and pool.lookup(ids) == 0

    def test_wrong_dtype_or_shape_is_refused(self, pool: Any) -> None:
        ids = tokens(2 * CT)
        pool.put(ids, kv_for(len(ids)))
        more = tokens(2 * CT, seed=2)
        with pytest.raises(InvalidArgumentError, match="does not match"):
            pool.put(more, kv_for(len(more), dtype=torch.float16))
        with pytest.raises(InvalidArgumentError, match="does not match"):
            pool.put(more, torch.zeros(2, 2, len(more), 2, 8))
        with pytest.raises(InvalidArgumentError, match="token"):
            pool.put(more, kv_for(len(more) - 1))  # token count differs
        with pytest.raises(InvalidArgumentError, match=r"torch\.Tensor"):
            pool.put(more, kv_for(len(more)).numpy())
        assert pool.lookup(more) == 0
        assert pool.layout == ("float32", (2, 2, 2, 4))

    # -- stats and close -----------------------------------------------------------------------
    def test_stats(self, pool: Any, ns: str) -> None:
        ids = tokens(2 * CT)
        pool.put(ids, kv_for(len(ids)))
        stats = pool.stats()
        for key in self.STATS_KEYS:
            assert key in stats, key
        assert stats["namespace"] == ns and stats["chunk_tokens"] == CT

    def test_use_after_close_is_refused(self, pool: Any) -> None:
        ids = tokens(2 * CT)
        pool.put(ids, kv_for(len(ids)))
        pool.close()
        pool.close()  # twice is fine
        calls: list[Callable[[], object]] = [
            lambda: pool.put(tokens(2 * CT, seed=8), kv_for(2 * CT)),
            lambda: pool.get(ids), lambda: pool.lookup(ids),
            lambda: pool.get_blocks(pool.block_keys(ids)),
        ]
        for call in calls:
            with pytest.raises(IsolaneError, match="closed"):
                call()
