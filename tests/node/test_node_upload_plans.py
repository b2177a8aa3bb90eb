"""A node keeps the plan of a plan request for its upload (``isolane.node.upload_plans``):
a re-save plans once and sends only the changed chunks; a plan token that is unknown,
used, foreign or stale is never trusted (the upload is planned again)."""

from __future__ import annotations

import itertools
import json
import secrets
import socket
import time

import torch

from isolane.client.snapshot_store import RemoteSnapshotStore
from isolane.wire import snapshot_stream as ss
from tests.support.node import NodeProcess
from tests.support.snapstreams import plan_request, stream_for


def _plans(node: NodeProcess) -> tuple[int, int]:
    counts = node.json("GET", "/v1/stats")["snapshots"]
    return counts["plans"], counts["plans_reused"]


def _received(node: NodeProcess) -> int:
    return int(node.json("GET", "/v1/stats")["totals"]["bytes_in"])


def test_a_resave_through_a_node_plans_once_and_sends_only_the_changed_chunks(
        node: NodeProcess, unique: str) -> None:
    base = {f"w{i}": torch.randn(512, 1024) for i in range(4)}  # 2 MiB each: 2 chunks
    state = {"base": base, "adapter": torch.randn(300, 1024), "bias": torch.ones(8),
             "step": 1}
    adapter_bytes = 300 * 1024 * 4
    with RemoteSnapshotStore(node.url, token=node.token) as store:
        before = _plans(node)
        store.save(state, f"once-{unique}-0")
        first = _plans(node)
        assert first == (before[0] + 1, before[1] + 1)  # the plan request's plan, reused
        with torch.no_grad():
            state["adapter"].add_(1)
        received = _received(node)
        info = store.save(state, f"once-{unique}-1")
        sent = _received(node) - received
        assert _plans(node) == (first[0] + 1, first[1] + 1)  # planned once, not twice
        assert info.parent is not None and info.parent["name"] == f"once-{unique}-0"
        assert info.linked_bytes >= 4 * 512 * 1024 * 4  # the base: linked on the node
        assert adapter_bytes <= sent < adapter_bytes + (256 << 10)  # + headers, hashes
        back = store.load(f"once-{unique}-1")
        assert torch.equal(back["adapter"], state["adapter"])
        assert all(torch.equal(back["base"][k], v) for k, v in base.items())
        store.delete(f"once-{unique}-0")
        store.delete(f"once-{unique}-1")


def _put(node: NodeProcess, name: str, body: bytes, token: str | None, client: str,
         query: str = "") -> tuple[int, bytes]:
    headers = {"X-Isolane-Client": client, "Content-Type": ss.CONTENT_TYPE}
    if token is not None:
        headers["X-Isolane-Plan"] = token
    return node.request("PUT", f"/v1/snapshots/{name}{query}", body, headers)


def _committed(node: NodeProcess, name: str, state: dict[str, torch.Tensor]) -> None:
    with RemoteSnapshotStore(node.url, token=node.token) as store:
        back = store.load(name)
        assert all(torch.equal(back[k], v) for k, v in state.items())
        store.delete(name)


def test_a_plan_token_unknown_used_foreign_or_for_another_header_is_planned_again(
        node: NodeProcess, unique: str) -> None:
    state = {"w": torch.arange(300_000.0), "small": torch.ones(3)}  # a big chunk and a pack
    me = {"X-Isolane-Client": "me-" + unique}
    # unknown (well formed, never answered): planned again, committed as any upload
    name = f"tok-unknown-{unique}"
    header, views, token = plan_request(node, name, state, headers=me)
    assert token is not None
    before = _plans(node)
    status, raw = _put(node, name, stream_for(header, views), secrets.token_urlsafe(24),
                       me["X-Isolane-Client"])
    assert status == 201, raw
    assert _plans(node) == (before[0] + 1, before[1])
    _committed(node, name, state)
    # foreign: my token sent by another client is not trusted, and not spent ...
    name = f"tok-foreign-{unique}"
    header, views, token = plan_request(node, name, state, headers=me)
    good = stream_for(header, views)
    cut = good[:-ss.END.size] + b"NOTTHEND" + good[-ss.END.size + 8:]  # fails at the end
    before = _plans(node)
    status, raw = _put(node, name, cut, token, "you-" + unique)
    assert status == 400, raw
    assert _plans(node) == (before[0] + 1, before[1])  # planned again for the stranger
    # ... so it still serves me, once (an upload that failed spent it too)
    status, raw = _put(node, name, cut, token, me["X-Isolane-Client"])
    assert status == 400, raw
    assert _plans(node) == (before[0] + 1, before[1] + 1)
    status, raw = _put(node, name, good, token, me["X-Isolane-Client"])
    assert status == 201, raw  # used: planned again
    assert _plans(node) == (before[0] + 2, before[1] + 1)
    _committed(node, name, state)
    # a plan for one header, an upload of another (its metadata changed): planned again
    name = f"tok-other-{unique}"
    header, views, token = plan_request(node, name, state, headers=me)
    other = ss.StreamHeader(header.name, header.tree, header.tensors, {"step": 2},
                            header.chunks)
    before = _plans(node)
    status, raw = _put(node, name, stream_for(other, views), token, me["X-Isolane-Client"])
    assert status == 201, raw
    assert _plans(node) == (before[0] + 1, before[1])
    assert node.json("GET", f"/v1/snapshots/{name}")["metadata"] == {"step": 2}
    _committed(node, name, state)


def test_a_plan_made_before_another_save_committed_is_planned_again(
        node: NodeProcess, unique: str) -> None:
    state = {"w": torch.arange(300_000.0), "small": torch.ones(3)}
    me = {"X-Isolane-Client": "me-" + unique}
    name = f"tok-stale-{unique}"
    header, views, token = plan_request(node, name, state, headers=me)
    newer = {"w": torch.zeros(300_000), "small": torch.zeros(3)}
    with RemoteSnapshotStore(node.url, token=node.token) as store:
        store.save(newer, f"tok-newer-{unique}")  # the parent a save would link from now
        before = _plans(node)
        status, raw = _put(node, name, stream_for(header, views), token,
                           me["X-Isolane-Client"])
        assert status == 201, raw
        assert _plans(node) == (before[0] + 1, before[1])  # its parent changed: re-planned
        assert json.loads(raw)["parent"]["name"] == f"tok-newer-{unique}"
        store.delete(f"tok-newer-{unique}")
    _committed(node, name, state)


def test_a_malformed_plan_token_is_refused(node: NodeProcess, unique: str) -> None:
    state = {"w": torch.arange(300_000.0)}
    name = f"tok-bad-{unique}"
    header, views, _token = plan_request(node, name, state)
    status, raw = _put(node, name, stream_for(header, views), "../../etc", "c")
    assert status == 400, raw
    answer = json.loads(raw)
    assert answer["error"] == "InvalidArgumentError" and "X-Isolane-Plan" in answer["message"]
    assert node.request("GET", f"/v1/snapshots/{name}")[0] == 404


def test_an_upload_in_http_chunks_commits(node: NodeProcess, unique: str) -> None:
    """Transfer-Encoding: chunked (the client's pipelined upload sends no length), with
    HTTP chunks that arrive in parts and end anywhere in the stream."""
    state = {"w": torch.arange(300_000.0), "small": torch.ones(3)}
    name = f"chunked-{unique}"
    header, views, _token = plan_request(node, name, state)
    body = stream_for(header, views)
    cuts = [0, 3, 16, 17, 500, 70_001, len(body) - 40, len(body)]
    with socket.create_connection(("127.0.0.1", node.port), timeout=30) as sock:
        sock.sendall((f"PUT /v1/snapshots/{name} HTTP/1.1\r\nHost: x\r\nAuthorization: "
                      f"Bearer {node.token}\r\nTransfer-Encoding: chunked\r\n\r\n").encode())
        for a, b in itertools.pairwise(cuts):
            piece = body[a:b]
            sock.sendall(b"%x\r\n" % len(piece) + piece[:len(piece) // 2])
            time.sleep(0.05)  # the node reads the first half before the chunk ends ...
            sock.sendall(piece[len(piece) // 2:])
            time.sleep(0.05)  # ... and all of its bytes before their chunk's end marker
            sock.sendall(b"\r\n")
        sock.sendall(b"0\r\n\r\n")
        answer = sock.makefile("rb").readline()
    assert b" 201 " in answer, answer
    _committed(node, name, state)
