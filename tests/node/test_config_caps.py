"""The KV and upload caps set in a node's config (``node.max_request_bytes`` and
friends): a node started from that config refuses an over-cap request with 413 (or
400) naming the config field that raises the cap, and a serve flag overrides it."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator

import pytest

from isolane.wire import frames
from tests.support.node import NodeProcess, write_node_config

KEY = bytes(range(32))[: frames.KEY_BYTES]


@pytest.fixture(scope="module")
def capped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    config = write_node_config(tmp_path_factory.mktemp("caps"), node={
        "max_request_bytes": "64KiB", "max_block_bytes": "4KiB", "max_batch_blocks": 4,
        "max_upload_bytes": "1KiB", "max_header_bytes": "1KiB"})
    with NodeProcess(config) as proc:
        proc.json("PUT", "/v1/kv/caps", {"dtype": "float16", "shape": [1, 1, 1, 8],
                                          "chunk_tokens": 16, "token_dim": 2})
        yield proc


def _refusal(proc: NodeProcess, method: str, path: str, body: bytes) -> tuple[int, str]:
    status, raw = proc.request(method, path, body)
    return status, str(json.loads(raw)["message"])


def test_a_block_over_the_config_cap_is_413_naming_the_field(capped: NodeProcess) -> None:
    status, message = _refusal(capped, "PUT", f"/v1/kv/caps/blocks/{KEY.hex()}",
                               b"x" * (5 << 10))
    assert status == 413, message
    assert "node.max_block_bytes" in message and "4096" in message


def test_a_layout_whose_blocks_exceed_the_cap_is_400_naming_the_field(
        capped: NodeProcess) -> None:
    layout = json.dumps({"dtype": "float16", "shape": [2, 4, 8, 64],
                         "chunk_tokens": 256, "token_dim": 2}).encode()
    status, message = _refusal(capped, "PUT", "/v1/kv/wide", layout)
    assert status == 400, message
    assert "node.max_block_bytes" in message


def test_a_key_list_over_max_batch_blocks_is_413_naming_the_field(
        capped: NodeProcess) -> None:
    status, message = _refusal(capped, "POST", "/v1/kv/caps/lookup", KEY * 5)
    assert status == 413, message
    assert "node.max_batch_blocks" in message


def test_a_batch_declaring_too_many_blocks_is_413_naming_the_field(
        capped: NodeProcess) -> None:
    header = frames.BATCH_HEADER.pack(frames.BATCH_MAGIC, frames.VERSION, 0, 5)
    status, message = _refusal(capped, "POST", "/v1/kv/caps/put", header)
    assert status == 413, message
    assert "node.max_batch_blocks" in message


def test_a_batch_over_max_request_bytes_is_413_naming_the_field(capped: NodeProcess) -> None:
    status, message = _refusal(capped, "POST", "/v1/kv/caps/put", b"\0" * (65 << 10))
    assert status == 413, message
    assert "node.max_request_bytes" in message


def test_an_upload_over_max_upload_bytes_is_413_naming_the_field(capped: NodeProcess) -> None:
    body = struct.pack("<Q", 16) + b"\0" * (4 << 10)
    status, message = _refusal(capped, "PUT", "/v1/snapshots/big", body)
    assert status == 413, message
    assert "node.max_upload_bytes" in message


def test_a_serve_flag_overrides_the_config_cap(tmp_path_factory: pytest.TempPathFactory
                                               ) -> None:
    config = write_node_config(tmp_path_factory.mktemp("flag"),
                               node={"max_block_bytes": "4KiB"})
    with NodeProcess(config, args=("--max-block-bytes", "2KiB")) as proc:
        status, message = _refusal(proc, "PUT", f"/v1/kv/caps/blocks/{KEY.hex()}",
                                   b"x" * (3 << 10))
    assert status == 413, message
    assert "2048" in message
