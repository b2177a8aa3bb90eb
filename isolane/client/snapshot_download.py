"""Receiving a snapshot download, over several connections at once.

A load asks the node for part 0 of ``parts`` (``GET .../data?part=0&parts=N``); the
node answers which generation it sends (``X-Isolane-Generation``) and in how many
parts it splits it (``X-Isolane-Parts``: 1 when this stream carries every chunk, as an
older node's or a multi-rank snapshot's does). Part ``k`` carries every ``N``-th chunk
from ``k`` on, so the other parts are asked for that very generation on connections
of their own (a node whose live generation moved on answers 409 ``ConflictError``:
load again), and all of them are received at once, each in a thread of its own:

- every part's stream has the same header; the first allocates the tensors (big ones
  in page-aligned memory of their own, faulted in by a thread that walks the chunks
  in the order the parts bring them, as a local restore does), the others check that
  their header is the same;
- each chunk is received straight into its tensor where it is one slice of it (else
  into a buffer, then copied into its tensors) and hashed by a small pool while the
  next one arrives; every hash is checked against the manifest's before the load
  returns (``IntegrityError`` naming the tensor);
- a part that fails stops the others at their next chunk; the first error is raised.

What the parts buy: the receiving (a copy out of the socket per byte), the faults of
fresh memory and the hashing spread over the cores instead of one thread, and the node
reads and sends several chunk files at once.

``receive_chunks`` receives the answer to ``POST .../chunks``: chunk files named by the
client, whole, each checked against the hash of the client's own manifest before it is
handed on.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from urllib3.exceptions import HTTPError

from isolane.client.transport import finish
from isolane.errors import (
    IntegrityError,
    InvalidArgumentError,
    NodeUnavailableError,
    WireFormatError,
)
from isolane.snapshot.dtypes import dtype_name
from isolane.snapshot.manifest import ChunkRecord
from isolane.snapshot.reader import fresh_memory, prefaulted
from isolane.storage.mapped import MappedRegion
from isolane.wire import snapshot_stream as ss

Progress = Callable[[int, int], None]
# Connections a load uses (the node may serve fewer: then one stream has everything).
DOWNLOAD_PARTS = 3


class _Stop(Exception):
    """Another part failed: this one stops at a chunk boundary."""


class Download:
    """One snapshot download in flight: the header, the tensors, and its parts.

    ``targets``: ``into`` tensors by dotted key. Thread-safe across its parts."""

    def __init__(self, targets: Mapping[str, torch.Tensor], progress: Progress | None,
                 where: str) -> None:
        self.targets = targets
        self.progress = progress
        self.where = where
        self.header: ss.StreamHeader | None = None
        self.encoded = b""
        self.tensors: dict[int, torch.Tensor] = {}
        self.copy_later: dict[int, torch.Tensor] = {}
        self.views: dict[int, memoryview] = {}
        self.regions: dict[int, MappedRegion] = {}
        self._keys: dict[int, str] = {}
        self._lock = threading.Lock()
        self._done = 0
        self._failed = threading.Event()
        self._checks: list[tuple[ss.ChunkEntry, str, Future[str]]] = []

    # -- the first part: header and tensors --------------------------------------------------
    def open(self, response: Any) -> ss.StreamHeader:
        """Read the first part's header and make the tensors it describes."""
        raw = self._read_header(response)
        header = ss.decode_header(raw, partial=True)
        for entry in header.tensors:
            target = _target(entry, self.targets)
            if target is not None and target.device.type == "cpu" and target.is_contiguous():
                self.tensors[entry.id] = target
                continue
            tensor, region = fresh_memory(entry.dtype, entry.shape)
            self.tensors[entry.id] = tensor
            if region is not None:
                self.regions[entry.id] = region
            if target is not None:
                self.copy_later[entry.id] = target
        self.views = {tid: ss.writable_bytes(t.detach()) for tid, t in self.tensors.items()}
        self._keys = {e.id: e.key for e in header.tensors}
        self.header, self.encoded = header, bytes(raw)
        return header

    def fault_plan(self) -> list[tuple[MappedRegion, int, int]]:
        """The fresh regions' parts in the order the chunks arrive (index order)."""
        assert self.header is not None
        return [(self.regions[p.tensor], p.src_offset, p.nbytes)
                for chunk in self.header.chunks for p in chunk.pieces
                if p.tensor in self.regions]

    # -- every part ------------------------------------------------------------------------------
    def receive(self, response: Any, part: int, parts: int, hasher: ThreadPoolExecutor,
                *, first: bool) -> None:
        """Receive part ``part`` of ``parts`` (its header already read when ``first``)."""
        try:
            self._receive(response, part, parts, hasher, first=first)
        except _Stop:
            return
        except BaseException:
            self._failed.set()
            raise

    def _receive(self, response: Any, part: int, parts: int, hasher: ThreadPoolExecutor,
                 *, first: bool) -> None:
        header = self.header
        assert header is not None
        fill = _filler(response, self.where)
        if not first and self._read_header(response) != self.encoded:
            raise WireFormatError(f"part {part} of a download from {self.where} describes "
                                  "another snapshot than part 0; load again")
        indexes = ss.part_indexes(len(header.chunks), part, parts)
        total = 0
        for index in indexes:
            if self._failed.is_set():
                raise _Stop
            chunk = header.chunks[index]
            if ss.check_chunk_header(_read(fill, ss.CHUNK_HEADER.size), index, chunk):
                raise WireFormatError(f"a download sent chunk {chunk.key} as a link")
            piece = chunk.single
            if piece is not None and piece.nbytes == chunk.nbytes:
                data = self.views[piece.tensor][piece.src_offset:piece.src_offset + piece.nbytes]
                fill(data)
            else:
                data = memoryview(_read(fill, chunk.nbytes))
                for p in chunk.pieces:
                    self.views[p.tensor][p.src_offset:p.src_offset + p.nbytes] = data[
                        p.dst_offset:p.dst_offset + p.nbytes]
            expected = ss.hash_hex(_read(fill, ss.HASH_BYTES))
            digest = hasher.submit(ss.chunk_digest, data, chunk.stored)
            total += chunk.nbytes
            with self._lock:
                self._checks.append((chunk, expected, digest))
                self._done += sum(p.nbytes for p in chunk.pieces)
                if self.progress is not None:
                    self.progress(self._done, header.data_bytes)
        ss.check_end(_read(fill, ss.END.size), len(indexes), total)

    def check(self) -> dict[int, torch.Tensor]:
        """Wait for the hashes, check them, fill copy-later targets; the tensors."""
        for chunk, expected, digest in self._checks:
            if digest.result() != expected:
                names = ", ".join(f"'{self._keys[p.tensor]}'" for p in chunk.pieces[:3])
                raise IntegrityError(f"tensor {names} (chunk {chunk.key} on {self.where})",
                                     "content hash mismatch")
        for tid, target in self.copy_later.items():
            with torch.no_grad():
                target.copy_(self.tensors[tid])
            self.tensors[tid] = target
        return self.tensors

    @property
    def failed(self) -> bool:
        return self._failed.is_set()

    def cancel(self) -> None:
        self._failed.set()
        for _chunk, _expected, digest in self._checks:
            digest.cancel()

    def _read_header(self, response: Any) -> bytearray:
        fill = _filler(response, self.where)
        return _read(fill, ss.decode_preamble(_read(fill, ss.PREAMBLE.size)))


def served_parts(response: Any, asked: int, where: str) -> tuple[int, str | None]:
    """How many parts the node splits this download into, and its generation."""
    text = response.headers.get(ss.PARTS_HEADER, "1")
    try:
        parts = int(text)
    except ValueError:
        parts = 0
    if not 1 <= parts <= asked:
        raise WireFormatError(f"{where} answered a download in {text!r} parts, asked for "
                              f"at most {asked}")
    return parts, response.headers.get(ss.GENERATION_HEADER)


def receive_parts(first: Any, open_part: Callable[[int, int, str | None], Any],
                  download: Download, parts: int, generation: str | None
                  ) -> dict[int, torch.Tensor]:
    """Receive a whole download: ``first`` is part 0's response (its header read by
    ``download.open``; the caller hands its connection back), ``open_part(part, parts,
    generation)`` opens another part's streamed response (handed back here)."""
    hashers = max(1, min(parts, 2))
    with ThreadPoolExecutor(hashers, thread_name_prefix="isolane-check") as hasher, \
            prefaulted(download.fault_plan()):
        others: list[Future[None]] = []
        with ThreadPoolExecutor(max(1, parts - 1),
                                thread_name_prefix="isolane-download") as pool:
            try:
                for part in range(1, parts):
                    others.append(pool.submit(_other_part, open_part, download, part, parts,
                                              generation, hasher))
                download.receive(first, 0, parts, hasher, first=True)
            except BaseException:
                download.cancel()
                raise
            finally:
                errors = []
                for fut in others:
                    exc = fut.exception()
                    if exc is not None:
                        errors.append(exc)
            if errors:
                download.cancel()
                raise errors[0]
        try:
            return download.check()
        except BaseException:
            download.cancel()
            raise


def _other_part(open_part: Callable[[int, int, str | None], Any], download: Download,
                part: int, parts: int, generation: str | None,
                hasher: ThreadPoolExecutor) -> None:
    response = open_part(part, parts, generation)
    complete = False
    try:
        download.receive(response, part, parts, hasher, first=False)
        complete = not download.failed
    finally:
        finish(response, complete=complete)


def _filler(response: Any, where: str) -> Callable[[memoryview], None]:
    fp = getattr(response, "_fp", None)  # http.client's response: reads into a buffer
    readinto = getattr(fp, "readinto", None) or response.readinto

    def fill(view: memoryview) -> None:
        got = 0
        while got < len(view):
            try:
                n = readinto(view[got:got + ss.PIECE_BYTES])
            except (HTTPError, OSError) as exc:
                raise NodeUnavailableError(where, f"the download broke off: {exc}") from None
            if not n:
                raise NodeUnavailableError(where, "the download broke off")
            got += n
    return fill


def _read(fill: Callable[[memoryview], None], n: int) -> bytearray:
    data = bytearray(n)
    fill(memoryview(data))
    return data


def _target(entry: ss.TensorEntry, targets: Mapping[str, torch.Tensor]
            ) -> torch.Tensor | None:
    """The ``into`` tensor for ``entry``; as SnapshotStore.load, one of another dtype or
    shape is an error (raised before any byte is written into it)."""
    target = targets.get(entry.key)
    if target is not None and (tuple(target.shape) != entry.shape
                               or dtype_name(target.dtype) != entry.dtype):
        raise InvalidArgumentError(
            f"into['{entry.key}'] is {dtype_name(target.dtype)}{list(target.shape)} but the "
            f"snapshot holds {entry.dtype}{list(entry.shape)}; load without into= or give "
            "a matching tensor")
    return target


def receive_chunks(response: Any, records: Sequence[ChunkRecord], where: str,
                   on_chunk: Callable[[ChunkRecord, memoryview], None]) -> int:
    """Receive the chunks ``records`` in that order (a tensor chunk up to its last data
    byte, a pack whole); ``on_chunk(record, data)`` is called with each once its hash
    matched the record's (IntegrityError otherwise, naming the chunk). The bytes received."""
    fill = _filler(response, where)
    raw = _read(fill, ss.decode_preamble(_read(fill, ss.PREAMBLE.size)))
    header = ss.decode_header(raw, need_chunks=False, partial=True)
    if [c.key for c in header.chunks] != [r.key for r in records]:
        raise WireFormatError(f"{where} sent other chunks than were asked for")
    total = 0
    for index, record in enumerate(records):
        entry = header.chunks[index]
        nbytes = ss.wire_bytes(record)
        if (entry.stored, entry.nbytes) != (record.stored, nbytes):
            raise WireFormatError(f"{where} describes chunk {record.key} with another size "
                                  "than its manifest")
        ss.check_chunk_header(_read(fill, ss.CHUNK_HEADER.size), index, entry)
        data = memoryview(_read(fill, nbytes))
        _read(fill, ss.HASH_BYTES)  # the node's word; the manifest's is checked instead
        if ss.chunk_digest(data, record.stored) != record.hash:
            raise IntegrityError(f"chunk {record.key} on {where}", "content hash mismatch")
        on_chunk(record, data)
        total += nbytes
    ss.check_end(_read(fill, ss.END.size), len(records), total)
    return total
