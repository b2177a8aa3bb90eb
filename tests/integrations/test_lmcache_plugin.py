"""The isolane LMCache plugin inside the real lmcache package (installed by scripts/setup;
a missing lmcache fails these tests, it never skips them).

What is real: LMCache's config loader reads the YAML documented in docs/INTEGRATIONS.md,
its ``StorageManager`` creates the backends (``CreateStorageBackends`` and its
``storage_plugin_launcher``, with the ``LocalCPUBackend`` and its allocator), the chunks
are LMCache ``MemoryObj``s allocated by it, keys are its ``CacheEngineKey``s, and reads
go the way ``LMCacheEngine.retrieve`` goes (``get_block_mapping``, then ``batched_get``
at the backend's location) or the async loader's way (``batched_async_contains``,
``batched_get_non_blocking`` on the manager's event loop). Only the GPU is missing: the
engine's connector copies paged GPU memory into these same memory objects. The pool is
an embedded folder, a real storage node (``isolane serve``, two engines on it at once),
or the default under ``$ISOLANE_HOME``.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.event_manager import EventManager
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.storage_manager import StorageManager

from isolane.errors import ConfigError, InvalidArgumentError, StorageError
from isolane.integrations.lmcache import IsolaneLMCacheBackend
from tests.support.node import NodeProcess, write_node_config

CHUNK = 16
LAYERS, HEADS, HEAD_DIM = 2, 2, 8
PLUGIN = "isolane"

DOCUMENTED_YAML = """\
chunk_size: {chunk}
local_cpu: false
max_local_cpu_size: 0.05
storage_plugins: ["isolane"]
extra_config:
  storage_plugin.isolane.module_path: isolane.integrations.lmcache
  storage_plugin.isolane.class_name: IsolaneLMCacheBackend
  isolane.pool: {pool}
"""


def write_config(tmp_path: Path, pool: Path | str, *, chunk: int = CHUNK,
                 extra: dict[str, Any] | None = None) -> LMCacheEngineConfig:
    """LMCache's own loader reading the YAML of docs/INTEGRATIONS.md."""
    text = DOCUMENTED_YAML.format(chunk=chunk, pool=pool)
    for key, value in (extra or {}).items():
        text += f"  {key}: {value}\n"
    path = tmp_path / f"lmcache-{len(list(tmp_path.glob('lmcache-*.yaml')))}.yaml"
    path.write_text(text)
    return LMCacheEngineConfig.from_file(str(path))


def metadata(model: str = "tiny-llama", *, dtype: torch.dtype = torch.bfloat16,
             heads: int = HEADS, chunk: int = CHUNK, mla: bool = False) -> LMCacheMetadata:
    """An engine's metadata; ``mla``: one latent of 2 * HEAD_DIM a token (DeepSeek's
    MLA: LMCache's kv_shape then has 1 for K/V and 1 head)."""
    shape = (LAYERS, 1, chunk, 1, 2 * HEAD_DIM) if mla else (LAYERS, 2, chunk, heads,
                                                               HEAD_DIM)
    return LMCacheMetadata(model_name=model, world_size=1, local_world_size=1, worker_id=0,
                           local_worker_id=0, kv_dtype=dtype, kv_shape=shape,
                           use_mla=mla, chunk_size=chunk)


def chunk_keys(md: LMCacheMetadata, n: int, seed: int = 0) -> list[CacheEngineKey]:
    """Keys of a prompt's first ``n`` chunks, chained as LMCache's token database chains
    its chunk hashes (each names the whole prefix)."""
    keys, prefix = [], seed
    for i in range(n):
        prefix = hash((prefix, i, seed))
        keys.append(CacheEngineKey(md.model_name, md.world_size, md.worker_id, prefix,
                                   md.kv_dtype))
    return keys


class Engine:
    """An LMCache storage manager the way LMCacheEngine drives it (store and retrieve of
    whole chunks), on the CPU."""

    def __init__(self, config: LMCacheEngineConfig, md: LMCacheMetadata) -> None:
        self.md = md
        self.manager = StorageManager(config, md, EventManager())

    @property
    def backend(self) -> IsolaneLMCacheBackend:
        backend = self.manager.storage_backends[PLUGIN]
        assert isinstance(backend, IsolaneLMCacheBackend)
        return backend

    def store(self, keys: list[CacheEngineKey], seed: int = 0,
              tokens: int | None = None) -> list[torch.Tensor]:
        """Store random chunks under ``keys`` and wait until the backend has them;
        returns the chunks' values."""
        gen = torch.Generator().manual_seed(seed)
        objs: list[MemoryObj] = []
        for _ in keys:
            obj = self.manager.allocate(
                self.md.get_shapes(tokens or CHUNK), self.md.get_dtypes(),
                fmt=MemoryFormat.KV_MLA_FMT if self.md.use_mla else MemoryFormat.KV_2LTD)
            assert obj is not None and obj.tensor is not None
            obj.tensor.copy_(torch.randn(obj.tensor.shape, generator=gen))
            objs.append(obj)
        values = [o.tensor.clone() for o in objs if o.tensor is not None]
        self.manager.batched_put(keys, objs)
        deadline = time.monotonic() + 30
        while any(self.backend.exists_in_put_tasks(k) for k in keys):
            assert time.monotonic() < deadline, "puts did not finish"
            time.sleep(0.01)
        return values

    def retrieve(self, keys: list[CacheEngineKey]) -> list[torch.Tensor]:
        """LMCacheEngine.retrieve's storage steps: the backends' prefix (block mapping),
        then one batched get at each location; the chunks served, copied out."""
        mapping = self.manager.get_block_mapping([(k, i * CHUNK, (i + 1) * CHUNK)
                                                  for i, k in enumerate(keys)])
        assert set(mapping) <= {PLUGIN}, mapping
        found = [k for k, _, _ in mapping.get(PLUGIN, [])]
        out: list[torch.Tensor] = []
        for obj in self.manager.batched_get(found, location=PLUGIN) if found else []:
            if obj is None:
                break
            assert obj.tensor is not None
            out.append(obj.tensor.clone())
            obj.ref_count_down()
        return out

    def retrieve_async(self, keys: list[CacheEngineKey]) -> list[torch.Tensor]:
        """The async loader's calls, on the manager's event loop."""
        async def load() -> list[Any]:
            n = await self.backend.batched_async_contains("req", keys, pin=True)
            return await self.backend.batched_get_non_blocking("req", keys[:n])

        objs = asyncio.run_coroutine_threadsafe(load(), self.manager.loop).result(30)
        out = [o.tensor.clone() for o in objs]
        for o in objs:
            o.ref_count_down()
        return out

    def close(self) -> None:
        self.manager.close()


@pytest.fixture
def pool(tmp_path: Path) -> Path:
    folder = tmp_path / "pool"
    folder.mkdir()
    return folder


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for engine in made:
        engine.close()


def open_engine(engines: list[Engine], config: LMCacheEngineConfig,
                md: LMCacheMetadata) -> Engine:
    engine = Engine(config, md)
    engines.append(engine)
    return engine


def equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    return len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want,
                                                                         strict=True))


class LMCacheLog(logging.Handler):
    """What LMCache's storage backend package logs (its loggers do not propagate)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def lmcache_errors() -> Iterator[LMCacheLog]:
    handler = LMCacheLog()
    logger = logging.getLogger("lmcache.v1.storage_backend")
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


# -- the documented YAML, round trips, restarts -----------------------------------------------
def test_documented_yaml_turns_it_on_and_chunks_round_trip(tmp_path: Path, pool: Path,
                                                           engines: list[Engine]) -> None:
    md = metadata()
    engine = open_engine(engines, write_config(tmp_path, pool), md)
    assert list(engine.manager.storage_backends) == ["LocalCPUBackend", PLUGIN]
    keys = chunk_keys(md, 5)
    values = engine.store(keys[:4])
    assert engine.backend.stats()["stored"] == 4
    assert equal(engine.retrieve(keys[:4]), values)
    assert equal(engine.retrieve(keys), values)  # a longer prompt: its stored prefix
    assert equal(engine.retrieve_async(keys), values)
    assert engine.retrieve(keys[4:]) == []
    engine.store(keys[:2])  # stored already: nothing new
    stats = engine.backend.stats()
    assert (stats["stored"], stats["hits"], stats["unreadable"]) == (4, 12, 0)
    assert stats["namespace"] == "lmcache:tiny-llama-bfloat16-tp1"
    assert engine.manager.remove(keys[1]) == 1
    assert equal(engine.retrieve(keys), values[:1])


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_chunks_survive_a_restart_bit_exact(tmp_path: Path, pool: Path,
                                            engines: list[Engine], mla: bool) -> None:
    md = metadata(mla=mla)
    config = write_config(tmp_path, pool)
    first = open_engine(engines, config, md)
    keys = chunk_keys(md, 6)
    values = first.store(keys)
    first.close()
    engines.remove(first)
    second = open_engine(engines, write_config(tmp_path, pool), md)  # a new engine
    assert second.backend.layout.fmt == (MemoryFormat.KV_MLA_FMT if mla
                                         else MemoryFormat.KV_2LTD)
    assert second.manager.batched_contains(keys)[0] == 6
    assert equal(second.retrieve(keys), values)
    assert second.backend.stats()["hits"] == 6


def test_chunk_keys_match_the_documented_vector(tmp_path: Path, pool: Path,
                                                engines: list[Engine]) -> None:
    engine = open_engine(engines, write_config(tmp_path, pool), metadata())
    assert engine.backend.layout.text() == "lmcache:KV_2LTD[2,2,T,16]"
    key = CacheEngineKey("tiny-llama", 1, 0, 0x1234ABCD, torch.bfloat16)
    assert engine.backend.pool_key(key).hex() == "8e25bc78128d2c71fa62e0c70c6d1858"


def test_partial_chunks_are_skipped_never_stored(tmp_path: Path, pool: Path,
                                                 engines: list[Engine]) -> None:
    md = metadata()
    engine = open_engine(engines, write_config(tmp_path, pool), md)
    keys = chunk_keys(md, 1)
    engine.store(keys, tokens=CHUNK // 2)  # save_unfull_chunk's last chunk
    assert engine.backend.stats()["skipped"] == 1
    assert engine.retrieve(keys) == []


# -- faults -------------------------------------------------------------------------------------
def flip_a_bit_of(pool: Path, chunk: torch.Tensor) -> None:
    """Flip one bit of ``chunk``'s bytes where the pool's segment files hold them."""
    needle = chunk.contiguous().view(torch.uint8).numpy().tobytes()
    segments = [p for p in pool.rglob("seg-*") if needle in p.read_bytes()]
    assert len(segments) == 1
    data = bytearray(segments[0].read_bytes())
    data[data.index(needle) + 100] ^= 0x01
    segments[0].write_bytes(bytes(data))


def damaged_in_pool(engine: Engine) -> int:
    return sum(d["damaged"] for d in engine.backend.stats()["pool"]["disk"])


def test_a_chunk_damaged_on_disk_reads_as_a_miss(tmp_path: Path, pool: Path,
                                                 engines: list[Engine]) -> None:
    md = metadata()
    engine = open_engine(engines, write_config(tmp_path, pool), md)
    keys = chunk_keys(md, 3)
    values = engine.store(keys)
    flip_a_bit_of(pool, values[1])  # while the engine runs
    assert equal(engine.retrieve(keys), values[:1])  # never the damaged bytes
    stats = engine.backend.stats()
    # the damaged chunk is a miss (counted unreadable too), and so is the one after it
    assert (stats["hits"], stats["misses"], stats["unreadable"], damaged_in_pool(engine)) \
        == (1, 2, 1, 1)
    assert engine.manager.batched_contains(keys)[0] == 1  # dropped: a miss from now on
    more = chunk_keys(md, 3, seed=1)
    again = engine.store(more, seed=1)
    engine.close()
    engines.remove(engine)
    flip_a_bit_of(pool, again[0])  # while the engine is down
    restarted = open_engine(engines, write_config(tmp_path, pool), md)
    assert restarted.retrieve(more) == []  # the reopen found it damaged
    assert damaged_in_pool(restarted) == 2  # and reports it
    assert equal(restarted.retrieve(keys), values[:1])


def test_a_key_of_another_model_or_layout_misses(tmp_path: Path, pool: Path,
                                                 engines: list[Engine]) -> None:
    md = metadata("model-a")
    shared = {"isolane.namespace": "shared"}
    first = open_engine(engines, write_config(tmp_path, pool, extra=shared), md)
    first.store(chunk_keys(md, 2))
    first.close()
    engines.remove(first)
    other = metadata("model-b")  # the same chunk hashes under another model's name
    second = open_engine(engines, write_config(tmp_path, pool, extra=shared), other)
    assert second.retrieve(chunk_keys(other, 2)) == []
    second.close()
    engines.remove(second)
    wider = metadata("model-a", heads=4)  # the same model at another layout
    third = open_engine(engines, write_config(tmp_path, pool), wider)
    assert third.backend.options.namespace != "shared"
    assert third.retrieve(chunk_keys(wider, 2)) == []


def test_missing_or_read_only_pool_folder_is_a_clear_error(
        tmp_path: Path, engines: list[Engine], lmcache_errors: LMCacheLog) -> None:
    md = metadata()
    missing = tmp_path / "not-mounted"
    engine = open_engine(engines, write_config(tmp_path, missing), md)
    assert PLUGIN not in engine.manager.storage_backends  # LMCache runs on without it
    assert any("does not exist; create it" in m for m in lmcache_errors.messages)
    assert not missing.exists()
    with pytest.raises(ConfigError, match="does not exist"):
        IsolaneLMCacheBackend(config=write_config(tmp_path, missing), metadata=md,
                              local_cpu_backend=engine.manager.local_cpu_backend,
                              loop=engine.manager.loop)
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    subprocess.run(["chattr", "+i", str(read_only)], check=True)  # even root cannot write
    try:
        with pytest.raises(StorageError, match=f"pool {read_only}"):
            IsolaneLMCacheBackend(config=write_config(tmp_path, read_only), metadata=md,
                                  local_cpu_backend=engine.manager.local_cpu_backend,
                                  loop=engine.manager.loop)
    finally:
        subprocess.run(["chattr", "-i", str(read_only)], check=True)


def test_chunk_size_or_dtype_other_than_the_namespaces_is_a_clear_error(
        tmp_path: Path, pool: Path, engines: list[Engine], lmcache_errors: LMCacheLog
) -> None:
    shared = {"isolane.namespace": "shared"}
    md = metadata()
    first = open_engine(engines, write_config(tmp_path, pool, extra=shared), md)
    values = first.store(chunk_keys(md, 1))
    first.close()
    engines.remove(first)
    halves = metadata(dtype=torch.float16)
    second = open_engine(engines, write_config(tmp_path, pool, extra=shared), halves)
    assert PLUGIN not in second.manager.storage_backends  # LMCache runs on without it
    assert any("stores dtype bfloat16" in m and "float16" in m
               for m in lmcache_errors.messages)
    cpu, loop = second.manager.local_cpu_backend, second.manager.loop
    with pytest.raises(InvalidArgumentError, match="another namespace"):
        IsolaneLMCacheBackend(config=write_config(tmp_path, pool, extra=shared),
                              metadata=halves, local_cpu_backend=cpu, loop=loop)
    with pytest.raises(ConfigError, match="chunk_tokens=16"):
        IsolaneLMCacheBackend(config=write_config(tmp_path, pool, chunk=32, extra=shared),
                              metadata=metadata(chunk=32), local_cpu_backend=cpu, loop=loop)
    third = open_engine(engines, write_config(tmp_path, pool, extra=shared), md)
    assert equal(third.retrieve(chunk_keys(md, 1)), values)  # the namespace kept its chunks


def test_layerwise_mode_is_refused_at_creation(tmp_path: Path, pool: Path,
                                               engines: list[Engine]) -> None:
    engine = open_engine(engines, write_config(tmp_path, pool), metadata())
    config = write_config(tmp_path, pool, extra={})
    config.use_layerwise = True
    with pytest.raises(ConfigError, match="use_layerwise"):
        IsolaneLMCacheBackend(config=config, metadata=metadata(),
                              local_cpu_backend=engine.manager.local_cpu_backend,
                              loop=engine.manager.loop)


# -- where the pool is --------------------------------------------------------------------------
def test_two_engines_share_a_storage_node(tmp_path: Path, engines: list[Engine],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # What tensor parallelism needs: several engine processes on one pool at once (an
    # embedded folder is open in one process at a time).
    md = metadata()
    monkeypatch.setenv("ISOLANE_TOKEN", "lmcache")
    with NodeProcess(write_node_config(tmp_path / "node"), token="lmcache") as node:
        first = open_engine(engines, write_config(tmp_path, node.url), md)
        second = open_engine(engines, write_config(tmp_path, node.url), md)
        keys = chunk_keys(md, 4)
        values = first.store(keys)
        assert equal(second.retrieve(keys), values)
        assert second.backend.stats()["hits"] == 4
        for engine in (first, second):
            engine.close()
            engines.remove(engine)


def test_no_pool_named_is_the_embedded_default_under_isolane_home(
        tmp_path: Path, engines: list[Engine], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ISOLANE_HOME", str(tmp_path / "home"))
    path = tmp_path / "no-pool.yaml"
    path.write_text("\n".join(line for line in DOCUMENTED_YAML.format(chunk=CHUNK, pool="")
                              .splitlines() if "isolane.pool" not in line) + "\n")
    config = LMCacheEngineConfig.from_file(str(path))
    md = metadata()
    engine = open_engine(engines, config, md)
    values = engine.store(chunk_keys(md, 2))
    assert equal(engine.retrieve(chunk_keys(md, 2)), values)
    assert any((tmp_path / "home").rglob("seg-*"))
