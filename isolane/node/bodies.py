"""Reading request bodies under a node's limits (async, aiohttp).

Every read names what it expected, so a body cut short is a ``WireFormatError``
(HTTP 400) saying so, and a body over a limit is a ``PayloadTooLargeError`` (413),
raised from ``Content-Length`` before anything is read whenever the client sent one.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from isolane import bounded_json
from isolane.errors import PayloadTooLargeError, WireFormatError


def check_length(request: web.Request, limit: int, what: str = "the request body",
                 field: str | None = None) -> None:
    """413 before reading when ``Content-Length`` is over ``limit`` (``field``: the
    config field that raises it)."""
    length = request.content_length
    if length is not None and length > limit:
        raise PayloadTooLargeError(what, length, limit, field=field)


async def read_exactly(request: web.Request, n: int, what: str) -> bytes:
    try:
        return await request.content.readexactly(n)
    except asyncio.IncompleteReadError as exc:
        raise WireFormatError(f"the body ends inside {what} ({len(exc.partial)} of {n} "
                              "bytes): truncated; nothing was stored") from None


async def read_all(request: web.Request, limit: int, what: str = "the request body",
                   field: str | None = None) -> bytes:
    """The whole body, refusing more than ``limit`` bytes (413)."""
    check_length(request, limit, what, field)
    data = await request.content.read(limit + 1)
    while len(data) <= limit and not request.content.at_eof():
        more = await request.content.read(limit + 1 - len(data))
        if not more:
            break
        data += more
    if len(data) > limit:
        raise PayloadTooLargeError(what, len(data), limit, field=field)
    return data


async def expect_end(request: web.Request, what: str) -> None:
    """WireFormatError if the body goes on after ``what``."""
    extra = await request.content.read(1)
    if extra:
        raise WireFormatError(f"the body goes on after {what}; send exactly one body per "
                              "request (docs/FORMATS.md)")


async def read_json(request: web.Request, limit: int, max_depth: int) -> Any:
    data = await read_all(request, limit, "the JSON body")
    try:
        return bounded_json.loads(data, max_depth=max_depth, what="the JSON body")
    except bounded_json.JsonTooDeepError as exc:
        raise WireFormatError(f"{exc}: raise node.max_json_depth to accept it") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise WireFormatError(f"the body is not JSON: {exc}") from None


class BodyReader:
    """Exact reads of a long body straight into the caller's buffers: the chunks aiohttp
    received are copied once, into place (``read_exactly`` on the stream would join
    them into a new bytes object first). A client that sends nothing for
    ``stall_timeout_s`` fails the read (an upload holds the store's save slot, so a
    stalled one must not hold it forever). Not thread-safe: one handler reads."""

    def __init__(self, request: web.Request, *, stall_timeout_s: float = 120.0) -> None:
        self._content = request.content
        self._rest = memoryview(b"")
        self._stall_timeout_s = stall_timeout_s

    async def _next(self, what: str) -> memoryview:
        if self._rest:
            out, self._rest = self._rest, memoryview(b"")
            return out
        try:
            async with asyncio.timeout(self._stall_timeout_s):
                data, chunk_end = await self._content.readchunk()
                while not data and chunk_end:  # an HTTP chunk's end: not the body's
                    data, chunk_end = await self._content.readchunk()
        except TimeoutError:
            raise WireFormatError(f"no byte of {what} came for {self._stall_timeout_s:g} s: "
                                  "the upload stalled; nothing was committed") from None
        return memoryview(data)

    async def readinto(self, view: memoryview, what: str, on_piece: Any = None) -> None:
        """Fill ``view``; WireFormatError naming ``what`` if the body ends first.
        ``on_piece(n)`` is called with each piece's size (load accounting)."""
        got = 0
        while got < len(view):
            piece = await self._next(what)
            if not piece:
                raise WireFormatError(f"the body ends inside {what} ({got} of {len(view)} "
                                      "bytes): truncated; nothing was stored")
            take = min(len(piece), len(view) - got)
            view[got:got + take] = piece[:take]
            if take < len(piece):
                self._rest = piece[take:]
            got += take
            if on_piece is not None:
                on_piece(take)

    async def read_exactly(self, n: int, what: str) -> bytes:
        out = bytearray(n)
        await self.readinto(memoryview(out), what)
        return bytes(out)

    async def expect_end(self, what: str) -> None:
        """WireFormatError if the body goes on after ``what``."""
        if self._rest or await self._next(what):
            raise WireFormatError(f"the body goes on after {what}; send exactly one body "
                                  "per request (docs/FORMATS.md)")
