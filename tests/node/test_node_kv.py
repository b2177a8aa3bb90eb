"""The KV endpoints of a real node, through RemoteKVPool and raw HTTP."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch

from isolane.client.kv_pool import RemoteKVPool, connect
from isolane.errors import ConfigError, InvalidArgumentError
from isolane.kvpool.pool import KVPool
from isolane.opening import open_kv_pool
from isolane.wire import frames
from isolane.wire.layout import NamespaceLayout
from tests.support.node import NodeProcess

CT = 16


def _kv(n_tokens: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, n_tokens, 4, 8, generator=gen).to(torch.bfloat16)


def _pool(node: NodeProcess, namespace: str, **kw: object) -> RemoteKVPool:
    return RemoteKVPool([node.url], namespace=namespace, chunk_tokens=CT, token=node.token,
                        **kw)  # type: ignore[arg-type]


def test_token_level_api_matches_the_embedded_pool(node: NodeProcess, unique: str,
                                                   tmp_path: Path) -> None:
    namespace = f"org/model-{unique}"
    tokens, kv = list(range(100)), _kv(100)
    with _pool(node, namespace) as pool:
        assert pool.get(tokens) == (0, None) and pool.lookup(tokens) == 0  # nothing yet
        assert pool.put(tokens, kv) == 6 and pool.put(tokens, kv) == 0
        n, out = pool.get(tokens)
        assert n == 96 and out is not None and torch.equal(out, kv[:, :, :96])
        longer = [*tokens[:50], 999, *tokens[51:]]  # diverges inside block 3
        assert pool.lookup(tokens) == 96 and pool.lookup(longer) == 48
        n, out = pool.get(longer)
        assert n == 48 and out is not None and torch.equal(out, kv[:, :, :48])
        dest = torch.zeros_like(kv)
        assert pool.get_into(tokens, dest) == 96 and torch.equal(dest[:, :, :96], kv[:, :, :96])
        assert pool.layout == ("bfloat16", (2, 2, 4, 8))
        # The same keys as an embedded pool of the same namespace: a node's blocks are
        # the blocks an engine would have stored locally.
        embedded = KVPool(str(tmp_path), namespace=namespace, chunk_tokens=CT)
        embedded.put(tokens, kv)
        assert embedded.block_keys(tokens) == pool.block_keys(tokens)
        embedded.close()
        assert pool.delete(tokens) == 6 and pool.get(tokens) == (0, None)
    # A second client learns the layout (and chunk_tokens) from the node.
    with RemoteKVPool([node.url], namespace=namespace, token=node.token) as other:
        assert other.layout == ("bfloat16", (2, 2, 4, 8)) and other.chunk_tokens == CT
        assert other.put(tokens, kv) == 6
        with pytest.raises(InvalidArgumentError, match="does not match namespace"):
            other.put(tokens, kv.float())
    with pytest.raises(ConfigError, match="chunk_tokens=16"):
        RemoteKVPool([node.url], namespace=namespace, token=node.token,
                     chunk_tokens=32).lookup(tokens)


def test_block_api_with_a_registered_layout(node: NodeProcess, unique: str) -> None:
    layout = NamespaceLayout("float32", (4,), chunk_tokens=2, token_dim=0)
    with RemoteKVPool([node.url], namespace=f"blocks-{unique}", layout=layout,
                      token=node.token) as pool:
        keys = [bytes([i]) * 16 for i in range(5)]
        values = [torch.full((2, 4), float(i)).numpy().tobytes() for i in range(5)]
        assert pool.put_blocks(keys[:3], values[:3]) == 3
        got = pool.get_blocks(keys)
        assert got[:3] == values[:3] and got[3:] == [None, None]
        assert pool.lookup_blocks(keys) == 3 and pool.lookup_blocks(keys[1:], chain=keys) == 2
        assert pool.delete_blocks(keys[1:2], chain=keys) == 1
        assert pool.get_blocks(keys)[:3] == [values[0], None, values[2]]
        with pytest.raises(InvalidArgumentError, match="is 3 bytes"):
            pool.put_blocks([keys[4]], [b"abc"])
        stats = pool.stats()["nodes"][node.url]
        assert stats["namespace"] == f"blocks-{unique}" and stats["disk"][0]["blocks"] == 2


def test_single_block_endpoints_and_listing(node: NodeProcess, unique: str) -> None:
    namespace = f"single-{unique}"
    layout = NamespaceLayout("uint8", (8,), chunk_tokens=1, token_dim=0)
    assert node.json("PUT", f"/v1/kv/{namespace}", layout.to_dict())["layout"] == \
        layout.to_dict()
    key = "ab" * 16
    status, body = node.request("PUT", f"/v1/kv/{namespace}/blocks/{key}", b"12345678")
    assert status == 200 and json.loads(body) == {"stored": 1}
    assert node.request("GET", f"/v1/kv/{namespace}/blocks/{key}") == (200, b"12345678")
    status, body = node.request("GET", f"/v1/kv/{namespace}/blocks/{'cd' * 16}")
    assert status == 404 and json.loads(body)["error"] == "KeyNotFoundError"
    assert namespace in node.json("GET", "/v1/kv")["namespaces"]
    assert node.json("DELETE", f"/v1/kv/{namespace}/blocks/{key}") == {"deleted": 1}
    assert node.request("GET", f"/v1/kv/{namespace}/blocks/{key}")[0] == 404
    status, body = node.request("PUT", f"/v1/kv/{namespace}",
                                json.dumps({**layout.to_dict(), "shape": [9]}).encode())
    assert status == 409 and "is stored with layout" in json.loads(body)["message"]


@pytest.mark.parametrize(("method", "path", "body", "needle"), [
    ("GET", "/v1/kv/{ns}/blocks/ABCDEF", None, "malformed block key"),
    ("GET", "/v1/kv/{ns}/blocks/" + "g" * 32, None, "malformed block key"),
    ("PUT", "/v1/kv/{ns}/blocks/" + "0" * 31, b"x" * 8, "malformed block key"),
    ("POST", "/v1/kv/{ns}/get", b"x" * 17, "not a multiple of 16"),
    ("POST", "/v1/kv/{ns}/put", b"NOTABATCH" + bytes(7), "not a KV batch"),
    ("PUT", "/v1/kv/{ns}/blocks/" + "0" * 32, b"x" * 7, "is 7 bytes"),
    ("GET", "/v1/kv/..%2Fetc/stats", None, "invalid KV namespace"),
    ("PUT", "/v1/kv/{ns}", b"{not json", "not JSON"),
])
def test_malformed_requests_are_400_with_a_clear_message(
        node: NodeProcess, unique: str, method: str, path: str, body: bytes | None,
        needle: str) -> None:
    namespace = f"bad-{unique}"
    node.json("PUT", f"/v1/kv/{namespace}", NamespaceLayout("uint8", (8,), 1, 0).to_dict())
    status, raw = node.request(method, path.format(ns=namespace), body)
    assert status == 400, raw
    answer = json.loads(raw)
    assert needle in answer["message"], answer


def test_oversized_bodies_are_413_and_store_nothing(node: NodeProcess, unique: str) -> None:
    # The shared node runs with --max-request-bytes 1MiB --max-block-bytes 256KiB.
    namespace = f"big-{unique}"
    layout = NamespaceLayout("uint8", (64 << 10,), chunk_tokens=1, token_dim=0)
    node.json("PUT", f"/v1/kv/{namespace}", layout.to_dict())
    key = "11" * 16
    status, raw = node.request("PUT", f"/v1/kv/{namespace}/blocks/{key}", bytes(300 << 10))
    assert status == 413 and "over this node's limit" in json.loads(raw)["message"]
    parts = [frames.encode_batch_header(20)]
    for i in range(20):  # 20 x 64 KiB: 1.25 MiB
        parts.extend(bytes(p) for p in frames.encode_frame(bytes([i]) * 16, bytes(64 << 10)))
    status, raw = node.request("POST", f"/v1/kv/{namespace}/put", b"".join(parts))
    assert status == 413, raw
    # Without a Content-Length (chunked), the node counts as it reads.
    status, raw = _chunked_post(node, f"/v1/kv/{namespace}/put", b"".join(parts))
    assert status == 413 and "node.max_request_bytes" in json.loads(raw)["message"], raw
    assert node.json("POST", f"/v1/kv/{namespace}/lookup", None) == {"blocks": 0}
    assert node.json("GET", f"/v1/kv/{namespace}/stats")["disk"][0]["blocks"] == 0
    # A layout whose block is over the limit is refused up front.
    status, raw = node.request("PUT", f"/v1/kv/{namespace}-huge", json.dumps(
        NamespaceLayout("uint8", (1 << 20,), 1, 0).to_dict()).encode())
    assert status == 400 and "node.max_block_bytes" in json.loads(raw)["message"]


def _chunked_post(node: NodeProcess, path: str, body: bytes) -> tuple[int, bytes]:
    with socket.create_connection(("127.0.0.1", node.port), timeout=10) as sock:
        sock.sendall((f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                      f"{node.token}\r\nTransfer-Encoding: chunked\r\n\r\n").encode())
        try:
            for start in range(0, len(body), 64 << 10):
                piece = body[start:start + (64 << 10)]
                sock.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
            sock.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # the node answered and closed before the whole body went out
        return _read_response(sock)


def _read_response(sock: socket.socket) -> tuple[int, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        more = sock.recv(65536)
        if not more:
            break
        data += more
    head, _, rest = data.partition(b"\r\n\r\n")
    status = int(head.split()[1])
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(rest) < length:
        more = sock.recv(65536)
        if not more:
            break
        rest += more
    return status, rest


@pytest.mark.parametrize("token", [None, "wrong", "Bearer"])
def test_missing_or_wrong_token_is_401_and_touches_nothing(
        node: NodeProcess, unique: str, token: str | None) -> None:
    namespace = f"auth-{unique}"
    layout = NamespaceLayout("uint8", (8,), 1, 0)
    assert node.request("PUT", f"/v1/kv/{namespace}", json.dumps(layout.to_dict()).encode(),
                        token=token)[0] == 401
    assert namespace not in node.json("GET", "/v1/kv")["namespaces"]  # nothing written
    node.json("PUT", f"/v1/kv/{namespace}", layout.to_dict())
    key = "22" * 16
    assert node.request("PUT", f"/v1/kv/{namespace}/blocks/{key}", b"8 bytes!",
                        token=token)[0] == 401
    assert node.json("POST", f"/v1/kv/{namespace}/lookup", None) == {"blocks": 0}
    node.request("PUT", f"/v1/kv/{namespace}/blocks/{key}", b"8 bytes!")
    status, body = node.request("GET", f"/v1/kv/{namespace}/blocks/{key}", token=token)
    assert status == 401 and b"8 bytes!" not in body  # nothing read
    for path in ["/healthz", "/v1/stats", "/metrics", "/v1/snapshots"]:
        assert node.request("GET", path, token=token)[0] == 401
    # A client with a wrong token is misconfigured, not facing an outage: it raises.
    with RemoteKVPool([node.url], namespace=namespace, token=token or "x") as pool, \
            pytest.raises(PermissionError, match="bearer token"):
        pool.lookup(list(range(4)))


def test_connect_reads_cluster_nodes_and_token_from_a_config(
        node: NodeProcess, unique: str, tmp_path: Path) -> None:
    import yaml

    path = tmp_path / "client.yaml"
    path.write_text(yaml.safe_dump({
        "cluster": {"nodes": [node.url]}, "node": {"token": node.token},
        "kvpool": {"namespace": f"cfg-{unique}", "chunk_tokens": CT}}))
    with connect(str(path)) as pool:
        assert pool.nodes == [node.url] and pool.namespace == f"cfg-{unique}"
        assert pool.put(list(range(CT)), _kv(CT)) == 1
    assert KVPool.connect(str(path)).lookup(list(range(CT))) == CT


def test_kvpool_opens_node_urls_as_a_remote_pool(node: NodeProcess, unique: str,
                                                  tmp_path: Path) -> None:
    # One way to open, as open_store(target): http:// gives the remote client.
    namespace = f"open-{unique}"
    with open_kv_pool(node.url, namespace=namespace, chunk_tokens=CT, token=node.token,
                poll_s=None) as pool:
        assert type(pool) is RemoteKVPool and pool.nodes == [node.url]
        assert pool.put(list(range(2 * CT)), _kv(2 * CT)) == 2
    dead = "http://127.0.0.1:9"  # never asked: nothing is stored or read here
    for target in (f"{node.url},{dead}", f"{node.url}, {dead}", [node.url, dead],
                   (node.url, dead)):
        with open_kv_pool(target, namespace=namespace, token=node.token,
                          poll_s=None) as pool:
            assert type(pool) is RemoteKVPool and sorted(pool.nodes) == sorted([node.url, dead])
    # A folder (or a config) is the embedded pool, as before.
    with open_kv_pool(str(tmp_path), namespace=namespace, chunk_tokens=CT) as embedded:
        assert type(embedded) is KVPool
        assert embedded.put(list(range(2 * CT)), _kv(2 * CT)) == 2
    with pytest.raises(TypeError, match="memory_budget"):  # embedded-only options: refused
        open_kv_pool(node.url, namespace=namespace, memory_budget=1 << 20)
    with pytest.raises(InvalidArgumentError, match=r"isolane\.open_kv_pool"):
        KVPool(node.url, namespace=namespace)  # the class opens the embedded pool only


def test_a_first_put_learns_chunk_tokens_from_the_node(node: NodeProcess,
                                                       unique: str) -> None:
    # A client opened without chunk_tokens learns it from the node; its first call may
    # be a put of a tensor of the namespace's layout (it was refused as not matching).
    namespace = f"learn-{unique}"
    tokens, kv = list(range(2 * CT)), _kv(2 * CT)
    with _pool(node, namespace) as pool:
        assert pool.put(tokens, kv) == 2
    with RemoteKVPool([node.url], namespace=namespace, token=node.token) as other:
        assert other.put(tokens + list(range(CT)), _kv(3 * CT)) == 1
        assert other.chunk_tokens == CT and other.lookup(tokens) == 2 * CT
