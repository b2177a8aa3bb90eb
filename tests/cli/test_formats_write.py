"""write_state publishes DEST atomically and never replaces one that appeared meanwhile."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from isolane.cli.formats import DestinationExistsError, write_atomic, write_state


def test_dest_that_appears_during_the_write_is_kept(tmp_path: Path) -> None:
    dest = tmp_path / "model.pt"

    def write(tmp: Path) -> None:
        torch.save({"w": torch.ones(4)}, tmp)
        dest.write_bytes(b"someone else's file")  # another process, meanwhile

    with pytest.raises(DestinationExistsError, match="--overwrite"):
        write_atomic(dest, write, overwrite=False)
    assert dest.read_bytes() == b"someone else's file"
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt"]


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_write_state_overwrites_only_when_asked(tmp_path: Path, suffix: str) -> None:
    dest = tmp_path / f"out{suffix}"
    state = {"w": torch.arange(6.0)}
    size = write_state(state, dest, overwrite=False)
    assert size == dest.stat().st_size > 0
    with pytest.raises(DestinationExistsError):
        write_state({"w": torch.zeros(2)}, dest, overwrite=False)
    write_state({"w": torch.zeros(2)}, dest, overwrite=True)
    if suffix == ".pt":
        loaded = torch.load(dest, weights_only=True)
    else:
        from safetensors.torch import load_file

        loaded = load_file(str(dest))
    assert torch.equal(loaded["w"], torch.zeros(2))
    assert [p.name for p in tmp_path.iterdir()] == [dest.name]
