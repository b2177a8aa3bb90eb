"""What one snapshot stream header may declare, checked before anything is planned.

A header's size is bounded by ``node.max_header_bytes``, but the work a node does for it
grows with the tensors, chunks and pieces it lists and the depth of its JSON: these caps
bound that work (docs/API.md, "Limits and caps").
"""

from __future__ import annotations

from dataclasses import dataclass

from isolane import bounded_json
from isolane.errors import PayloadTooLargeError


@dataclass(frozen=True)
class StreamLimits:
    """What one stream header may declare, checked before anything is planned; each
    refusal names ``<config_section>.<field>`` that raises it (a node's ``node.*``)."""

    max_tensors: int = 200_000
    max_chunks: int = 1_000_000
    max_pieces: int = 2_000_000
    max_depth: int = bounded_json.MAX_DEPTH
    config_section: str = "node"

    def check_counts(self, tensors: int, chunks: int, pieces: int) -> None:
        for what, count, limit, unit, name in (
                ("the snapshot stream", tensors, self.max_tensors, "tensors",
                 "max_snapshot_tensors"),
                ("the snapshot stream", chunks, self.max_chunks, "chunks",
                 "max_snapshot_chunks"),
                ("the snapshot stream", pieces, self.max_pieces, "chunk pieces",
                 "max_snapshot_pieces")):
            if count > limit:
                raise PayloadTooLargeError(what, count, limit, unit,
                                           f"{self.config_section}.{name}")


DEFAULT_LIMITS = StreamLimits()
