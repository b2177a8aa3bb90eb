"""``SnapshotStore.begin_save(plan=...)``: a fed save follows a plan made by
``plan_upload`` only while it was made for the same parent (a node's kept plan)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from isolane.errors import IsolaneError
from isolane.snapshot.store import SnapshotStore
from isolane.snapshot.tree import TensorLeaf, flatten_state


def _meta(state: dict[str, torch.Tensor]) -> tuple[object, list[TensorLeaf]]:
    tree, leaves = flatten_state(state)
    return tree, [TensorLeaf(leaf.id, leaf.path, torch.empty(
        leaf.tensor.shape, dtype=leaf.tensor.dtype, device="meta")) for leaf in leaves]


def _abort(fed: object) -> None:
    future = fed.abort(IsolaneError("stopped by the test"))  # type: ignore[attr-defined]
    with pytest.raises(IsolaneError, match="stopped by the test"):
        future.result(timeout=30)


def test_a_fed_save_follows_a_plan_for_its_parent_and_replans_for_another(
        tmp_path: Path) -> None:
    with SnapshotStore(str(tmp_path / "store")) as store:
        state = {"w": torch.randn(512, 1024), "b": torch.ones(3)}
        store.save(state, "base")
        tree, leaves = _meta(state)
        planned = store.plan_upload(leaves, "next")
        assert planned.parent is not None and planned.parent["name"] == "base"
        fed = store.begin_save(tree, leaves, "next", plan=planned)
        assert fed.plan_reused and fed.plan is planned.plan
        _abort(fed)
        store.save(state, "newer")  # the newest snapshot, the parent a save takes now
        fed = store.begin_save(tree, leaves, "next", plan=planned)
        assert not fed.plan_reused and fed.plan is not planned.plan
        _abort(fed)
        fed = store.begin_save(tree, leaves, "next")
        assert not fed.plan_reused
        _abort(fed)
        assert [i.name for i in store.list()] == ["base", "newer"]
