"""The pure parts of etcd membership: URLs, key layout, records, ring signatures, and
the ``cluster.etcd`` config."""

from __future__ import annotations

import pytest

from isolane.cluster.etcd_client import parse_etcd_url, prefix_end
from isolane.cluster.etcd_records import (
    MoveRecord,
    NodeRecord,
    RecordError,
    node_key,
    ring_signature,
    url_of_node_key,
)
from isolane.config import config_from_dict
from isolane.errors import ConfigError, InvalidArgumentError


def test_etcd_urls() -> None:
    target = parse_etcd_url("etcd://10.0.0.5:2380/prod/kv")
    assert (target.scheme, target.host, target.port, target.prefix) == \
        ("http", "10.0.0.5", 2380, "/prod/kv")
    assert target.url == "etcd://10.0.0.5:2380/prod/kv"
    default = parse_etcd_url("etcds://etcd.local")
    assert (default.scheme, default.port, default.prefix) == ("https", 2379, "/isolane")
    for bad in ("http://h:2379/x", "etcd://", "etcd://u:p@h/x", "etcd://h:99999/x", 7):
        with pytest.raises(InvalidArgumentError, match="etcd"):
            parse_etcd_url(bad)  # type: ignore[arg-type]
    assert prefix_end("/isolane/") == "/isolane0"


def test_node_keys_round_trip_any_url() -> None:
    for url in ("http://127.0.0.1:7070", "https://[::1]:443", "http://h:1/?x=%2F"):
        assert url_of_node_key("/p", node_key("/p", url)) == url
    assert url_of_node_key("/p", "/p/move/lock") is None
    assert url_of_node_key("/p", "/other/nodes/x") is None


def test_node_records_are_checked_field_by_field() -> None:
    record = NodeRecord("http://h:1", 2.0, 1.5, "abc", 42)
    assert NodeRecord.decode("http://h:1", record.encode()) == record
    bad = {
        b"{not json": "not JSON",
        b"[1]": "not a JSON object",
        b"[" * 50 + b"]" * 50: "not JSON",
        b'{"url": "ftp://h:1"}': "http",
        b'{"url": "http://other:1"}': "names another url",
        b'{"url": "http://h:1", "weight": 0}': "weight",
        b'{"url": "http://h:1", "weight": true}': "weight",
        b'{"url": "http://h:1", "started": "x"}': "started",
        b'{"url": "http://h:1", "pid": 1.5}': "pid",
        b'{"url": "http://h:1", "pad": "' + b"x" * 5000 + b'"}': "bytes",
    }
    for raw, why in bad.items():
        with pytest.raises(RecordError, match=why):
            NodeRecord.decode("http://h:1", raw)
    assert MoveRecord.decode(MoveRecord("r1", "c").encode()) == MoveRecord("r1", "c")
    with pytest.raises(RecordError):
        MoveRecord.decode(b'{"ring": 5}')


def test_ring_signatures_name_members_and_weights_in_any_order() -> None:
    a = ring_signature({"http://a:1": 1.0, "http://b:1": 1.0})
    assert a == ring_signature({"http://b:1": 1.0, "http://a:1": 1.0})
    assert a != ring_signature({"http://a:1": 1.0, "http://b:1": 2.0})
    assert a != ring_signature({"http://a:1": 1.0})


def test_cluster_etcd_config(tmp_path: object) -> None:
    short = config_from_dict({"cluster": {"etcd": "etcd://127.0.0.1:2379/x"}})
    assert short.cluster.etcd is not None and short.cluster.etcd.lease_ttl_s == 5
    full = config_from_dict({"cluster": {"etcd": {
        "url": "etcds://h/x", "lease_ttl_s": 3, "user": "u", "password": "p",
        "ca_file": "ca.pem", "cert_file": "c.pem", "key_file": "k.pem",
        "static_fallback": True}}}, base_dir="/etc/isolane")
    etcd = full.cluster.etcd
    assert etcd is not None and etcd.ca_file == "/etc/isolane/ca.pem" and etcd.static_fallback
    assert config_from_dict({}).cluster.etcd is None  # static cluster.nodes by default
    for bad, field in (({"url": "http://h"}, "cluster.etcd.url"),
                       ({"url": "etcd://h", "lease_ttl_s": 0}, "lease_ttl_s"),
                       ({"url": "etcd://h", "cert_file": "c"}, "cert_file"),
                       ({"url": "etcd://h", "password": "p"}, "cluster.etcd.user"),
                       ({"url": "etcd://h", "ttl": 3}, "cluster.etcd.ttl")):
        with pytest.raises(ConfigError, match=field):
            config_from_dict({"cluster": {"etcd": bad}})
