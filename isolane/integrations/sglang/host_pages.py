"""An SGLang host KV pool seen as pages: where each page's bytes are, to read into and
write from in place (pure torch, no I/O, no SGLang import: it calls the host pool's own
``get_data_page``/``get_dummy_flat_data_page``/``set_from_flat_data_page``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from isolane.errors import InvalidArgumentError
from isolane.integrations.sglang.pages import PageFormat
from isolane.kvpool.api import block_bytes_of

VIEW_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
"""Host layouts whose pages are strided views of the host buffer (read into in place)."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class HostPages:
    """One registered SGLang host pool as pages: views into its buffer where its layout
    has them, else its own flat-page copies (auxiliary pools, e.g. Mamba state)."""

    def __init__(self, host_pool: Any) -> None:
        self.host = host_pool
        self.page_size = int(getattr(host_pool, "page_size", 1) or 1)
        self.layout = str(getattr(host_pool, "layout", "flat"))
        probe = host_pool.get_dummy_flat_data_page()
        self.format = PageFormat(dtype_name(probe.dtype), int(probe.numel()), self.layout)
        self.views = False
        if self.layout in VIEW_LAYOUTS and getattr(host_pool, "kv_buffer", None) is not None:
            try:
                page = host_pool.get_data_page(0, flat=False)
            except (ValueError, NotImplementedError):
                page = None
            buffer = host_pool.kv_buffer
            self.views = (page is not None and page.numel() == probe.numel()
                          and page.dtype == probe.dtype
                          and page.untyped_storage().data_ptr()
                          == buffer.untyped_storage().data_ptr())

    def starts(self, host_indices: torch.Tensor, pages: int) -> list[int]:
        """The first host slot of each of ``pages`` pages (SGLang passes every slot)."""
        flat = host_indices.reshape(-1)
        if flat.numel() != pages * self.page_size:
            raise InvalidArgumentError(
                f"{pages} pages of {self.page_size} tokens need {pages * self.page_size} "
                f"host indices, got {flat.numel()}")
        return [int(i) for i in flat[::self.page_size].tolist()]

    def page_views(self, starts: Sequence[int]) -> list[torch.Tensor]:
        return [self.host.get_data_page(s, flat=False) for s in starts]

    def page_buffers(self, starts: Sequence[int]) -> list[memoryview]:
        """Each page's bytes: the host memory itself where a page is contiguous, else one
        gather of the batch (never a Python copy a page)."""
        if not self.views:
            return [block_bytes_of(self.host.get_data_page(s, flat=True)) for s in starts]
        views = self.page_views(starts)
        if all(v.is_contiguous() for v in views):
            return [block_bytes_of(v) for v in views]
        staged = torch.stack(views)
        return [block_bytes_of(staged[i]) for i in range(len(views))]


