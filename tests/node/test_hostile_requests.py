"""Hostile requests to a real node: bounded work, caps checked before the work starts
(413/400 naming the config field that raises them), no 500 from a parser, and a node
that stops within its shutdown timeout whatever it was asked to plan."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.node import NodeProcess, write_node_config

DEEP = 100_000


def stream_header(name: str, n_tensors: int, tree: Any = None) -> bytes:
    """A plan request's header declaring ``n_tensors`` empty tensors."""
    return json.dumps({
        "format": "isolane-snapshot-stream", "version": 2, "name": name, "metadata": {},
        "tree": tree if tree is not None else {"t": "dict", "items": [
            [f"t{i}", {"t": "tensor", "id": i}] for i in range(n_tensors)]},
        "tensors": [{"id": i, "key": f"t{i}", "dtype": "float32", "shape": [0],
                     "nbytes": 0} for i in range(n_tensors)],
        "chunks": []}).encode()


@pytest.fixture(scope="module")
def capped(tmp_path_factory: pytest.TempPathFactory) -> Any:
    config = write_node_config(tmp_path_factory.mktemp("capped"), node={
        "max_snapshot_tensors": 1000, "max_json_depth": 64, "max_header_bytes": "1MiB"})
    with NodeProcess(config) as proc:
        yield proc


def _error(raw: bytes) -> str:
    return str(json.loads(raw)["message"])


def test_a_json_body_nested_100k_deep_is_400_naming_the_cap(capped: NodeProcess) -> None:
    body = b'{"dtype": "float16", "shape": ' + b"[" * DEEP + b"]" * DEEP + b"}"
    status, raw = capped.request("PUT", "/v1/kv/deep", body)
    assert status == 400, raw
    assert "node.max_json_depth" in _error(raw)
    assert capped.request("GET", "/healthz")[0] == 200


def test_a_stream_header_nested_100k_deep_is_400(capped: NodeProcess) -> None:
    header = stream_header("deep", 1).replace(
        b'"tree": {', b'"deep": ' + b"[" * DEEP + b"]" * DEEP + b', "tree": {', 1)
    status, raw = capped.request("POST", "/v1/snapshots/deep/plan", header)
    assert status == 400, raw
    assert "node.max_json_depth" in _error(raw)


def test_too_many_tensors_is_413_naming_the_field(capped: NodeProcess) -> None:
    status, raw = capped.request("POST", "/v1/snapshots/many/plan", stream_header("many", 1001))
    assert status == 413, raw
    message = _error(raw)
    assert "1001 tensors" in message and "node.max_snapshot_tensors" in message
    assert capped.request("POST", "/v1/snapshots/few/plan", stream_header("few", 1000)
                          )[0] == 200


def test_a_header_over_its_cap_is_413_naming_the_field(capped: NodeProcess) -> None:
    header = stream_header("big", 1).replace(b'"metadata": {}',
                                             b'"metadata": {"x": "' + b"a" * (2 << 20) + b'"}')
    status, raw = capped.request("POST", "/v1/snapshots/big/plan", header)
    assert status == 413, raw
    assert "node.max_header_bytes" in _error(raw)


def test_a_node_planning_40k_tensors_stops_within_its_shutdown_timeout(tmp_path: Path
                                                                        ) -> None:
    config = write_node_config(tmp_path)
    node = NodeProcess(config, args=("--shutdown-timeout", "5")).start()
    answers: list[int] = []

    def plan() -> None:
        answers.append(node.request("POST", "/v1/snapshots/flood/plan",
                                    stream_header("flood", 40_000))[0])

    thread = threading.Thread(target=plan, daemon=True)
    thread.start()
    time.sleep(4.0)  # the header is in, planning runs
    started = time.monotonic()
    code = node.stop(timeout_s=60)
    assert time.monotonic() - started < 15, "the node did not stop in its shutdown timeout"
    assert code == 0
    thread.join(30)
