from __future__ import annotations

from typing import Any

import torch

from isolane.snapshot.dtypes import as_bytes


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Bit-exact equality of nested state dicts (dtype, shape, bytes, container types)."""
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(as_bytes(a.contiguous()), as_bytes(b.contiguous())), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and a != a:
        assert b != b, path
    else:
        assert a == b, path


