"""A multi-rank save through a storage node (``isolane.node.snapshot_parts``): the
coordinator begins it, every rank streams its own part, the coordinator commits.

Used by the DCP storage layer (``isolane.integrations.dcp``) when its store is a node
URL. Each call is one request; none is retried once its body started (a part or a
commit sent twice would be refused, not applied twice).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote, urlencode

import torch

from isolane.client.snapshot_upload import read_info, send
from isolane.client.transport import Transport
from isolane.errors import WireFormatError
from isolane.snapshot.results import SnapshotInfo
from isolane.snapshot.versions import TensorVersions


def begin(transport: Transport, node: str, name: str, *, overwrite: bool,
          parent: str | bool | None) -> tuple[str, list[str] | None]:
    """The generation the ranks write into, and the parent their chunks link from."""
    query = {"overwrite": "1"} if overwrite else {}
    if parent is False:
        query["no_parent"] = "1"
    elif isinstance(parent, str):
        query["parent"] = parent
    answer = transport.json("POST", node, f"/v1/snapshots/{quote(name)}/parts?"
                            f"{urlencode(query)}", idempotent=False)
    generation, ref = answer.get("generation"), answer.get("parent")
    if not isinstance(generation, str) or not (
            ref is None or (isinstance(ref, list) and len(ref) == 2
                            and all(isinstance(p, str) for p in ref))):
        raise WireFormatError("a storage node began a save without a generation and parent")
    return generation, ref


def save_part(transport: Transport, node: str, name: str, generation: str,
              parent: list[str] | None, rank: int, items: Mapping[str, torch.Tensor], *,
              overwrite: bool, client_id: str) -> str:
    """Rank ``rank``'s items as its part; the part's manifest (JSON text) once written."""
    query = {"overwrite": "1"} if overwrite else {}
    if parent is not None:
        query.update(parent=parent[0], parent_generation=parent[1])
    sent = send(transport, TensorVersions(), node,
                f"/v1/snapshots/{quote(name)}/parts/{generation}/{rank}", dict(items), name,
                None, query=query, progress=None, client_id=client_id)
    if not isinstance(sent.answer, dict):
        raise WireFormatError("a storage node answered a part's upload without its manifest")
    return json.dumps(sent.answer)


def commit(transport: Transport, node: str, name: str, generation: str,
           parent: list[str] | None, world: int, dcp: dict[str, Any],
           metadata: dict[str, Any], *, overwrite: bool, mirror: bool | None,
           seconds: float) -> SnapshotInfo:
    """The manifest, written by the node from the ``world`` parts it holds."""
    body = {"world": world, "parent": parent, "dcp": dcp, "metadata": metadata,
            "overwrite": overwrite, "mirror": mirror, "seconds": seconds}
    return read_info(transport.json("POST", node, f"/v1/snapshots/{quote(name)}/parts/"
                                    f"{generation}/commit", body=body, idempotent=False))
