from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest

from isolane.config import (
    RemovedFieldWarning,
    SharedDiskWarning,
    config_from_dict,
    default_config,
    is_node_target,
    load_config,
    node_url_list,
    store_config,
    target_config,
)
from isolane.errors import ConfigError
from isolane.units import parse_size


def test_embedded_default_lives_under_isolane_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                   ) -> None:
    monkeypatch.setenv("ISOLANE_HOME", str(tmp_path / "home"))
    config = default_config()
    assert config.home == str(tmp_path / "home")
    write = config.require_group("write")
    read = config.require_group("read")
    assert write.devices == (str(tmp_path / "home" / "checkpoints"),)
    assert read.devices == (str(tmp_path / "home" / "kv"),)
    assert config.group("capacity") is None


def test_full_config_file_parses_sizes_and_resolves_paths(tmp_path: Path) -> None:
    path = tmp_path / "host.yaml"
    path.write_text(
        "home: ./data\n"
        "device_groups:\n"
        "  checkpoint: {role: write, devices: [a, b], threads: 8, inflight_bytes: 256MiB,"
        " direct_io: off}\n"
        "  kv: {role: read, devices: [c], memory_budget: 2GiB}\n"
        "  cold: {role: capacity, devices: ['s3://bkt/cold/'],"
        " storage_options: {endpoint_url: 'http://127.0.0.1:1'}}\n"
        "snapshot: {keep_last: 3, mirror: true, staging_budget: 1GiB}\n"
        "qos: {read_p99_slo_ms: 2}\n")
    config = load_config(path)
    write = config.require_group("write")
    assert write.devices == (str(tmp_path / "a"), str(tmp_path / "b"))
    assert write.threads == 8 and write.inflight_bytes == 256 << 20
    assert write.direct_io == "off"
    assert config.require_group("read").memory_budget == 2 << 30
    cold = config.require_group("capacity")
    assert cold.devices == ("s3://bkt/cold",)
    assert cold.storage_options == {"endpoint_url": "http://127.0.0.1:1"}
    assert config.snapshot.keep_last == 3 and config.snapshot.mirror
    assert config.qos.read_p99_slo_ms == 2.0


@pytest.mark.parametrize(("data", "field"), [
    ({"device_groups": {"g": {"role": "write", "devices": []}}}, "device_groups.g.devices"),
    ({"device_groups": {"g": {"role": "fast", "devices": ["x"]}}}, "device_groups.g.role"),
    ({"device_groups": {"g": {"role": "write", "devices": ["x"], "threads": 0}}},
     "device_groups.g.threads"),
    ({"device_groups": {"g": {"role": "write", "devices": ["x"], "threds": 2}}},
     "device_groups.g.threds"),
    ({"device_groups": {"g": {"role": "write", "devices": ["x"],
                              "inflight_bytes": "lots"}}}, "device_groups.g.inflight_bytes"),
    ({"snapshot": {"keep_last": 0}}, "snapshot.keep_last"),
    ({"snapshot": {"mirror": True}}, "snapshot.mirror"),
    ({"snapshot": {"chunk_bytes": "3KiB"}}, "snapshot.chunk_bytes"),
    ({"qos": {"read_p99_slo_ms": 0}}, "qos.read_p99_slo_ms"),
    ({"qos": {"read_p99_slo_ms": -1}}, "qos.read_p99_slo_ms"),
    ({"qos": {"write_bandwidth_min": 0}}, "qos.write_bandwidth_min"),
    ({"qos": {"write_bandwidth_max": 0}}, "qos.write_bandwidth_max"),
    ({"qos": {"write_bandwidth_min": "200MiB", "write_bandwidth_max": "100MiB"}},
     "qos.write_bandwidth_min"),
    ({"qos": {"read_p99_window_s": 0}}, "qos.read_p99_window_s"),
    ({"qos": {"governor_period_s": 2.0}}, "qos.governor_period_s"),
    ({"qos": {"decrease_factor": 1.5}}, "qos.decrease_factor"),
    ({"qos": {"background_share": 0}}, "qos.background_share"),
    ({"qos": {"control": "pid"}}, "qos.control"),
    ({"qos": {"governor": "yes"}}, "qos.governor"),
    ({"qos": {"read_lane": {"slo_ms": 3}}}, "qos.read_lane"),
    ({"node": {"port": 70000}}, "node.port"),
    ({"kvpool": {"namespace": ".."}}, "kvpool.namespace"),
    ({"kvpool": {"namespace": "model\n"}}, "kvpool.namespace"),
    ({"bogus": 1}, "bogus"),
])
def test_config_errors_name_the_field(tmp_path: Path, data: dict[str, object], field: str
                                      ) -> None:
    with pytest.raises(ConfigError) as err:
        config_from_dict(data, base_dir=tmp_path)
    assert err.value.field == field
    assert field in str(err.value)


def test_device_in_two_groups_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="overlaps"):
        config_from_dict({"device_groups": {
            "a": {"role": "write", "devices": [str(tmp_path / "x")]},
            "b": {"role": "read", "devices": [str(tmp_path / "x")]},
        }})
    with pytest.raises(ConfigError, match="overlaps"):
        config_from_dict({"device_groups": {
            "a": {"role": "write", "devices": [str(tmp_path / "x")]},
            "b": {"role": "read", "devices": [str(tmp_path / "x" / "sub")]},
        }})


def test_floor_above_cap_says_how_to_fix_it() -> None:
    with pytest.raises(ConfigError, match=r"above qos.write_bandwidth_max .*lower the floor, "
                                          "raise the cap, or set write_bandwidth_max: null"):
        config_from_dict({"qos": {"write_bandwidth_min": "200MiB",
                                  "write_bandwidth_max": "100MiB"}})
    qos = config_from_dict({"qos": {"write_bandwidth_min": "100MiB",
                                    "write_bandwidth_max": "100MiB"}}).qos
    assert qos.write_bandwidth_min == qos.write_bandwidth_max == 100 << 20  # equal is fine


def test_groups_on_one_disk_warn(tmp_path: Path) -> None:
    with pytest.warns(SharedDiskWarning, match="share one physical disk"):
        config_from_dict({"device_groups": {
            "a": {"role": "write", "devices": [str(tmp_path / "w")]},
            "b": {"role": "read", "devices": [str(tmp_path / "r")]},
        }})


def test_groups_on_different_disks_do_not_warn(tmp_path: Path) -> None:
    if os.stat("/dev/shm").st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("/dev/shm is on the same device as tmp_path here")
    with warnings.catch_warnings():
        warnings.simplefilter("error", SharedDiskWarning)
        config_from_dict({"device_groups": {
            "a": {"role": "write", "devices": [str(tmp_path / "w")]},
            "b": {"role": "read", "devices": ["/dev/shm/isolane-test-r"]},
        }})


def test_a_config_that_still_sets_cluster_replicas_loads_with_one_warning(tmp_path: Path
                                                                          ) -> None:
    """Hot replicas were removed: an old config still loads (the field ignored) and says
    which line to delete, once per process, not on every load."""
    path = tmp_path / "old.yaml"
    path.write_text("cluster:\n  nodes: [http://127.0.0.1:7071]\n  replicas: 1\n"
                    "  load_bound: 1.5\n")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        configs = [load_config(path) for _ in range(3)]
    removed = [w for w in seen if issubclass(w.category, RemovedFieldWarning)]
    assert len(removed) == 1
    text = str(removed[0].message)
    assert "cluster.replicas" in text and "ignored" in text
    assert "delete the line 'replicas: 1'" in text and "hot replicas were removed" in text
    for config in configs:  # the rest of the section is read as before
        assert config.cluster.nodes == ("http://127.0.0.1:7071",)
        assert config.cluster.load_bound == 1.5
        assert not hasattr(config.cluster, "replicas")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RemovedFieldWarning)
        config_from_dict({"cluster": {"load_bound": 1.5}})  # no warning without the field
    with pytest.raises(ConfigError, match=r"cluster\.replica"):  # a typo is still refused
        config_from_dict({"cluster": {"replica": 1}})


def test_missing_file_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("device_groups: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_store_config_for_url_and_folder(tmp_path: Path) -> None:
    assert store_config(str(tmp_path)).require_group("write").devices == (str(tmp_path),)
    s3 = store_config("s3://b/p", {"anon": True}).require_group("write")
    assert s3.devices == ("s3://b/p",) and s3.storage_options == {"anon": True}


@pytest.mark.parametrize(("text", "value"), [
    ("256MiB", 256 << 20), ("4GiB", 4 << 30), ("1.5GB", 1_500_000_000), ("1024", 1024),
    (4096, 4096), ("2 kib", 2048)])
def test_parse_size(text: str | int, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["-1", "lots", "5XB", True, -3])
def test_parse_size_refuses(text: object) -> None:
    with pytest.raises(ValueError):
        parse_size(text)  # type: ignore[arg-type]


# --- one way to open: what open_store(target) and open_kv_pool(target) take a target for


@pytest.mark.parametrize("target", ["http://h:1", "HTTPS://h:1", " http://a:1,http://b:2",
                                    ["http://a:1"], ("http://a:1", "http://b:2")])
def test_node_targets(target: object) -> None:
    assert is_node_target(target)


@pytest.mark.parametrize("target", [None, "./data", "s3://bucket/p", "file:///x",
                                    "conf.yaml", 7])
def test_embedded_targets(target: object) -> None:
    assert not is_node_target(target)


def test_node_url_list_splits_commas() -> None:
    assert node_url_list("http://a:1, http://b:2") == ["http://a:1", "http://b:2"]
    assert node_url_list(("http://a:1",)) == ["http://a:1"]


def test_target_config_gives_each_role_its_group(tmp_path: Path) -> None:
    folder = str(tmp_path / "data")
    write = target_config(folder, "write")
    assert write.require_group("write").devices == (folder,)
    read = target_config(folder, "read")
    assert read.require_group("read").devices == (folder,)
    conf = tmp_path / "host.yaml"
    conf.write_text(f"device_groups:\n  kv: {{role: read, devices: ['{folder}']}}\n")
    assert target_config(str(conf), "write") == load_config(conf)
    assert target_config(None, "read") == default_config()
    assert target_config(write, "read") is write


def test_a_config_naming_the_removed_aimd_law_is_refused_with_the_way_out(
        tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        config_from_dict({"qos": {"control": "aimd"}}, base_dir=tmp_path)
    assert err.value.field == "qos.control"
    assert "AIMD law was removed" in str(err.value) and "qos.control: target" in str(err.value)
    assert config_from_dict({"qos": {"control": "target"}}, base_dir=tmp_path).qos.control \
        == "target"


def test_the_aimd_step_field_loads_with_a_warning(tmp_path: Path) -> None:
    with pytest.warns(RemovedFieldWarning, match="qos.write_bandwidth_step"):
        config = config_from_dict({"qos": {"write_bandwidth_step": "64MiB"}},
                                  base_dir=tmp_path)
    assert not hasattr(config.qos, "write_bandwidth_step")


def test_a_config_naming_the_removed_wtinylfu_policy_is_refused_with_the_way_out(
        tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        config_from_dict({"kvpool": {"policy": "wtinylfu"}}, base_dir=tmp_path)
    assert err.value.field == "kvpool.policy" and "set s3fifo" in str(err.value)
    assert config_from_dict({"kvpool": {"policy": "lru"}}, base_dir=tmp_path).kvpool.policy \
        == "lru"


def test_node_request_caps_are_config_fields_with_sizes() -> None:
    config = config_from_dict({"node": {"max_request_bytes": "1MiB", "max_block_bytes": "64KiB",
                                        "max_batch_blocks": 8, "max_upload_bytes": "2GiB"}})
    assert config.node.max_request_bytes == 1 << 20
    assert config.node.max_block_bytes == 64 << 10
    assert config.node.max_batch_blocks == 8
    assert config.node.max_upload_bytes == 2 << 30
    default = config_from_dict({}).node
    assert (default.max_request_bytes, default.max_block_bytes, default.max_batch_blocks,
            default.max_upload_bytes) == (256 << 20, 64 << 20, 65536, None)


@pytest.mark.parametrize(("field", "value", "words"), [
    ("max_request_bytes", "lots", "lots"),
    ("max_request_bytes", 0, "at least 1"),
    ("max_block_bytes", -4, "negative"),
    ("max_batch_blocks", "many", "whole number"),
    ("max_batch_blocks", 0, "at least 1"),
    ("max_upload_bytes", 0, "at least 1"),
])
def test_a_bad_node_request_cap_names_its_field(field: str, value: object, words: str) -> None:
    with pytest.raises(ConfigError, match=f"node.{field}") as info:
        config_from_dict({"node": {field: value}})
    assert words in str(info.value)


def test_open_kv_pool_takes_an_etcd_url_and_never_makes_a_folder_of_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from isolane import KVPool, open_kv_pool
    from isolane.errors import EtcdUnavailableError, InvalidArgumentError
    from tests.support.procs import free_ports

    monkeypatch.chdir(tmp_path)
    dead = f"etcd://127.0.0.1:{free_ports(1)[0]}/isolane"
    with pytest.raises(EtcdUnavailableError, match=dead.replace(".", r"\.")):
        open_kv_pool(dead)
    with pytest.raises(InvalidArgumentError, match="open_kv_pool"):
        KVPool(dead)
    assert list(tmp_path.iterdir()) == []


def test_open_store_refuses_an_etcd_url_naming_what_it_takes(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    from isolane import SnapshotStore, open_store
    from isolane.errors import InvalidArgumentError

    monkeypatch.chdir(tmp_path)
    for opener in (open_store, SnapshotStore):
        with pytest.raises(InvalidArgumentError, match=r"a snapshot store is opened by a node URL"):
            opener("etcd://127.0.0.1:2379/isolane")
    assert list(tmp_path.iterdir()) == []
