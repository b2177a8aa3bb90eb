"""JSON from outside (request bodies, manifests, stream headers, files) parsed with a
nesting bound.

Python's ``json`` recurses once per nesting level, so a body of 100k ``[`` raises
``RecursionError`` — an unhandled 500 on a node, a traceback in the CLI, one damaged
file blocking a whole store. ``loads`` measures the nesting first, in C-speed passes
(strings removed, then innermost bracket pairs stripped once per level), and refuses
anything deeper than ``max_depth`` with a ``ValueError`` — what every caller already
maps to its own error for malformed JSON.
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_DEPTH = 256
"""Default nesting bound: deeper than any document isolane writes (a state dict's tree
takes three levels per level of the dict)."""
DEPTH_CEILING = 512
"""The deepest bound a caller may ask for: the parser's stack stays far from Python's
recursion limit."""

_STRINGS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_TO_PARENS = bytes.maketrans(b"[]{}", b"()()")


class JsonTooDeepError(ValueError):
    """A JSON document nests deeper than the bound it was parsed with."""


def nesting_depth_over(data: bytes, max_depth: int) -> bool:
    """Whether ``data`` nests bracket pairs more than ``max_depth`` deep. Linear per
    level, at most ``max_depth`` passes."""
    brackets = _STRINGS.sub(b"", data).translate(_TO_PARENS, _NOT_BRACKETS)
    for _ in range(max_depth):
        stripped = brackets.replace(b"()", b"")
        if len(stripped) == len(brackets):
            break
        brackets = stripped
    # A pair left after max_depth passes is nested deeper. Unbalanced brackets alone
    # are malformed JSON: json.loads says so (a long run of openers it cannot parse
    # without recursing is caught as RecursionError in ``loads``).
    return b"()" in brackets


def loads(data: bytes | bytearray | memoryview | str, *, max_depth: int = MAX_DEPTH,
          what: str = "JSON") -> Any:
    """``json.loads`` that refuses nesting deeper than ``max_depth`` (``JsonTooDeepError``,
    a ``ValueError``); malformed input raises ``ValueError`` as ``json.loads`` does."""
    max_depth = min(max_depth, DEPTH_CEILING)
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    if nesting_depth_over(raw, max_depth):
        raise JsonTooDeepError(f"{what} nests deeper than {max_depth} levels; refused "
                               "unread")
    try:
        return json.loads(raw)
    except RecursionError:  # belt and braces: never let a parser blow the stack
        raise JsonTooDeepError(f"{what} nests too deep to parse") from None
