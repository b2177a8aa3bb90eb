"""Dropping one file's pages from the page cache, for tests of cold reads."""

from __future__ import annotations

import os
from pathlib import Path


def evict(path: Path | str) -> None:
    """Write the file's pages back and drop them from the page cache (this file only)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
