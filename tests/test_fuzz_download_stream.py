"""Fuzzing the snapshot stream as the download client receives it: the chunk frames
(header, bytes, hash) and the end marker after a stream header, read by the real
``Download`` and ``receive_parts``. Random bytes and mutations of a valid stream end in
the library's error (``WireFormatError``, ``IntegrityError``, ``NodeUnavailableError``
for a stream that stops short, ``PayloadTooLargeError`` for an oversized header), never
another exception or a hang, and a stream accepted never yields bytes other than those
its hashes vouch for.

Bounded and deterministic for CI like tests/test_fuzz_parsers.py: derandomized, no
example database, a fixed number of examples (a few seconds on an idle machine).
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from isolane.client.snapshot_download import Download, receive_parts
from isolane.errors import (
    IntegrityError,
    NodeUnavailableError,
    PayloadTooLargeError,
    WireFormatError,
)
from isolane.snapshot.tree import flatten_state
from isolane.wire import snapshot_stream as ss
from tests.test_fuzz_parsers import mutations

FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow])
LIBRARY_ERRORS = (WireFormatError, IntegrityError, NodeUnavailableError,
                  PayloadTooLargeError)

STATE = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
         "b": torch.tensor([7.0, -1.0]), "c": torch.arange(5, dtype=torch.int8)}


def _header() -> ss.StreamHeader:
    """Slices of ``w`` (the last one stored with padding) and one pack of ``b`` and
    ``c``: both of the client's receive paths (into the tensor, via a buffer)."""
    tree, leaves = flatten_state(STATE)
    header = ss.header_for("fuzz", tree, leaves, {"step": 1})
    ids = {e.key: e for e in header.tensors}
    w, b, c = ids["w"], ids["b"], ids["c"]
    chunks = [ss.ChunkEntry("w/c.0", 32, 32, (ss.PieceEntry(w.id, 0, 0, 32),)),
              ss.ChunkEntry("w/c.1", 4096, 16, (ss.PieceEntry(w.id, 32, 0, 16),)),
              ss.ChunkEntry("_packs/0/c.0", 16, 16, (ss.PieceEntry(b.id, 0, 0, 8),
                                                     ss.PieceEntry(c.id, 0, 8, 5)))]
    return header.with_chunks(chunks)


def _tensor_views(header: ss.StreamHeader) -> dict[int, memoryview]:
    by_key = {e.key: e.id for e in header.tensors}
    return {by_key[k]: ss.tensor_bytes(t) for k, t in STATE.items()}


def _stream(header: ss.StreamHeader) -> tuple[bytes, bytes]:
    """The preamble and header, and the frames and end marker after them."""
    encoded = header.encode()
    views = _tensor_views(header)
    body = bytearray()
    for index, chunk in enumerate(header.chunks):
        data = ss.chunk_view(chunk, views)
        body += ss.encode_chunk_header(index, chunk.nbytes) + bytes(data)
        body += ss.hash_bytes(ss.chunk_digest(data, chunk.stored))
    body += ss.encode_end(len(header.chunks), sum(c.nbytes for c in header.chunks))
    return ss.encode_preamble(encoded) + encoded, bytes(body)


HEADER = _header()
HEAD, FRAMES = _stream(HEADER)


def _receive(stream: bytes) -> tuple[ss.StreamHeader, dict[int, torch.Tensor]]:
    """What a load does with part 0 of a one-part download."""
    download = Download({}, None, "fuzz")
    response = io.BytesIO(stream)
    header = download.open(response)

    def no_other_part(part: int, parts: int, generation: str | None) -> Any:
        raise AssertionError("a one-part download opens no other part")

    return header, receive_parts(response, no_other_part, download, 1, None)


def _accepted_bytes_are_vouched_for(header: ss.StreamHeader,
                                    tensors: dict[int, torch.Tensor]) -> None:
    """Every tensor returned holds the original bytes: a mutation that got through
    changed nothing a hash covers (the frames' hashes are xxh3-128 of the originals)."""
    originals = _tensor_views(HEADER)
    for entry in header.tensors:
        got = bytes(ss.tensor_bytes(tensors[entry.id]))
        assert got == bytes(originals[entry.id]), f"tensor {entry.key} accepted damaged"


def test_the_valid_stream_is_received_whole() -> None:
    header, tensors = _receive(HEAD + FRAMES)
    assert header == HEADER
    _accepted_bytes_are_vouched_for(header, tensors)


@pytest.mark.parametrize(("at", "why"), [
    (ss.CHUNK_HEADER.size + 3, IntegrityError),  # a byte of chunk 0's data
    (ss.CHUNK_HEADER.size + 32, IntegrityError),  # a byte of chunk 0's hash
    (len(FRAMES) - 1, WireFormatError),  # the end marker's byte count
    (0, WireFormatError),  # chunk 0's index
])
def test_a_flipped_frame_byte_is_refused(at: int, why: type[Exception]) -> None:
    frames = bytearray(FRAMES)
    frames[at] ^= 0x01
    with pytest.raises(why):
        _receive(HEAD + bytes(frames))


@FUZZ
@given(frames=mutations(FRAMES) | st.binary(max_size=256))
def test_mutated_chunk_frames_and_end_markers_fail_closed(frames: bytes) -> None:
    try:
        header, tensors = _receive(HEAD + frames)
    except LIBRARY_ERRORS:
        return
    assert frames == FRAMES or frames.startswith(FRAMES), "a changed stream was accepted"
    _accepted_bytes_are_vouched_for(header, tensors)


@FUZZ
@given(stream=mutations(HEAD + FRAMES) | st.binary(max_size=512))
def test_mutated_whole_streams_fail_closed(stream: bytes) -> None:
    try:
        header, tensors = _receive(stream)
    except LIBRARY_ERRORS:
        return
    _accepted_bytes_are_vouched_for(header, tensors)
