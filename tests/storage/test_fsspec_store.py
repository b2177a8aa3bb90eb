"""FsspecBlobStore: the conformance suite on a real SeaweedFS (S3) and on memory://,
plus ranged batch reads, error translation and a server that goes away."""

from __future__ import annotations

import gc
import importlib
import importlib.util
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from isolane.errors import ConfigError, MissingDependencyError, StorageError
from isolane.storage import blob_store_from_url
from isolane.storage.base import ByteRange
from isolane.storage.fsspec_store import FsspecBlobStore
from tests.storage.conformance import BlobStoreConformance, pattern
from tests.support.seaweedfs import SeaweedServer

S3Url = tuple[str, dict[str, Any]]


class FsspecExtras:
    """Tests of what FsspecBlobStore adds to the interface."""

    def test_two_stores_on_one_url(
        self, store: FsspecBlobStore, store_options: dict[str, Any]
    ) -> None:
        twin = FsspecBlobStore(store.url, store_options)
        try:
            assert twin._fs is not store._fs  # no instance cache
            assert twin.list() == []
            store.write("x", b"1")
            assert twin.list() == ["x"]  # no listings cache either
        finally:
            twin.close()


class TestSeaweedFS(FsspecExtras, BlobStoreConformance):
    pytestmark = pytest.mark.s3

    @pytest.fixture
    def store_options(self, s3_url: S3Url) -> dict[str, Any]:
        return s3_url[1]

    @pytest.fixture
    def store(self, s3_url: S3Url) -> Iterator[FsspecBlobStore]:
        url, options = s3_url
        store = FsspecBlobStore(url, options)
        yield store
        store.close()

    def test_delete_prefix_removes_emptied_folders(self, store: FsspecBlobStore) -> None:
        """SeaweedFS keeps emptied folders listed for ~2 min; delete_prefix sweeps them."""
        store.write("snap/1/a/b/c", b"x")
        store.write("snap/2/a", b"y")
        store.delete_prefix("snap/1")
        assert store.children("snap") == ["2"]
        assert store.children("snap/1") == []


class TestMemory(FsspecExtras, BlobStoreConformance):
    @pytest.fixture
    def store_options(self) -> dict[str, Any]:
        return {}  # fsspec's process-wide memory store; the unique URL isolates tests

    @pytest.fixture
    def store(self, store_options: dict[str, Any]) -> Iterator[FsspecBlobStore]:
        store = FsspecBlobStore(f"memory://t-{uuid.uuid4().hex}/prefix", store_options)
        yield store
        for name in store.children():  # free the 5 MiB blobs in the shared store
            store.delete_prefix(name)
        store.close()

    def test_private_memory_store(self) -> None:
        url = f"memory://p-{uuid.uuid4().hex}/x"
        one = FsspecBlobStore(url, {"global_store": False})
        two = FsspecBlobStore(url, {"global_store": False})
        one.write("k", b"v")
        assert two.list() == []
        one.close()
        two.close()


# -- construction ------------------------------------------------------------------------
def test_registry_picks_fsspec_for_urls() -> None:
    store = blob_store_from_url(f"memory://r-{uuid.uuid4().hex}/x")
    assert isinstance(store, FsspecBlobStore)
    store.write("k", b"v")
    assert store.read("k") == b"v"
    store.delete("k")


def test_missing_s3fs_raises_missing_dependency(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "s3fs", None)  # import s3fs -> ImportError
    loaded = importlib.import_module("fsspec.registry")._registry  # classes imported so far
    for protocol in ("s3", "s3a"):
        monkeypatch.delitem(loaded, protocol, raising=False)
    with pytest.raises(MissingDependencyError, match="pip install s3fs"):
        FsspecBlobStore("s3://bucket/prefix", {})


def test_missing_other_backend_names_its_package() -> None:
    if _importable("gcsfs"):
        pytest.skip("gcsfs is installed")
    with pytest.raises(MissingDependencyError, match="gcsfs"):
        FsspecBlobStore("gs://bucket/prefix", {})


@pytest.mark.parametrize("url", ["s3://", "nosuchscheme://x/y"])
def test_bad_urls_raise_config_error(url: str) -> None:
    with pytest.raises(ConfigError):
        FsspecBlobStore(url, {"anon": True} if url.startswith("s3") else {})


def test_caller_config_kwargs_override_defaults() -> None:
    store = FsspecBlobStore("s3://bucket/prefix", {
        "anon": True, "config_kwargs": {"connect_timeout": 17}})
    conf = store._fs.config_kwargs
    assert conf["connect_timeout"] == 17
    assert conf["retries"] == {"mode": "standard", "total_max_attempts": 2}


def _importable(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


# -- a server that goes away -------------------------------------------------------------
def fails_fast(call: Callable[[], object], within_s: float = 5.0) -> StorageError:
    t0 = time.monotonic()
    with pytest.raises(StorageError) as info:
        call()
    elapsed = time.monotonic() - t0
    assert elapsed < within_s, f"took {elapsed:.1f} s to report a dead server"
    return info.value


@pytest.mark.s3
def test_stopped_server_raises_storage_error_then_recovers(
    fresh_s3_server: SeaweedServer,
) -> None:
    server = fresh_s3_server
    bucket = server.create_bucket()
    store = FsspecBlobStore(f"s3://{bucket}/p", server.storage_options)
    data = pattern(100_000, seed=3)
    store.write("kept", data)

    server.stop()
    calls: dict[str, Callable[[], object]] = {
        "read": lambda: store.read("kept"),
        "range": lambda: store.read("kept", ByteRange(0, 9)),
        "read_ranges": lambda: store.read_ranges([("kept", ByteRange(0, 9))]),
        "read_into": lambda: store.read_into("kept", memoryview(bytearray(10))),
        "write": lambda: store.write("new", b"x"),
        "write_atomic": lambda: store.write_atomic("new", b"x"),
        "copy": lambda: store.copy("kept", "c"),
        "size": lambda: store.size("kept"),
        "exists": lambda: store.exists("kept"),
        "list": lambda: store.list(),
        "children": lambda: store.children(),
        "delete": lambda: store.delete("kept"),
        "delete_prefix": lambda: store.delete_prefix("p"),
    }
    with ThreadPoolExecutor(len(calls)) as pool:  # each waits ~0-1 s for its one retry
        errors = dict(zip(calls, pool.map(fails_fast, calls.values()), strict=True))
    for op, error in errors.items():
        assert server.endpoint_url in str(error), op
        assert "running?" in str(error), op
        assert isinstance(error, OSError), op

    server.start()  # same ports, same data: the store reconnects
    assert store.read("kept") == data
    back = bytearray(len(data))
    store.read_into("kept", memoryview(back))  # ranged GETs on a new connection
    assert back == data
    store.write("after", b"restart")
    assert store.list() == ["after", "kept"]

    server.kill()  # a crash: acknowledged writes must survive it
    fails_fast(lambda: store.read("after"))
    server.start()
    assert store.read("after") == b"restart"
    store.close()


@pytest.mark.s3
def test_store_works_in_a_forked_child(s3_url: S3Url) -> None:
    """DataLoader workers fork: the child opens its own client, and nothing it frees may
    disturb the parent's connections (the epoll instance is shared across fork)."""
    store = FsspecBlobStore(*s3_url)
    store.write("k", b"from parent")  # the parent now holds a pooled connection
    # Earlier tests' s3fs garbage must be finalized here: finalized in the child it
    # could unregister the parent's sockets (fsspec/s3fs are not fork-safe upstream).
    gc.collect()
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        code = 1
        try:
            signal.alarm(20)  # a deadlock in the child must not hang the suite
            if store.read("k") == b"from parent":
                store.write("child", b"hi")
                code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    t0 = time.monotonic()
    assert store.read("child") == b"hi"
    assert store.read("k") == b"from parent"
    assert time.monotonic() - t0 < 5, "the parent's connection was disturbed by the child"
    store.close()


# -- ranged GETs straight into the destination (s3_ranged) -------------------------------
@pytest.mark.s3
def test_s3_read_into_uses_ranged_gets_into_place(s3_url: S3Url) -> None:
    url, options = s3_url
    store = FsspecBlobStore(url, options)
    try:
        store.read_part_bytes = 64 << 10  # 1 MiB + 5 bytes: 17 ranges, the last 5 bytes
        data = pattern((1 << 20) + 5)
        store.write("big", data)
        assert store._ranged_getter() is not None
        out = bytearray(len(data))
        store.read_into("big", memoryview(out))
        assert out == data
        part = bytearray(300_001)  # from an odd offset across several ranges
        store.read_into("big", memoryview(part), offset=77_777)
        assert part == data[77_777:77_777 + len(part)]
        with pytest.raises(EOFError):  # the blob is shorter than asked
            store.read_into("big", memoryview(bytearray(200_000)), offset=len(data) - 1000)
        with pytest.raises(EOFError):  # a range that starts past the end
            store.read_into("big", memoryview(bytearray(10)), offset=len(data) + 10)
        with pytest.raises(FileNotFoundError, match="no blob 'missing'"):
            store.read_into("missing", memoryview(bytearray(10)))
        for _ in range(3):  # connections survive the failed reads above
            again = bytearray(len(data))
            store.read_into("big", memoryview(again))
            assert again == data
    finally:
        store.close()


@pytest.mark.s3
def test_s3_read_into_without_ranged_gets_gives_the_same_bytes(s3_url: S3Url) -> None:
    url, options = s3_url
    store = FsspecBlobStore(url, options)
    try:
        store.ranged_gets = False
        store.read_part_bytes = 64 << 10
        data = pattern(300_000)
        store.write("b", data)
        assert store._ranged_getter() is None
        out = bytearray(200_000)
        store.read_into("b", memoryview(out), offset=1)
        assert out == data[1:200_001]
    finally:
        store.close()


def test_local_presigner_signs_as_botocore_does() -> None:
    import botocore.session
    from botocore.config import Config

    from isolane.storage.s3_ranged import local_presigner

    options = {"key": "AKID", "secret": "s3cr3t", "token": "tok",
               "client_kwargs": {"endpoint_url": "http://127.0.0.1:9/", "region_name": "eu-x-1"}}
    sign = local_presigner(options, 3600)
    assert sign is not None
    client = botocore.session.get_session().create_client(
        "s3", region_name="eu-x-1", endpoint_url="http://127.0.0.1:9",
        aws_access_key_id="AKID", aws_secret_access_key="s3cr3t", aws_session_token="tok",
        config=Config(signature_version="s3v4", s3={"addressing_style": "path"}))
    for _ in range(5):  # both within one second: the same X-Amz-Date, the same signature
        ours = sign("bkt/a b/c+d~e.0")
        theirs = client.generate_presigned_url(
            "get_object", Params={"Bucket": "bkt", "Key": "a b/c+d~e.0"}, ExpiresIn=3600)
        if ours.split("X-Amz-Date=")[1][:16] == theirs.split("X-Amz-Date=")[1][:16]:
            break
    assert ours == theirs
    client.close()
    # credentials or endpoint s3fs must find itself: no local signer
    assert local_presigner({"client_kwargs": {"endpoint_url": "http://h:1"}}, 60) is None
    assert local_presigner({"key": "a", "secret": "b"}, 60) is None


# -- listings and whole-blob reads by presigned requests (s3_listing) ----------------------
@pytest.mark.s3
def test_s3_presigned_listing_and_reads_match_s3fs_without_its_client(
        s3_url: S3Url, monkeypatch: pytest.MonkeyPatch) -> None:
    from isolane.storage import s3_listing

    url, options = s3_url
    writer = FsspecBlobStore(url, options)
    for key in ("a/1", "a/2", "a/b/3", "a/b/4", "c", "d/e/f"):
        writer.write(key, key.encode())
    monkeypatch.setattr(s3_listing, "PAGE_KEYS", 2)  # several pages per listing
    direct = FsspecBlobStore(url, options)
    through_s3fs = FsspecBlobStore(url, options)
    through_s3fs.ranged_gets = False
    try:
        for prefix in ("", "a", "a/b", "d", "d/e", "missing", "a/1"):
            assert direct.children(prefix) == through_s3fs.children(prefix), prefix
        assert direct.children("") == ["a", "c", "d"]
        assert direct.children("a") == ["1", "2", "b"]
        assert direct.read("a/b/3") == b"a/b/3" and direct.read("c") == b"c"
        with pytest.raises(FileNotFoundError, match="no blob 'a/9'"):
            direct.read("a/9")
        assert direct._fs._s3 is None  # s3fs's aiobotocore client was never created
        gone = FsspecBlobStore(url.replace("s3://", "s3://no-such-bucket-x", 1), options)
        assert gone.children("") == []
        gone.close()
    finally:
        for store in (writer, direct, through_s3fs):
            store.close()


def test_s3_listing_parse_and_its_errors() -> None:
    from isolane.storage.s3_listing import parse_listing

    body = (b'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult '
            b'xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><IsTruncated>true</IsTruncated>'
            b'<Contents><Key>p/x</Key><Size>1</Size></Contents><CommonPrefixes><Prefix>p/y/'
            b'</Prefix></CommonPrefixes><NextContinuationToken>t1</NextContinuationToken>'
            b'</ListBucketResult>')
    assert parse_listing(body, "s3://b/p") == (["p/x", "p/y/"], True, "t1")
    with pytest.raises(StorageError, match="not S3 XML"):
        parse_listing(b"<html>oops", "s3://b/p")
    bomb = (b'<?xml version="1.0"?><!DOCTYPE x [<!ENTITY a "aaaaaaaaaa">'
            + b"".join(b'<!ENTITY %c "&%c;&%c;&%c;&%c;&%c;&%c;&%c;&%c;&%c;&%c;">'
                       % ((98 + i,) + (97 + i,) * 10) for i in range(8))
            + b']><ListBucketResult><Contents><Key>&i;</Key></Contents></ListBucketResult>')
    with pytest.raises(StorageError, match="not S3 XML"):  # expat caps the expansion
        parse_listing(bomb, "s3://b/p")
