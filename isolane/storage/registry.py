"""Pick a BlobStore implementation by URL scheme (lazy imports, install hints)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from isolane.config import is_url
from isolane.storage.base import BlobStore


def blob_store_from_url(
    url: str, *, storage_options: Mapping[str, Any] | None = None, direct_io: str = "auto"
) -> BlobStore:
    """A local folder (plain path or ``file://``) or any fsspec URL (``s3://``, ``memory://``)."""
    if not is_url(url):
        from isolane.storage.local import LocalBlobStore

        path = url[len("file://"):] if url.startswith("file://") else url
        return LocalBlobStore(path, direct_io=direct_io)
    from isolane.storage.fsspec_store import FsspecBlobStore

    return FsspecBlobStore(url, storage_options=storage_options or {})
