"""What cluster membership keeps in etcd: the key layout and the records (pure: no I/O).

Under the cluster's prefix ``P`` (``etcd://host:port/P``)::

    P/nodes/<url, percent-quoted>   a node's NodeRecord, attached to the node's lease:
                                    it disappears when the node stops refreshing it
    P/move/lock                     the client moving chains after a change (MoveRecord),
                                    attached to that client's lease: one mover at a time
    P/move/done                     MoveRecord of the last ring whose moves are complete

A NodeRecord is small JSON: ``{"url", "weight", "started", "instance", "pid"}``
(``started``: the node's wall-clock start, for people; ``instance``: random per process,
so a node recognises its own registration). A MoveRecord is ``{"ring", "client"}``
where ``ring`` is :func:`ring_signature` of the members the move leads to. Values are
parsed with a nesting bound and checked field by field; a malformed one is reported
(``RecordError``) and ignored by the caller, never trusted.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import quote, unquote, urlsplit

from isolane import bounded_json
from isolane.errors import InvalidArgumentError

NODES = "/nodes/"
MOVE_LOCK = "/move/lock"
MOVE_DONE = "/move/done"
MAX_RECORD_BYTES = 4096
MAX_RECORD_DEPTH = 4


class RecordError(InvalidArgumentError):
    """A value under the membership prefix that is not a valid record."""


def node_key(prefix: str, url: str) -> str:
    return prefix + NODES + quote(url, safe="")


def url_of_node_key(prefix: str, key: str) -> str | None:
    """The node URL a key under ``prefix/nodes/`` names; None for other keys."""
    head = prefix + NODES
    return unquote(key[len(head):]) if key.startswith(head) else None


@dataclass(frozen=True)
class NodeRecord:
    url: str
    weight: float = 1.0
    started: float = 0.0  # wall-clock seconds (informational)
    instance: str = ""
    pid: int = 0

    def encode(self) -> bytes:
        return json.dumps({"url": self.url, "weight": self.weight, "started": self.started,
                           "instance": self.instance, "pid": self.pid}).encode()

    @classmethod
    def decode(cls, key_url: str, raw: bytes) -> NodeRecord:
        """The record under the key for ``key_url``; ``RecordError`` says what is wrong."""
        data = _object(raw, "node record")
        url = data.get("url")
        if not isinstance(url, str) or urlsplit(url).scheme not in ("http", "https") \
                or not urlsplit(url).hostname:
            raise RecordError(f"node record has no http(s) 'url': {url!r}")
        if url != key_url:
            raise RecordError(f"node record for {key_url} names another url {url!r}")
        weight = data.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, int | float) \
                or not 0 < weight < math.inf:
            raise RecordError(f"node record of {url}: weight must be a positive number, "
                              f"got {weight!r}")
        started = data.get("started", 0.0)
        if isinstance(started, bool) or not isinstance(started, int | float):
            raise RecordError(f"node record of {url}: started must be a number")
        instance = data.get("instance", "")
        pid = data.get("pid", 0)
        if not isinstance(instance, str) or isinstance(pid, bool) or not isinstance(pid, int):
            raise RecordError(f"node record of {url}: instance/pid malformed")
        return cls(url, float(weight), float(started), instance, pid)


@dataclass(frozen=True)
class MoveRecord:
    ring: str
    client: str = ""

    def encode(self) -> bytes:
        return json.dumps({"ring": self.ring, "client": self.client}).encode()

    @classmethod
    def decode(cls, raw: bytes) -> MoveRecord:
        data = _object(raw, "move record")
        ring, client = data.get("ring"), data.get("client", "")
        if not isinstance(ring, str) or not isinstance(client, str):
            raise RecordError(f"move record malformed: {data!r}"[:200])
        return cls(ring, client)


def _object(raw: bytes, what: str) -> dict[str, object]:
    if len(raw) > MAX_RECORD_BYTES:
        raise RecordError(f"{what} is {len(raw)} bytes (at most {MAX_RECORD_BYTES})")
    try:
        data = bounded_json.loads(raw, max_depth=MAX_RECORD_DEPTH, what=what)
    except ValueError as exc:
        raise RecordError(f"{what} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise RecordError(f"{what} is not a JSON object: {raw[:80]!r}")
    return data


def ring_signature(members: Mapping[str, float]) -> str:
    """A short name for a set of members with their weights, the same in every client."""
    text = "\n".join(f"{url} {members[url]!r}" for url in sorted(members))
    return hashlib.sha256(text.encode()).hexdigest()[:16]
