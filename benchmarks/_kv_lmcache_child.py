"""LMCache 0.5.6 LocalDiskBackend driven over a line protocol (run with LMCache's venv).

    .bench/lmcache-venv/bin/python benchmarks/_kv_lmcache_child.py

LMCache pins numpy <= 2.2.6, so it lives in a virtual environment of its own and this
script runs there; it imports only LMCache, torch, numpy and ``_kv_data``. Each request
is one JSON object on a line of stdin; each answer one JSON object on a line of stdout
that starts with ``PREFIX`` (LMCache may log to stdout too). Requests:

- ``init``: geometry name, disk folder, base file, CPU staging pool bytes, I/O threads;
- ``build`` ids: store those blocks (``submit_put_task`` per block, as LMCache's storage
  manager does) and wait until every write completed; answers seconds;
- ``restore`` ids: ``batched_get_blocking(keys)`` (LMCache's concurrent read path), then
  copy every memory object into one preallocated, pre-touched destination tensor and
  release it (``ref_count_down``), as a caller that wants the bytes in its own tensor
  would; answers seconds (timed from the call to the last byte in the tensor) and the
  result of comparing the tensor with the stored blocks (outside the timing);
- ``reopen``: a new LocalDiskBackend over the same folder; answers how many of the stored
  keys it finds (LMCache keeps its disk index in memory only);
- ``close``.

The parent drops the page cache before a cold ``restore``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

import _kv_data as D
import numpy as np
import torch

PREFIX = "KVCHILD "


class Driver:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.backend: Any = None
        self.cpu: Any = None
        self.dest: np.ndarray | None = None

    def init(self, req: dict[str, Any]) -> dict[str, Any]:
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.memory_allocators.mixed_memory_allocator import MixedMemoryAllocator
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

        self.geometry = D.GEOMETRIES[req["geometry"]]
        self.block_bytes = self.geometry.block_bytes
        self.base = D.load_base(Path(req["base"]))
        self.folder = req["folder"]
        self.dtype = torch.bfloat16
        self.key_cls = CacheEngineKey
        self.config = LMCacheEngineConfig.from_defaults(
            chunk_size=self.geometry.chunk_tokens, local_cpu=False,
            max_local_cpu_size=req["pool_bytes"] / 2**30, local_disk=self.folder,
            max_local_disk_size=req["disk_gib"], lmcache_instance_id="isolane-bench",
            extra_config={"disk_io_threads": req["threads"],
                          "use_odirect": bool(req.get("odirect", False))})
        # LocalCPUBackend's default allocator for this config (what LMCacheEngine builds)
        allocator = MixedMemoryAllocator(int(req["pool_bytes"]), config=self.config)
        self.cpu = LocalCPUBackend(self.config, memory_allocator=allocator)
        self.backend = self._new_backend()
        self.shape = torch.Size(self.geometry.lmcache_shape)
        self.dest_mmap, self.dest = D.aligned_buffer(int(req["dest_bytes"]))
        self.dest_tensor = torch.from_numpy(self.dest)
        import lmcache
        return {"lmcache": getattr(lmcache, "__version__", "?"), "torch": torch.__version__,
                "numpy": np.__version__}

    def _new_backend(self) -> Any:
        from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend
        return LocalDiskBackend(self.config, self.loop, self.cpu, dst_device="cpu")

    def key(self, block_id: int) -> Any:
        return self.key_cls("isolane-bench", 1, 0, block_id, self.dtype)

    def build(self, req: dict[str, Any]) -> dict[str, Any]:
        from lmcache.v1.memory_management import MemoryFormat

        ids = req["ids"]
        done = threading.Semaphore(0)
        start = time.perf_counter()
        for block_id in ids:
            obj = self.cpu.allocate(self.shape, self.dtype, MemoryFormat.KV_2LTD)
            if obj is None:
                raise RuntimeError("LMCache CPU staging pool exhausted during build")
            np.frombuffer(obj.byte_array, dtype=np.uint8)[:] = D.block_view(
                self.base, block_id, self.block_bytes)
            self.backend.submit_put_task(self.key(block_id), obj,
                                         on_complete_callback=lambda _k: done.release())
            obj.ref_count_down()
        for _ in ids:
            done.acquire()
        seconds = time.perf_counter() - start
        os.sync()
        return {"seconds": seconds, "seconds_synced": time.perf_counter() - start}

    def restore(self, req: dict[str, Any]) -> dict[str, Any]:
        ids = req["ids"]
        keys = [self.key(i) for i in ids]
        b = self.block_bytes
        dest = self.dest_tensor
        start = time.perf_counter()
        objs = self.backend.batched_get_blocking(keys)
        missing = sum(o is None for o in objs)
        for pos, obj in enumerate(objs):
            if obj is not None:
                dest[pos * b:(pos + 1) * b].copy_(obj.tensor.view(-1).view(torch.uint8))
                obj.ref_count_down()
        seconds = time.perf_counter() - start
        check = f"{missing} of {len(ids)} blocks missing" if missing else None
        if check is None and req.get("verify", True):
            assert self.dest is not None
            check = D.check_blocks(self.dest, self.base, ids, b, sample=req.get("sample"))
        return {"seconds": seconds, "check": check}

    def reopen(self, req: dict[str, Any]) -> dict[str, Any]:
        start = time.perf_counter()
        fresh = self._new_backend()
        seconds = time.perf_counter() - start
        found = sum(fresh.contains(self.key(i)) for i in req["ids"])
        files = len(os.listdir(self.folder))
        fresh.close()
        return {"seconds": seconds, "found": found, "files": files}

    def close(self, req: dict[str, Any]) -> dict[str, Any]:
        if self.backend is not None:
            self.backend.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        return {"closed": True}


def main() -> int:
    driver = Driver()
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        try:
            answer = getattr(driver, req["cmd"])(req)
        except Exception as exc:  # report to the parent, which records it in the table
            traceback.print_exc(file=sys.stderr)
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        print(PREFIX + json.dumps(answer), flush=True)
        if req["cmd"] == "close":
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
