"""A storage node exports the host view: every process on its host config, not only
itself, in ``/v1/stats`` and ``/metrics``. A real ``isolane serve`` and a real writer
process on one config."""

from __future__ import annotations

import json
import time
from pathlib import Path

from tests.lanes.test_plane_processes import Members, wait_for
from tests.support.node import NodeProcess, write_node_config


def test_a_node_reports_every_member_of_its_host(tmp_path: Path) -> None:
    config = write_node_config(tmp_path / "host")
    members = Members(config, tmp_path)
    with NodeProcess(config, token="t0k3n") as node:
        try:
            writer, _ = members.start("writer", 20, "writer")

            def pids() -> set[int]:
                stats = node.json("GET", "/v1/stats")
                return {m["pid"] for m in stats["host"]["members"]}

            wait_for(lambda: {node.pid, writer.pid} <= pids(), 10, "both members")
            stats = node.json("GET", "/v1/stats")
            roles = {m["pid"]: m["roles"] for m in stats["host"]["members"]}
            assert "node" in roles[node.pid] and "writer" in roles[writer.pid]
            time.sleep(0.3)
            status, body = node.request("GET", "/metrics")
            text = body.decode()
            assert status == 200
            assert "isolane_host_members 2.0" in text
            assert f'isolane_host_member_write_bytes_per_second{{pid="{writer.pid}"' in text
            json.dumps(stats)  # JSON-able as served
        finally:
            members.close()
