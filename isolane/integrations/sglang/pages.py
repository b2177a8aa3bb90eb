"""What an SGLang HiCache page is to the KV pool: its format, its scope, its key (pure).

SGLang names each page of ``page_size`` tokens by a string (a hash of the token chain up
to that page) and moves pages between its host KV pool and an L3 backend. A page's
bytes are one host-pool page in the host layout's order (``get_data_page``):

    +--------------------+--------------------------------------+
    | host layout        | MHA page            | MLA page        |
    +--------------------+---------------------+-----------------+
    | layer_first        | [2, L, P, H, D]     | [L, P, 1, C]    |
    | page_first         | [2, P, L, H, D]     | [P, L, 1, C]    |
    | page_first_direct  | [2, 1, L, P, H, D]  | [1, L, P, 1, C] |
    +--------------------+---------------------+-----------------+

(L layers, P tokens a page, H KV heads, D head dim, C the MLA latent width.) The same
tokens therefore give different bytes under different layouts, dtypes, page sizes and
tensor-parallel shards, so all of them join the key: a page stored under one reads as a
miss under any other, never as wrong KV.

In the pool a page is one block of a namespace whose layout is ``(dtype, (elements,))``
with ``chunk_tokens=1``: a block is a whole page, whatever its shape.

Keys: ``BLAKE2b-128(scope digest || b"sglang-page\\x00" || page name as UTF-8)``, where
the scope digest is ``KVNamespace(model, dtype, "sglang-hicache:<layout>:<elements>",
tp_rank, tp_size).digest()`` (``kvpool/keys.py``). MLA's latent is the same on every
tensor-parallel rank (SGLang's ``is_mla_model``), so MLA scopes use rank 0 of 1: every
rank computes the same keys and one copy serves them all.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass

from isolane.errors import ConfigError
from isolane.kvpool.keys import KEY_BYTES, KVNamespace

PAGE_KEY_TAG = b"sglang-page\x00"
LAYOUT_PREFIX = "sglang-hicache"
_NOT_IN_NAMESPACE = re.compile(r"[^A-Za-z0-9._+=@:/-]+")


@dataclass(frozen=True)
class PageFormat:
    """What one stored page's bytes are: ``dtype`` (torch name, e.g. ``bfloat16``), the
    ``elements`` of that dtype a page holds, and the ``host_layout`` ordering them."""

    dtype: str
    elements: int
    host_layout: str

    @property
    def layout_text(self) -> str:
        return f"{LAYOUT_PREFIX}:{self.host_layout}:{self.elements}"


@dataclass(frozen=True)
class StorageScope:
    """Whose pages these are: the model (with its pipeline and context-parallel shard)
    and the tensor-parallel shard, as keyed (MLA: rank 0 of 1)."""

    model: str
    tp_rank: int
    tp_size: int
    is_mla: bool
    writer: bool  # SGLang's is_storage_writer: MLA pages are written by one rank only


def storage_scope(model_name: str | None, *, tp_rank: int, tp_size: int, pp_rank: int,
                  pp_size: int, cp_rank: int, cp_size: int, is_mla: bool, writer: bool
                  ) -> StorageScope:
    """The scope of one SGLang rank's pages (``HiCacheStorageConfig``'s fields;
    ``writer``: its ``is_storage_writer``)."""
    model = model_name or "sglang-model"
    if pp_size > 1:
        model += f"@pp{pp_rank}of{pp_size}"
    if cp_size > 1:  # each context-parallel rank holds a disjoint slice of every page
        model += f"@cp{cp_rank}of{cp_size}"
    if is_mla:
        return StorageScope(model, 0, 1, True, writer)
    return StorageScope(model, tp_rank, tp_size, False, True)


def sharded(scope: StorageScope, tp_rank: int, tp_size: int) -> StorageScope:
    """``scope`` keyed per tensor-parallel rank even for MLA (state that is sharded
    across ranks whatever the attention, e.g. Mamba's); every rank writes its own."""
    return StorageScope(scope.model, tp_rank, tp_size, False, True)


def default_namespace(model_name: str | None) -> str:
    """``sglang/<model>`` with the characters a KV namespace cannot hold made ``_``."""
    model = _NOT_IN_NAMESPACE.sub("_", model_name or "model").strip("/_.") or "model"
    while "//" in model or ".." in model:
        model = model.replace("//", "/").replace("..", "_")
    return f"sglang/{model}"[:200].rstrip("/")


def scope_digest(scope: StorageScope, page: PageFormat) -> bytes:
    """The 16 bytes that seed every page key of this scope and format."""
    try:
        return KVNamespace(model=scope.model, dtype=page.dtype, layout=page.layout_text,
                           tp_rank=scope.tp_rank, tp_size=scope.tp_size).digest()
    except ConfigError as exc:
        raise ConfigError("model_name", f"SGLang's model name {scope.model!r} cannot key "
                          f"KV pages: {exc}") from None


def page_keys(digest: bytes, names: Sequence[str]) -> list[bytes]:
    """The pool keys of SGLang's page names under ``digest`` (``scope_digest``)."""
    keys = []
    for name in names:
        h = hashlib.blake2b(digest, digest_size=KEY_BYTES)
        h.update(PAGE_KEY_TAG)
        h.update(name.encode("utf-8", "surrogatepass"))
        keys.append(h.digest())
    return keys


def check_page_format(stored: tuple[str, tuple[int, ...]], page: PageFormat,
                      namespace: str, where: str) -> None:
    """ConfigError unless the namespace's stored layout holds pages of ``page``'s dtype
    and size (``where`` says which page: the host pool's, or the one being set)."""
    dtype, shape = stored
    if dtype == page.dtype and shape == (page.elements,):
        return
    held = shape[0] if len(shape) == 1 else list(shape)
    raise ConfigError("isolane_namespace", (
        f"namespace '{namespace}' holds SGLang pages of {held} {dtype} elements; {where} "
        f"has pages of {page.elements} {page.dtype} elements (another page size, dtype or "
        "model): use another isolane_namespace for it, or the page size and dtype the "
        "namespace was written with"))
