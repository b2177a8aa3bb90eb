"""A DCP load through a storage node receives the bytes its plan reads: a real
``isolane serve`` process, 4 gloo ranks saving DTensors through it, 2 ranks loading them
(tests/integrations/dcp_node_worker.py), chunks checked against the manifest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from isolane import open_store
from isolane.errors import ConflictError, IntegrityError, InvalidArgumentError
from isolane.integrations.dcp import IsolaneStorageReader, IsolaneStorageWriter
from isolane.integrations.dcp_node_reads import item_span
from isolane.snapshot.names import ROOT
from tests.support.node import NodeProcess, write_node_config
from tests.support.procs import run_ranks

WORKER = Path(__file__).with_name("dcp_node_worker.py")


def run_world(root: Path, mode: str, world: int, timeout_s: float = 150) -> dict[int, list[str]]:
    """Run ``mode`` on ``world`` ranks; each rank's report lines."""
    for code, err in run_ranks(WORKER, [str(root), mode], world, timeout_s):
        assert code == 0, err
    return {rank: (root / f"{mode}-rank-{rank}.out").read_text().splitlines()
            for rank in range(world)}


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("dcp-node-reads")
    node = NodeProcess(write_node_config(root / "node"), startup_timeout_s=120).start()
    (root / "node-url").write_text(node.url)
    try:
        yield root, node
    finally:
        node.stop()


def test_saved_at_four_ranks_each_of_two_receives_about_its_share(node: Any) -> None:
    root, _proc = node
    assert run_world(root, "save4", 4)[0] == ["SAVED"]
    loaded = run_world(root, "load2", 2)
    for rank in (0, 1):
        assert f"ROWS {''!r}" in loaded[rank] and f"COLUMNS {''!r}" in loaded[rank], loaded
    full = 10 * (1 << 20) + 64 * 1024 * 2 + 16 * 4  # w, b, r
    served = int(next(line for line in loaded[0] if line.startswith("SERVED")).split()[1])
    # each rank got about its half (rows of w cut inside the saved shards), where each
    # received every tensor whole before: 2 x full
    print(f"served {served} bytes for 2 ranks; the tensors hold {full}")
    assert full <= served < 0.75 * 2 * full, (served, full)


def test_a_flipped_byte_in_a_chunk_a_range_read_covers_is_refused(node: Any) -> None:
    root, proc = node
    state = {"w": torch.arange(4 * (1 << 18), dtype=torch.float32).reshape(4, -1)}
    dcp.save(state, storage_writer=IsolaneStorageWriter(proc.url, "flip"))
    with open_store(proc.url) as remote:
        manifest = remote.manifest("flip")
    chunk = next(c for c in manifest.chunks if c.tensor is not None and c.offset > 0)
    path = root / "node" / "ckpt" / ROOT / "flip" / manifest.generation / chunk.key
    data = bytearray(path.read_bytes())
    data[10] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointException) as raised:
        dcp.load({"w": torch.zeros(4, 1 << 18)},
                 storage_reader=IsolaneStorageReader(proc.url, "flip"))
    error = raised.value.failures[0][0]
    assert isinstance(error, IntegrityError) and chunk.key in str(error), error
    assert "content hash mismatch" in str(error)


def test_a_chunks_request_names_chunks_of_the_live_generation(node: Any) -> None:
    _root, proc = node
    dcp.save({"x": torch.ones(8)}, storage_writer=IsolaneStorageWriter(proc.url, "named"))
    with open_store(proc.url) as remote:
        manifest = remote.manifest("named")
        with pytest.raises(ConflictError, match="overwritten"):
            remote.read_chunks("named", "0" * 20 + "-gone", manifest.chunks[:1],
                               lambda *_: None)
        bogus = type(manifest.chunks[0])("../../etc/passwd", 0, 1, "00")
        with pytest.raises(InvalidArgumentError, match="has no chunk"):
            remote.read_chunks("named", manifest.generation, [bogus], lambda *_: None)


@pytest.mark.parametrize(("shape", "offsets", "lengths", "span"), [
    ((10, 4), (3, 0), (2, 4), (48, 80, True)),  # rows
    ((10, 4), (0, 1), (10, 2), (0, 160, False)),  # columns: the whole item
    ((2, 3, 4), (1, 2, 1), (1, 1, 3), (84, 96, True)),  # a run inside one row
    ((2, 3, 4), (0, 1, 0), (2, 1, 4), (0, 96, False)),
    ((), (), (), (0, 4, True)),
    ((5,), (2,), (0,), (0, 0, True)),
])
def test_item_span_is_the_region_when_it_is_one_run_of_bytes(
        shape: tuple[int, ...], offsets: tuple[int, ...], lengths: tuple[int, ...],
        span: tuple[int, int, bool]) -> None:
    assert item_span(shape, 4, offsets, lengths) == span
    region = torch.arange(max(1, int(torch.tensor(shape).prod())), dtype=torch.int32)
    full = region.reshape(shape)
    start, stop, alone = span
    if alone and stop > start:
        want = full
        for dim, (o, n) in enumerate(zip(offsets, lengths, strict=True)):
            want = want.narrow(dim, o, n)
        got = full.reshape(-1).view(torch.uint8)[start:stop].view(torch.int32)
        assert torch.equal(got, want.reshape(-1))
