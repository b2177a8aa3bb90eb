"""What an SGLang page is keyed by (pure: no SGLang, no storage)."""

from __future__ import annotations

import pytest

from isolane.errors import ConfigError
from isolane.integrations.sglang.pages import (
    PageFormat,
    check_page_format,
    default_namespace,
    page_keys,
    scope_digest,
    sharded,
    storage_scope,
)
from isolane.kvpool.namespaces import check_namespace

PAGE = PageFormat("bfloat16", 1024, "page_first")


def scope(rank: int = 0, size: int = 2, *, mla: bool = False, pp: int = 1) -> object:
    return storage_scope("org/model", tp_rank=rank, tp_size=size, pp_rank=0, pp_size=pp,
                         cp_rank=0, cp_size=1, is_mla=mla, writer=rank == 0)


def keys_of(s: object, page: PageFormat = PAGE) -> list[bytes]:
    return page_keys(scope_digest(s, page), ["a" * 64, "b" * 64])  # type: ignore[arg-type]


def test_mha_pages_are_keyed_per_rank_mla_pages_once() -> None:
    assert keys_of(scope(0)) != keys_of(scope(1))
    assert keys_of(scope(0, mla=True)) == keys_of(scope(1, mla=True)) \
        == keys_of(scope(0, 8, mla=True))  # any TP size: one copy
    assert scope(1, mla=True).writer is False and scope(1).writer is True
    mamba = sharded(scope(1, mla=True), 1, 2)  # Mamba state stays per rank under MLA
    assert keys_of(mamba) == keys_of(scope(1))


def test_model_dtype_layout_size_and_stage_change_every_key() -> None:
    base = keys_of(scope())
    others = [keys_of(scope(pp=2)),
              keys_of(scope(), PageFormat("float16", 1024, "page_first")),
              keys_of(scope(), PageFormat("bfloat16", 1024, "layer_first")),
              keys_of(scope(), PageFormat("bfloat16", 2048, "page_first")),
              page_keys(scope_digest(storage_scope(
                  "org/other", tp_rank=0, tp_size=2, pp_rank=0, pp_size=1, cp_rank=0,
                  cp_size=1, is_mla=False, writer=True), PAGE), ["a" * 64, "b" * 64])]
    assert all(not set(base) & set(o) for o in others)
    assert len(set(base)) == 2 and all(len(k) == 16 for k in base)


def test_default_namespace_is_always_valid() -> None:
    for model in ["meta-llama/Llama-3.1-8B", None, "a b/c..d//e", "/abs/path/", "ü" * 300]:
        check_namespace(default_namespace(model))
    assert default_namespace("meta-llama/Llama-3.1-8B") == "sglang/meta-llama/Llama-3.1-8B"


def test_pages_of_another_size_or_dtype_are_refused_with_the_way_out() -> None:
    check_page_format(("bfloat16", (1024,)), PAGE, "ns", "x")
    with pytest.raises(ConfigError, match="use another isolane_namespace"):
        check_page_format(("bfloat16", (2048,)), PAGE, "ns", "the registered host KV pool")
    with pytest.raises(ConfigError, match="float16"):
        check_page_format(("float16", (1024,)), PAGE, "ns", "x")
