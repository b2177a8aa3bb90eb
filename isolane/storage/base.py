"""The storage seam: a small blob-store interface.

A blob store holds byte blobs under ``/``-separated keys relative to one root (a local
folder or an fsspec URL). Implementations supply these primitives; everything above
(snapshot layout, mirroring, GC) is written against them only.

Guarantees every implementation gives:

- ``write`` and ``write_atomic`` are durable when they return for the blob itself;
  ``sync`` makes the *names* durable (directory fsync on local disks, no-op on S3).
- ``write_atomic`` is all-or-nothing for readers: they see the old blob or the new one.
  It is the commit primitive (temp file + fsync + rename locally; one PUT on S3).
- ``copy`` makes ``dst`` hold the bytes of ``src`` without moving them through this
  process where the medium allows it (hard link locally, server-side copy on S3).
- All methods are thread-safe; keys are validated by ``check_key`` before any I/O.
"""

from __future__ import annotations

import builtins
import contextlib
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from isolane.errors import InvalidNameError

Buffer = bytes | bytearray | memoryview

_KEY_PART = re.compile(r"[A-Za-z0-9._%+=@,-]+")  # whole part: fullmatch


def check_key(key: str) -> str:
    """Refuse keys that could escape the root or confuse a backend."""
    parts = key.split("/")
    if not key or key.startswith("/") or any(
        part in ("", ".", "..") or not _KEY_PART.fullmatch(part) for part in parts
    ):
        raise InvalidNameError(
            f"invalid storage key {key!r}: keys are '/'-separated parts of letters, digits "
            "and ._%+=@,- with no empty, '.' or '..' parts"
        )
    return key


@dataclass(frozen=True)
class ByteRange:
    """Bytes ``[start, end)`` of a blob."""

    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


class BlobStore(ABC):
    """Byte blobs under keys below one root. See the module docstring for guarantees."""

    url: str
    is_local: bool = False

    @abstractmethod
    def read(self, key: str, byte_range: ByteRange | None = None) -> bytes:
        """The blob (or a range of it); FileNotFoundError when it does not exist."""

    def read_ranges(self, requests: builtins.list[tuple[str, ByteRange]]) -> builtins.list[bytes]:
        """Many ranges (of one or many blobs), in order: ``read`` of each range.

        The same results and errors as ``read`` range by range. Object stores fetch the
        batch concurrently (one round trip's latency, not one per range); the default
        reads them one after the other.
        """
        return [self.read(key, rng) for key, rng in requests]

    def read_into(self, key: str, out: memoryview, offset: int = 0) -> None:
        """Fill ``out`` with ``len(out)`` bytes of the blob starting at ``offset``."""
        data = self.read(key, ByteRange(offset, offset + len(out)))
        if len(data) != len(out):
            raise EOFError(f"{self.url}/{key}: expected {len(out)} bytes, got {len(data)}")
        out[:] = data

    @abstractmethod
    def write(
        self, key: str, data: Buffer, *, length: int | None = None, durable: bool = True
    ) -> None:
        """Store ``data[:length]`` (default all) as the blob; durable on return unless
        ``durable=False``, in which case a later ``sync(..., files=[key])`` makes it so."""

    @abstractmethod
    def write_atomic(self, key: str, data: Buffer) -> None:
        """Store a small blob all-or-nothing; durable on return (name included)."""

    @abstractmethod
    def copy(self, src: str, dst: str) -> None:
        """Make ``dst`` a copy of ``src`` without moving the bytes through this process."""

    @abstractmethod
    def size(self, key: str) -> int:
        """Blob size in bytes; FileNotFoundError when it does not exist."""

    @abstractmethod
    def list(self, prefix: str = "") -> builtins.list[str]:
        """All blob keys below ``prefix`` (recursive), sorted."""

    @abstractmethod
    def children(self, prefix: str = "") -> builtins.list[str]:
        """Names directly below ``prefix`` (blobs and sub-folders), sorted."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove one blob; no error when it is already gone."""

    @abstractmethod
    def delete_prefix(self, prefix: str) -> None:
        """Remove everything below ``prefix``; no error when nothing is there."""

    def exists(self, key: str) -> bool:
        try:
            self.size(key)
        except FileNotFoundError:
            return False
        return True

    def sync(  # noqa: B027 - optional hook
        self, prefixes: Iterable[str], files: Iterable[str] = ()
    ) -> None:
        """Make ``files`` and the names written in the folders ``prefixes`` durable
        (a no-op where a PUT is final)."""

    def sync_all(self) -> None:  # noqa: B027 - optional hook
        """Make everything written under this store durable, by any process of this
        host (a no-op where a PUT is final)."""

    @contextlib.contextmanager
    def lock(self, key: str) -> Iterator[None]:
        """Hold the exclusive lock named ``key`` across processes while in the block
        (blocking until it is free; released when the holder dies). Local stores lock
        a file; the default, for media without a lock primitive (object stores), holds
        nothing, and callers must say what that leaves open."""
        check_key(key)
        yield

    @property
    def direct_read_align(self) -> int | None:
        """The buffer alignment that lets ``read_into`` bypass the page cache (O_DIRECT),
        or None when the store reads through it whatever the buffer."""
        return None

    def local_path(self, key: str) -> str | None:
        """The blob's path on a local filesystem (for mmap), or None for remote media."""
        return None

    def free_bytes(self) -> int | None:
        """Free space on the device, or None when the medium does not say."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections; the store must not be used afterwards."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"
