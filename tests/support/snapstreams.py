"""Raw snapshot upload streams (version 2) for tests that send bytes by hand: the
node's plan for a state dict, then every chunk as bytes (none linked)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from isolane.snapshot.tree import flatten_state
from isolane.wire import snapshot_stream as ss
from tests.support.node import NodeProcess


def planned_header(node: NodeProcess, name: str, state: Any) -> tuple[ss.StreamHeader, Any]:
    """The stream header with the node's chunks, and the leaves' byte views."""
    header, views, _token = plan_request(node, name, state)
    return header, views


def plan_request(node: NodeProcess, name: str, state: Any, *,
                 metadata: dict[str, Any] | None = None, query: str = "",
                 headers: dict[str, str] | None = None
                 ) -> tuple[ss.StreamHeader, Any, str | None]:
    """``planned_header`` plus the plan token the node answered."""
    tree, leaves = flatten_state(state)
    bare = ss.header_for(name, tree, leaves, metadata or {})
    status, raw = node.request("POST", f"/v1/snapshots/{name}/plan{query}", bare.encode(),
                               headers)
    assert status == 200, raw
    answer = json.loads(raw)
    body = json.loads(bare.encode())
    body["chunks"] = answer["chunks"]
    header = ss.decode_header(json.dumps(body).encode())
    return header, {leaf.id: ss.tensor_bytes(leaf.tensor) for leaf in leaves}, answer.get(
        "plan_token")


def stream_for(header: ss.StreamHeader, views: Any) -> bytes:
    """The whole upload of ``header``'s chunks from ``views`` (every chunk as bytes)."""
    encoded = header.encode()
    parts = [ss.encode_preamble(encoded), encoded]
    for index, chunk in enumerate(header.chunks):
        data = bytes(ss.chunk_view(chunk, views))
        parts += [ss.encode_chunk_header(index, chunk.nbytes), data,
                  ss.hash_bytes(ss.chunk_digest(data, chunk.stored))]
    parts.append(ss.encode_end(len(header.chunks), header.wire_bytes()))
    return b"".join(parts)


def upload_stream(node: NodeProcess, name: str, state: Any) -> bytes:
    """A whole, correct upload of ``state`` as ``name`` (every chunk sent as bytes)."""
    header, views = planned_header(node, name, state)
    return stream_for(header, views)


def generation_files(node: NodeProcess, name: str) -> list[Path]:
    """Every file the node's write device holds for snapshot ``name``."""
    folder = node.config.parent / "ckpt" / "snapshots" / name
    while True:
        try:  # the node may be removing the folder while it is walked: walk it again
            return sorted(p for p in folder.rglob("*") if p.is_file()) if folder.exists() else []
        except FileNotFoundError:
            continue
