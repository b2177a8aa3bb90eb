"""Every name and key rule matches the whole string: a trailing newline is refused
(``re``'s ``$`` matches before a final ``\\n``; the rules use ``fullmatch``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from isolane import SnapshotStore
from isolane.errors import InvalidNameError
from isolane.kvpool.log.segment_log import parse_segment_name
from isolane.storage.base import check_key
from isolane.units import parse_size


@pytest.mark.parametrize("name", ["step-1\n", "step-1\r\n", "\nstep-1", "step\n-1"])
def test_snapshot_names_with_a_newline_are_refused_by_the_api(tmp_path: Path, name: str
                                                              ) -> None:
    store = SnapshotStore(str(tmp_path))
    with pytest.raises(InvalidNameError, match="invalid snapshot name"):
        store.save({"w": torch.ones(2)}, name)
    assert not (tmp_path / "snapshots").exists() or not any(
        (tmp_path / "snapshots").iterdir())
    with pytest.raises(InvalidNameError):
        store.load(name)


@pytest.mark.parametrize("key", ["snapshots/a\n", "a\n/b", "snapshots/a/zarr.json\n"])
def test_storage_keys_with_a_newline_are_refused(key: str) -> None:
    with pytest.raises(InvalidNameError, match="invalid storage key"):
        check_key(key)


def test_sizes_are_matched_whole() -> None:
    assert parse_size(" 4MiB ") == 4 << 20
    for bad in ("4MiB\nx", "4\nMiB", "x4MiB"):
        with pytest.raises(ValueError, match="expected a size"):
            parse_size(bad)


def test_segment_file_names_with_a_newline_are_not_segments() -> None:
    assert parse_segment_name("seg-00000001.live") == (1, "live")
    assert parse_segment_name("seg-00000001.live\n") is None


def test_a_real_node_refuses_names_and_keys_ending_in_a_newline(tmp_path: Path) -> None:
    from tests.support.node import NodeProcess, write_node_config

    with NodeProcess(write_node_config(tmp_path), token="t") as node:
        status, body = node.request("GET", "/v1/snapshots/step-1%0A")
        assert status == 400 and b"invalid snapshot name" in body
        status, body = node.request("DELETE", "/v1/snapshots/step-1%0A")
        assert status == 400
        status, body = node.request("PUT", "/v1/snapshots/step-1%0A", b"")
        assert status == 400
        status, _ = node.request("GET", "/v1/snapshots/step-1")
        assert status == 404
