"""Fuzzing a real node's routes: random and mutated bodies, frames, names and headers
sent to every route of a node on 127.0.0.1 never get a 500, never hang it, and leave
it serving. Bounded and deterministic (derandomized, no example database)."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from isolane.wire import frames
from isolane.wire import snapshot_stream as ss
from tests.support.node import NodeProcess, write_node_config
from tests.test_fuzz_parsers import mutations

ROUTES = [
    ("GET", "/v1/kv"), ("PUT", "/v1/kv/{ns}"), ("GET", "/v1/kv/{ns}"),
    ("GET", "/v1/kv/{ns}/stats"), ("GET", "/v1/kv/{ns}/blocks/{key}"),
    ("PUT", "/v1/kv/{ns}/blocks/{key}"), ("DELETE", "/v1/kv/{ns}/blocks/{key}"),
    ("POST", "/v1/kv/{ns}/get"), ("POST", "/v1/kv/{ns}/put"), ("POST", "/v1/kv/{ns}/lookup"),
    ("POST", "/v1/kv/{ns}/delete"), ("GET", "/v1/kv/{ns}/chains"),
    ("GET", "/v1/snapshots"), ("POST", "/v1/snapshots/_gc"), ("GET", "/v1/snapshots/{name}"),
    ("GET", "/v1/snapshots/{name}/manifest"), ("DELETE", "/v1/snapshots/{name}"),
    ("POST", "/v1/snapshots/{name}/verify"), ("POST", "/v1/snapshots/{name}/plan"),
    ("PUT", "/v1/snapshots/{name}"), ("GET", "/v1/snapshots/{name}/data"),
    ("GET", "/v1/stats"), ("GET", "/healthz"),
]
LAYOUT = json.dumps({"dtype": "float16", "shape": [2, 4], "chunk_tokens": 16,
                     "token_dim": 0}).encode()
KEY = bytes(range(16))
BATCH = frames.encode_batch_header(1) + b"".join(
    bytes(p) for p in frames.encode_frame(KEY, b"\0" * 256))
HEADER = json.dumps({"format": ss.FORMAT, "version": ss.VERSION, "name": "fz",
                     "metadata": {}, "tree": {"t": "dict", "items": []}, "tensors": [],
                     "chunks": []}).encode()
STREAM = ss.encode_preamble(HEADER) + HEADER + ss.encode_end(0, 0)
FUZZ = settings(max_examples=250, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow,
                                       HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    config = write_node_config(Path(tmp_path_factory.mktemp("fuzz")))
    with NodeProcess(config, args=("--max-request-bytes", "1MiB")) as proc:
        yield proc


names = st.one_of(st.sampled_from(["fz", "a.b", "_gc", "..", "%2e%2e", "x" * 300]),
                  st.text(alphabet="abc.-_%/~", min_size=1, max_size=20))
bodies = st.one_of(st.none(), mutations(LAYOUT), mutations(BATCH), mutations(KEY * 3),
                   mutations(STREAM), mutations(HEADER),
                   st.just(b"[" * 100_000), st.binary(max_size=2048))
headers = st.dictionaries(
    st.sampled_from(["Content-Type", "Transfer-Encoding", "X-Isolane-Plan",
                     "X-Isolane-Client", "Accept", "Range", "X-Junk"]),
    st.text(alphabet="abcdefghij0123456789-=;, /", max_size=40), max_size=3)


def send(node: NodeProcess, method: str, path: str, body: bytes | None,
         extra: dict[str, str]) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", node.port, timeout=30)
    try:
        sent = {k: v for k, v in extra.items() if k != "Transfer-Encoding"}
        conn.request(method, path, body=body, headers=sent)
        response = conn.getresponse()
        response.read()
        return response.status
    except (ConnectionError, http.client.HTTPException):
        return 0  # the node closed a connection whose body it would not read: fine
    finally:
        conn.close()


def test_no_route_answers_500_to_hostile_input(node: NodeProcess) -> None:
    statuses: dict[int, int] = {}

    @FUZZ
    @given(route=st.sampled_from(ROUTES), ns=names, name=names,
           key=st.sampled_from([KEY.hex(), "zz", "0" * 31, "g" * 32]), body=bodies,
           extra=headers, query=st.sampled_from(["", "?overwrite=1", "?keys=a,b",
                                                  "?mirror=2", "?x=%zz"]))
    @example(route=("PUT", "/v1/kv/{ns}"), ns="deep", name="n", key=KEY.hex(),
             body=b"[" * 100_000, extra={}, query="")
    @example(route=("POST", "/v1/snapshots/{name}/plan"), ns="n", name="deep", key=KEY.hex(),
             body=HEADER.replace(b'"tree"', b'"d": ' + b"[" * 50_000 + b"]" * 50_000
                                 + b', "tree"'), extra={}, query="")
    def check(route: tuple[str, str], ns: str, name: str, key: str, body: bytes | None,
              extra: dict[str, str], query: str) -> None:
        method, template = route
        path = template.format(ns=ns, name=name, key=key) + query
        status = send(node, method, path, body, extra)
        statuses[status] = statuses.get(status, 0) + 1
        assert status < 500 or status in (503, 507), (method, path, status)

    check()
    assert node.request("GET", "/healthz")[0] == 200  # still serving
    assert statuses.get(200, 0) + statuses.get(201, 0) > 0, statuses  # some got through
    assert statuses.get(400, 0) > 0, statuses
