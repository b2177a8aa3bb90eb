"""The snapshot-store contract: what every snapshot store promises, wherever it keeps
its bytes.

In the manner of zarr's ``StoreTests``: ``SnapshotStoreContract`` holds the tests, a
module per implementation subclasses it and provides the ``store`` fixture (an empty
store, closed after the test). Run against the local ``SnapshotStore`` (a folder), the
same class on S3 (a real SeaweedFS) and ``RemoteSnapshotStore`` (a real node).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from isolane.errors import InvalidNameError, SnapshotExistsError, SnapshotNotFoundError
from tests.snapshot.conftest import assert_same

MiB = 1 << 20


def state(seed: int = 0) -> dict[str, Any]:
    """Nested dicts, big and small tensors, bf16, non-contiguous, empty, 0-d, JSON."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "model": {f"w{i}": torch.randn(256, 1024, generator=gen) for i in range(3)}
        | {"embed": torch.randn(64, 32, generator=gen).to(torch.bfloat16),
           "proj_t": torch.randn(48, 80, generator=gen).t(),  # non-contiguous
           "empty": torch.empty(0, 7), "scale": torch.tensor(1.5 + seed),
           "mask": torch.rand(33, generator=gen) > 0.5,
           "ids": torch.arange(10, dtype=torch.int64) * (seed + 1)},
        "optim": {"step": 100 + seed, "lr": 3e-4, "betas": [0.9, 0.95], "name": "adamw",
                  "amsgrad": False, "extra": None},
    }


class SnapshotStoreContract:
    """Tests every snapshot store passes. Subclasses provide the ``store`` fixture."""

    @pytest.fixture
    def store(self) -> Any:  # pragma: no cover - provided by subclasses
        raise NotImplementedError

    def test_save_load_bit_exact(self, store: Any) -> None:
        saved = state(1)
        assert not saved["model"]["proj_t"].is_contiguous()
        info = store.save(saved, "s0", {"run": "contract", "epoch": 3})
        assert info.name == "s0" and info.tensors == 9
        assert info.logical_bytes >= 3 * MiB
        assert info.metadata == {"run": "contract", "epoch": 3}
        assert_same(saved, store.load("s0"))

    def test_load_keys(self, store: Any) -> None:
        saved = state(2)
        store.save(saved, "s0")
        assert_same({"model": {"w1": saved["model"]["w1"]}},
                    store.load("s0", keys=["model.w1"]))
        assert_same({"optim": saved["optim"]}, store.load("s0", keys=["optim"]))

    def test_list_and_info(self, store: Any) -> None:
        assert store.list() == []
        store.save(state(1), "a-1")
        store.save(state(2), "b.2", {"k": "v"})
        listed = store.list()
        assert [i.name for i in listed] == ["a-1", "b.2"]  # oldest first
        info = store.info("b.2")
        assert info.name == "b.2" and info.metadata == {"k": "v"}
        assert info.generation == listed[1].generation
        assert info.committed_at >= listed[0].committed_at

    def test_save_refuses_an_existing_name_unless_overwrite(self, store: Any) -> None:
        first, second = state(1), state(2)
        store.save(first, "s")
        with pytest.raises(SnapshotExistsError, match="'s'"):
            store.save(second, "s")
        assert_same(first, store.load("s"))  # untouched
        info = store.save(second, "s", overwrite=True)
        assert info.name == "s"
        assert_same(second, store.load("s"))
        assert [i.name for i in store.list()] == ["s"]

    def test_delete_and_not_found(self, store: Any) -> None:
        store.save(state(1), "gone")
        store.save(state(2), "kept")
        store.delete("gone")
        assert [i.name for i in store.list()] == ["kept"]
        for call in (lambda: store.load("gone"), lambda: store.info("gone"),
                     lambda: store.delete("gone"), lambda: store.verify("gone")):
            with pytest.raises(SnapshotNotFoundError,
                               match=r"snapshot 'gone' not found in .*isolane ls"):
                call()
        assert_same(state(2), store.load("kept"))

    @pytest.mark.parametrize("name", ["", "a/b", "..", "a..b", " x", "x ", "x\n", "-x",
                                      ".hidden", "x" * 201, "tab\tname"])
    def test_invalid_names_are_refused(self, store: Any, name: str) -> None:
        for call in (lambda: store.save({"w": torch.ones(2)}, name),
                     lambda: store.load(name), lambda: store.info(name),
                     lambda: store.delete(name)):
            with pytest.raises(InvalidNameError, match="invalid snapshot name"):
                call()
        assert store.list() == []

    def test_load_into(self, store: Any) -> None:
        saved = state(3)
        store.save(saved, "s")
        into = {"model": {k: torch.zeros_like(v) for k, v in saved["model"].items()}}
        targets = dict(into["model"])
        loaded = store.load("s", into=into)
        assert_same(saved, loaded)
        for key in ("w0", "w1", "w2", "embed"):
            assert loaded["model"][key] is targets[key], key  # filled in place
            assert torch.equal(targets[key], saved["model"][key])

    def test_incremental_save_links_unchanged_bytes(self, store: Any) -> None:
        base = state(4)
        first = store.save(base, "s0")
        assert first.linked_bytes == 0
        base["model"]["w2"].add_(1)
        second = store.save(base, "s1")
        assert second.linked_bytes >= 2 * MiB  # w0 and w1 unchanged
        assert second.written_bytes < first.written_bytes
        assert_same(base, store.load("s1"))
        store.delete("s0")  # the child stands alone
        assert_same(base, store.load("s1"))
        store.verify("s1")

    def test_save_async(self, store: Any) -> None:
        saved = state(5)
        expected = {"model": {"w0": saved["model"]["w0"].clone()}}
        handle = store.save_async(saved, "s")
        saved["model"]["w0"].zero_()  # staged: changing it now does not change the save
        info = handle.result(timeout=120)
        assert info.name == "s" and handle.done()
        assert_same(expected, store.load("s", keys=["model.w0"]))

    def test_gc_keep_last(self, store: Any) -> None:
        for i in range(4):
            store.save({"w": torch.full((64,), float(i))}, f"step-{i}")
        report = store.gc(keep_last=2)
        assert sorted(report.deleted_snapshots) == ["step-0", "step-1"]
        assert [i.name for i in store.list()] == ["step-2", "step-3"]
        assert_same({"w": torch.full((64,), 3.0)}, store.load("step-3"))
        assert store.gc(keep_last=2).deleted_snapshots == ()

    def test_verify(self, store: Any) -> None:
        store.save(state(6), "s")
        info = store.verify("s")
        assert info.name == "s" and info.generation == store.info("s").generation
