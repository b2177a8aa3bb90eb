"""Copy a committed snapshot to the capacity group (S3) in the background.

Chunks go first (server-side copy from the parent's mirror when the bytes are the same,
else an upload), then the zarr metadata, then the manifest: the mirror is committed by
the same rule as the local copy. Runs on the background lane; retried with backoff.

A snapshot whose parts were written on several hosts (a DCP checkpoint, ranks on their
own hosts' disks) names the parts the other hosts mirror themselves (``elsewhere``):
their chunks are not copied from here, and the manifest goes up only once each of them
is there (its own ``isolane.json``, written last by that host's mirror of the part).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, wait
from dataclasses import replace

from isolane.lanes.scheduler import LaneHandle
from isolane.snapshot.manifest import MANIFEST, WRITING_MARKER, Manifest
from isolane.storage.base import BlobStore

log = logging.getLogger(__name__)
# How long the mirror of a snapshot waits for the parts other hosts upload, and how
# often it looks.
PART_WAIT_S = 600.0
PART_POLL_S = 0.2


def mirror_manifest(manifest: Manifest, target: BlobStore) -> Manifest:
    """The manifest as stored on the mirror: one device, every chunk on it (the parts
    other hosts wrote included)."""
    return replace(manifest, devices=(target.url,),
                   chunks=tuple(replace(c, device=0, linked=False) for c in manifest.chunks),
                   ranks=tuple(replace(r, devices=None) for r in manifest.ranks))


class Mirrorer:
    def __init__(self, sources: Sequence[BlobStore], target: BlobStore, lane: LaneHandle,
                 *, attempts: int = 3, backoff_s: float = 1.0) -> None:
        self.sources = sources
        self.target = target
        self.lane = lane
        self.attempts = attempts
        self.backoff_s = backoff_s

    def start(self, manifest: Manifest, prefix: str,
              parent_chunks: Callable[[], Mapping[str, str]],
              elsewhere: Sequence[str] = ()) -> Future[None]:
        """Mirror in a driver thread; the future holds the last error after all attempts."""
        future: Future[None] = Future()

        def drive() -> None:
            error: BaseException | None = None
            for attempt in range(self.attempts):
                try:
                    self.mirror(manifest, prefix, parent_chunks(), elsewhere)
                except Exception as exc:  # retried, then reported on the future
                    error = exc
                    log.warning("mirror of %s to %s failed (attempt %d/%d): %s",
                                prefix, self.target.url, attempt + 1, self.attempts, exc)
                    time.sleep(self.backoff_s * 2**attempt)
                else:
                    future.set_result(None)
                    return
            future.set_exception(error or RuntimeError("mirror failed"))

        threading.Thread(target=drive, name=f"isolane-mirror-{manifest.name}",
                         daemon=True).start()
        return future

    def mirror(self, manifest: Manifest, prefix: str, parent_chunks: Mapping[str, str],
               elsewhere: Sequence[str] = ()) -> None:
        """Upload one snapshot; ``parent_chunks`` maps hashes to keys already mirrored,
        ``elsewhere`` names the part folders other hosts upload."""
        away = tuple(f"{part}/" for part in elsewhere)
        futures = [self.lane.submit_sized(c.stored, self._chunk, prefix, c.key, c.device,
                                          c.hash, parent_chunks)
                   for c in manifest.chunks if not (away and c.key.startswith(away))]
        wait(futures)
        for fut in futures:
            fut.result()
        chunk_keys = {f"{prefix}/{c.key}" for c in manifest.chunks}
        for device, source in enumerate(self.sources):
            if device > 0 and not any(c.device == device for c in manifest.chunks):
                continue
            for key in source.list(prefix):
                if (key in chunk_keys or key.endswith(("/" + MANIFEST, "/" + WRITING_MARKER))
                        or ".tmp-" in key):
                    continue
                self.target.write(key, source.read(key))
        self._await_parts(prefix, elsewhere)
        self.target.write_atomic(f"{prefix}/{MANIFEST}",
                                 mirror_manifest(manifest, self.target).to_json())

    def _await_parts(self, prefix: str, parts: Sequence[str]) -> None:
        """Wait until every part another host mirrors is complete on the mirror."""
        deadline = time.monotonic() + PART_WAIT_S
        for part in parts:
            while not self.target.exists(f"{prefix}/{part}/{MANIFEST}"):
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{prefix}/{part} did not reach {self.target.url} within "
                        f"{PART_WAIT_S:.0f} s: is the host that wrote it still mirroring?")
                time.sleep(PART_POLL_S)

    def _chunk(self, prefix: str, key: str, device: int, digest: str,
               parent_chunks: Mapping[str, str]) -> None:
        full = f"{prefix}/{key}"
        existing = parent_chunks.get(digest)
        if existing is not None:
            self.target.copy(existing, full)
        else:
            self.target.write(full, self.sources[device].read(full))
