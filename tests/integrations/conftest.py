from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Tiny models run fastest on one thread, and the child processes use one too (the
    same thread count on both sides keeps the float results comparable)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
