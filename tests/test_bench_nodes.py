"""The cluster benchmark's loopback nodes (``bench_cluster.start_nodes``) start empty: a
run into a folder an earlier run used must not find that run's blocks (a put of a block
already stored counts as not new, which the node-loss benchmark reads as a failed store),
and emptying a folder removes a link in it without following it."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_cluster import start_nodes  # noqa: E402


def test_nodes_start_from_empty_homes_and_spare_what_a_link_points_at(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    stale = folder / "node-0" / "kv" / "left-by-an-earlier-run"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"old")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_bytes(b"keep")
    (folder / "node-0" / "link").symlink_to(outside, target_is_directory=True)
    [node] = start_nodes(folder, 64 << 20, count=1)
    try:
        assert node.request("GET", "/healthz")[0] == 200
    finally:
        node.kill()
    assert not stale.exists()
    assert not (folder / "node-0" / "link").exists()
    assert (outside / "keep").read_bytes() == b"keep"
