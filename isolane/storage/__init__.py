"""The storage seam: ``BlobStore`` and its implementations, chosen by URL."""

from isolane.storage.base import BlobStore, ByteRange, check_key
from isolane.storage.registry import blob_store_from_url

__all__ = ["BlobStore", "ByteRange", "blob_store_from_url", "check_key"]
