"""A save on a device that fills up, at any point of the save, is a CapacityError and
leaves the previous snapshot intact (and the device usable once space is freed).

The device is a real tmpfs of 8 MiB mounted for the test (the tests run as root on the
project's machines); it is filled by a filler file that leaves ``free`` bytes, so the
save runs out of space at its marker, its chunks or its manifest.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from isolane import SnapshotStore
from isolane.errors import CapacityError
from tests.snapshot.test_store import _small_config

CHUNK = 1 << 16


@pytest.fixture
def small_device(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "dev"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}): ENOSPC is "
                    "produced by filling a real small filesystem, which needs root")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _fill(device: Path, free: int) -> Path:
    """A filler file that leaves about ``free`` bytes free on ``device``."""
    filler = device / "filler"
    with open(filler, "wb", buffering=0) as f:
        block = bytes(CHUNK)
        try:
            while True:
                f.write(block)
        except OSError:
            pass
    size = filler.stat().st_size
    os.truncate(filler, max(0, size - free))
    return filler


@pytest.mark.parametrize("free", [0, 8 << 10, 600 << 10, 2 << 20])
def test_a_save_that_fills_the_device_is_a_capacity_error(small_device: Path, free: int
                                                          ) -> None:
    store = SnapshotStore(_small_config(small_device))
    first = {"w": torch.arange(200_000, dtype=torch.float32), "step": 1}
    store.save(first, "a")
    filler = _fill(small_device, free)
    with pytest.raises(CapacityError):
        store.save({"w": torch.randn(1_000_000), "step": 2}, "b")
    loaded = store.load("a")
    assert torch.equal(loaded["w"], first["w"]) and loaded["step"] == 1
    assert [i.name for i in store.list()] == ["a"]
    store.verify("a")  # raises IntegrityError on any damaged chunk
    filler.unlink()
    store.save({"w": torch.randn(1_000_000), "step": 2}, "b")
    assert [i.name for i in store.list()] == ["a", "b"]
    store.close()
