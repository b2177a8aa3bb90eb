from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from isolane.errors import ConfigError, InvalidArgumentError, InvalidNameError, StorageError
from isolane.kvpool.pool import KVPool
from tests.support.damage import flip_byte

CT = 16  # tokens a block in these tests


def _pool(path: Path, **kw: object) -> KVPool:
    return KVPool(str(path), namespace="llama-test", chunk_tokens=CT, **kw)  # type: ignore[arg-type]


def _kv(n_tokens: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # [layers, 2, tokens, heads, head_dim]
    return torch.randn(2, 2, n_tokens, 4, 8, generator=gen).to(torch.bfloat16)


def _tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def test_put_then_get_returns_the_longest_cached_prefix(tmp_path: Path) -> None:
    pool = _pool(tmp_path)
    tokens, kv = _tokens(100), _kv(100)
    assert pool.put(tokens, kv) == 6  # 6 full blocks, the partial tail is not cached
    n, out = pool.get(tokens)
    assert n == 96 and out is not None
    assert torch.equal(out, kv[:, :, :96])
    longer = [*tokens[:50], 999, *tokens[51:]]  # diverges inside block 3
    n, out = pool.get(longer)
    assert n == 48 and out is not None and torch.equal(out, kv[:, :, :48])
    assert pool.lookup(tokens) == 96 and pool.lookup(longer) == 48
    assert pool.put(tokens, kv) == 0  # blocks already present are not written again


def test_get_into_fills_a_preallocated_tensor(tmp_path: Path) -> None:
    pool = _pool(tmp_path)
    tokens, kv = _tokens(64), _kv(64)
    pool.put(tokens, kv)
    out = torch.zeros_like(kv)
    assert pool.get_into(tokens, out) == 64
    assert torch.equal(out, kv)


def test_short_and_empty_prompts_are_misses(tmp_path: Path) -> None:
    pool = _pool(tmp_path)
    assert pool.get(_tokens(5)) == (0, None)  # nothing stored yet
    pool.put(_tokens(32), _kv(32))
    assert pool.get(_tokens(5)) == (0, None)  # shorter than one block
    assert pool.get([]) == (0, None)
    assert pool.lookup([]) == 0


def test_layout_and_shape_mismatches_are_clear_errors(tmp_path: Path) -> None:
    pool = _pool(tmp_path)
    pool.put(_tokens(32), _kv(32))
    with pytest.raises(InvalidArgumentError, match="does not match namespace"):
        pool.put(_tokens(32), _kv(32).float())
    with pytest.raises(InvalidArgumentError, match="token_dim"):
        pool.put(_tokens(31), _kv(32))
    with pytest.raises(InvalidArgumentError, match=r"token_ids\[1\]"):
        pool.put([1, -5, 3], _kv(3))


def test_restart_keeps_every_block(tmp_path: Path) -> None:
    pool = _pool(tmp_path)
    kvs = {i: _kv(64, seed=i) for i in range(5)}
    for i, kv in kvs.items():
        pool.put(_tokens(64, start=1000 * i), kv)
    pool.close()
    reopened = _pool(tmp_path, memory_budget=0)  # nothing in memory: every get hits disk
    for i, kv in kvs.items():
        n, out = reopened.get(_tokens(64, start=1000 * i))
        assert n == 64 and out is not None and torch.equal(out, kv)
    assert reopened.stats()["disk"][0]["blocks"] == 20


def test_restart_after_kill_during_puts(tmp_path: Path) -> None:
    code = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
        from tests.kvpool.test_pool import _pool, _kv, _tokens
        from pathlib import Path
        pool = _pool(Path({str(tmp_path)!r}))
        i = 0
        while True:
            pool.put(_tokens(64, start=1000 * i), _kv(64, seed=i))
            print(i, flush=True)
            i += 1
    """)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    done = -1
    for line in child.stdout:
        done = int(line)
        if done >= 30:
            break
    child.kill()
    child.wait()
    pool = _pool(tmp_path, memory_budget=0)
    for i in range(done + 1):  # every acknowledged put is back
        n, out = pool.get(_tokens(64, start=1000 * i))
        assert n == 64 and out is not None and torch.equal(out, _kv(64, seed=i))


def test_damaged_block_reads_as_a_miss_and_is_dropped(tmp_path: Path) -> None:
    pool = _pool(tmp_path, memory_budget=0)
    tokens, kv = _tokens(64), _kv(64)
    pool.put(tokens, kv)
    keys = pool.block_keys(tokens)
    location = pool.logs[0].locate(keys[2])
    assert location is not None
    segment = next(p for p in (tmp_path / "kvpool" / "llama-test" / "segments").iterdir()
                   if p.name.startswith(f"seg-{location.segment_id:08d}") and p.suffix != ".hint")
    flip_byte(segment, location.value_offset + 10)
    assert pool.stats()["disk"][0]["damaged"] == 0
    n, out = pool.get(tokens)
    assert n == 32 and out is not None and torch.equal(out, kv[:, :, :32])
    assert pool.lookup(tokens) == 32  # the damaged block is gone, never returned
    assert pool.stats()["disk"][0]["damaged"] == 1  # reported until a verify shows it
    assert pool.verify()["damaged"] == 1 and pool.stats()["disk"][0]["damaged"] == 0


def test_memory_tier_respects_its_budget(tmp_path: Path) -> None:
    block_bytes = 2 * 2 * CT * 4 * 8 * 2
    pool = _pool(tmp_path, memory_budget=10 * block_bytes)
    for i in range(10):
        pool.put(_tokens(64, start=1000 * i), _kv(64, seed=i))
    assert pool.memory.nbytes <= 10 * block_bytes
    for i in range(10):  # evicted blocks come back from disk
        n, out = pool.get(_tokens(64, start=1000 * i))
        assert n == 64 and out is not None and torch.equal(out, _kv(64, seed=i))


def test_block_api_and_delete(tmp_path: Path) -> None:
    pool = _pool(tmp_path)
    pool.put(_tokens(48), _kv(48))
    keys = pool.block_keys(_tokens(48))
    assert len(keys) == 3 and all(len(k) == 16 for k in keys)
    blocks = pool.get_blocks([*keys, b"\x00" * 16])
    assert all(b is not None for b in blocks[:3]) and blocks[3] is None
    block = bytes(range(256)) * ((pool.block_bytes or 0) // 256)
    assert pool.block_bytes == 4096 and len(block) == 4096
    assert pool.put_blocks([b"\x01" * 16], [block]) == 1
    assert pool.get_blocks([b"\x01" * 16]) == [block]
    assert pool.delete(_tokens(48)) == 3
    assert pool.get(_tokens(48)) == (0, None)


def test_concurrent_put_get_delete_never_tears(tmp_path: Path) -> None:
    pool = _pool(tmp_path, memory_budget=1 << 16)
    prompts = {i: (_tokens(64, start=1000 * i), _kv(64, seed=i)) for i in range(8)}
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            tokens, kv = prompts[i % 8]
            for _ in range(20):
                pool.put(tokens, kv)
                n, out = pool.get(tokens)
                if n:
                    assert out is not None and torch.equal(out, kv[:, :, :n])
                if i % 3 == 0:
                    pool.delete(tokens)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_blocks_of_a_prompt_are_one_range_read(tmp_path: Path) -> None:
    from isolane.kvpool.log.coalesce import coalesce_ranges

    pool = _pool(tmp_path)
    pool.put(_tokens(256), _kv(256))
    locations = [pool.logs[0].locate(k) for k in pool.block_keys(_tokens(256))]
    assert len(coalesce_ranges(locations)) == 1


def test_device_full_keeps_serving(tmpfs: Callable[[str], Path]) -> None:
    where = tmpfs("8m")
    pool = KVPool(str(where), namespace="full", chunk_tokens=256,
                  segment_bytes=1 << 20, memory_budget=0)
    stored = 0
    for i in range(30):  # 30 blocks of 512 KiB on an 8 MiB device
        kv = torch.full((1, 2, 256, 4, 64), float(i))
        stored += pool.put(_tokens(256, start=1000 * i), kv)
    assert stored > 16  # more than fits at once: old segments were evicted
    n, out = pool.get(_tokens(256, start=1000 * 29))  # the newest block is there
    assert n == 256 and out is not None and bool((out == 29.0).all())
    assert pool.get(_tokens(256, start=0)) == (0, None)  # the oldest was evicted
    pool.close()


def test_verify_compact_list_and_drop_namespaces(tmp_path: Path) -> None:
    from isolane.kvpool.catalog import drop_namespace, list_namespaces

    pool = _pool(tmp_path, segment_bytes=64 << 10)
    for i in range(8):
        pool.put(_tokens(64, start=1000 * i), _kv(64, seed=i))
    for i in range(6):
        pool.delete(_tokens(64, start=1000 * i))
    assert pool.verify() == {"checked": 8, "damaged": 0, "dropped_earlier": []}
    pool.compact(min_live_ratio=0.9)  # deletes already started a background pass
    from isolane.kvpool.log.compaction import should_compact

    assert not any(should_compact(i.live_bytes, i.file_bytes, 0.9)
                   for i in pool.logs[0].segments() if i.state == "sealed")
    live = sum(i.live_bytes for i in pool.logs[0].segments())
    assert sum(i.file_bytes for i in pool.logs[0].segments()) < 3 * live  # dead bytes gone
    for i in (6, 7):  # the live blocks survive compaction
        n, out = pool.get(_tokens(64, start=1000 * i))
        assert n == 64 and out is not None and torch.equal(out, _kv(64, seed=i))
    pool.logs[0].rotate()  # damage a sealed segment (in the live one it reads as a torn tail)
    key = pool.block_keys(_tokens(64, start=7000))[1]
    location = pool.logs[0].locate(key)
    assert location is not None
    segment = next(p for p in (tmp_path / "kvpool" / "llama-test" / "segments").iterdir()
                   if p.name.startswith(f"seg-{location.segment_id:08d}")
                   and p.suffix != ".hint")
    flip_byte(segment, location.value_offset + 3)
    assert pool.verify() == {"checked": 8, "damaged": 1, "dropped_earlier": []}
    pool.close()
    other = KVPool(str(tmp_path), namespace="other/model", chunk_tokens=CT)
    other.put(_tokens(32), _kv(32))
    other.close()
    listed = {n["namespace"]: n for n in list_namespaces(str(tmp_path))}
    assert set(listed) == {"llama-test", "other/model"}
    assert listed["llama-test"]["blocks"] == 7 and listed["other/model"]["blocks"] == 2
    assert drop_namespace(str(tmp_path), "other/model") == 2
    assert [n["namespace"] for n in list_namespaces(str(tmp_path))] == ["llama-test"]
    with pytest.raises(KeyError, match="isolane kv ls"):
        drop_namespace(str(tmp_path), "nope")


@pytest.mark.timeout(60)
def test_reads_larger_than_the_lane_budget_complete(tmp_path: Path) -> None:
    from isolane.config import config_from_dict

    config = config_from_dict({"device_groups": {"kv": {
        "role": "read", "devices": [str(tmp_path)], "inflight_bytes": "1MiB", "threads": 2}}})
    pool = KVPool(config, namespace="budget", chunk_tokens=256, memory_budget=0,
                  segment_bytes=1 << 20)
    kvs = [torch.full((1, 2, 256, 8, 128), float(i)) for i in range(4)]  # 2 MiB a block
    for i, kv in enumerate(kvs):
        pool.put(_tokens(256, start=1000 * i), kv)  # each block in a segment of its own
    keys = [pool.block_keys(_tokens(256, start=1000 * i))[0] for i in range(4)]
    blocks = pool.get_blocks(keys)  # four ranges, each larger than the whole budget
    assert all(b is not None and len(b) == 2 << 20 for b in blocks)
    pool.close()


@pytest.mark.parametrize("heads,head_dim", [(4, 8), (16, 64)])  # bounce copy / scatter
def test_disk_reads_land_in_the_callers_tensor(tmp_path: Path, heads: int,
                                               head_dim: int) -> None:
    pool = _pool(tmp_path, memory_budget=0)  # every block comes from its segment file
    gen = torch.Generator().manual_seed(3)
    kv = torch.randn(3, 2, 128, heads, head_dim, generator=gen).to(torch.bfloat16)
    tokens = _tokens(128)
    pool.put(tokens, kv)
    room = torch.zeros(3, 2, 200, heads, head_dim, dtype=torch.bfloat16)
    out = room[:, :, 8:168]  # a strided view into a larger buffer
    assert pool.get_into(tokens, out) == 128
    assert torch.equal(out[:, :, :128], kv)
    assert torch.count_nonzero(room[:, :, :8]) == 0  # nothing written outside
    assert torch.count_nonzero(room[:, :, 136:]) == 0
    n, got = pool.get(tokens)
    assert n == 128 and got is not None and got.is_contiguous() and torch.equal(got, kv)


def test_damaged_block_read_into_a_tensor_ends_the_prefix(tmp_path: Path) -> None:
    pool = _pool(tmp_path, memory_budget=0)
    gen = torch.Generator().manual_seed(4)
    kv = torch.randn(2, 2, 96, 16, 64, generator=gen).to(torch.bfloat16)
    tokens = _tokens(96)
    pool.put(tokens, kv)
    location = pool.logs[0].locate(pool.block_keys(tokens)[3])
    assert location is not None
    segment = next(p for p in (tmp_path / "kvpool" / "llama-test" / "segments").iterdir()
                   if p.name.startswith(f"seg-{location.segment_id:08d}") and p.suffix != ".hint")
    flip_byte(segment, location.value_offset + location.value_length - 1)
    out = torch.zeros_like(kv)
    assert pool.get_into(tokens, out) == 48
    assert torch.equal(out[:, :, :48], kv[:, :, :48])
    assert pool.lookup(tokens) == 48  # dropped, never returned


def test_get_into_refuses_a_tensor_of_another_layout(tmp_path: Path) -> None:
    pool = _pool(tmp_path)
    pool.put(_tokens(32), _kv(32))
    with pytest.raises(InvalidArgumentError, match="allocate out with that dtype and shape"):
        pool.get_into(_tokens(32), torch.zeros(2, 2, 32, 4, 8))  # float32, not bfloat16
    with pytest.raises(InvalidArgumentError, match="allocate out"):
        pool.get_into(_tokens(32), torch.zeros(2, 2, 32, 4, 9, dtype=torch.bfloat16))
    with pytest.raises(InvalidArgumentError, match="room for the whole prompt"):
        pool.get_into(_tokens(32), torch.zeros(2, 2, 16, 4, 8, dtype=torch.bfloat16))


def test_each_chain_segment_stays_on_one_device_and_a_chain_spreads_over_devices(
        tmp_path: Path) -> None:
    """The embedded pool places a chain segment by segment (``cluster.segment_blocks``
    blocks each): all of a segment's blocks on one device, the same device when the
    chain's prefix was stored first, and a chain of several segments over several
    devices (not the whole chain on one)."""
    from isolane.config import config_from_dict

    config = config_from_dict({"device_groups": {"kv": {
        "role": "read", "devices": [str(tmp_path / "d0"), str(tmp_path / "d1")]}}})
    s = config.cluster.segment_blocks
    n_segments = 4
    pool = KVPool(config, namespace="llama-test", chunk_tokens=CT, memory_budget=0)
    spread_chains = 0
    used = set()
    for p in range(12):
        tokens = _tokens(n_segments * s * CT, start=10_000 * p)
        head = (s + s // 2) * CT  # the first segment and half of the second ...
        pool.put(tokens[:head], _kv(head, seed=p))
        pool.put(tokens, _kv(len(tokens), seed=p))  # ... then the whole chain
        keys = pool.block_keys(tokens)
        assert len(keys) == n_segments * s
        per_segment = []
        for i in range(n_segments):
            devices = {d for d, lg in enumerate(pool.logs) for k in keys[i * s:(i + 1) * s]
                       if k in lg}
            assert len(devices) == 1, (p, i, devices)
            per_segment.append(devices.pop())
        spread_chains += len(set(per_segment)) > 1
        used |= set(per_segment)
    assert used == {0, 1}
    assert spread_chains >= 6  # 4 segments on 2 devices: all on one for 1 chain in 8


@pytest.mark.parametrize("namespace", ["..", ".", "a/..", "../../etc", "ns\n", "-x", "a//b",
                                       "a/", "", "x" * 201])
def test_crafted_namespaces_are_refused_everywhere_they_enter(tmp_path: Path,
                                                              namespace: str) -> None:
    from isolane.kvpool.catalog import drop_namespace, open_namespace

    canary = tmp_path / "canary"
    canary.write_text("keep me")
    with _pool(tmp_path) as pool:
        pool.put(_tokens(32), _kv(32))
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    with pytest.raises(InvalidNameError, match="invalid KV namespace"):
        KVPool(str(tmp_path), namespace=namespace, chunk_tokens=CT)
    with pytest.raises(InvalidNameError, match="invalid KV namespace"):
        open_namespace(str(tmp_path), namespace)
    with pytest.raises(InvalidNameError, match="invalid KV namespace"):
        drop_namespace(str(tmp_path), namespace)
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before
    with _pool(tmp_path) as pool:
        assert pool.lookup(_tokens(32)) == 32


def test_drop_namespace_never_leaves_the_pool_folder(tmp_path: Path) -> None:
    from isolane.kvpool.catalog import drop_namespace

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("keep me")
    with _pool(tmp_path / "dev") as pool:
        pool.put(_tokens(32), _kv(32))
    # a namespace folder replaced by a link to a folder outside the store
    folder = tmp_path / "dev" / "kvpool" / "llama-test"
    (outside / "namespace.json").write_bytes((folder / "namespace.json").read_bytes())
    (outside / "segments").mkdir()
    for item in folder.iterdir():
        if item.is_file():
            item.unlink()
    for item in (folder / "segments").iterdir():
        item.unlink()
    (folder / "segments").rmdir()
    folder.rmdir()
    folder.symlink_to(outside)
    with pytest.raises(StorageError, match="symbolic link"):
        drop_namespace(str(tmp_path / "dev"), "llama-test")
    with pytest.raises(StorageError, match="symbolic link"):
        _pool(tmp_path / "dev")
    assert (outside / "precious").read_text() == "keep me"
    assert sorted(p.name for p in outside.iterdir()) == ["namespace.json", "precious",
                                                         "segments"]
    assert not list((outside / "segments").iterdir())


@pytest.mark.parametrize("text", ["{not json", "null", "[]", '{"dtype": "float32"}',
                                  '{"dtype": "nope", "shape": [1], "chunk_tokens": 16, '
                                  '"token_dim": 2}', "\xff\xfe"])
def test_a_garbage_namespace_file_is_an_integrity_error_naming_it(tmp_path: Path,
                                                                   text: str) -> None:
    from isolane.errors import IntegrityError
    from isolane.kvpool.catalog import open_namespace

    with _pool(tmp_path) as pool:
        pool.put(_tokens(32), _kv(32))
    meta = tmp_path / "kvpool" / "llama-test" / "namespace.json"
    meta.write_bytes(text.encode("latin-1"))
    for opener in (lambda: _pool(tmp_path), lambda: open_namespace(str(tmp_path), "llama-test")):
        with pytest.raises(IntegrityError, match=r"namespace\.json") as info:
            opener()
        assert "isolane kv evict --namespace llama-test" in str(info.value)


def test_metadata_files_are_written_durably(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """namespace.json (and hints) reach the disk before they are relied on: the file
    and its folder are fsynced (a spy records what the real fsync was called on)."""
    import os

    synced: list[str] = []
    real_fsync = os.fsync

    def spy(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    with _pool(tmp_path, segment_bytes=64 << 10) as pool:
        pool.put(_tokens(32), _kv(32))
        pool.logs[0].rotate()
    folder = tmp_path / "kvpool" / "llama-test"
    meta = [p for p in synced if Path(p).name.startswith(".namespace.json.tmp")]
    assert meta, synced  # the file's bytes, under its temp name before the rename
    assert str(folder) in synced  # the rename
    assert any(".seg-00000001.hint.tmp" in p for p in synced)
    assert str(folder / "segments") in synced
    assert not [p for p in folder.rglob("*tmp*")]


def test_an_open_refused_for_its_chunk_tokens_leaves_the_namespace_free(tmp_path: Path
                                                                        ) -> None:
    pool = _pool(tmp_path)
    pool.put(_tokens(32), _kv(32))
    pool.close()
    with pytest.raises(ConfigError, match="chunk_tokens=16"):
        KVPool(str(tmp_path), namespace="llama-test", chunk_tokens=2 * CT)
    again = _pool(tmp_path)  # the refused open let go of the namespace's segment logs
    assert again.lookup(_tokens(32)) == 32
