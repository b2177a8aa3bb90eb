"""Byte-size parsing and formatting (``256MiB``, ``4GiB``, ``1.5GB`` or plain bytes)."""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1 << 10,
    "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
    "g": 1000**3, "gb": 1000**3, "gib": 1 << 30,
    "t": 1000**4, "tb": 1000**4, "tib": 1 << 40,
}
_SIZE = re.compile(r"[ \t]*(\d+(?:\.\d+)?)[ \t]*([a-zA-Z]*)[ \t]*")  # fullmatch


def parse_size(value: int | float | str) -> int:
    """Return a byte count; raises ValueError with the accepted forms on bad input."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a size cannot be negative, got {value}")
        return value
    if isinstance(value, float):
        if value < 0 or value != value:
            raise ValueError(f"expected a non-negative size, got {value}")
        return int(value)
    match = _SIZE.fullmatch(str(value))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"expected a size such as 512MiB, 4GiB or 1048576, got {value!r}")
    return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
