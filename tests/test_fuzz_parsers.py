"""Fuzzing every parser of outside data: random bytes and mutations of valid input map
to the library's own error (or parse), never a raw exception, a hang or a crash.

Bounded and deterministic for CI: derandomized, no example database, a fixed number
of examples per parser (this file runs in well under 30 s on an idle machine).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from isolane import SnapshotStore, bounded_json
from isolane.client.transport import check_node_url
from isolane.config import config_from_dict, load_config, store_config
from isolane.errors import (
    ConfigError,
    IntegrityError,
    InvalidArgumentError,
    StorageError,
    WireFormatError,
)
from isolane.kvpool.namespace_files import read_namespace_meta
from isolane.lanes.plane_format import (
    FILE_BYTES,
    GOV_BYTES,
    HEADER,
    SLOT_BYTES,
    Header,
    SlotRecord,
    check_header,
    fresh_file,
    pack_governor,
    unpack_governor,
)
from isolane.snapshot.manifest import MANIFEST, Manifest
from isolane.snapshot.tree import flatten_state
from isolane.wire import frames
from isolane.wire import snapshot_stream as ss
from isolane.wire.chain_list import decode_chain_list, encode_chain_list
from isolane.wire.layout import NamespaceLayout

FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow,
                                       HealthCheck.function_scoped_fixture])


def mutations(valid: bytes) -> st.SearchStrategy[bytes]:
    """``valid`` with bytes flipped, cut, repeated or spliced in."""
    n = len(valid)

    def flip(at: int, value: int) -> bytes:
        return valid[:at % n] + bytes([value]) + valid[at % n + 1:]

    return st.one_of(
        st.builds(flip, st.integers(0, 1 << 30), st.integers(0, 255)),
        st.builds(lambda cut: valid[:cut % (n + 1)], st.integers(0, 1 << 30)),
        st.builds(lambda at, junk: valid[:at % (n + 1)] + junk + valid[at % (n + 1):],
                  st.integers(0, 1 << 30), st.binary(max_size=64)),
        st.builds(lambda k: valid * k, st.integers(2, 3)),
        st.binary(max_size=512),
    )


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner,
                                                                  max_size=4),
    max_leaves=20)


# -- JSON ------------------------------------------------------------------------------
@FUZZ
@given(data=st.binary(max_size=256) | st.text(alphabet='[]{}"\\,:1a ', max_size=300).map(
    str.encode))
def test_bounded_json_raises_only_value_error(data: bytes) -> None:
    with contextlib.suppress(ValueError):
        bounded_json.loads(data, max_depth=8)


@FUZZ
@given(value=json_values)
def test_bounded_json_reads_what_json_writes(value: Any) -> None:
    assert bounded_json.loads(json.dumps(value)) == value


@FUZZ
@given(depth=st.integers(1, 600), opener=st.sampled_from(["[", '{"a":']))
def test_bounded_json_depth_is_exact(depth: int, opener: str) -> None:
    closer = "]" if opener == "[" else "}"
    text = opener * depth + "1" + closer * depth
    if depth <= 64:
        bounded_json.loads(text, max_depth=64)
    else:
        try:
            bounded_json.loads(text, max_depth=64)
        except bounded_json.JsonTooDeepError:
            return
        raise AssertionError("too deep was accepted")


# -- snapshot manifests and streams ------------------------------------------------------
_manifest_cache: dict[str, bytes] = {}


def _valid_manifest(tmp: Path) -> bytes:
    if "m" not in _manifest_cache:
        store = SnapshotStore(str(tmp / "store"))
        store.save({"w": torch.ones(3, 4), "opt": {"step": 3, "lr": 0.1, "n": [1, "x"]}},
                   "m")
        _manifest_cache["m"] = (Path(store.path("m")) / MANIFEST).read_bytes()
        store.close()
    return _manifest_cache["m"]


def test_manifests_fail_closed(tmp_path: Path) -> None:
    valid = _valid_manifest(tmp_path)
    Manifest.from_json(valid, "fuzz")

    @FUZZ
    @given(data=mutations(valid))
    def check(data: bytes) -> None:
        with contextlib.suppress(IntegrityError):
            Manifest.from_json(data, "fuzz")

    check()


def _valid_header() -> bytes:
    tree, leaves = flatten_state({"w": torch.ones(3, 4), "b": torch.zeros(2), "s": 1})
    entries = tuple(ss.TensorEntry(leaf.id, str(leaf.path), "float32",
                                   tuple(leaf.tensor.shape), leaf.tensor.nbytes)
                    for leaf in leaves)
    return ss.StreamHeader("x", tree, entries, {"k": 1}, ()).encode()


def test_stream_headers_fail_closed() -> None:
    valid = _valid_header()
    ss.decode_header(valid, need_chunks=False)

    @FUZZ
    @given(data=mutations(valid))
    def check(data: bytes) -> None:
        for need in (True, False):
            # WireFormatError or PayloadTooLargeError
            with contextlib.suppress(InvalidArgumentError):
                ss.decode_header(data, need_chunks=need)

    check()


@FUZZ
@given(data=st.binary(min_size=ss.PREAMBLE.size, max_size=ss.PREAMBLE.size) | mutations(
    ss.encode_preamble(b"{}"))
    .filter(lambda d: len(d) == ss.PREAMBLE.size))
def test_stream_preambles_fail_closed(data: bytes) -> None:
    with contextlib.suppress(InvalidArgumentError):
        ss.decode_preamble(data)


@FUZZ
@given(data=st.lists(json_values, max_size=4))
def test_stream_chunk_lists_fail_closed(data: list[Any]) -> None:
    with contextlib.suppress(WireFormatError):
        ss.decode_chunks(data)


# -- KV frames, chain lists, layouts, namespace files -------------------------------------
@FUZZ
@given(data=mutations(frames.encode_batch_header(3) + b"".join(
    b"".join(bytes(p) for p in frames.encode_frame(bytes(range(16)), b"v" * 40))
    for _ in range(1))))
def test_kv_frames_fail_closed(data: bytes) -> None:
    for parse in (lambda: frames.decode_batch_header(data[:16], 1 << 16),
                  lambda: frames.decode_keys(data),
                  lambda: frames.decode_frame_header(data[:frames.FRAME_HEADER.size], 1 << 20)):
        with contextlib.suppress(InvalidArgumentError):
            parse()


@FUZZ
@given(data=mutations(encode_chain_list([(bytes(16), [bytes(range(16))] * 3)])))
def test_chain_lists_fail_closed(data: bytes) -> None:
    with contextlib.suppress(WireFormatError):
        decode_chain_list(data)


@FUZZ
@given(body=json_values)
def test_namespace_layouts_fail_closed(body: Any) -> None:
    with contextlib.suppress(InvalidArgumentError):
        NamespaceLayout.from_dict(body)


def test_namespace_files_fail_closed(tmp_path: Path) -> None:
    path = tmp_path / "namespace.json"
    valid = json.dumps({"dtype": "float16", "shape": [2, 4], "chunk_tokens": 16,
                        "token_dim": 0}).encode()

    @FUZZ
    @given(data=mutations(valid) | st.just(b"[" * 100_000))
    def check(data: bytes) -> None:
        path.write_bytes(data)
        with contextlib.suppress(IntegrityError):
            read_namespace_meta(path, "ns")

    check()


# -- plane files ------------------------------------------------------------------------
def test_plane_files_fail_closed() -> None:
    digest = bytes(16)
    valid = fresh_file(Header(digest, 1.0))
    assert len(valid) == FILE_BYTES and check_header(valid[:HEADER.size + 4], digest) is None
    slot = SlotRecord(state=1, pid=1, generation=1).pack()
    gov = pack_governor({"write": {"rate": 1.0}, "decisions": []})

    @FUZZ
    @given(head=mutations(valid[:HEADER.size + 4]), slot_data=mutations(slot),
           gov_data=mutations(gov) | st.just(b"[" * 4000))
    def check(head: bytes, slot_data: bytes, gov_data: bytes) -> None:
        assert check_header(head, digest) is None or isinstance(check_header(head, digest), str)
        SlotRecord.unpack(slot_data[:SLOT_BYTES].ljust(SLOT_BYTES, b"\0"))
        unpack_governor(gov_data[:GOV_BYTES])

    check()


# -- config and URLs --------------------------------------------------------------------
@FUZZ
@given(data=st.dictionaries(st.sampled_from(["home", "device_groups", "snapshot", "kvpool",
                                             "qos", "node", "cluster", "bogus"]),
                            json_values, max_size=3))
def test_configs_fail_closed(data: dict[str, Any]) -> None:
    with contextlib.suppress(ConfigError):
        config_from_dict(data, base_dir="/tmp/isolane-fuzz-never-made")


def test_config_files_fail_closed(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"

    @FUZZ
    @given(text=st.text(alphabet="{}[]:,- \n\tabc01'\"&*!|>", max_size=200))
    def check(text: str) -> None:
        path.write_text(text)
        with contextlib.suppress(ConfigError):
            load_config(path)

    check()


@FUZZ
@given(url=st.text(max_size=40) | st.builds(lambda s, rest: s + rest,
                                            st.sampled_from(["http://", "https://", "s3://",
                                                             "http://[", "gs://"]),
                                            st.text(max_size=30)))
def test_store_urls_fail_closed(url: str) -> None:
    with contextlib.suppress(InvalidArgumentError):
        check_node_url(url)
    if "://" in url and not url.startswith("file://"):
        cwd = os.getcwd()
        before = set(os.listdir(cwd))
        with contextlib.suppress(ConfigError, StorageError):
            store_config(url)
        assert set(os.listdir(cwd)) == before  # no folder named after half a URL
