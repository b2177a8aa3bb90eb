"""A governor's decision: one change of a governed rate, kept for ``stats``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DECISIONS_KEPT = 32


@dataclass(frozen=True)
class Decision:
    """One change of a governed rate (``None``: unlimited)."""

    at_s: float
    lane: str
    read_p99_s: float | None
    old_rate: float | None
    new_rate: float | None
    reason: str

    def as_dict(self, now: float) -> dict[str, Any]:
        return {"age_s": round(now - self.at_s, 3), "lane": self.lane,
                "read_p99_ms": None if self.read_p99_s is None
                else round(self.read_p99_s * 1e3, 3),
                "old_rate_bytes_per_s": round_rate(self.old_rate),
                "new_rate_bytes_per_s": round_rate(self.new_rate), "reason": self.reason}


def round_rate(rate: float | None) -> int | None:
    return None if rate is None else round(rate)
