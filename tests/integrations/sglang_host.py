"""Host KV pools with the page API of SGLang 0.5.23's ``MHATokenToKVPoolHost`` and
``MLATokenToKVPoolHost`` (``sglang/srt/mem_cache/pool_host/mha.py`` and ``mla.py``):
the same ``kv_buffer`` shapes per layout and the same ``get_data_page``,
``get_dummy_flat_data_page`` and ``set_from_flat_data_page``, line for line.

Why not SGLang's classes themselves: ``import sglang.srt.mem_cache.pool_host.mha`` runs
``sglang.srt.configs/__init__`` (through ``memory_pool`` and ``configs.mamba_utils``),
which imports ``torchvision.transforms`` (``multimodal/internvl_utils.py``); the only
torchvision for torch 2.13 on the registry (0.28.0) is a CUDA build whose extension
cannot load beside the CPU torch wheel, and its import then fails with "operator
torchvision::nms does not exist" (docs/INTEGRATIONS.md, SGLang). SGLang's own
``HiCacheStorageConfig``, ``StorageBackendFactory`` and ``HiCacheStorage`` do import and
are used as they are.
"""

from __future__ import annotations

import torch


class HostPool:
    """``layout``: layer_first, page_first or page_first_direct; ``mla``: one latent of
    ``head_dim`` a token (SGLang's kv_cache_dim) instead of K and V of ``heads`` heads."""

    def __init__(self, *, layers: int, page_size: int, pages: int, heads: int = 2,
                 head_dim: int = 8, dtype: torch.dtype = torch.bfloat16,
                 layout: str = "page_first", mla: bool = False) -> None:
        self.layer_num, self.page_size, self.page_num = layers, page_size, pages
        self.size = pages * page_size
        self.head_num, self.head_dim, self.dtype = heads, head_dim, dtype
        self.layout, self.mla, self.device, self.pin_memory = layout, mla, "cpu", False
        self.kv_buffer = torch.zeros(self._dims(), dtype=dtype)

    def _dims(self) -> tuple[int, ...]:
        n, p, nl, h, d = (self.size, self.page_size, self.layer_num, self.head_num,
                          self.head_dim)
        if self.mla:
            return {"layer_first": (nl, n, 1, d), "page_first": (n, nl, 1, d),
                    "page_first_direct": (self.page_num, nl, p, 1, d)}[self.layout]
        return {"layer_first": (2, nl, n, h, d), "page_first": (2, n, nl, h, d),
                "page_first_direct": (2, self.page_num, nl, p, h, d)}[self.layout]

    def fill_random(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.kv_buffer.copy_(torch.randn(self.kv_buffer.shape, generator=g).to(self.dtype))

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        p = self.page_size
        if self.mla:
            if self.layout == "layer_first":
                page = self.kv_buffer[:, index:index + p, :, :]
            elif self.layout == "page_first":
                page = self.kv_buffer[index:index + p, :, :, :]
            else:
                page = self.kv_buffer[index // p:index // p + 1, :, :, :, :]
        elif self.layout == "layer_first":
            page = self.kv_buffer[:, :, index:index + p, :, :]
        elif self.layout == "page_first":
            page = self.kv_buffer[:, index:index + p, :, :, :]
        else:
            page = self.kv_buffer[:, index // p:index // p + 1, :, :, :, :]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        shape = ((self.layer_num, self.page_size, 1, self.head_dim) if self.mla else
                 (2, self.layer_num, self.page_size, self.head_num, self.head_dim))
        return torch.zeros(shape, dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        page = self.get_data_page(index, flat=False)
        page.copy_(data_page.reshape(page.shape))


class CopiedPagesHostPool(HostPool):
    """A host pool whose ``get_data_page`` returns a copy, not a view of its buffer, as
    SGLang's Mamba state pool does (``torch.cat`` of its tensors' bytes): pages are
    written back through ``set_from_flat_data_page``."""

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        return super().get_data_page(index, flat).clone()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        page = super().get_data_page(index, flat=False)
        page.copy_(data_page.reshape(page.shape))
