"""Reading a streamed batch-get answer (``frames``) from a node: each key's value or a
miss, and whether the body was whole. A body cut short (a node killed mid-answer, a
reset connection) keeps its whole, checked frames and reads the rest as misses.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from urllib3.exceptions import HTTPError

from isolane.errors import WireFormatError
from isolane.service import frames


class Readable(Protocol):
    def read(self, amt: int) -> bytes: ...


def read_batch(stream: Readable, keys: Sequence[bytes], max_value_bytes: int
               ) -> tuple[list[bytes | None], bool]:
    """Parse a batch-get response (``frames``) for ``keys``: each key's value or None,
    and whether the body was complete. Frames before a cut are whole and checked; the
    rest read as misses. A body that answers other keys than asked is a WireFormatError."""
    values: list[bytes | None] = [None] * len(keys)
    read = _exact_reader(stream)
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


def _exact_reader(stream: Readable) -> Callable[[int], bytes]:
    def read(n: int) -> bytes:
        if n == 0:
            return b""
        try:
            data = stream.read(n)
        except (HTTPError, OSError) as exc:
            raise _Cut(str(exc)) from None
        while len(data) < n:
            try:
                more = stream.read(n - len(data))
            except (HTTPError, OSError) as exc:
                raise _Cut(str(exc)) from None
            if not more:
                raise _Cut(f"{len(data)} of {n} bytes")
            data += more
        return data
    return read


def json_object(data: bytes) -> dict[str, Any]:
    """A JSON answer that must be an object."""
    parsed = json.loads(data)
    if not isinstance(parsed, dict):
        raise WireFormatError("a storage node answered with JSON that is not an object")
    return parsed
