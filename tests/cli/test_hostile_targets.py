"""Careless or hostile store URLs and configs get a clear error, never a traceback, an
empty listing or a folder named after half a URL."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from isolane.config import load_config, store_config
from isolane.errors import ConfigError
from tests.cli.helpers import fails, run

EXIT_USER = 1


@pytest.mark.parametrize("url", ["http://[::1", "http://127.0.0.1:99999", "https://[zz]:1"])
def test_a_malformed_node_url_is_a_clear_error(url: str, tmp_path: Path) -> None:
    result = fails(run("--store", url, "ls"), EXIT_USER, "--store")
    assert "Traceback" not in result.output + result.stderr


@pytest.mark.parametrize("url", ["s3://", "s3:///", "gs://"])
def test_a_bucket_url_without_a_bucket_is_refused_and_makes_no_folder(
        url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    result = fails(run("--store", url, "ls"), EXIT_USER, "names no bucket")
    assert "Traceback" not in result.output + result.stderr
    assert os.listdir(tmp_path) == []
    with pytest.raises(ConfigError, match="devices"):
        store_config(url)


def test_a_config_nested_100k_deep_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "deep.yaml"
    path.write_text("snapshot: " + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ConfigError, match="deep"):
        load_config(path)
    result = fails(run("--config", str(path), "ls"), EXIT_USER, "deep")
    assert "Traceback" not in result.output + result.stderr
