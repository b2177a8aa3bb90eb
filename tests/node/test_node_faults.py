"""Nodes that die, stop and come back: clients see misses, never exceptions (and write
to the next node of the ring meanwhile); a node's KV index and snapshots survive a
restart; SIGTERM lets requests in flight finish."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import torch
import urllib3

from isolane.client.kv_pool import RemoteKVPool, read_batch
from isolane.client.snapshot_store import RemoteSnapshotStore
from isolane.wire import frames
from isolane.wire.layout import NamespaceLayout
from tests.support.cluster import wait_up
from tests.support.node import NodeProcess, write_node_config
from tests.support.snapstreams import upload_stream

CT = 4
TOKEN = "fault-token"


def _kv(n_tokens: int, seed: int) -> torch.Tensor:
    return torch.full((2, n_tokens, 8), float(seed))  # [layers, tokens, dim], token_dim 1


def _prompt(seed: int, n_tokens: int = 3 * CT) -> list[int]:
    return [seed * 1000 + i for i in range(n_tokens)]


class _KillAfter:
    """A response reader that SIGKILLs ``node`` once ``after`` bytes were read."""

    def __init__(self, response: urllib3.BaseHTTPResponse, node: NodeProcess, after: int):
        self.response, self.node, self.after, self.seen = response, node, after, 0

    def read(self, amt: int) -> bytes:
        data = self.response.read(amt)
        self.seen += len(data)
        if self.seen >= self.after and self.node.running:
            self.node.kill()
        return data


def _holder(nodes: list[NodeProcess], keys: list[bytes]) -> str:
    """The one node that stores all of ``keys``."""
    found = [node.url for node in nodes if json.loads(node.request(
        "POST", "/v1/kv/cluster/lookup", frames.encode_keys(keys))[1])["blocks"] == len(keys)]
    assert len(found) == 1, found
    return found[0]


def test_a_node_killed_mid_batch_reads_as_misses_and_comes_back(tmp_path: Path) -> None:
    nodes = [NodeProcess(write_node_config(tmp_path / name), token=TOKEN)
             for name in ("a", "b")]
    for node in nodes:
        node.launch()
    for node in nodes:
        node.wait_ready()
    a, b = nodes
    try:
        pool = RemoteKVPool([a.url, b.url], namespace="cluster", chunk_tokens=CT,
                            token_dim=1, token=TOKEN, down_s=0.2, retries=0, poll_s=0.2)
        prompts = {seed: _prompt(seed) for seed in range(24)}
        for seed, tokens in prompts.items():
            assert pool.put(tokens, _kv(len(tokens), seed)) == 3
        owner = {seed: _holder(nodes, pool.block_keys(t)) for seed, t in prompts.items()}
        assert set(owner.values()) == {a.url, b.url}  # both nodes hold chains

        # A long chain on node a, read as one batch; a dies after the first MiB arrives.
        layout = NamespaceLayout("uint8", (256 << 10,), chunk_tokens=1, token_dim=0)
        big = RemoteKVPool([a.url], namespace="big", layout=layout, token=TOKEN, retries=0,
                           poll_s=None)  # no probes: a failed node is skipped for down_s
        keys = [bytes([i]) * 16 for i in range(256)]  # 64 MiB in all
        values = [bytes([i]) * (256 << 10) for i in range(256)]
        assert big.put_blocks(keys, values) == 256
        http = urllib3.PoolManager()
        response = http.request("POST", f"{a.url}/v1/kv/big/get", body=frames.encode_keys(keys),
                                headers={"Authorization": f"Bearer {TOKEN}"},
                                preload_content=False)
        got, complete = read_batch(_KillAfter(response, a, 1 << 20), keys, 256 << 10)
        assert not a.running and not complete
        arrived = sum(v is not None for v in got)
        assert 3 <= arrived < 256  # whole frames before the cut (3 fit in 1 MiB), then misses
        assert got[:arrived] == values[:arrived] and got[arrived:] == [None] * (256 - arrived)

        # The engine keeps going: a's prompts are misses, b's are hits, and a's prompts
        # put again go to b, the next node of the ring, and read from there.
        for seed, tokens in prompts.items():
            n, kv = pool.get(tokens)
            if owner[seed] == b.url:
                assert n == 3 * CT and kv is not None and torch.equal(kv, _kv(3 * CT, seed))
            else:
                assert (n, kv) == (0, None)
                assert pool.lookup(tokens) == 0
                assert pool.get_blocks(pool.block_keys(tokens)) == [None] * 3
        moved = [seed for seed in prompts if owner[seed] == a.url][:3]
        for seed in moved:
            assert pool.put(prompts[seed], _kv(3 * CT, seed)) == 3  # on b now
            assert pool.lookup(prompts[seed]) == 3 * CT
        assert big.get_blocks(keys[:2]) == [None, None]
        assert "error" in pool.stats()["nodes"][a.url]
        assert pool.stats()["cluster"]["down"] == [a.url]

        # Back after the crash: its index is rebuilt from the segments, every block is there.
        a.start()
        wait_up(pool)  # the client's probes (every poll_s) bring it back
        assert pool.stats()["cluster"]["down"] == []
        for seed, tokens in prompts.items():
            n, kv = pool.get(tokens)
            assert n == 3 * CT and kv is not None and torch.equal(kv, _kv(3 * CT, seed))
        assert big.get_blocks(keys[-2:]) == values[-2:]
        pool.close()
        big.close()
    finally:
        for node in nodes:
            node.kill()


def test_sigterm_finishes_an_upload_in_flight_and_a_restart_keeps_everything(
        tmp_path: Path) -> None:
    node = NodeProcess(write_node_config(tmp_path), token=TOKEN).start()
    try:
        pool = RemoteKVPool([node.url], namespace="persist", chunk_tokens=CT, token_dim=1,
                            token=TOKEN, retries=3)
        tokens = _prompt(7, 5 * CT)
        assert pool.put(tokens, _kv(5 * CT, 7)) == 5
        body = upload_stream(node, "in-flight",
                             {"w": torch.arange(1 << 20, dtype=torch.float32)})
        with socket.create_connection(("127.0.0.1", node.port), timeout=30) as sock:
            sock.sendall((f"PUT /v1/snapshots/in-flight HTTP/1.1\r\nHost: x\r\nAuthorization: "
                          f"Bearer {TOKEN}\r\nContent-Length: {len(body)}\r\n\r\n").encode())
            sock.sendall(body[:len(body) // 2])
            time.sleep(0.3)  # the node is inside the upload
            assert node._proc is not None
            node._proc.send_signal(15)  # SIGTERM while the request is in flight
            time.sleep(0.3)
            assert node.running  # still finishing the upload
            sock.sendall(body[len(body) // 2:])
            answer = sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 201"), answer
        assert node._proc.wait(30) == 0
        node._forget()

        node.start()  # graceful stop: indexes were flushed
        wait_up(pool)  # the client skipped the node while it was gone; a probe sees it back
        assert pool.lookup(tokens) == 5 * CT
        n, kv = pool.get(tokens)
        assert n == 5 * CT and kv is not None and torch.equal(kv, _kv(5 * CT, 7))
        with RemoteSnapshotStore(node.url, token=TOKEN) as store:
            back = store.load("in-flight")
            assert torch.equal(back["w"], torch.arange(1 << 20, dtype=torch.float32))
        stats = node.json("GET", "/v1/stats")
        assert stats["kv"]["namespaces"] == ["persist"]
        assert stats["capacity"]["read"]["free_bytes"] > 0
        assert set(stats["lanes"]) == {"write", "read", "background"}
        metrics = node.request("GET", "/metrics")[1].decode()
        assert 'isolane_kv_blocks{namespace="persist",tier="disk"} 5.0' in metrics
        assert 'route="/v1/kv/{ns}/get"' in metrics
        assert json.loads(node.request("GET", "/healthz")[1]) == {"status": "ok"}
    finally:
        node.kill()


def _cut_body(node: NodeProcess, method: str, path: str, length: int, sent: bytes) -> None:
    """Send a request whose body stops after ``sent`` of ``length`` bytes, then hang up."""
    with socket.create_connection(("127.0.0.1", node.port), timeout=10) as sock:
        sock.sendall((f"{method} {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                      f"{node.token}\r\nContent-Length: {length}\r\n\r\n").encode() + sent)
        time.sleep(0.3)  # the handler is reading the body now


def test_a_client_that_cuts_its_body_is_one_info_line_not_a_traceback(tmp_path: Path) -> None:
    node = NodeProcess(write_node_config(tmp_path), token="t0k3n").start()
    try:
        layout = NamespaceLayout("uint8", (4096,), 1, 0)
        assert node.request("PUT", "/v1/kv/cut", json.dumps(layout.to_dict()).encode())[0] in (
            200, 201)
        key = "ab" * 16
        cuts = [("PUT", f"/v1/kv/cut/blocks/{key}", 4096, b"x" * 1000),
                ("POST", "/v1/kv/cut/put", 1 << 16, b""),  # nothing of the body yet
                ("POST", "/v1/kv/cut/lookup", 16 * 64, b"\1" * 100),
                ("PUT", "/v1/snapshots/cut-upload", 1 << 16, b"")]
        for method, path, length, sent in cuts:
            _cut_body(node, method, path, length, sent)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            lines = [ln for ln in node.log_path.read_text().splitlines()
                     if "disconnected" in ln]
            if len(lines) >= len(cuts):
                break
            time.sleep(0.1)
        text = node.log_path.read_text()
        assert "Traceback" not in text and "Error handling request" not in text, text
        for method, path, _length, _sent in cuts:
            line = next(ln for ln in lines if f"{method} {path}" in ln)
            assert " INFO " in line and "127.0.0.1:" in line, line
        assert node.request("GET", f"/v1/kv/cut/blocks/{key}")[0] == 404  # nothing stored
    finally:
        node.stop()
