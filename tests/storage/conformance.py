"""The contract every BlobStore keeps, as tests each backend's test module subclasses.

    class TestMyStore(BlobStoreConformance):
        @pytest.fixture
        def store(self, tmp_path):
            yield MyStore(...)

The fixture yields an empty store. Keys are written in scrambled order on purpose so
that sorted output is tested, not insertion order.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from isolane.errors import InvalidNameError
from isolane.storage.base import BlobStore, ByteRange

MiB = 1 << 20
BAD_KEYS = ["../x", "/abs", "a//b", "a/./b", "x\x00", "", "a/", "a/../b", "a b"]

# A small tree: names that share prefixes ("a/b" vs "a/b2" vs "a/bc") catch prefix bugs.
TREE = {
    "b": b"b",
    "a/bc": b"bc",
    "a/b/d": b"d" * 10,
    "a/b2": b"",
    "a/b/c": b"c" * 5,
    "z/1/2/3": b"deep",
}


def pattern(n: int, seed: int = 0) -> bytes:
    """``n`` pseudo-random bytes (a wrong offset or range cannot pass by luck)."""
    return random.Random(seed).randbytes(n)


def write_tree(store: BlobStore) -> None:
    for key, data in TREE.items():
        store.write(key, data)


class BlobStoreConformance:
    """Subclasses provide the ``store`` fixture; every test runs against it."""

    @pytest.fixture
    def store(self) -> BlobStore:
        raise NotImplementedError("subclasses provide the 'store' fixture")

    # -- round trips ---------------------------------------------------------------------
    @pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, 5 * MiB], ids=lambda n: f"{n}B")
    def test_round_trip(self, store: BlobStore, size: int) -> None:
        data = pattern(size, seed=size)
        store.write("blob", data)
        assert store.read("blob") == data
        assert store.size("blob") == size
        assert store.exists("blob")

    @pytest.mark.parametrize("kind", [bytearray, memoryview])
    def test_write_accepts_buffers(self, store: BlobStore, kind: Callable[[bytes], Any]) -> None:
        data = pattern(3000, seed=1)
        store.write("k", kind(data))
        assert store.read("k") == data

    def test_write_unaligned_memoryview_slice(self, store: BlobStore) -> None:
        backing = bytearray(pattern(3 * 4096 + 100, seed=2))
        view = memoryview(backing)[3 : 3 + 5000]  # odd start, not a page multiple
        store.write("k", view)
        assert store.read("k") == bytes(backing[3:5003])

    def test_write_length_shorter_than_data(self, store: BlobStore) -> None:
        data = pattern(10_000, seed=3)
        store.write("k", data, length=4321)
        assert store.read("k") == data[:4321]
        assert store.size("k") == 4321

    def test_sync_all_keeps_what_was_written_unsynced(self, store: BlobStore) -> None:
        store.write("g/k", pattern(5000, seed=6), durable=False)
        store.sync_all()
        assert store.read("g/k") == pattern(5000, seed=6)

    def test_overwrite_with_shorter_blob(self, store: BlobStore) -> None:
        store.write("k", pattern(9000, seed=4))
        store.write("k", b"short")
        assert store.read("k") == b"short"
        assert store.size("k") == 5

    # -- ranges --------------------------------------------------------------------------
    def test_read_byte_ranges(self, store: BlobStore) -> None:
        data = pattern(1000, seed=5)
        store.write("k", data)
        for start, end in [(0, 1), (0, 1000), (1, 999), (500, 501), (999, 1000), (123, 456)]:
            assert store.read("k", ByteRange(start, end)) == data[start:end], (start, end)

    def test_read_range_edges(self, store: BlobStore) -> None:
        data = pattern(100, seed=6)
        store.write("k", data)
        store.write("empty", b"")
        assert store.read("k", ByteRange(90, 200)) == data[90:]  # runs past the end
        assert store.read("k", ByteRange(100, 110)) == b""  # starts at the end
        assert store.read("k", ByteRange(500, 510)) == b""  # starts after the end
        assert store.read("k", ByteRange(7, 7)) == b""
        assert store.read("empty", ByteRange(0, 0)) == b""

    def test_read_ranges(self, store: BlobStore) -> None:
        a, b = pattern(10_000, seed=1), pattern(300, seed=2)
        store.write("kv/a", a)
        store.write("kv/b", b)
        requests = [("kv/a", ByteRange(0, 10)), ("kv/b", ByteRange(100, 300)),
                    ("kv/a", ByteRange(9000, 10_000)), ("kv/a", ByteRange(5, 5)),
                    ("kv/b", ByteRange(250, 400)), ("kv/a", ByteRange(20_000, 20_010))]
        assert store.read_ranges(requests) == [
            a[:10], b[100:], a[9000:], b"", b[250:], b""]
        assert store.read_ranges([]) == []

    def test_read_ranges_missing_key(self, store: BlobStore) -> None:
        store.write("kv/a", b"0123")
        with pytest.raises(FileNotFoundError, match="kv/nope"):
            store.read_ranges([("kv/a", ByteRange(0, 2)), ("kv/nope", ByteRange(0, 2))])

    def test_read_into_at_offset(self, store: BlobStore) -> None:
        data = pattern(20_000, seed=7)
        store.write("k", data)
        out = bytearray(5000)
        store.read_into("k", memoryview(out), offset=12_345)
        assert bytes(out) == data[12_345:17_345]
        whole = bytearray(len(data))
        store.read_into("k", memoryview(whole))
        assert bytes(whole) == data

    def test_read_into_past_end_raises(self, store: BlobStore) -> None:
        store.write("k", b"0123456789")
        with pytest.raises(EOFError):
            store.read_into("k", memoryview(bytearray(8)), offset=5)

    # -- write_atomic --------------------------------------------------------------------
    def test_write_atomic_round_trip_and_replace(self, store: BlobStore) -> None:
        store.write_atomic("meta/manifest", b"v1")
        assert store.read("meta/manifest") == b"v1"
        store.write_atomic("meta/manifest", memoryview(b"version two"))
        assert store.read("meta/manifest") == b"version two"
        assert store.list() == ["meta/manifest"]  # no temp file left behind
        assert store.children("meta") == ["manifest"]

    def test_write_atomic_readers_see_old_or_new(self, store: BlobStore) -> None:
        old, new = b"o" * 50_000, b"N" * 70_001
        store.write_atomic("m", old)
        seen: set[bytes] = set()
        stop = threading.Event()

        def reader() -> None:
            while not stop.is_set():
                seen.add(store.read("m"))

        threads = [threading.Thread(target=reader) for _ in range(2)]
        for t in threads:
            t.start()
        try:
            for i in range(20):
                store.write_atomic("m", new if i % 2 == 0 else old)
        finally:
            stop.set()
            for t in threads:
                t.join()
        assert seen <= {old, new}
        assert store.read("m") == old

    # -- copy ----------------------------------------------------------------------------
    def test_copy(self, store: BlobStore) -> None:
        data = pattern(70_000, seed=8)
        store.write("src/x", data)
        store.copy("src/x", "dst/deeper/y")
        assert store.read("dst/deeper/y") == data
        assert store.read("src/x") == data

    def test_copy_overwrites_existing_dst(self, store: BlobStore) -> None:
        store.write("src", b"new bytes")
        store.write("dst", pattern(9000, seed=9))
        store.copy("src", "dst")
        assert store.read("dst") == b"new bytes"
        assert store.size("dst") == 9

    def test_writing_copy_leaves_source_alone(self, store: BlobStore) -> None:
        store.write("src", b"original")
        store.copy("src", "dst")
        store.write("dst", b"changed!")
        assert store.read("src") == b"original"

    def test_copy_missing_src(self, store: BlobStore) -> None:
        with pytest.raises(FileNotFoundError):
            store.copy("nope", "dst")
        assert not store.exists("dst")

    # -- listing -------------------------------------------------------------------------
    def test_list_sorted_and_recursive(self, store: BlobStore) -> None:
        write_tree(store)
        assert store.list() == sorted(TREE)
        assert store.list("a") == ["a/b/c", "a/b/d", "a/b2", "a/bc"]
        assert store.list("a/b") == ["a/b/c", "a/b/d"]  # not a/b2 or a/bc
        assert store.list("z/1") == ["z/1/2/3"]

    def test_list_edge_cases(self, store: BlobStore) -> None:
        assert store.list() == []
        write_tree(store)
        assert store.list("missing") == []
        assert store.list("a/b/c") == ["a/b/c"]  # a blob lists as itself

    def test_children(self, store: BlobStore) -> None:
        write_tree(store)
        assert store.children() == ["a", "b", "z"]
        assert store.children("a") == ["b", "b2", "bc"]
        assert store.children("a/b") == ["c", "d"]
        assert store.children("z/1") == ["2"]

    def test_children_edge_cases(self, store: BlobStore) -> None:
        assert store.children() == []
        write_tree(store)
        assert store.children("missing") == []
        assert store.children("a/b/c") == []  # a blob has no children
        assert store.children("a/b") == ["c", "d"]  # no trailing slashes

    def test_listing_sees_a_write_at_once(self, store: BlobStore) -> None:
        write_tree(store)
        assert store.list("a/b") == ["a/b/c", "a/b/d"]
        store.write("a/b/e", b"e")
        assert store.list("a/b") == ["a/b/c", "a/b/d", "a/b/e"]
        assert store.children("a/b") == ["c", "d", "e"]
        store.delete("a/b/e")
        assert store.list("a/b") == ["a/b/c", "a/b/d"]

    # -- deletion ------------------------------------------------------------------------
    def test_delete_is_idempotent(self, store: BlobStore) -> None:
        store.write("k/x", b"1")
        store.delete("k/x")
        store.delete("k/x")
        store.delete("never/existed")
        assert not store.exists("k/x")
        with pytest.raises(FileNotFoundError):
            store.read("k/x")
        assert store.list() == []

    def test_delete_prefix(self, store: BlobStore) -> None:
        write_tree(store)
        store.delete_prefix("a/b")
        assert store.list() == ["a/b2", "a/bc", "b", "z/1/2/3"]
        assert store.children("a") == ["b2", "bc"]
        store.delete_prefix("z")
        assert store.children() == ["a", "b"]
        store.delete_prefix("b")  # a blob
        assert store.list() == ["a/b2", "a/bc"]
        store.delete_prefix("missing")
        store.delete_prefix("z")
        assert store.list() == ["a/b2", "a/bc"]

    # -- exists and missing keys ---------------------------------------------------------
    def test_exists(self, store: BlobStore) -> None:
        assert not store.exists("k")
        store.write("k", b"")
        assert store.exists("k")
        assert not store.exists("k2")

    @pytest.mark.parametrize("op", ["read", "range", "read_into", "size"])
    def test_missing_key_raises_file_not_found(self, store: BlobStore, op: str) -> None:
        store.write("other", b"x")
        calls: dict[str, Callable[[], object]] = {
            "read": lambda: store.read("a/missing"),
            "range": lambda: store.read("a/missing", ByteRange(0, 4)),
            "read_into": lambda: store.read_into("a/missing", memoryview(bytearray(4))),
            "size": lambda: store.size("a/missing"),
        }
        with pytest.raises(FileNotFoundError):
            calls[op]()

    # -- key validation ------------------------------------------------------------------
    @pytest.mark.parametrize("key", BAD_KEYS, ids=repr)
    def test_bad_keys_are_refused(self, store: BlobStore, key: str) -> None:
        store.write("ok", b"x")
        calls: dict[str, Callable[[], object]] = {
            "read": lambda: store.read(key),
            "write": lambda: store.write(key, b"x"),
            "write_atomic": lambda: store.write_atomic(key, b"x"),
            "copy_src": lambda: store.copy(key, "ok2"),
            "copy_dst": lambda: store.copy("ok", key),
            "size": lambda: store.size(key),
            "exists": lambda: store.exists(key),
            "delete": lambda: store.delete(key),
            "delete_prefix": lambda: store.delete_prefix(key),
            "read_into": lambda: store.read_into(key, memoryview(bytearray(1))),
        }
        if key:  # "" is the root for listing, which is valid
            calls["list"] = lambda: store.list(key)
            calls["children"] = lambda: store.children(key)
        for op, call in calls.items():
            with pytest.raises(InvalidNameError):
                call()
                pytest.fail(f"{op}({key!r}) was accepted")
        assert store.list() == ["ok"]

    # -- threads -------------------------------------------------------------------------
    def test_concurrent_writes_and_reads(self, store: BlobStore) -> None:
        def work(worker: int) -> list[str]:
            keys = []
            for i in range(6):
                key = f"w{worker}/blob{i}"
                data = pattern(1000 * (i + 1) + worker, seed=worker * 10 + i)
                store.write(key, data)
                assert store.read(key) == data
                assert store.read(key, ByteRange(10, 20)) == data[10:20]
                keys.append(key)
            store.write("shared", f"from {worker}".encode())
            return keys

        with ThreadPoolExecutor(8) as pool:
            written = [k for keys in pool.map(work, range(8)) for k in keys]
        assert store.list() == sorted([*written, "shared"])
        assert store.read("shared") in {f"from {w}".encode() for w in range(8)}
        assert store.children() == sorted(["shared", *(f"w{w}" for w in range(8))])
