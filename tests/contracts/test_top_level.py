"""``import isolane`` exposes both stores, lazily (the CLI's start-up stays light)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

import isolane


def test_kvpool_and_snapshotstore_from_the_package() -> None:
    from isolane import KVContext, KVPool, SnapshotStore
    from isolane.kvpool.keys import KVContext as KeysContext
    from isolane.kvpool.pool import KVPool as PoolKVPool
    from isolane.snapshot import SnapshotStore as SnapStore

    assert KVPool is PoolKVPool and SnapshotStore is SnapStore and KVContext is KeysContext
    assert {"KVPool", "KVContext", "SnapshotStore"} <= set(isolane.__all__)
    with pytest.raises(AttributeError, match="no attribute 'KVPol'"):
        isolane.KVPol  # noqa: B018


def test_import_isolane_does_not_import_torch() -> None:
    code = ("import sys, isolane; assert 'torch' not in sys.modules, 'torch imported'; "
            "isolane.KVPool; assert 'torch' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_remote_clients_from_the_package() -> None:
    from isolane import RemoteKVPool, RemoteSnapshotStore
    from isolane.client.kv_pool import RemoteKVPool as ClientKVPool
    from isolane.client.snapshot_store import RemoteSnapshotStore as ClientStore

    assert RemoteKVPool is ClientKVPool and RemoteSnapshotStore is ClientStore
    assert {"RemoteKVPool", "RemoteSnapshotStore"} <= set(isolane.__all__)


def test_open_store_and_open_kv_pool_pick_the_class_by_target(tmp_path: Any) -> None:
    from isolane import KVPool, SnapshotStore, open_kv_pool, open_store
    from isolane.errors import InvalidArgumentError

    assert {"open_store", "open_kv_pool"} <= set(isolane.__all__)
    with open_store(str(tmp_path / "snaps")) as store:
        assert type(store) is SnapshotStore
    with open_kv_pool(str(tmp_path / "kv"), namespace="t", chunk_tokens=4) as pool:
        assert type(pool) is KVPool
    # The classes open their own kind only and name the factory for node URLs (nothing
    # is contacted: the refusal comes first).
    for url in ("http://127.0.0.1:9", ["http://127.0.0.1:9"]):
        with pytest.raises(InvalidArgumentError, match=r"isolane\.open_store"):
            SnapshotStore(url)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError, match=r"isolane\.open_kv_pool"):
            KVPool(url)  # type: ignore[arg-type]


# Old module paths users may have in code or in a vLLM config (kv_connector_module_path):
# each still imports, warns once that it moved, and hands out the very same objects.
MOVED = [
    ("isolane.kvpool.vllm_connector", "isolane.integrations.vllm.connector",
     "IsolaneConnectorV1"),
    ("isolane.kvpool.hooks", "isolane.integrations.transformers_kv", "HFKVHook"),
    ("isolane.snapshot.callbacks", "isolane.integrations.callbacks", "PeriodicSnapshot"),
]


@pytest.mark.parametrize(("old", "new", "name"), MOVED)
def test_moved_module_paths_still_work_and_warn(old: str, new: str, name: str) -> None:
    # A fresh interpreter: the warning is given when the old module is first imported.
    code = (
        "import importlib, warnings\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        f"    old = importlib.import_module({old!r})\n"
        f"new = importlib.import_module({new!r})\n"
        f"assert getattr(old, {name!r}) is getattr(new, {name!r})\n"
        f"assert {name!r} in dir(old)\n"
        "moved = [w for w in caught if issubclass(w.category, DeprecationWarning)\n"
        f"         and {new!r} in str(w.message)]\n"
        "assert len(moved) == 1, [str(w.message) for w in caught]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
