"""Flatten a nested state dict into tensor leaves plus a JSON tree, and back.

The tree is what the manifest stores for everything that is not a tensor: dicts (keys
of type str, int, float, bool or None), lists, tuples, ints, floats (as ``float.hex``
so they round-trip bit-exact, NaN and inf included), bools, None, strings, bytes and
torch dtypes. A tensor leaf becomes ``{"t": "tensor", "id": n}``. Two leaves that are
the same tensor (same storage, offset, shape, strides, dtype) share one id, so tied
weights stay tied after a restore. Anything else is refused with the key that holds
it; nothing is ever pickled.
"""

from __future__ import annotations

import base64
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from isolane.errors import UnsupportedValueError
from isolane.tensor_devices import unreadable_device

Json = Any
KeyPart = str | int | float | bool | None


@dataclass(frozen=True)
class TensorLeaf:
    """A tensor to store, with the first key path that reached it."""

    id: int
    path: tuple[KeyPart, ...]
    tensor: torch.Tensor


def key_label(path: tuple[KeyPart, ...]) -> str:
    """``['optimizer']['state'][0]`` — how error messages name a leaf."""
    return "".join(f"[{part!r}]" for part in path)


def dotted_key(path: tuple[KeyPart, ...]) -> str:
    """``optimizer.state.0.exp_avg`` — the key users pass to ``load(keys=...)``."""
    return ".".join(str(part) for part in path)


def _alias_key(t: torch.Tensor) -> tuple[Any, ...]:
    storage = t.untyped_storage()
    return (storage.data_ptr(), storage.nbytes(), t.storage_offset(), tuple(t.shape),
            t.stride(), t.dtype, t.device)


def flatten_state(state: Any) -> tuple[Json, list[TensorLeaf]]:
    flattener = _Flattener()
    return flattener.walk(state, ()), flattener.leaves


# The walks are methods rather than nested functions: a nested function calling itself
# refers to itself through its closure cell, a reference cycle that kept every tensor
# of a loaded state dict (and of a flattened one) alive until the next collection,
# which then unmapped a whole checkpoint inside whatever call came next.
class _Flattener:
    def __init__(self) -> None:
        self.leaves: list[TensorLeaf] = []
        self.seen: dict[tuple[Any, ...], int] = {}

    @staticmethod
    def encode_key(key: Any, path: tuple[KeyPart, ...]) -> Json:
        if isinstance(key, bool) or key is None:
            return {"t": "bool" if isinstance(key, bool) else "none", "v": key}
        if isinstance(key, int):
            return {"t": "int", "v": key}
        if isinstance(key, float):
            return {"t": "float", "v": key.hex()}
        if isinstance(key, str):
            return key
        raise UnsupportedValueError(
            key_label(path), f"dict key {key!r} of type {type(key).__name__} is not "
            "supported; use str or int keys")

    def walk(self, value: Any, path: tuple[KeyPart, ...]) -> Json:
        if isinstance(value, torch.Tensor):
            return {"t": "tensor", "id": self.add_tensor(value, path)}
        if isinstance(value, bool):
            return {"t": "bool", "v": value}
        if isinstance(value, int):
            return {"t": "int", "v": value}
        if isinstance(value, float):
            return {"t": "float", "v": value.hex()}
        if isinstance(value, str):
            return {"t": "str", "v": value}
        if value is None:
            return {"t": "none"}
        if isinstance(value, bytes):
            return {"t": "bytes", "v": base64.b64encode(value).decode()}
        if isinstance(value, torch.dtype):
            return {"t": "dtype", "v": str(value).removeprefix("torch.")}
        if isinstance(value, Mapping):
            items = []
            for k, v in value.items():
                items.append([self.encode_key(k, path), self.walk(v, (*path, k))])
            node: dict[str, Any] = {"t": "dict", "items": items}
            if isinstance(value, OrderedDict):
                # nn.Module.state_dict() returns an OrderedDict whose _metadata holds the
                # module versions load_state_dict migrates by; keep both, like torch.save.
                node["t"] = "odict"
                module_meta = getattr(value, "_metadata", None)
                if module_meta is not None:
                    node["meta"] = self.walk(dict(module_meta), (*path, "_metadata"))
            return node
        if isinstance(value, list | tuple) and type(value) in (list, tuple, torch.Size):
            kind = "list" if isinstance(value, list) else (
                "size" if isinstance(value, torch.Size) else "tuple")
            return {"t": kind,
                    "items": [self.walk(v, (*path, i)) for i, v in enumerate(value)]}
        raise UnsupportedValueError(
            key_label(path),
            f"a value of type {type(value).__module__}.{type(value).__qualname__} cannot be "
            "stored; isolane stores tensors, numbers, strings, bytes, None, dtypes, lists, "
            "tuples and dicts (never pickles) — convert it or keep it out of the state dict")

    def add_tensor(self, t: torch.Tensor, path: tuple[KeyPart, ...]) -> int:
        if t.is_sparse or t.layout != torch.strided:
            raise UnsupportedValueError(key_label(path), f"tensor layout {t.layout} is not "
                                        "supported; call .to_dense() first")
        if t.is_quantized:
            raise UnsupportedValueError(key_label(path), "quantized tensors are not supported; "
                                        "store int_repr(), scale and zero_point instead")
        problem = unreadable_device(t)
        if problem is not None:
            raise UnsupportedValueError(key_label(path), problem)
        alias = _alias_key(t)
        if alias in self.seen:
            return self.seen[alias]
        tid = len(self.leaves)
        self.seen[alias] = tid
        self.leaves.append(TensorLeaf(tid, path, t))
        return tid


def unflatten_state(
    tree: Json,
    tensor_for: Callable[[int], torch.Tensor],
    wanted: Callable[[tuple[KeyPart, ...]], bool] = lambda _p: True,
) -> Any:
    """Rebuild the nested value; subtrees for which ``wanted`` is False are left out."""
    return _Unflattener(tensor_for, wanted).walk(tree, ())


class _Unflattener:
    def __init__(self, tensor_for: Callable[[int], torch.Tensor],
                 wanted: Callable[[tuple[KeyPart, ...]], bool]) -> None:
        self.tensor_for = tensor_for
        self.wanted = wanted

    def walk(self, node: Json, path: tuple[KeyPart, ...]) -> Any:
        kind = node["t"]
        if kind == "tensor":
            return self.tensor_for(node["id"])
        if kind in ("dict", "odict"):
            out: dict[Any, Any] = {} if kind == "dict" else OrderedDict()
            for raw_key, child in node["items"]:
                key = _key(raw_key)
                child_path = (*path, key)
                if _contains_wanted(child, child_path, self.wanted):
                    out[key] = self.walk(child, child_path)
            if "meta" in node:
                out._metadata = self.walk(node["meta"], (*path, "_metadata"))  # type: ignore[attr-defined]
            return out
        if kind in ("list", "tuple", "size"):
            items = [self.walk(child, (*path, i)) for i, child in enumerate(node["items"])]
            return {"list": list, "tuple": tuple, "size": torch.Size}[kind](items)
        return _scalar(node)


def _contains_wanted(node: Json, path: tuple[KeyPart, ...],
                     wanted: Callable[[tuple[KeyPart, ...]], bool]) -> bool:
    if wanted(path):
        return True
    if node["t"] in ("dict", "odict"):
        return any(_contains_wanted(c, (*path, _key(k)), wanted) for k, c in node["items"])
    if node["t"] in ("list", "tuple"):  # a wanted key inside keeps the whole sequence
        return any(_contains_wanted(c, (*path, i), wanted) for i, c in enumerate(node["items"]))
    return False


def _key(raw: Json) -> KeyPart:
    if isinstance(raw, str):
        return raw
    value: KeyPart = _scalar(raw)
    return value


def _scalar(node: Json) -> Any:
    kind = node["t"]
    if kind in ("bool", "int", "str"):
        return node["v"]
    if kind == "float":
        return float.fromhex(node["v"])
    if kind == "none":
        return None
    if kind == "bytes":
        return base64.b64decode(node["v"])
    if kind == "dtype":
        dtype = getattr(torch, str(node["v"]), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{node['v']!r} in snapshot tree is not a torch dtype")
        return dtype
    raise ValueError(f"unknown node type {kind!r} in snapshot tree")


def tensor_ids(tree: Json, wanted: Callable[[tuple[KeyPart, ...]], bool]) -> set[int]:
    """Ids of the tensors that ``unflatten_state(tree, ..., wanted)`` would ask for."""
    ids: set[int] = set()

    def record(tensor_id: int) -> torch.Tensor:
        ids.add(tensor_id)
        return torch.empty(0)

    unflatten_state(tree, record, wanted)
    return ids


def key_filter(keys: list[str] | None) -> Callable[[tuple[KeyPart, ...]], bool]:
    """Select a leaf whose dotted key equals one of ``keys`` or lies below it."""
    if keys is None:
        return lambda _p: True
    wanted = set(keys)

    def match(path: tuple[KeyPart, ...]) -> bool:
        parts = [str(p) for p in path]
        return any(".".join(parts[:i]) in wanted for i in range(1, len(parts) + 1))

    return match


def tensor_paths(tree: Json) -> dict[int, tuple[KeyPart, ...]]:
    """The first key path that reaches each tensor id, in the order ``flatten_state``
    walks (so a leaf rebuilt from a stream gets the path its sender's leaf had)."""
    paths: dict[int, tuple[KeyPart, ...]] = {}

    def walk(node: Json, path: tuple[KeyPart, ...]) -> None:
        kind = node["t"]
        if kind == "tensor":
            paths.setdefault(node["id"], path)
        elif kind in ("dict", "odict"):
            for raw_key, child in node["items"]:
                walk(child, (*path, _key(raw_key)))
            if "meta" in node:
                walk(node["meta"], (*path, "_metadata"))
        elif kind in ("list", "tuple", "size"):
            for i, child in enumerate(node["items"]):
                walk(child, (*path, i))

    walk(tree, ())
    return paths
