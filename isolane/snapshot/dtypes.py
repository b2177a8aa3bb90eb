"""torch dtype <-> zarr v3 data type.

zarr has no bfloat16 or float8; such tensors are stored as unsigned integers of the
same width (their raw bits) and the torch dtype goes into the array attributes.
"""

from __future__ import annotations

import torch

_NATIVE = {
    torch.bool: "bool",
    torch.uint8: "uint8", torch.int8: "int8",
    torch.int16: "int16", torch.int32: "int32", torch.int64: "int64",
    torch.float16: "float16", torch.float32: "float32", torch.float64: "float64",
    torch.complex64: "complex64", torch.complex128: "complex128",
}
for _name in ("uint16", "uint32", "uint64"):
    if hasattr(torch, _name):
        _NATIVE[getattr(torch, _name)] = _name
_BITS = {1: "uint8", 2: "uint16", 4: "uint32", 8: "uint64"}
_BITS_TORCH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r} in snapshot; this isolane's torch "
                         f"{torch.__version__} does not have it")
    return value


def zarr_dtype(dtype: torch.dtype) -> str:
    """The zarr v3 data type that holds this torch dtype's bytes."""
    native = _NATIVE.get(dtype)
    if native is not None:
        return native
    size = torch.empty((), dtype=dtype).element_size()
    if size not in _BITS:
        raise ValueError(f"dtype {dtype} has an element size of {size} bytes, "
                         "which isolane cannot store")
    return _BITS[size]


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view of a contiguous tensor's bytes (works for every dtype, 0-d too)."""
    flat = t.reshape(-1)
    if flat.dtype == torch.bool:
        return flat.view(torch.uint8)
    if flat.dtype.is_complex:
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.element_size() == 1:
        return flat.view(torch.uint8)
    # Bit-cast through an integer of the same width first: view(uint8) is refused for
    # some dtypes (fp8 variants, uint16 ...) on older torch builds.
    return flat.view(_BITS_TORCH[flat.element_size()]).view(torch.uint8)
