"""Restores from the S3 mirror (part of ``bench_cluster.py --snapshots``), with the bound
of this machine measured in the same run.

A snapshot mirrored to a SeaweedFS server on loopback (``tests/support/seaweedfs.py``),
its local copy removed, restored by ``SnapshotStore.load`` (chunks in parallel, each by
concurrent ranged GETs straight into the tensor, hashed as each chunk completes)
against, round by round on the very same chunk objects:

- **s3fs, one stream**: s3fs ``cat_file`` of each object, one after the other (the
  target's reference);
- **raw ranged GETs**: the same 8 MiB ranges by ``RANGE_THREADS`` threads, each a
  presigned GET ``readinto`` one reused buffer (what isolane's reads do, minus hashing
  and tensors): the cheapest client.

The CPU seconds of this process and of the ``weed`` server are measured for every run:
the server shares the machine's cores with the client, so ``cores / weed CPU-s per GB``
bounds any client's rate, even one that costs nothing.
"""

from __future__ import annotations

import http.client
import os
import shutil
import statistics
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import _common as C
import _statedicts as S

PART = 8 << 20  # bytes per ranged GET of the raw peer (FsspecBlobStore.read_part_bytes)
PEERS = ("isolane", "s3fs, one stream", "raw ranged GETs")


def run_mirror(args: Any, log: Any) -> dict[str, Any]:
    """``{"nbytes", "chunks", "seconds": {peer: [...]}, "cpu": {peer: [[client, weed]]}}``."""
    import numpy as np
    import s3fs

    from isolane.config import config_from_dict
    from isolane.snapshot import SnapshotStore
    from isolane.storage.s3_ranged import RANGE_THREADS
    from tests.support.seaweedfs import SeaweedServer

    state = S.build_state_dict(S.plan_mixed(1.0, total_bytes=int(args.mirror_gb * 1e9)))
    folder = args.dir / "mirror"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    out: dict[str, Any] = {"seconds": {p: [] for p in PEERS}, "cpu": {p: [] for p in PEERS}}
    with SeaweedServer(folder / "weed") as server:
        bucket = server.create_bucket("bench")
        options = server.storage_options
        config = config_from_dict({"device_groups": {
            "ckpt": {"role": "write", "devices": [str(folder / "local")]},
            "cold": {"role": "capacity", "devices": [f"s3://{bucket}/snapshots"],
                     "storage_options": options}}})
        store = SnapshotStore(config)
        store.save(state, "m", mirror=True)
        errors = store.wait_for_mirrors()
        if errors != {"m": None}:
            raise RuntimeError(f"mirror failed: {errors}")
        manifest = store.manifest("m")
        store.close()
        shutil.rmtree(folder / "local")
        sizes = [c.stored for c in manifest.chunks]
        out["nbytes"], out["chunks"] = sum(sizes), len(sizes)
        keys = [f"{bucket}/snapshots/snapshots/m/{manifest.generation}/{c.key}"
                for c in manifest.chunks]
        ranges = [(k, s, min(PART, size - s)) for k, size in zip(keys, sizes, strict=True)
                  for s in range(0, size, PART)]
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
        view = memoryview(np.zeros(max(sizes), dtype=np.uint8))  # the raw loop's memory
        local = threading.local()
        endpoint = urllib.parse.urlsplit(options["client_kwargs"]["endpoint_url"])

        def get_into(item: tuple[str, int, int]) -> int:
            target, start, n = item
            if getattr(local, "conn", None) is None:
                local.conn = http.client.HTTPConnection(endpoint.hostname or "",
                                                        endpoint.port)
            local.conn.request("GET", target,
                               headers={"Range": f"bytes={start}-{start + n - 1}"})
            response = local.conn.getresponse()
            got = 0
            while got < n:
                m = response.readinto(view[start + got:start + n])
                if not m:
                    raise EOFError(f"{target}: {got} of {n} bytes")
                got += m
            return got

        def signed(key: str) -> str:
            u = urllib.parse.urlsplit(fs.sign(key, expiration=3600))
            return f"{u.path}?{u.query}"

        with ThreadPoolExecutor(RANGE_THREADS) as pool:
            for rnd in range(args.repeats):
                for who in PEERS if rnd % 2 == 0 else PEERS[::-1]:
                    cpu0 = (C.own_cpu_s(), C.process_cpu_s([server.pid]))
                    t0 = time.perf_counter()
                    if who == "isolane":
                        fresh = SnapshotStore(config)
                        back = fresh.load("m")
                        S.touch_pages(back)
                        got = out["nbytes"]
                    elif who == "s3fs, one stream":
                        got = sum(len(fs.cat_file(k)) for k in keys)
                    else:
                        urls = {k: signed(k) for k in keys}  # once per object, as isolane
                        got = sum(pool.map(get_into, [(urls[k], s, n) for k, s, n in ranges]))
                    seconds = time.perf_counter() - t0
                    used = [C.own_cpu_s() - cpu0[0], C.process_cpu_s([server.pid]) - cpu0[1]]
                    if who == "isolane":
                        S.check_equal(state, back)
                        del back
                        fresh.close()
                    if got != out["nbytes"]:
                        raise AssertionError(f"{who} read {got} of {out['nbytes']} bytes")
                    out["seconds"][who].append(seconds)
                    out["cpu"][who].append(used)
                    log(f"mirror round {rnd + 1}: {who} {seconds:.3f} s, CPU client "
                        f"{used[0]:.2f} s, weed {used[1]:.2f} s")
    shutil.rmtree(folder, ignore_errors=True)
    return out


def summary(res: dict[str, Any]) -> dict[str, Any]:
    """Medians, the single stream's ratios and the bound of this machine."""
    gb = res["nbytes"] / 1e9
    median = {p: statistics.median(v) for p, v in res["seconds"].items() if v}
    cpu = {p: [statistics.median(c[i] for c in v) / gb for i in (0, 1)]
           for p, v in res["cpu"].items() if v}
    single = median["s3fs, one stream"]
    weed = min(c[1] for c in cpu.values())
    cores = os.cpu_count() or 1
    return {"gb": gb, "median": median, "cpu": cpu, "weed": weed, "cores": cores,
            "speedup": {p: single / s for p, s in median.items()},
            "bound": cores / weed / (gb / single)}


def report_lines(res: dict[str, Any]) -> tuple[list[list[str]], list[str]]:
    """(table rows, bullet lines) of the mirror part."""
    s = summary(res)
    rows = [[f"S3 mirror: {p}", C.fmt_seconds(s["median"][p]),
             C.fmt_rate(res["nbytes"], s["median"][p]), f"{s['speedup'][p]:.2f}x",
             f"{s['cpu'][p][0]:.2f} + {s['cpu'][p][1]:.2f}",
             ", ".join(f"{v:.3f}" for v in res["seconds"][p])] for p in s["median"]]
    iso = s["speedup"]["isolane"]
    return rows, [
        f"restore from the S3 mirror: {iso:.2f}x a single-stream s3fs get of the same "
        f"bytes (target 3x: {'met' if iso >= 3 else 'NOT met'}); the raw ranged GETs "
        f"{s['speedup']['raw ranged GETs']:.2f}x, same rounds;",
        f"the bound on this machine ({s['cores']} cores shared by client and server): the "
        f"weed server itself takes {s['weed']:.2f} CPU-s per GB served, so no client can "
        f"pass {s['bound']:.2f}x the single stream even at zero CPU of its own."]
