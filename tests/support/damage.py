"""Damage stored bytes on purpose, for integrity tests."""

from __future__ import annotations

from pathlib import Path


def flip_byte(path: Path, offset: int, mask: int = 0xFF) -> None:
    """XOR one byte of ``path`` at ``offset`` with ``mask`` (in place)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ mask]))
