"""Reading a streamed batch-get answer (``frames``) from a node: each key's value or a
miss, and whether the body was whole. A body cut short (a node killed mid-answer, a
reset connection) keeps its whole, checked frames and reads the rest as misses.

Frames of small blocks are cut out of pieces of ``PIECE_BYTES`` read at once: a call
into urllib3 costs tens of microseconds, three a frame would cost more than the frames'
bytes take to arrive on loopback. Blocks larger than a piece are read exactly, value by
value, so each arrives as one bytes object, not copied again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from urllib3.exceptions import HTTPError

from isolane import bounded_json
from isolane.errors import WireFormatError
from isolane.wire import frames

PIECE_BYTES = 256 << 10


class Readable(Protocol):
    def read(self, amt: int) -> bytes: ...


def read_batch(stream: Readable, keys: Sequence[bytes], max_value_bytes: int
               ) -> tuple[list[bytes | None], bool]:
    """Parse a batch-get response (``frames``) for ``keys``: each key's value or None,
    and whether the body was complete. Frames before a cut are whole and checked; the
    rest read as misses. A body that answers other keys than asked is a WireFormatError.
    ``max_value_bytes``: the namespace's block size (larger values are refused)."""
    values: list[bytes | None] = [None] * len(keys)
    frame_bytes = frames.FRAME_HEADER.size + max_value_bytes + frames.CHECKSUM.size
    # Large values are read one by one, exactly: each arrives as one bytes object.
    read = _BufferedReader(stream, PIECE_BYTES if frame_bytes <= PIECE_BYTES else 0).read
    try:
        count = frames.decode_batch_header(read(frames.BATCH_HEADER.size), len(keys))
        for i in range(count):
            header = frames.decode_frame_header(read(frames.FRAME_HEADER.size),
                                                max_value_bytes)
            if header.key != keys[i]:
                raise WireFormatError(f"frame {i} answers key {header.key.hex()}, asked for "
                                      f"{bytes(keys[i]).hex()}")
            value = read(header.length)
            frames.check_value(header, value, read(frames.CHECKSUM.size))
            if header.status == frames.STATUS_VALUE:
                values[i] = value
    except _Cut:
        return values, False
    return values, True


class _Cut(Exception):
    """The body ended early (node killed, connection reset)."""


class _BufferedReader:
    """Exact reads out of pieces of at least ``piece`` bytes read from ``stream``;
    ``piece`` 0: every read goes to the stream for exactly what it needs."""

    def __init__(self, stream: Readable, piece: int) -> None:
        self.stream = stream
        self.piece = piece
        self.buf = b""
        self.pos = 0

    def read(self, n: int) -> bytes:
        end = self.pos + n
        if end <= len(self.buf):
            out = self.buf[self.pos:end]
            self.pos = end
            return out
        rest = self.buf[self.pos:]
        need = n - len(rest)
        more = self._more(need, max(need, self.piece))
        self.buf = rest + more if rest else more
        self.pos = n
        return self.buf[:n] if len(self.buf) > n else self.buf

    def _more(self, need: int, want: int) -> bytes:
        """At least ``need`` bytes (asking for ``want``); _Cut if the body ends first."""
        try:
            data = self.stream.read(want)
            while len(data) < need:  # a short read: more may come until the end
                more = self.stream.read(want - len(data))
                if not more:
                    raise _Cut(f"{len(data)} of {need} bytes")
                data += more
        except (HTTPError, OSError) as exc:
            raise _Cut(str(exc)) from None
        return data


def json_object(data: bytes) -> dict[str, Any]:
    """A JSON answer that must be an object."""
    try:
        parsed = bounded_json.loads(data)
    except ValueError as exc:
        raise WireFormatError(f"a storage node answered with malformed JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise WireFormatError("a storage node answered with JSON that is not an object")
    return parsed
