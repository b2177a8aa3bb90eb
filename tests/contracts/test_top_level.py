"""``import isolane`` exposes both stores, lazily (the CLI's start-up stays light)."""

from __future__ import annotations

import subprocess
import sys

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
