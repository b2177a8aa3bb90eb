from __future__ import annotations

import math
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zarr

from isolane import SnapshotStore
from isolane.config import config_from_dict
from isolane.errors import (
    IntegrityError,
    InvalidNameError,
    IsolaneError,
    SnapshotExistsError,
    SnapshotNotFoundError,
    UnsupportedValueError,
)
from tests.snapshot.conftest import assert_same
from tests.support.damage import flip_byte

ALL_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
              torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
              torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2,
              torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.uint16, torch.uint32,
              torch.uint64]


def _random(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    raw = torch.randint(0, 256, (math.prod(shape) * torch.empty((), dtype=dtype).element_size(),),
                        dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        return (raw % 2).bool().view(shape)
    return raw.view(dtype).view(shape) if raw.numel() else torch.empty(shape, dtype=dtype)


def _training_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randn(8, 256)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 2,
            "rng": torch.get_rng_state(), "note": "adamw"}


def _small_config(tmp_path: Path, **snapshot: Any) -> Any:
    return config_from_dict({
        "device_groups": {"ckpt": {"role": "write", "devices": [str(tmp_path / "d0")]}},
        "snapshot": {"chunk_bytes": "1MiB", "pack_threshold": "64KiB", **snapshot}})


def test_model_and_optimizer_round_trip_bit_exact(tmp_path: Path) -> None:
    store = SnapshotStore(str(tmp_path))
    state = _training_state()
    info = store.save(state, "step-2", metadata={"loss": 0.5})
    assert info.name == "step-2" and info.metadata == {"loss": 0.5}
    assert info.logical_bytes > 0 and info.written_bytes == info.stored_bytes
    assert_same(state, store.load("step-2"))


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_and_odd_shapes_round_trip(tmp_path: Path, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    big = _random((700, 513), dtype, gen)  # > pack threshold, uneven chunk edge
    state = {"big": big, "scalar": _random((), dtype, gen), "empty": _random((0, 4), dtype, gen),
             "small": _random((3, 5), dtype, gen), "noncontig": big.t()[::3],
             "view": big[10:20]}
    store = SnapshotStore(_small_config(tmp_path))
    store.save(state, "dtypes")
    out = store.load("dtypes")
    assert_same(state, out)
    assert out["noncontig"].is_contiguous()


def test_tied_tensors_stay_tied(tmp_path: Path) -> None:
    w = torch.randn(512, 512)
    store = SnapshotStore(str(tmp_path))
    info = store.save({"embed": w, "lm_head": w}, "tied")
    out = store.load("tied")
    assert out["embed"] is out["lm_head"]
    assert info.logical_bytes == w.numel() * 4


def test_snapshot_opens_with_plain_zarr(tmp_path: Path) -> None:
    state = {"model": {"w": torch.randn(600, 700).bfloat16(), "b": torch.randn(700)},
             "big32": torch.randn(1000, 300), "step": 5}
    store = SnapshotStore(_small_config(tmp_path))
    store.save(state, "z")
    group = zarr.open_group(store.path("z"), mode="r")
    w = group["model/w"]
    assert w.attrs["torch_dtype"] == "bfloat16" and w.dtype == np.uint16
    assert np.array_equal(w[:], state["model"]["w"].view(torch.uint16).numpy())
    assert np.array_equal(group["big32"][:], state["big32"].numpy())
    assert group["big32"].chunks[0] < 1000  # really chunked
    # Small tensors live in packs; the manifest says where.
    record = next(t for t in store.manifest("z").tensors if t.key == "model.b")
    assert record.pack is not None
    pack = group[record.pack.array][record.pack.offset:record.pack.offset + record.pack.nbytes]
    assert np.array_equal(pack.view(np.float32), state["model"]["b"].numpy())


def test_load_keys_reads_only_those_bytes(tmp_path: Path) -> None:
    state = {"model": {"a": torch.randn(512, 1024), "b": torch.randn(16)},
             "optimizer": {"m": torch.randn(512, 1024)}, "step": 9}
    store = SnapshotStore(_small_config(tmp_path))
    store.save(state, "k")
    for chunk in store.manifest("k").chunks:  # damage everything optimizer-related
        if chunk.key.startswith("optimizer/"):
            path = Path(store.path("k")) / chunk.key
            path.write_bytes(b"\x00" * path.stat().st_size)
    out = store.load("k", keys=["model"])
    assert_same({"model": state["model"]}, out)
    assert_same(store.load("k", keys=["model.b", "step"]),
                {"model": {"b": state["model"]["b"]}, "step": 9})
    with pytest.raises(KeyError, match="no key 'nope'"):
        store.load("k", keys=["nope"])


def test_multi_device_striping(tmp_path: Path) -> None:
    config = config_from_dict({
        "device_groups": {"ckpt": {"role": "write", "devices": [str(tmp_path / "a"),
                                                                 str(tmp_path / "b")]}},
        "snapshot": {"chunk_bytes": "1MiB"}})
    store = SnapshotStore(config)
    state = {f"w{i}": torch.randn(512, 1024) for i in range(4)}
    store.save(state, "striped")
    devices = {c.device for c in store.manifest("striped").chunks}
    assert devices == {0, 1}
    assert any((tmp_path / "b" / "snapshots" / "striped").rglob("c.*"))
    assert_same(state, store.load("striped"))
    store.verify("striped")


def test_incremental_save_links_unchanged_chunks(tmp_path: Path) -> None:
    base = {f"layer{i}": torch.randn(1024, 1024) for i in range(4)}
    adapter = {"lora_A": torch.randn(1024, 256), "lora_B": torch.zeros(256, 1024)}
    store = SnapshotStore(_small_config(tmp_path))
    first = store.save({"base": base, "adapter": adapter}, "lora-0")
    adapter["lora_B"].add_(1.0)
    second = store.save({"base": base, "adapter": adapter}, "lora-1")
    assert second.parent == {"name": "lora-0", "generation": first.generation}
    base_bytes = sum(t.numel() * 4 for t in base.values())
    assert second.linked_bytes >= base_bytes
    assert second.written_bytes <= second.stored_bytes - base_bytes
    chunk = next(c for c in store.manifest("lora-1").chunks if c.key.startswith("base/"))
    a = Path(store.path("lora-0")) / chunk.key
    b = Path(store.path("lora-1")) / chunk.key
    assert os.path.samefile(a, b)  # a hard link, not a copy
    store.delete("lora-0")  # the child keeps its bytes
    assert_same({"base": base, "adapter": adapter}, store.load("lora-1"))
    full = store.save({"base": base, "adapter": adapter}, "full", parent=False)
    assert full.linked_bytes == 0


def test_async_save_is_safe_to_mutate_after_return(tmp_path: Path) -> None:
    store = SnapshotStore(_small_config(tmp_path, staging_budget="4MiB"))
    state = {f"w{i}": torch.randn(256, 1024) for i in range(12)}  # 12 MiB > budget
    expected = {k: v.clone() for k, v in state.items()}
    handle = store.save_async(state, "a")
    for t in state.values():
        t.fill_(-1.0)
    info = handle.result(timeout=60)
    assert info.name == "a"
    assert_same(expected, store.load("a"))
    assert store.staging.allocated_bytes <= 4 << 20  # back-pressure, not more memory


def test_async_error_surfaces_on_result_and_next_save(tmp_path: Path, tmpfs: Any) -> None:
    where = tmpfs("6m")
    store = SnapshotStore(config_from_dict({
        "device_groups": {"ckpt": {"role": "write", "devices": [str(where)]}},
        "snapshot": {"chunk_bytes": "1MiB"}}))
    handle = store.save_async({"w": torch.randn(4 << 20)}, "too-big")  # 16 MiB on 6 MiB
    with pytest.raises(OSError, match="full"):
        handle.result(timeout=60)
    store.save_async({"w": torch.randn(4 << 20)}, "again")  # nobody asks for its result
    store.wait()
    with pytest.raises(IsolaneError, match="previous async save of 'again' failed"):
        store.save({"w": torch.ones(4)}, "small")
    store.save({"w": torch.ones(4)}, "small")  # reported once, then saving works again
    assert [i.name for i in store.list()] == ["small"]


def test_names_are_validated(tmp_path: Path) -> None:
    store = SnapshotStore(str(tmp_path))
    for bad in ["a/b", "..", "../x", "x\x01y", "", " lead", "a..b", "-x", "x" * 300]:
        with pytest.raises(InvalidNameError):
            store.save({"w": torch.ones(1)}, bad)
    with pytest.raises(InvalidNameError):
        store.load("../../etc")
    assert not list(tmp_path.rglob("*zarr.json"))


def test_unknown_snapshot_error_says_what_to_do(tmp_path: Path) -> None:
    store = SnapshotStore(str(tmp_path))
    with pytest.raises(SnapshotNotFoundError, match="isolane ls"):
        store.load("nope")
    with pytest.raises(FileNotFoundError):
        store.info("nope")
    with pytest.raises(SnapshotNotFoundError):
        store.delete("nope")


def test_existing_name_needs_overwrite(tmp_path: Path) -> None:
    store = SnapshotStore(str(tmp_path))
    store.save({"w": torch.zeros(10)}, "s")
    with pytest.raises(SnapshotExistsError, match="overwrite"):
        store.save({"w": torch.ones(10)}, "s")
    assert torch.equal(store.load("s")["w"], torch.zeros(10))
    store.save({"w": torch.ones(10)}, "s", overwrite=True)
    assert torch.equal(store.load("s")["w"], torch.ones(10))
    assert len(list((tmp_path / "snapshots" / "s").iterdir())) == 1  # old generation gone


def test_unsupported_leaf_is_refused_before_any_write(tmp_path: Path) -> None:
    store = SnapshotStore(str(tmp_path))
    with pytest.raises(UnsupportedValueError, match=r"\['opt'\]\['hook'\]"):
        store.save({"w": torch.ones(3), "opt": {"hook": object()}}, "bad")
    assert store.list() == []
    with pytest.raises(ValueError, match="metadata"):
        store.save({"w": torch.ones(3)}, "m", metadata={"x": object()})


def test_list_info_delete_and_keep_last(tmp_path: Path) -> None:
    store = SnapshotStore(_small_config(tmp_path, keep_last=2))
    for step in range(4):
        store.save({"w": torch.full((10,), float(step))}, f"step-{step}")
    assert [i.name for i in store.list()] == ["step-2", "step-3"]
    store.delete("step-2")
    assert [i.name for i in store.list()] == ["step-3"]
    assert not (tmp_path / "d0" / "snapshots" / "step-2").exists()
    store.save({"w": torch.ones(1)}, "x")
    store.save({"w": torch.ones(1)}, "y")
    report = store.gc(keep_last=1)
    assert report.deleted_snapshots == ("x",) or set(report.deleted_snapshots) == {"step-3", "x"}
    assert [i.name for i in store.list()] == ["y"]


def test_concurrent_saves_and_loads(tmp_path: Path) -> None:
    store = SnapshotStore(_small_config(tmp_path))
    states = {f"s{i}": {"w": torch.randn(300, 1024), "i": i} for i in range(6)}
    errors: list[BaseException] = []

    def work(name: str) -> None:
        try:
            store.save(states[name], name)
            assert_same(states[name], store.load(name))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in states]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert {i.name for i in store.list()} == set(states)


def test_map_location_and_default_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ISOLANE_HOME", str(tmp_path / "home"))
    store = SnapshotStore()
    store.save({"w": torch.arange(5)}, "d")
    assert (tmp_path / "home" / "checkpoints" / "snapshots" / "d").is_dir()
    out = store.load("d", map_location="meta")
    assert out["w"].device.type == "meta"


def test_load_into_fills_existing_tensors_in_place(tmp_path: Path) -> None:
    store = SnapshotStore(_small_config(tmp_path))
    state = _training_state()
    store.save(state, "s")
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 256))
    target = {"model": model.state_dict()}
    before = {k: v.data_ptr() for k, v in target["model"].items()}
    out = store.load("s", keys=["model"], into=target)
    assert_same({"model": state["model"]}, out)
    for key, tensor in out["model"].items():
        assert tensor.data_ptr() == before[key]  # the model's own memory was filled
    assert torch.equal(model[0].weight, state["model"]["0.weight"])
    strided = {"model": {"0.weight": torch.empty(256, 512).t()}}
    out = store.load("s", keys=["model.0.weight"], into=strided)
    assert out["model"]["0.weight"] is strided["model"]["0.weight"]
    assert torch.equal(strided["model"]["0.weight"], state["model"]["0.weight"])
    with pytest.raises(ValueError, match="snapshot holds float32"):
        store.load("s", into={"model": {"0.weight": torch.empty(3)}})


def test_load_with_mmap_is_bit_exact_and_copy_on_write(tmp_path: Path) -> None:
    store = SnapshotStore(_small_config(tmp_path))
    state = {"w": torch.randn(1024, 1024), "odd": torch.randn(333, 777)}
    store.save(state, "m")
    out = store.load("m", mmap=True)
    assert_same(state, out)
    out["w"].fill_(0)  # private mapping: the files keep the saved bytes
    assert_same(state, store.load("m"))
    store.verify("m")


def _anonymous_kib(tensor: torch.Tensor) -> int:
    """Anonymous memory (kB, /proc/self/smaps) of the mappings under ``tensor``."""
    start = tensor.data_ptr()
    stop = start + tensor.numel() * tensor.element_size()
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and len(head.split("-")) == 2 and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < stop and hi > start
            elif inside and head == "Anonymous:":
                total += int(line.split()[1])
    return total


def test_load_with_mmap_maps_the_page_cache_without_copying(tmp_path: Path) -> None:
    """mmap=True puts the chunk files' page cache pages behind the tensor: no anonymous
    copy of them is made at load (a writable private mapping populated for writing
    would copy every page); a write then copies only the pages it touches."""
    store = SnapshotStore(_small_config(tmp_path))
    state = {"w": torch.randn(2048, 1024)}  # 8 MiB: 2 chunks of 4 MiB
    store.save(state, "m")
    out = store.load("m", mmap=True)
    assert_same(state, out)
    assert _anonymous_kib(out["w"]) < 256  # 8 MiB mapped, none of it copied
    out["w"][0].fill_(0)  # one row: one page copied on write
    assert 0 < _anonymous_kib(out["w"]) < 256
    assert_same(state, store.load("m"))


def test_version_change_detection_skips_untouched_tensors(tmp_path: Path) -> None:
    store = SnapshotStore(_small_config(tmp_path))
    base = {f"layer{i}": torch.randn(512, 1024) for i in range(3)}
    adapter = torch.zeros(512, 1024)
    state = {"base": base, "adapter": adapter}
    store.save(state, "v0", change_detection="version")
    adapter.add_(1.0)  # bumps the version counter
    base["layer1"][0, 0] += 1.0  # so does a write through indexing
    info = store.save(state, "v1", change_detection="version")
    chunks = {c.key: c for c in store.manifest("v1").chunks}
    assert all(c.linked for k, c in chunks.items()
               if k.startswith(("base/layer0/", "base/layer2/")))
    assert not any(c.linked for k, c in chunks.items() if k.startswith("adapter/"))
    assert not chunks["base/layer1/c.0.0"].linked  # the changed row's chunk
    assert chunks["base/layer1/c.1.0"].linked  # hashed (version moved), found equal
    assert info.written_bytes < info.stored_bytes
    assert_same(state, store.load("v1"))
    # A fresh tensor object with the same bytes is not trusted by identity: it is
    # hashed, found equal, and linked all the same.
    clone = {"base": {k: v.clone() for k, v in base.items()}, "adapter": adapter}
    again = store.save(clone, "v2", change_detection="version")
    assert again.linked_bytes >= sum(t.numel() * 4 for t in base.values())
    assert_same(clone, store.load("v2"))
    with pytest.raises(ValueError, match="change_detection"):
        store.save(state, "v3", change_detection="mtime")  # type: ignore[arg-type]


def test_async_version_save_does_not_stage_untouched_tensors(tmp_path: Path) -> None:
    store = SnapshotStore(_small_config(tmp_path, staging_budget="2MiB"))
    base = {f"layer{i}": torch.randn(512, 1024) for i in range(8)}  # 16 MiB
    state = {"base": base, "adapter": torch.zeros(64, 64)}
    store.save_async(state, "a0", change_detection="version").result()
    state["adapter"].add_(1)
    handle = store.save_async(state, "a1", change_detection="version")
    state["adapter"].fill_(7)  # mutated after return: a1 keeps the staged value
    info = handle.result()
    assert info.written_bytes < 1 << 20
    out = store.load("a1")
    assert torch.equal(out["adapter"], torch.ones(64, 64))
    assert_same(base, out["base"])


def test_plain_load_gives_big_tensors_page_aligned_memory_of_their_own(tmp_path: Path) -> None:
    """Big tensors land in page-aligned memory (so O_DIRECT reads straight into them),
    whatever the chunk offsets: 1024 float32 rows tile 1 MiB chunks on page boundaries,
    777 do not (offsets off 512), 4096 bf16 rows land on 512-byte ones."""
    store = SnapshotStore(_small_config(tmp_path, chunk_bytes="1MiB"))
    torch.manual_seed(3)
    state = {"aligned": torch.randn(1024, 1024), "odd": torch.randn(700, 777),
             "bf16": torch.randn(1500, 4096 + 256).to(torch.bfloat16),
             "small": torch.randn(10)}
    store.save(state, "s")
    out = store.load("s")
    assert_same(state, out)
    for key in ("aligned", "odd", "bf16"):
        assert out[key].data_ptr() % 4096 == 0, key
    store.delete("s")  # the tensors own their memory: no file behind them
    out["aligned"].add_(1)
    assert torch.equal(out["aligned"], state["aligned"] + 1)
    assert torch.equal(out["odd"], state["odd"])


def test_load_into_misaligned_targets_goes_through_checked_staging(tmp_path: Path) -> None:
    """torch's allocator hands out 64-byte aligned memory (mostly), which O_DIRECT
    refuses: such targets are filled through a staging buffer, and a damaged chunk is
    reported before its bytes reach the target."""
    config = _small_config(tmp_path, chunk_bytes="4MiB")
    torch.manual_seed(4)
    state = {"w": torch.randn(3000, 1024), "v": torch.randn(512, 2048).to(torch.bfloat16)}
    SnapshotStore(config).save(state, "s")
    store = SnapshotStore(config)
    target = {"w": _misaligned((3000, 1024), torch.float32),
              "v": _misaligned((512, 2048), torch.bfloat16)}
    ptrs = {k: t.data_ptr() for k, t in target.items()}
    out = store.load("s", into=target)
    assert_same(state, out)
    assert {k: t.data_ptr() for k, t in out.items()} == ptrs
    assert store.staging.acquired > 0  # bounce buffers
    assert 0 < store.staging.allocated_bytes <= 64 << 20  # a few, kept for later saves
    manifest = store.manifest("s")
    chunk = next(c for c in manifest.chunks if c.key.startswith("w/") and c.offset > 0)
    flip_byte(tmp_path / "d0" / "snapshots" / "s" / manifest.generation / chunk.key, 999)
    fresh = {"w": _misaligned((3000, 1024), torch.float32),
             "v": _misaligned((512, 2048), torch.bfloat16)}
    with pytest.raises(IntegrityError, match=r"'w'.*content hash mismatch"):
        store.load("s", into=fresh)
    damaged = fresh["w"].view(-1).view(torch.uint8)[chunk.offset:chunk.offset + chunk.nbytes]
    assert int(damaged.count_nonzero()) == 0  # checked before the copy: still zeros


def test_load_into_aligned_targets_goes_through_checked_staging_too(tmp_path: Path) -> None:
    """A target on a 512-byte boundary (torch hands those out too, about one big
    allocation in four here) could take O_DIRECT in place, but is filled through the
    huge-page backed staging buffers as well: their reads reach the device as 4 MiB
    requests, a read into the target's 4 KiB pages in ~1 MiB pieces. So a damaged chunk
    is reported before its bytes reach an aligned target too."""
    config = _small_config(tmp_path, chunk_bytes="4MiB")
    torch.manual_seed(4)
    state = {"w": torch.randn(3000, 1024), "v": torch.randn(512, 2048).to(torch.bfloat16)}
    SnapshotStore(config).save(state, "s")
    store = SnapshotStore(config)
    target = {"w": _misaligned((3000, 1024), torch.float32, at=0),
              "v": _misaligned((512, 2048), torch.bfloat16, at=0)}
    out = store.load("s", into=target)
    assert_same(state, out)
    assert all(out[k] is target[k] for k in target)
    manifest = store.manifest("s")
    assert store.staging.acquired == len(manifest.chunks)  # every chunk bounced
    chunk = next(c for c in manifest.chunks if c.key.startswith("w/") and c.offset > 0)
    flip_byte(tmp_path / "d0" / "snapshots" / "s" / manifest.generation / chunk.key, 999)
    fresh = {"w": _misaligned((3000, 1024), torch.float32, at=0),
             "v": _misaligned((512, 2048), torch.bfloat16, at=0)}
    with pytest.raises(IntegrityError, match=r"'w'.*content hash mismatch"):
        store.load("s", into=fresh)
    damaged = fresh["w"].view(-1).view(torch.uint8)[chunk.offset:chunk.offset + chunk.nbytes]
    assert int(damaged.count_nonzero()) == 0  # checked before the copy: still zeros


def _misaligned(shape: tuple[int, ...], dtype: torch.dtype, at: int = 64) -> torch.Tensor:
    """Zeroed contiguous tensor whose data starts ``at`` bytes past a 512-byte boundary."""
    n = math.prod(shape)
    size = torch.empty(0, dtype=dtype).element_size()
    base = torch.zeros(n + 1024 // size, dtype=dtype)
    skip = ((at - base.data_ptr()) % 512) // size
    out = base[skip:skip + n].view(shape)
    assert out.data_ptr() % 512 == at
    return out


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_every_chunk_file_and_folder_is_fsynced_before_the_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """Chunk files are written without an fsync each and fsynced together before the
    manifest: a spy on os.fsync sees every one of them (and their folders) first."""
    from isolane.storage.local import LocalBlobStore

    synced: list[str] = []
    real_fsync = os.fsync

    def spy_fsync(fd: int) -> None:
        real_fsync(fd)
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))

    commits: list[int] = []
    real_atomic = LocalBlobStore.write_atomic

    def spy_atomic(self: LocalBlobStore, key: str, data: Any) -> None:
        if key.endswith("/isolane.json"):
            commits.append(len(synced))
        real_atomic(self, key, data)

    store = SnapshotStore(_small_config(tmp_path))
    state = {"w": torch.randn(1024, 1024), "v": torch.randn(700, 777), "b": torch.randn(5)}
    monkeypatch.setattr(os, "fsync", spy_fsync)
    monkeypatch.setattr(LocalBlobStore, "write_atomic", spy_atomic)
    if mode == "sync":
        store.save(state, "s")
    else:
        store.save_async(state, "s").result()
    assert len(commits) == 1
    before_commit = set(synced[:commits[0]])
    gen = tmp_path / "d0" / "snapshots" / "s" / store.manifest("s").generation
    chunk_files = [p for p in gen.rglob("c*") if p.is_file()]
    assert len(chunk_files) >= 5
    for path in chunk_files:
        assert str(path) in before_commit, path
        assert str(path.parent) in before_commit, path.parent
    assert str(gen) in before_commit


def _resident(region: Any) -> int:
    """Pages of an anonymous region present in memory (mincore)."""
    import ctypes
    import mmap as _mmap

    pages = region.size // _mmap.PAGESIZE
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    vec = (ctypes.c_ubyte * pages)()
    if libc.mincore(region.address, region.size, vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(v & 1 for v in vec)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_prefault_threads_fault_in_every_part_and_stop_with_the_block(threads: int) -> None:
    """Each of the pre-fault threads takes every threads-th part; together they fault in
    all of them while the block runs, and leaving the block stops them."""
    import time

    from isolane.snapshot.reader import prefaulted
    from isolane.storage.mapped import PAGE, MappedRegion

    region = MappedRegion(7 * 64 * PAGE)
    parts = [(region, i * 64 * PAGE, 64 * PAGE) for i in range(7)]
    with prefaulted(parts, threads):
        deadline = time.monotonic() + 10
        while _resident(region) < 7 * 64 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert _resident(region) == 7 * 64
    idle = MappedRegion(64 * 64 * PAGE)
    with prefaulted([(idle, i * 64 * PAGE, 64 * PAGE) for i in range(64)], threads):
        pass  # a failed read: the block ends at once
    after = _resident(idle)
    time.sleep(0.2)
    assert _resident(idle) == after  # the threads were joined: nothing faults in later
    region.close()
    idle.close()
