from __future__ import annotations

import contextlib
import gc
import math
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from isolane.errors import UnsupportedValueError
from isolane.snapshot.tree import flatten_state, key_filter, unflatten_state


def _roundtrip(value: Any) -> Any:
    tree, leaves = flatten_state(value)
    tensors = {leaf.id: leaf.tensor for leaf in leaves}
    return unflatten_state(tree, tensors.__getitem__)


def test_non_tensor_leaves_round_trip_with_their_types() -> None:
    value = {"step": 7, "lr": 1e-4, "nan": float("nan"), "inf": -math.inf, "flag": True,
             "none": None, "name": "run-1", "blob": b"\x00\xff", "betas": (0.9, 0.999),
             "list": [1, [2, 3]], 0: "int key", 2.5: "float key", "dtype": torch.bfloat16,
             "size": torch.Size([2, 3])}
    out = _roundtrip(value)
    assert list(out) == list(value)
    assert type(out["betas"]) is tuple and type(out["size"]) is torch.Size
    assert out["step"] == 7 and type(out["step"]) is int
    assert math.isnan(out["nan"]) and out["inf"] == -math.inf
    assert out[0] == "int key" and out[2.5] == "float key"
    assert out["dtype"] is torch.bfloat16 and out["blob"] == b"\x00\xff"
    assert (0.1 + 0.2).hex() == _roundtrip({"x": 0.1 + 0.2})["x"].hex()


def test_same_tensor_twice_is_stored_once() -> None:
    w = torch.randn(4, 4)
    _tree, leaves = flatten_state({"embed": w, "lm_head": w, "view": w[1:]})
    assert len(leaves) == 2  # the overlapping view is separate, the alias is shared


@pytest.mark.parametrize("bad", [object(), {1, 2}, lambda: 1, torch.randn(2).to_sparse()])
def test_unsupported_leaf_names_its_key(bad: object) -> None:
    with pytest.raises(UnsupportedValueError) as err:
        flatten_state({"optimizer": {"state": {0: {"thing": bad}}}})
    assert "['optimizer']['state'][0]['thing']" in str(err.value)


def test_unsupported_dict_key() -> None:
    with pytest.raises(UnsupportedValueError, match="dict key"):
        flatten_state({"a": {(1, 2): 3}})


def test_key_filter_selects_subtrees() -> None:
    tree, leaves = flatten_state({"model": {"a": torch.ones(1), "b": torch.ones(2)},
                                  "optimizer": {"state": {0: {"m": torch.ones(3)}}},
                                  "step": 3})
    tensors = {leaf.id: leaf.tensor for leaf in leaves}
    out = unflatten_state(tree, tensors.__getitem__, key_filter(["model.b", "optimizer"]))
    assert set(out) == {"model", "optimizer"}
    assert set(out["model"]) == {"b"}
    assert out["optimizer"]["state"][0]["m"].shape == (3,)


def test_key_filter_finds_keys_inside_lists() -> None:
    # DCP names a param group's leaves "optim.param_groups.0.lr"
    tree, leaves = flatten_state({"optim": {"param_groups": [{"lr": 0.5, "m": torch.ones(2)}]},
                                  "step": 3})
    tensors = {leaf.id: leaf.tensor for leaf in leaves}
    out = unflatten_state(tree, tensors.__getitem__, key_filter(["optim.param_groups.0.lr"]))
    assert out["optim"]["param_groups"][0]["lr"] == 0.5 and "step" not in out


@contextlib.contextmanager
def _no_collector() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_unflattened_tensors_die_with_the_result_without_a_collection() -> None:
    """A recursive closure referring to itself is a reference cycle: it kept every
    tensor of a loaded state dict alive until the next collection, which then freed
    (unmapped) a whole checkpoint's memory inside whatever call came next (a
    save_async's staging copy blocked twice as long)."""
    with _no_collector():
        tree, leaves = flatten_state({"a": {"w": torch.ones(8)}, "b": [torch.zeros(4)]})
        tensors = {leaf.id: leaf.tensor.clone() for leaf in leaves}
        del leaves
        out = unflatten_state(tree, tensors.__getitem__)
        ref = weakref.ref(out["a"]["w"])
        del tensors, out
        assert ref() is None


def test_flattening_keeps_no_reference_to_the_tensors() -> None:
    with _no_collector():
        w = torch.ones(8)
        ref = weakref.ref(w)
        _tree, leaves = flatten_state({"m": {"w": w}, "o": (w,)})
        del w, leaves
        assert ref() is None
