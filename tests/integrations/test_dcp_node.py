"""torch.distributed.checkpoint through a storage node: a real ``isolane serve`` process,
real ranks (gloo on CPU) saving a real FSDP2 transformer with AdamW state
(tests/integrations/dcp_worker.py, mode node2), each rank streaming its own part to the
node; this process loads what they saved, through the node, as a world of one.

The node's part-save lease is shortened to a few seconds: the save whose rank was
SIGKILLed is swept by the node while another save, kept alive by its part uploads,
runs beside it."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from isolane import open_store
from isolane.errors import ConflictError, WireFormatError
from isolane.integrations.dcp import IsolaneStorageReader, IsolaneStorageWriter
from isolane.snapshot.dcp_metadata import ItemPlace, encode_metadata
from isolane.snapshot.names import ROOT
from tests.integrations.test_dcp import lines, run_world
from tests.support.node import NodeProcess, write_node_config

LEASE_S = 6.0  # the node's part_save_lease_s: long beside a part's gap, short for a test


class LiveSave:
    """A multi-rank save kept alive beside the others: a part (a tensor of its own) is
    uploaded every second until ``stop``; then ``commit`` with DCP metadata naming them."""

    def __init__(self, url: str, name: str) -> None:
        self.remote = open_store(url)
        self.name = name
        self.generation, self.parent = self.remote.begin_parts(name)
        self.sent: list[torch.Tensor] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set() and len(self.sent) < 100:
            rank = len(self.sent)
            value = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
            self.remote.save_part(self.name, self.generation, self.parent, rank,
                                  {f"x{rank}@0,0": value})
            self.sent.append(value)
            self._stop.wait(1.0)

    def commit(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)
        world = len(self.sent)
        state = {f"x{r}": TensorStorageMetadata(
            TensorProperties(dtype=torch.float32), torch.Size([4, 8]),
            [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([4, 8]))])
            for r in range(world)}
        places = {MetadataIndex(f"x{r}", torch.Size([0, 0])): ItemPlace(r, f"x{r}@0,0")
                  for r in range(world)}
        self.remote.commit_parts(self.name, self.generation, self.parent, world,
                                 encode_metadata(Metadata(state, planner_data={}), places), {})

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)
        self.remote.close()


@pytest.fixture(scope="module")
def node_saved(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("dcp-node")
    node = NodeProcess(write_node_config(root / "node", node={"part_save_lease_s": LEASE_S}),
                       startup_timeout_s=120).start()
    (root / "store.json").write_text(json.dumps({"home": str(root / "rank-home")}))
    (root / "node-url").write_text(node.url)
    live = LiveSave(node.url, "n-live")
    try:
        codes = run_world(root, "node2", 2)
        crashes = lines(root, "node2", "CRASH")
        assert not crashes, crashes[0]
        assert codes == [0, -9], codes
        yield root, node, live
    finally:
        live.close()
        node.stop()


def generations(root: Path, name: str) -> list[str]:
    folder = root / "node" / "ckpt" / ROOT / name
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def check_base_loads_bit_exact(root: Path, node: NodeProcess) -> None:
    """'n-base' loaded as a world of one equals the full tensors saved beside it."""
    ref = torch.load(root / "ref-base.pt", weights_only=True)
    state: dict[str, Any] = {
        "model": {k: torch.zeros_like(v) for k, v in ref["model"].items()},
        "optim": {"state": {p: {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v
                                for k, v in moments.items()}
                            for p, moments in ref["optim"]["state"].items()},
                  "param_groups": ref["optim"]["param_groups"]},
        "step": 0}
    reader = IsolaneStorageReader(node.url, "n-base")
    dcp.load(state, storage_reader=reader)
    reader.close()
    assert state["step"] == 1
    for key, value in ref["model"].items():
        assert torch.equal(state["model"][key].view(-1).view(torch.uint8),
                           value.view(-1).view(torch.uint8)), key
    for param, moments in ref["optim"]["state"].items():
        for key, value in moments.items():
            assert torch.equal(state["optim"]["state"][param][key], value), (param, key)


def test_saved_at_two_ranks_through_a_node_loads_bit_exact_at_one(node_saved: Any) -> None:
    root, node, _live = node_saved
    # ``info`` on the coordinator only
    assert sorted(lines(root, "node2", "SAVED")) == sorted(
        f"SAVED {n} {c}" for n in ("n-base", "n-again") for c in (True, False))
    check_base_loads_bit_exact(root, node)


def test_the_node_holds_one_committed_snapshot_per_save(node_saved: Any) -> None:
    _root, node, _live = node_saved
    with open_store(node.url) as remote:
        base, again = remote.info("n-base"), remote.info("n-again")
        manifest = remote.manifest("n-base")
        remote.verify("n-base")
    assert manifest.dcp is not None and len(manifest.ranks) == 2
    assert again.parent is not None and again.parent["name"] == "n-base"
    assert (again.written_bytes, again.linked_bytes) == (0, again.stored_bytes)
    assert base.written_bytes == base.stored_bytes > 0


def test_a_rank_killed_mid_save_through_a_node_commits_nothing(node_saved: Any) -> None:
    root, node, _live = node_saved
    doomed = lines(root, "node2", "DOOMED")  # rank 0 raised (rank 1 died)
    assert len(doomed) == 1 and doomed[0].startswith("DOOMED raised"), doomed
    with open_store(node.url) as remote:
        names = {i.name for i in remote.list()}
    assert "n-doomed" not in names and {"n-base", "n-again"} <= names


def test_a_node_writer_on_one_process_saves_and_reloads(node_saved: Any) -> None:
    _root, node, _live = node_saved
    state = {"w": torch.arange(12.0).reshape(3, 4), "meta": {"lr": 0.5}}
    writer = IsolaneStorageWriter(node.url, "n-one", metadata={"job": "x"})
    dcp.save(state, storage_writer=writer)
    assert writer.info is not None and writer.info.metadata == {"job": "x"}
    into = {"w": torch.zeros(3, 4), "meta": {"lr": 0.0}}
    dcp.load(into, storage_reader=IsolaneStorageReader(node.url, "n-one"))
    assert torch.equal(into["w"], state["w"]) and into["meta"]["lr"] == 0.5
    with pytest.raises(BaseException, match="already exists"):
        dcp.save(state, storage_writer=IsolaneStorageWriter(node.url, "n-one"))


def test_parts_never_go_into_a_committed_generation(node_saved: Any) -> None:
    _root, node, _live = node_saved
    with open_store(node.url) as remote:
        committed = remote.info("n-base").generation
        with pytest.raises(ConflictError, match="not a save in progress"):
            remote.save_part("n-base", committed, None, 0, {"x": torch.ones(4)},
                             overwrite=True)
        with pytest.raises(ConflictError, match="not a save in progress"):
            remote.commit_parts("n-base", committed, None, 1, {}, {}, overwrite=True)
        remote.verify("n-base")  # untouched
        generation, _parent = remote.begin_parts("n-bad")
        with pytest.raises(WireFormatError, match="not DCP metadata"):
            remote.commit_parts("n-bad", generation, None, 1, {"version": 99}, {})
        assert "n-bad" not in {i.name for i in remote.list()}


def test_an_abandoned_save_is_swept_after_its_lease_beside_a_live_one(node_saved: Any
                                                                      ) -> None:
    root, node, live = node_saved
    deadline = time.monotonic() + 6 * LEASE_S
    while generations(root, "n-doomed") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert generations(root, "n-doomed") == []  # the killed save's leftovers are gone
    swept = node.json("GET", "/v1/stats")["part_saves"]
    assert swept["abandoned"] >= 1 and swept["lease_s"] == LEASE_S, swept
    check_base_loads_bit_exact(root, node)  # the checkpoint before it
    # the save beside it kept its lease through its uploads: untouched, and it commits
    assert generations(root, "n-live") == [live.generation]
    live.commit()
    into = {f"x{r}": torch.zeros(4, 8) for r in range(len(live.sent))}
    dcp.load(into, storage_reader=IsolaneStorageReader(node.url, "n-live"))
    assert len(live.sent) >= 2
    for r, value in enumerate(live.sent):
        assert torch.equal(into[f"x{r}"], value), r
    # the killed save's name is free again
    state = {"w": torch.arange(24.0).reshape(4, 6)}
    dcp.save(state, storage_writer=IsolaneStorageWriter(node.url, "n-doomed"))
    back = {"w": torch.zeros(4, 6)}
    dcp.load(back, storage_reader=IsolaneStorageReader(node.url, "n-doomed"))
    assert torch.equal(back["w"], state["w"])
