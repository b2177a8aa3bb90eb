from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from isolane.errors import ConfigError, InvalidArgumentError
from isolane.kvpool.keys import (
    CONTEXT_MAGIC,
    KEY_BYTES,
    NAMESPACE_MAGIC,
    KVContext,
    KVNamespace,
    block_keys,
    chain_seed,
    key_from_hex,
    key_hex,
    token_bytes,
)

REPO = Path(__file__).resolve().parents[2]
NS = KVNamespace("example/model-8b", "bfloat16", "vllm:[2,L,B,H,D]", tp_rank=1, tp_size=2)
token_lists = st.lists(st.integers(0, 2**32 - 1), max_size=70)


# -- golden vector: the documented encoding, recomputed with hashlib and struct -----------
GOLDEN_TOKENS = [0, 1, 255, 256, 65535, 65536, 4294967295, 7, 8, 9]  # chunk 4: 2 keys
GOLDEN_NAMESPACE_DIGEST = "3c93a9f00b287e71c945900467b754b3"
GOLDEN_KEYS = ["36827688c04c5f2cafa5a8a6a40de595", "e5cdfc2063cffcd82fffe5ab6b94956f"]


def _blake2b_128(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def _documented_keys(tokens: list[int], chunk: int, model: str, dtype: str, layout: str,
                     tp_rank: int, tp_size: int) -> tuple[bytes, list[bytes]]:
    """docs/FORMATS.md "KV block keys", written out independently of isolane.kvpool."""
    enc = b"isolane-kvns-v1\x00"
    for text in (model, dtype, layout):
        raw = text.encode("utf-8")
        enc += struct.pack("<I", len(raw)) + raw
    enc += struct.pack("<II", tp_rank, tp_size)
    digest = _blake2b_128(enc)
    keys, prev = [], digest
    for i in range(len(tokens) // chunk):
        block = struct.pack(f"<{chunk}I", *tokens[i * chunk:(i + 1) * chunk])
        prev = _blake2b_128(prev + block)
        keys.append(prev)
    return digest, keys


def test_golden_vector_matches_the_documented_encoding() -> None:
    digest, keys = _documented_keys(GOLDEN_TOKENS, 4, "example/model-8b", "bfloat16",
                                    "vllm:[2,L,B,H,D]", 1, 2)
    assert digest.hex() == GOLDEN_NAMESPACE_DIGEST
    assert [k.hex() for k in keys] == GOLDEN_KEYS
    assert NS.digest().hex() == GOLDEN_NAMESPACE_DIGEST
    assert [key_hex(k) for k in block_keys(GOLDEN_TOKENS, 4, NS)] == GOLDEN_KEYS
    assert NS.encode()[:16] == NAMESPACE_MAGIC
    assert len(NS.encode()) == 16 + (4 + 16) + (4 + 8) + (4 + 16) + 4 + 4


@settings(max_examples=30, deadline=None)
@given(tokens=token_lists, chunk=st.integers(1, 9),
       model=st.text(min_size=1, max_size=8).map(str.strip).filter(bool))
def test_keys_follow_the_documented_encoding(tokens: list[int], chunk: int,
                                             model: str) -> None:
    ns = KVNamespace(model, "float16", "flat")
    digest, keys = _documented_keys(tokens, chunk, model, "float16", "flat", 0, 1)
    assert ns.digest() == digest
    assert ns.digest() == digest  # computed once, kept: the same
    assert ns == KVNamespace(model, "float16", "flat") and hash(ns) == hash(
        KVNamespace(model, "float16", "flat"))  # the kept digest is no field
    assert block_keys(tokens, chunk, ns) == keys


# -- properties --------------------------------------------------------------------------
def test_keys_are_the_same_in_a_process_with_another_hash_seed() -> None:
    tokens = list(range(1000, 1000 + 3 * 16 + 5))
    script = (
        "import json, sys\n"
        "from isolane.kvpool.keys import KVNamespace, block_keys\n"
        "ns = KVNamespace(**json.loads(sys.argv[1]))\n"
        "print(json.dumps([k.hex() for k in block_keys(json.loads(sys.argv[2]), 16, ns)]))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", script, json.dumps(dataclasses.asdict(NS)), json.dumps(tokens)],
        capture_output=True, text=True, check=True, cwd=REPO, env=env, timeout=60)
    theirs = json.loads(out.stdout)
    assert theirs == [k.hex() for k in block_keys(tokens, 16, NS)]
    assert len(theirs) == 3


@settings(max_examples=40, deadline=None)
@given(tokens=token_lists, cut=st.integers(0, 70), chunk=st.integers(1, 8))
def test_keys_of_a_prefix_are_a_prefix_of_the_keys(tokens: list[int], cut: int,
                                                    chunk: int) -> None:
    full = block_keys(tokens, chunk, NS)
    part = block_keys(tokens[:cut], chunk, NS)
    assert full[:len(part)] == part
    assert len(full) == len(tokens) // chunk
    assert all(len(k) == KEY_BYTES for k in full)


def test_blocks_after_a_difference_all_change() -> None:
    tokens = list(range(64))
    changed = tokens.copy()
    changed[20] += 1  # in block 1 of 16-token blocks
    a, b = block_keys(tokens, 16, NS), block_keys(changed, 16, NS)
    assert a[0] == b[0]
    assert all(x != y for x, y in zip(a[1:], b[1:], strict=True))


@pytest.mark.parametrize("change", [
    {"model": "example/model-8b-v2"}, {"dtype": "float16"}, {"layout": "vllm:[L,2,B,H,D]"},
    {"tp_rank": 0}, {"tp_size": 4}, {"tp_rank": 3, "tp_size": 4},
])
def test_any_namespace_field_changes_every_key(change: dict[str, Any]) -> None:
    other = dataclasses.replace(NS, **change)
    tokens = list(range(40))
    mine, theirs = block_keys(tokens, 8, NS), block_keys(tokens, 8, other)
    assert len(mine) == len(theirs) == 5
    assert not set(mine) & set(theirs)
    assert NS.digest() != other.digest()


def test_length_prefixes_keep_fields_apart() -> None:
    a = KVNamespace("ab", "c", "x")
    b = KVNamespace("a", "bc", "x")
    assert a.encode() != b.encode() and a.digest() != b.digest()


def test_partial_blocks_and_empty_input_give_no_keys() -> None:
    assert block_keys([], 4, NS) == []
    assert block_keys([1, 2, 3], 4, NS) == []
    assert len(block_keys(list(range(7)), 4, NS)) == 1
    assert block_keys(list(range(7)), 4, NS) == block_keys(list(range(4)), 4, NS)
    assert len(block_keys(list(range(8)), 4, NS)) == 2
    assert block_keys(np.array([], dtype=np.int64), 4, NS) == []
    assert block_keys(torch.tensor([], dtype=torch.long), 4, NS) == []


@pytest.mark.parametrize("convert", [
    list, tuple, lambda t: range(t[0], t[0] + len(t)),
    lambda t: np.asarray(t, dtype=np.int64), lambda t: np.asarray(t, dtype=np.uint32),
    lambda t: np.asarray(t, dtype=np.int32), lambda t: np.asarray(t, dtype=">i8"),
    lambda t: np.asarray(t, dtype=np.uint64), lambda t: np.repeat(np.asarray(t), 2)[::2],
    lambda t: torch.tensor(t, dtype=torch.long), lambda t: torch.tensor(t, dtype=torch.int32),
    lambda t: [np.int64(x) for x in t],
], ids=["list", "tuple", "range", "int64", "uint32", "int32", "big-endian", "uint64",
        "strided", "torch-long", "torch-int32", "numpy-scalars"])
def test_lists_arrays_and_tensors_give_the_same_keys(convert: Any) -> None:
    tokens = list(range(50_000, 50_000 + 70))
    expected = block_keys(tokens, 16, NS)
    assert len(expected) == 4
    assert block_keys(convert(tokens), 16, NS) == expected


def test_token_bytes_are_uint32_little_endian() -> None:
    assert token_bytes([1, 2**32 - 1, 256]) == struct.pack("<3I", 1, 2**32 - 1, 256)
    assert token_bytes(torch.tensor([1, 256], dtype=torch.int16)) == struct.pack("<2I", 1, 256)


# -- bad input ---------------------------------------------------------------------------
@pytest.mark.parametrize(("tokens", "where"), [
    ([0, 1, -1, 3], "token_ids[2] = -1"),
    ([0, 2**32], "token_ids[1] = 4294967296"),
    ([5, 2**70], "token_ids[1] = "),
    ([0, 1.5], "token_ids[1]"),
    ([0, "7"], "token_ids[1]"),
    (np.array([3, -5, 1]), "token_ids[1] = -5"),
    (np.array([0, 0, 2**40]), "token_ids[2] = 1099511627776"),
    (np.array([0, 2**63], dtype=np.uint64), "token_ids[1]"),
    (torch.tensor([1, 2, 3, -1]), "token_ids[3] = -1"),
])
def test_out_of_range_or_non_integer_ids_name_their_position(tokens: Any, where: str) -> None:
    with pytest.raises(InvalidArgumentError, match=r"token_ids\[") as info:
        block_keys(tokens, 2, NS)
    assert where in str(info.value)


@pytest.mark.parametrize(("tokens", "words"), [
    (np.array([1.0, 2.0]), "dtype float64"),
    (np.zeros((2, 2), dtype=np.int64), "1-D"),
    (np.array([True, False]), "dtype bool"),
    (torch.zeros(4), "integer tensor"),
    (torch.zeros(4, dtype=torch.bool), "integer tensor"),
    (torch.zeros((2, 2), dtype=torch.long), "1-D"),
    ("hello", "sequence of ints"),
    (b"\x00\x01", "sequence of ints"),
    (42, "sequence of ints"),
    ({1, 2}, "sequence of ints"),
])
def test_unsupported_token_containers_are_refused(tokens: Any, words: str) -> None:
    with pytest.raises(InvalidArgumentError, match="token_ids") as info:
        block_keys(tokens, 2, NS)
    assert words in str(info.value)


@pytest.mark.parametrize("chunk", [0, -4, 2.0, True, None])
def test_bad_chunk_tokens_is_refused(chunk: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="chunk_tokens"):
        block_keys([1, 2, 3], chunk, NS)


def test_namespace_must_be_a_kvnamespace() -> None:
    with pytest.raises(InvalidArgumentError, match="namespace"):
        block_keys([1, 2], 1, "model")  # type: ignore[arg-type]


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"model": ""}, "namespace.model"),
    ({"model": " m"}, "namespace.model"),
    ({"dtype": 16}, "namespace.dtype"),
    ({"layout": "bad\ud800"}, "namespace.layout"),
    ({"tp_size": 0}, "namespace.tp_size"),
    ({"tp_size": 2**32}, "namespace.tp_size"),
    ({"tp_rank": 2, "tp_size": 2}, "namespace.tp_rank"),
    ({"tp_rank": -1}, "namespace.tp_rank"),
    ({"tp_rank": True}, "namespace.tp_rank"),
    ({"tp_size": 2.0}, "namespace.tp_size"),
])
def test_invalid_namespace_fields_are_named(kwargs: dict[str, Any], field: str) -> None:
    base = {"model": "m", "dtype": "bfloat16", "layout": "flat"}
    with pytest.raises(ConfigError) as info:
        KVNamespace(**{**base, **kwargs})
    assert info.value.field == field
    assert isinstance(info.value, ValueError)


def test_hex_round_trip_and_validation() -> None:
    key = block_keys(list(range(4)), 4, NS)[0]
    text = key_hex(key)
    assert len(text) == 32 and text == text.lower()
    assert key_from_hex(text) == key
    for bad in ["", text[:-1], text + "0", text.upper(), "g" * 32, text[:-1] + "\n",
                " " + text[1:], None, key]:
        with pytest.raises(InvalidArgumentError, match="32 lowercase hex"):
            key_from_hex(bad)  # type: ignore[arg-type]
    for bad_key in [b"", b"\x00" * 15, b"\x00" * 17, text]:
        with pytest.raises(InvalidArgumentError, match="16 bytes"):
            key_hex(bad_key)  # type: ignore[arg-type]


# -- request context (docs/FORMATS.md "Request context"): golden vector -------------------
GOLDEN_CONTEXT = KVContext(lora_name="sql-adapter", lora_path="/adapters/sql",
                           cache_salt="tenant-a", mm_items=(("img-hash-1", 3, 5),),
                           adapter="peft:abc")
GOLDEN_CONTEXT_ENCODING = (
    "04000000" "01" "0b000000" "73716c2d61646170746572" "0d000000" "2f61646170746572732f73716c"
    "02" "08000000" "74656e616e742d61"
    "03" "0a000000" "696d672d686173682d31" "0300000000000000" "0500000000000000"
    "04" "08000000" "706566743a616263")
GOLDEN_CONTEXT_SEED = "5bccfae10c1b1a6b756748413446dbb3"
GOLDEN_CONTEXT_KEYS = ["13343526f7d731b9d2c502b13fe86623", "2fc19f18d6bccc6333c9bc1e4a17ada9"]


def test_context_golden_vector_matches_the_documented_encoding() -> None:
    assert GOLDEN_CONTEXT.encode().hex() == GOLDEN_CONTEXT_ENCODING
    seed = _blake2b_128(CONTEXT_MAGIC + bytes.fromhex(GOLDEN_NAMESPACE_DIGEST)
                        + bytes.fromhex(GOLDEN_CONTEXT_ENCODING))
    assert seed.hex() == GOLDEN_CONTEXT_SEED == chain_seed(NS, GOLDEN_CONTEXT).hex()
    keys = [key_hex(k) for k in block_keys(GOLDEN_TOKENS, 4, NS, GOLDEN_CONTEXT)]
    assert keys == GOLDEN_CONTEXT_KEYS
    # an empty context is no context: the plain keys, unchanged
    assert block_keys(GOLDEN_TOKENS, 4, NS, KVContext()) == block_keys(GOLDEN_TOKENS, 4, NS)
    assert [key_hex(k) for k in block_keys(GOLDEN_TOKENS, 4, NS, KVContext())] == GOLDEN_KEYS


@pytest.mark.parametrize("context", [
    KVContext(lora_name="a", lora_path="/p"), KVContext(lora_name="a", lora_path="/q"),
    KVContext(cache_salt="tenant-a"), KVContext(cache_salt="tenant-b"),
    KVContext(mm_items=(("img", 0, 4),)), KVContext(mm_items=(("img", 4, 4),)),
    KVContext(mm_items=(("other", 0, 4),)), KVContext(adapter="x")])
def test_every_context_field_gives_keys_of_its_own(context: KVContext) -> None:
    plain = block_keys(GOLDEN_TOKENS, 4, NS)
    keyed = block_keys(GOLDEN_TOKENS, 4, NS, context)
    assert not set(plain) & set(keyed)


def test_contexts_do_not_collide_with_each_other() -> None:
    contexts = [KVContext(lora_name="a", lora_path="b"), KVContext(lora_name="ab", lora_path=""),
                KVContext(cache_salt="a"), KVContext(adapter="a"),
                KVContext(mm_items=(("a", 1, 2),)), KVContext(mm_items=(("a", 1, 2),) * 2)]
    assert len({c.encode() for c in contexts}) == len(contexts)


@pytest.mark.parametrize("bad", [{"cache_salt": 3}, {"lora_name": "x" * 5000},
                                 {"mm_items": (("h", -1, 2),)}, {"mm_items": (("h", 1),)}])
def test_malformed_contexts_are_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgumentError, match="KVContext"):
        KVContext(**bad)
