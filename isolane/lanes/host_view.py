"""The host's lanes as an onlooker sees them: ``isolane lanes stats``, a node's stats.

``read_host_view`` opens the config's plane without joining it and reports every live
member (pid, roles, lanes, rates, heartbeat age), the host KV read p50/p99/p999
merged over the window, and the elected member's rates and recent decisions.
"""

from __future__ import annotations

import time
from typing import Any

from isolane.config import Config
from isolane.lanes.decisions import round_rate
from isolane.lanes.host_governor import host_read_latency
from isolane.lanes.plane import HostPlane, Member, plane_path


def member_dict(member: Member, now: float) -> dict[str, Any]:
    r = member.record
    return {"slot": member.index, "pid": r.pid, "roles": r.role_names(),
            "threads": {"read": r.threads[0], "write": r.threads[1],
                        "background": r.threads[2]},
            "heartbeat_age_s": round(now - r.heartbeat_s, 3), "fresh": member.fresh,
            "joined_age_s": round(now - r.joined_s, 3),
            "write_bytes_per_s": round(r.write_bps), "write_limit_bytes_per_s":
            round_rate(r.write_limit), "write_demand_bytes": r.write_demand,
            "background_bytes_per_s": round(r.background_bps),
            "background_limit_bytes_per_s": round_rate(r.background_limit),
            "background_demand_bytes": r.background_demand, "kv_gets": r.kv_gets}


def view_of(plane: HostPlane, window_s: float, now: float | None = None) -> dict[str, Any]:
    now = time.monotonic() if now is None else now
    members = plane.members(now)
    block: dict[str, Any] = dict(plane.read_governor() or {})
    decisions = block.get("decisions")
    decisions = decisions if isinstance(decisions, list) else []
    write = block.get("write")
    write = write if isinstance(write, dict) else {}
    background = block.get("background")
    background = background if isinstance(background, dict) else {}
    updated = block.get("updated_s")
    return {
        "plane": str(plane.path), "available": True,
        "members": [member_dict(m, now) for m in members],
        "read_latency_ms": host_read_latency(members, now, window_s),
        "window_s": window_s,
        "elected_pid": block.get("pid"),
        "governor_age_s": round(now - updated, 3) if isinstance(updated, int | float) else None,
        "write_rate_bytes_per_s": write.get("rate"),
        "write_state": write.get("state"),
        "background_rate_bytes_per_s": background.get("rate"),
        "background_state": background.get("state"),
        "decisions": [{**d, "age_s": round(now - float(d.get("at_s", now)), 3)}
                      for d in decisions if isinstance(d, dict)],
    }


def read_host_view(config: Config) -> dict[str, Any]:
    """The host view of ``config``'s plane (``available`` False without one)."""
    if not config.qos.host_plane:
        return {"plane": None, "available": False,
                "reason": "qos.host_plane is false: every process has lanes of its own"}
    path = plane_path(config)
    if not path.exists():  # nobody has joined: nothing to show, nothing to create
        return {"plane": str(path), "available": True, "members": [],
                "read_latency_ms": {"p50": None, "p99": None, "p999": None, "count": 0},
                "window_s": config.qos.read_p99_window_s, "elected_pid": None,
                "governor_age_s": None, "write_rate_bytes_per_s": None, "write_state": None,
                "background_rate_bytes_per_s": None, "background_state": None,
                "decisions": []}
    plane = HostPlane.open(config)
    if plane is None:
        return {"plane": str(plane_path(config)), "available": False,
                "reason": "the plane's folder is not writable here"}
    try:
        return view_of(plane, config.qos.read_p99_window_s)
    finally:
        plane.close()
