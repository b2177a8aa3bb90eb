"""Names, layouts, tokens, error statuses and load counters (pure)."""

from __future__ import annotations

import pytest
import torch

from isolane.errors import (
    AuthenticationError,
    ConflictError,
    IntegrityError,
    InvalidArgumentError,
    InvalidNameError,
    IsolaneError,
    KeyNotFoundError,
    PayloadTooLargeError,
    SnapshotExistsError,
    SnapshotNotFoundError,
    StorageError,
)
from isolane.kvpool.api import shape_with_tokens
from isolane.node.load import ByteRate, Load, lane_latency_ms
from isolane.wire.auth import authorized, is_loopback, resolve_token
from isolane.wire.layout import NamespaceLayout
from isolane.wire.names import check_key, check_namespace, check_snapshot_name
from isolane.wire.statuses import error_body, error_from_body, status_for


def test_keys_are_exactly_32_lowercase_hex() -> None:
    assert check_key("00" * 16) == bytes(16)
    for bad in ["AB" * 16, "0" * 31, "0" * 33, "zz" * 16, "0x" + "0" * 30, " " + "0" * 31]:
        with pytest.raises(InvalidNameError, match="malformed block key"):
            check_key(bad)


def test_namespaces_allow_model_names_and_nothing_path_like() -> None:
    for good in ["default", "meta-llama/Llama-3.1-8B@main", "m:tp2", "a" * 200]:
        assert check_namespace(good) == good
    for bad in ["", "../etc", "a/../b", "/abs", "a//b", "a/", "sp ace", "a" * 201, "é", "-x"]:
        with pytest.raises(InvalidNameError, match="invalid KV namespace"):
            check_namespace(bad)
    with pytest.raises(InvalidNameError, match="invalid snapshot name"):
        check_snapshot_name("a/b")


def test_layout_sizes_blocks_and_names_them_like_the_embedded_pool() -> None:
    layout = NamespaceLayout("bfloat16", (2, 2, 4, 8), chunk_tokens=16, token_dim=2)
    assert layout.block_bytes == 16 * 2 * 2 * 4 * 8 * 2
    assert layout.full_shape(16) == (2, 2, 16, 4, 8)
    assert layout.text() == shape_with_tokens((2, 2, 4, 8), 2, "T") == "[2,2,T,4,8]"
    assert NamespaceLayout.from_dict(layout.to_dict()) == layout
    assert torch.empty((), dtype=torch.bfloat16).element_size() == 2
    for bad in [{"dtype": "bfloat16", "shape": [0], "chunk_tokens": 1},
                {"dtype": "object", "shape": [2], "chunk_tokens": 1},
                {"dtype": "float32", "shape": [2], "chunk_tokens": 0},
                {"dtype": "float32", "shape": [2], "chunk_tokens": 4, "token_dim": 2},
                {"dtype": "float32", "shape": [2], "chunk_tokens": 4, "extra": 1},
                [1, 2]]:
        with pytest.raises(InvalidArgumentError):
            NamespaceLayout.from_dict(bad)


def test_tokens_come_from_the_environment_first_and_compare_whole() -> None:
    assert resolve_token("from-config", {"ISOLANE_TOKEN": "from-env"}) == "from-env"
    assert resolve_token("from-config", {}) == "from-config"
    assert resolve_token(None, {"ISOLANE_TOKEN": ""}) is None
    assert authorized(None, None)
    assert authorized("s3cret", "Bearer s3cret") and authorized("s3cret", "bearer s3cret")
    for header in [None, "", "Bearer", "Bearer s3cre", "Bearer s3cret2", "Basic s3cret",
                   "s3cret"]:
        assert not authorized("s3cret", header), header
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("example.org")


@pytest.mark.parametrize(("exc", "status"), [
    (AuthenticationError("no"), 401),
    (PayloadTooLargeError("body", 10, 5), 413),
    (SnapshotNotFoundError("s", "/x"), 404),
    (KeyNotFoundError("k"), 404),
    (SnapshotExistsError("s", "/x"), 409),
    (ConflictError("c"), 409),
    (InvalidNameError("n"), 400),
    (IntegrityError("chunk c.0", "hash differs"), 500),
    (StorageError("down"), 503),
    (OSError(5, "EIO"), 503),
])
def test_errors_cross_the_wire_as_the_same_class(exc: Exception, status: int) -> None:
    assert status_for(exc) == status
    again = error_from_body(status, error_body(exc), "node")
    assert str(again) == str(exc)
    if isinstance(exc, IsolaneError):
        assert type(again) is type(exc)
    else:
        assert isinstance(again, StorageError)
    if isinstance(exc, SnapshotNotFoundError):
        assert isinstance(again, FileNotFoundError) and again.name == "s"  # type: ignore[attr-defined]


def test_unknown_error_names_are_not_instantiated() -> None:
    again = error_from_body(500, {"error": "SystemExit", "message": "boom"}, "node")
    assert type(again) is IsolaneError and str(again) == "boom"
    assert isinstance(error_from_body(401, None, "node"), AuthenticationError)
    assert isinstance(error_from_body(502, "<html>", "node"), StorageError)


def test_byte_rate_covers_the_last_window_only() -> None:
    rate = ByteRate(window_s=10)
    rate.add(1000, now=100.2)
    rate.add(1000, now=105.9)
    assert rate.per_s(106.0) == 200.0
    assert rate.per_s(110.5) == 100.0  # second 100 fell out of (100, 110]
    assert rate.per_s(200.0) == 0.0
    load = Load()
    load.request_started()
    load.hold(4096)
    load.received(4096, now=50.0)
    snap = load.snapshot(now=50.5)
    assert (snap.requests, snap.bytes_in_flight, snap.bytes_in_total) == (1, 4096, 4096)
    load.release(4096)
    load.request_finished()
    assert load.snapshot(now=51).requests == 0 and load.snapshot(now=51).bytes_in_flight == 0


def test_lane_latency_reads_whatever_the_scheduler_reports() -> None:
    assert lane_latency_ms({"latency_ms": {"p50": 0.1, "p99": 2.5, "p999": None}}) == {
        "p50": 0.1, "p99": 2.5, "p999": None}
    assert lane_latency_ms({"p99_ms": 3}) == {"p50": None, "p99": 3.0, "p999": None}
    assert lane_latency_ms({"ops": 1}) == {"p50": None, "p99": None, "p999": None}
