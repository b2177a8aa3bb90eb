"""Cold 64 KiB KV blocks for the restore tests: a one-device read group, random bf16
prompts compared bit for bit, and the segment files' pages dropped from the cache."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from isolane.config import config_from_dict
from tests.support.page_cache import evict

CT = 16  # tokens a block; [1, 2, 16, 8, 128] bf16 = 64 KiB a block


def kv_config(tmp_path: Path) -> Any:
    return config_from_dict({"device_groups": {"kv": {
        "role": "read", "devices": [str(tmp_path / "kv")], "threads": 4}}})


def random_kv(blocks: int, seed: int) -> torch.Tensor:
    """Random bits, NaN and subnormal patterns included: compared bit for bit."""
    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(-2**15, 2**15, (1, 2, blocks * CT, 8, 128), generator=gen,
                         dtype=torch.int16)
    return bits.view(torch.bfloat16)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.int16), b.contiguous().view(torch.int16))


def segment_files(tmp_path: Path) -> list[Path]:
    return [p for p in (tmp_path / "kv").rglob("seg-*") if p.suffix != ".hint"]


def evict_segments(tmp_path: Path) -> None:
    """Drop the segment files' pages, so the next reads are cold."""
    for path in segment_files(tmp_path):
        with contextlib.suppress(FileNotFoundError):  # compacted away meanwhile
            evict(path)
