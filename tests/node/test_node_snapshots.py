"""The snapshot endpoints of a real node, through RemoteSnapshotStore and raw sockets."""

from __future__ import annotations

import gc
import json
import socket
import time
import urllib.error
import urllib.request
import weakref
from collections import OrderedDict
from typing import Any

import pytest
import torch

from isolane.client import snapshot_download as sd
from isolane.client.snapshot_store import RemoteSnapshotStore
from isolane.errors import (
    ConflictError,
    InvalidArgumentError,
    IsolaneError,
    SnapshotExistsError,
    SnapshotNotFoundError,
)
from isolane.opening import open_store
from isolane.snapshot.store import SnapshotStore
from isolane.wire import snapshot_stream as ss
from tests.support.node import NodeProcess
from tests.support.snapstreams import generation_files, planned_header, upload_stream


def _state(seed: int = 0) -> dict[str, object]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(300, 1024, generator=gen).to(torch.bfloat16)  # chunked (> 64 KiB)
    return {
        "model": OrderedDict(w=w, b=torch.randn(7, generator=gen),
                             f8=torch.randn(33, generator=gen).to(torch.float8_e4m3fn)),
        "tied": w,  # stays tied after the round trip
        "view": w[:, :3],  # a strided view: sent contiguous
        "optimizer": {"state": {0: {"step": torch.tensor(5), "exp": torch.zeros(0, 3)}},
                      "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "name": None}]},
        "c": torch.randn(5, generator=gen, dtype=torch.complex64),
        "mask": torch.tensor([True, False, True]),
        "step": 100, "note": "ok", "blob": b"\x00\x01",
    }


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and ss.tensor_bytes(a).tobytes() == ss.tensor_bytes(b).tobytes())
    if isinstance(a, dict):
        return (isinstance(b, dict) and type(a) is type(b) and list(a) == list(b)
                and all(_same(a[k], b[k]) for k in a))
    if isinstance(a, list | tuple):
        return (type(a) is type(b) and len(a) == len(b)  # type: ignore[arg-type]
                and all(_same(x, y) for x, y in zip(a, b, strict=True)))  # type: ignore[call-overload]
    return a == b


def _store(node: NodeProcess) -> RemoteSnapshotStore:
    return RemoteSnapshotStore(node.url, token=node.token)


def test_save_load_list_verify_delete_round_trip(node: NodeProcess, unique: str) -> None:
    name = f"step-{unique}"
    state = _state()
    with _store(node) as store:
        info = store.save(state, name, {"loss": 1.25})
        assert info.name == name and info.metadata == {"loss": 1.25} and info.tensors == 8
        back = store.load(name)
        assert _same(state, back)
        assert back["tied"] is back["model"]["w"]  # type: ignore[index]
        assert name in [i.name for i in store.list()]
        assert store.info(name).generation == info.generation
        assert store.verify(name).name == name
        only = store.load(name, keys=["model.w", "step"])
        assert list(only) == ["model", "step"] and list(only["model"]) == ["w"]
        into = {"model": {"w": torch.zeros(300, 1024, dtype=torch.bfloat16),
                          "b": torch.zeros(7)[None, :].expand(2, 7)[0]}}  # strided target
        loaded = store.load(name, keys=["model"], into=into)
        assert loaded["model"]["w"] is into["model"]["w"]
        assert torch.equal(into["model"]["w"], state["model"]["w"])  # type: ignore[index]
        assert torch.equal(into["model"]["b"], state["model"]["b"])  # type: ignore[index]
        with pytest.raises(InvalidArgumentError, match=r"into\[.model\.w.\]"):
            store.load(name, keys=["model"], into={"model": {"w": torch.zeros(3)}})
        with pytest.raises(SnapshotExistsError):
            store.save(state, name)
        newer = {**state, "step": 101}
        assert store.save(newer, name, overwrite=True).generation != info.generation
        assert store.load(name, keys=["step"]) == {"step": 101}
        store.delete(name)
        with pytest.raises(SnapshotNotFoundError):
            store.info(name)
        with pytest.raises(FileNotFoundError):
            store.load(name)
    # open_store picks the client by URL: a training loop switches by the URL alone.
    remote = open_store(node.url, token=node.token)
    assert isinstance(remote, RemoteSnapshotStore) and remote.url == node.url
    assert type(open_store(str(node.config.parent / "other"))) is SnapshotStore
    # The same URL forms as open_kv_pool(url): several nodes, comma-joined or as a list.
    dead = "http://127.0.0.1:9"  # never asked here
    for target in (f"{node.url},{dead}", f"{node.url}, {dead}", [node.url, dead]):
        several = open_store(target, token=node.token)
        assert isinstance(several, RemoteSnapshotStore)
        assert sorted(several.nodes) == sorted([node.url, dead])
    # The class opens its own kind only, and says which call opens a node.
    with pytest.raises(InvalidArgumentError, match=r"isolane\.open_store"):
        SnapshotStore(node.url)


def _names(node: NodeProcess) -> list[str]:
    return [s["name"] for s in node.json("GET", "/v1/snapshots")["snapshots"]]


def test_a_loaded_state_dict_dies_with_its_last_reference(node: NodeProcess, unique: str
                                                          ) -> None:
    """No reference cycle keeps a load's tensors (their page-aligned memory of their
    own) alive until a collection: that freed a whole checkpoint inside the caller's
    next call (a save_async's staging copy blocked twice as long)."""
    name = f"free-{unique}"
    state = {"big": torch.randn(1 << 20), "small": torch.ones(3), "step": 1}
    with _store(node) as store:
        store.save(state, name)
        gc.collect()
        gc.disable()
        try:
            back = store.load(name)
            assert torch.equal(back["big"], state["big"])
            refs = [weakref.ref(back["big"]), weakref.ref(back["small"])]
            del back
            assert [r() for r in refs] == [None, None]
        finally:
            gc.enable()
        store.delete(name)


def test_a_truncated_upload_commits_nothing(node: NodeProcess, unique: str) -> None:
    name = f"cut-{unique}"
    body = upload_stream(node, name, {"w": torch.randn(1 << 20)})  # 4 MiB: 4 chunks
    with socket.create_connection(("127.0.0.1", node.port), timeout=10) as sock:
        sock.sendall((f"PUT /v1/snapshots/{name} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                      f"{node.token}\r\nContent-Length: {len(body)}\r\n\r\n").encode())
        sock.sendall(body[:len(body) * 3 // 4])
        deadline = time.monotonic() + 10
        while not any(p.name.startswith("c.") for p in generation_files(node, name)) and (
                time.monotonic() < deadline):
            time.sleep(0.02)  # the node writes chunk files as they arrive
        assert any(p.name.startswith("c.") for p in generation_files(node, name))
    # The connection is gone mid-chunk: no snapshot, and the generation is removed.
    deadline = time.monotonic() + 10
    while generation_files(node, name) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert generation_files(node, name) == []
    assert name not in _names(node)
    assert node.request("GET", f"/v1/snapshots/{name}")[0] == 404


@pytest.mark.parametrize("damage", ["checksum", "hash", "end", "name", "plan", "tail"])
def test_a_stream_that_does_not_check_out_is_400_and_commits_nothing(
        node: NodeProcess, unique: str, damage: str) -> None:
    name = f"bad-{damage}-{unique}"
    state = {"w": torch.arange(300_000.0), "small": torch.ones(3)}  # a big chunk and a pack
    body = bytearray(upload_stream(node, name, state))
    if damage == "checksum":
        body[-ss.END.size - ss.HASH_BYTES - 1] ^= 0xFF  # last byte of the last chunk
    elif damage == "hash":
        body[-ss.END.size - 1] ^= 0x01  # the sender's hash of the last chunk
    elif damage == "end":
        body[-ss.END.size:-ss.END.size + 8] = b"NOTTHEND"
    elif damage == "name":
        body = bytearray(upload_stream(node, "someone-else", state))
    elif damage == "plan":  # chunks other than the node's plan
        header, _views = planned_header(node, name, state)
        other = header.with_chunks(ss.tensor_chunks(header.tensors))
        encoded = other.encode()
        body = bytearray(ss.encode_preamble(encoded) + encoded)
    else:
        body += b"trailing"
    status, raw = node.request("PUT", f"/v1/snapshots/{name}", bytes(body))
    assert status == 400, raw
    assert json.loads(raw)["error"] == "WireFormatError"
    assert name not in _names(node) and generation_files(node, name) == []


def test_snapshot_requests_check_names_tokens_and_limits(node: NodeProcess, unique: str
                                                          ) -> None:
    name = f"auth-{unique}"
    body = upload_stream(node, name, {"w": torch.ones(4)})
    for token in [None, "nope"]:
        assert node.request("PUT", f"/v1/snapshots/{name}", body, token=token)[0] == 401
        assert node.request("GET", "/v1/snapshots", token=token)[0] == 401
    assert name not in _names(node)
    status, raw = node.request("PUT", "/v1/snapshots/..%2Fescape", body)
    assert status == 400 and "invalid snapshot name" in json.loads(raw)["message"]
    status, raw = node.request("GET", "/v1/snapshots/no-such-thing/data")
    assert status == 404 and json.loads(raw)["error"] == "SnapshotNotFoundError"
    status, raw = node.request("PUT", f"/v1/snapshots/{name}", b"ISOKVBAT" + bytes(8))
    assert status == 400 and "not a snapshot stream" in json.loads(raw)["message"]
    assert node.request("PUT", f"/v1/snapshots/{name}", body)[0] == 201
    assert _names(node).count(name) == 1


@pytest.mark.parametrize("mode", ["hash", "version"])
def test_an_incremental_upload_sends_only_changed_chunks(node: NodeProcess, unique: str,
                                                         mode: str) -> None:
    base = {f"w{i}": torch.randn(512, 1024) for i in range(4)}  # 2 MiB each: 2 chunks
    state = {"base": base, "adapter": torch.randn(300, 1024), "bias": torch.ones(8),
             "step": 1}  # bias: a packed tensor (no chunk of its own)
    with _store(node) as store:
        first = store.save(state, f"inc-{mode}-{unique}-0", change_detection=mode)
        assert first.linked_bytes == 0 or first.parent is not None
        with torch.no_grad():
            state["adapter"].add_(1)  # in place: bumps its version counter
        sent: list[int] = []
        again = store.save(state, f"inc-{mode}-{unique}-1", change_detection=mode,
                           progress=lambda done, _total: sent.append(done))
        assert again.parent is not None and again.parent["name"] == f"inc-{mode}-{unique}-0"
        assert again.linked_bytes >= 4 * 512 * 1024 * 4  # the base: linked on the node
        assert again.written_bytes < 2 * 300 * 1024 * 4
        back = store.load(f"inc-{mode}-{unique}-1")
        assert torch.equal(back["adapter"], state["adapter"])
        assert all(torch.equal(back["base"][k], v) for k, v in base.items())
        store.delete(f"inc-{mode}-{unique}-0")
        store.delete(f"inc-{mode}-{unique}-1")


def _get(node: NodeProcess, path: str) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(node.url + path,
                                 headers={"Authorization": f"Bearer {node.token}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def _part_chunks(raw: bytes) -> tuple[bytes, list[tuple[int, bytes]], tuple[int, int]]:
    """A part stream's header, its (chunk index, hash) in order, and its end marker."""
    size = ss.decode_preamble(raw[:ss.PREAMBLE.size])
    at = ss.PREAMBLE.size + size
    header, chunks = raw[ss.PREAMBLE.size:at], []
    while raw[at:at + 8] != ss.END_MAGIC:
        index, _flags, nbytes = ss.CHUNK_HEADER.unpack_from(raw, at)
        at += ss.CHUNK_HEADER.size + nbytes
        chunks.append((index, raw[at:at + ss.HASH_BYTES]))
        at += ss.HASH_BYTES
    _magic, count, data = ss.END.unpack_from(raw, at)
    assert at + ss.END.size == len(raw)
    return header, chunks, (count, data)


def test_a_download_comes_in_parts_of_one_generation(node: NodeProcess, unique: str) -> None:
    """part=k of parts=N carries every N-th chunk from k on (same header, the manifest's
    hashes, its own end marker), names its generation, and refuses another one (409):
    the client asks for the other parts of the generation part 0 is sending."""
    name = f"parts-{unique}"
    state = {"w": torch.randn(5 << 18), "b": torch.randn(3)}  # 5 chunks of 1 MiB + a pack
    with _store(node) as store:
        info = store.save(state, name)
        manifest = store.manifest(name)
        hashes = {c.key: bytes.fromhex(c.hash) for c in manifest.chunks}
        status, headers, whole = _get(node, f"/v1/snapshots/{name}/data")
        assert status == 200 and headers["X-Isolane-Parts"] == "1"
        full_header, every, _end = _part_chunks(whole)
        keys = [c.key for c in ss.decode_header(full_header, partial=True).chunks]
        assert [i for i, _h in every] == list(range(len(keys))) and len(keys) == 6
        seen = []
        for part in range(3):
            status, headers, raw = _get(
                node, f"/v1/snapshots/{name}/data?part={part}&parts=3"
                f"&generation={info.generation}")
            assert status == 200, raw
            assert headers["X-Isolane-Parts"] == "3"
            assert headers["X-Isolane-Generation"] == info.generation
            assert int(headers["Content-Length"]) == len(raw)
            header, chunks, (count, _data) = _part_chunks(raw)
            assert header == full_header
            assert [i for i, _h in chunks] == ss.part_indexes(len(keys), part, 3)
            assert count == len(chunks)
            assert all(h == hashes[keys[i]] for i, h in chunks)
            seen += [i for i, _h in chunks]
        assert sorted(seen) == list(range(len(keys)))
        status, _headers, raw = _get(node, f"/v1/snapshots/{name}/data?part=1&parts=3"
                                     "&generation=00000000000000000001-abcdef")
        assert status == 409 and json.loads(raw)["error"] == "ConflictError"
        for bad in ("part=3&parts=3", "part=-1&parts=2", "parts=0", "parts=99", "part=x"):
            status, _headers, raw = _get(node, f"/v1/snapshots/{name}/data?{bad}")
            assert status == 400, bad


def test_an_overwrite_between_the_parts_of_a_download_is_a_conflict_then_reloads(
        node: NodeProcess, unique: str) -> None:
    """Parts 1.. ask for part 0's generation: an overwrite committed in between makes
    them ConflictError (never a mix of two generations), and load() then reads the
    live snapshot whole."""
    name = f"moved-{unique}"
    old = {"w": torch.randn(4 << 18)}
    new = {"w": torch.randn(4 << 18)}
    with _store(node) as store, _store(node) as other:
        store.save(old, name)

        def open_part(part: int, parts: int, generation: str | None) -> Any:
            if part == 1:
                other.save(new, name, overwrite=True)
            query = f"part={part}&parts={parts}" + (
                f"&generation={generation}" if generation else "")
            return store._transport.request("GET", node.url,
                                            f"/v1/snapshots/{name}/data?{query}",
                                            idempotent=True, stream=True)

        first = open_part(0, 2, None)
        parts, generation = sd.served_parts(first, 2, node.url)
        assert parts == 2 and generation is not None
        download = sd.Download({}, None, node.url)
        download.open(first)
        with pytest.raises(ConflictError, match="overwritten while it downloaded"):
            sd.receive_parts(first, open_part, download, parts, generation)
        first.close()
        back = store.load(name)
        assert torch.equal(back["w"], new["w"])


def test_save_async_copies_before_it_returns_and_reuses_its_staging(
        node: NodeProcess, unique: str) -> None:
    """The caller may change its tensors as soon as save_async returns (big ones are
    staged by memmove in pieces, strided and small ones by copy_), save after save into
    the same staging memory."""
    big = torch.randn(3 << 20)  # 12 MiB: several copy pieces
    state = {"big": big, "strided": torch.randn(64, 64).t(), "small": torch.ones(3),
             "tied": big}
    with _store(node) as store:
        for round_ in range(2):
            expected = {k: v.clone() for k, v in state.items()}
            handle = store.save_async(state, f"async-{round_}-{unique}")
            for t in state.values():
                t.add_(1.0)  # after return: the snapshot must not see it
            handle.result()
            back = store.load(f"async-{round_}-{unique}")
            for key, value in expected.items():
                assert torch.equal(back[key], value), key
            assert back["tied"] is back["big"]


def test_an_async_save_error_nobody_asked_for_is_raised_by_the_next_save(
        node: NodeProcess, unique: str) -> None:
    """As the embedded store (one rule, ``results.AsyncSaves``): the failure of an async
    save whose result nobody asked for is raised once, by the next save."""
    name = f"taken-{unique}"
    with _store(node) as store:
        store.save({"w": torch.ones(4)}, name)
        handle = store.save_async({"w": torch.zeros(4)}, name)  # the node refuses it
        store.wait()
        assert isinstance(handle.exception(), SnapshotExistsError)
        with pytest.raises(IsolaneError, match=f"previous async save of '{name}' failed"):
            store.save({"w": torch.ones(4)}, f"next-{unique}")
        store.save({"w": torch.ones(4)}, f"next-{unique}")  # reported once
        assert torch.equal(store.load(name)["w"], torch.ones(4))  # the first save stands
