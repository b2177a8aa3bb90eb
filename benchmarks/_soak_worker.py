"""One member of the chaos soak (started, killed and restarted by ``soak.py``), and what
every soak process derives from a run folder.

usage: [torchrun --nproc-per-node 2] _soak_worker.py <role> <run folder> <member> <seed>
       _soak_worker.py etcd-client <cluster folder> <name> <etcd url> <seed>

Data describes itself: a state dict is rebuilt from its seed, a KV block's bytes from its
key, so a check needs only the journal line that acknowledged it (``ack`` is written
only after the call returned). ``hb/<member>`` says which operation runs since when (a
hang, not a slow machine). SIGTERM: finish the operation, then exit 0 (a ``dist`` rank
keeps the default: torchrun ends the job's ranks with it).
"""

from __future__ import annotations

import faulthandler
import hashlib
import json
import os
import random
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

# Before the heavy imports: a SIGTERM during start-up must end the process cleanly too.
# A member that does not stop is asked for every thread's stack (SIGUSR1) before the kill.
STOP = threading.Event()
if __name__ == "__main__":
    if sys.argv[1:2] != ["dist"]:
        signal.signal(signal.SIGTERM, lambda *_: STOP.set())
    faulthandler.register(signal.SIGUSR1, all_threads=True)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from isolane import KVPool, RemoteKVPool, RemoteSnapshotStore, SnapshotStore  # noqa: E402
from isolane.errors import IntegrityError, IsolaneError, SnapshotNotFoundError  # noqa: E402
from isolane.snapshot.sharding import Shard  # noqa: E402

KV_NAMESPACE = "soak"
KV_CHUNK_TOKENS = 16
KV_SHAPE = (2, 2, KV_CHUNK_TOKENS, 2, 16)  # [layers, k/v, tokens, heads, head_dim], fp16
KV_TOKEN_DIM = 2
KV_BLOCK_BYTES = 2 * 2 * KV_CHUNK_TOKENS * 2 * 16 * 2  # 4 KiB
KV_ARGS = {"namespace": KV_NAMESPACE, "chunk_tokens": KV_CHUNK_TOKENS,
           "token_dim": KV_TOKEN_DIM}
INC_BASE_SEED = 7  # the frozen base of the incremental trainer: the same in every save
OP_PAUSE_S = {"race": 0.0, "dist": 0.5, "sync": 0.4, "async": 0.4, "incremental": 0.4,
              "overwrite": 0.6, "remote": 0.6, "gc": 0.7, "rm": 1.0, "verify": 0.3, "kv": 0.03,
              "kv-cluster": 0.05}
KEEP_PER_MEMBER = 8  # rm keeps each trainer's newest snapshots, deletes older ones
RACE_SLOT_S = 2.0
# A stalled node costs a remote request at most (1 + retries) x the read timeout; a save
# makes three holder checks, then a plan and an upload on each of three nodes:
# 3 x 20 s + 3 x (20 + 10) s = 150 s, below soak.py's STOP_TIMEOUT_S.
REMOTE_READ_TIMEOUT_S = 10.0
REMOTE_RETRIES = 1
# The etcd cluster phase
PREFIX = "/soak"
LEASE_TTL_S = 2  # short: a dead node leaves within seconds, so quick runs stay quick
PROMPT_BLOCKS = 8  # two segments of the default segment_blocks (4): spread over nodes
CLIENTS = ("etcd-client-a", "etcd-client-b")


def run_paths(run: Path) -> dict[str, Path]:
    return {"journal": run / "journal", "hb": run / "hb", "ctl": run / "ctl",
            "logs": run / "logs", "stores": run / "stores", "canary": run / "canary",
            "embedded_config": run / "stores" / "embedded.yaml",
            "nodes": run / "ctl" / "nodes.json", "members": run / "ctl" / "members.json"}


# -- state dicts ----------------------------------------------------------------------------
def expected_state(kind: str, seed: int) -> dict[str, Any]:
    """The state a trainer of ``kind`` saves for ``seed``, as a load returns it (``plain``:
    ~1.6 MB over two 1 MiB chunks, small tensors packed, JSON leaves; ``incremental``: a
    frozen 4 MiB base linked from the parent and a small adapter; ``dist``: the unsplit
    model of the 2-rank job)."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "incremental":
        base = torch.Generator().manual_seed(INC_BASE_SEED)
        return {"base": {"w": torch.randn(1024, 1024, generator=base)},
                "lora": {"a": torch.randn(1024, 8, generator=gen),
                         "b": torch.randn(8, 1024, generator=gen)}, "step": seed}
    if kind == "dist":
        return {"model": {"w": torch.randn(1001, 512, generator=gen),
                          "bias": torch.randn(512, generator=gen)}, "step": seed, "rank": 0}
    return {"model": {"w": torch.randn(384, 1024, generator=gen),
                      "emb": torch.randn(64, 32, generator=gen).to(torch.bfloat16),
                      "b": torch.randn(1024, generator=gen),
                      "ids": torch.randint(0, 1 << 30, (257,), generator=gen)},
            "step": seed, "opt": {"lr": 0.001, "betas": [0.9, 0.999]}}


def leaves(tree: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """(path, leaf) of a nested state dict; lists and tuples alike."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from leaves(v, f"{path}.{k}" if path else str(k))
    elif isinstance(tree, list | tuple):
        for i, v in enumerate(tree):
            yield from leaves(v, f"{path}[{i}]")
    else:
        yield path, tree


def state_bytes(state: Any) -> int:
    return sum(v.numel() * v.element_size() for _, v in leaves(state)
               if isinstance(v, torch.Tensor))


def differences(got: Any, want: Any) -> list[str]:
    """Where ``got`` differs from ``want`` (bit-exact for tensors); [] when equal."""
    g, w = dict(leaves(got)), dict(leaves(want))
    if g.keys() != w.keys():
        return [f"leaves {sorted(g)} instead of {sorted(w)}"]
    return [f"{p}: {g[p]!r:.60} instead of {v!r:.60}" for p, v in w.items() if not same(g[p], v)]


def same(a: Any, b: Any) -> bool:
    if not isinstance(b, torch.Tensor):
        return not isinstance(a, torch.Tensor) and a == b
    return (isinstance(a, torch.Tensor) and (a.dtype, a.shape) == (b.dtype, b.shape)
            and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


# -- KV blocks ----------------------------------------------------------------------------
def block_value(key: bytes) -> bytes:
    """A block's bytes, derived from its key: wrong bytes under a key are detectable."""
    return hashlib.shake_128(b"isolane-soak" + bytes(key)).digest(KV_BLOCK_BYTES)


def kv_tensor(keys: list[bytes]) -> torch.Tensor:
    """The KV tensor of a prompt whose full blocks have ``keys`` (block i from
    ``block_value(keys[i])``, so any block read back can be checked alone)."""
    return torch.cat([torch.frombuffer(bytearray(block_value(k)), dtype=torch.float16)
                      .view(KV_SHAPE) for k in keys], dim=KV_TOKEN_DIM)


def layout_tensor() -> torch.Tensor:
    """Less than one block: fixes the namespace's layout and stores nothing."""
    shape = list(KV_SHAPE)
    shape[KV_TOKEN_DIM] = 1
    return torch.zeros(shape, dtype=torch.float16)


def served_blocks(got: tuple[int, torch.Tensor] | None) -> list[bytes]:
    """The bytes of each block a ``get`` served, in order."""
    if got is None:
        return []
    return [bytes(got[1].narrow(KV_TOKEN_DIM, i * KV_CHUNK_TOKENS, KV_CHUNK_TOKENS)
                  .contiguous().view(torch.uint8).reshape(-1).numpy())
            for i in range(got[0] // KV_CHUNK_TOKENS)]


# -- journals and small files -----------------------------------------------------------
class Journal:
    """One JSON object a line, appended with O_APPEND (a killed writer loses at most a
    torn last line, which readers skip). Safe for one writer process."""

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, event: str, **fields: Any) -> None:
        os.write(self._fd, (json.dumps({"t": time.time(), "ev": event, "pid": os.getpid(),
                                        **fields}, separators=(",", ":")) + "\n").encode())


def read_journals(folder: Path) -> dict[str, list[dict[str, Any]]]:
    """Every member's journal: member name -> events in order."""
    out: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(folder.glob("*.jsonl")):
        out[path.stem] = []
        for line in path.read_text().splitlines():
            try:
                out[path.stem].append(json.loads(line))
            except ValueError:
                continue  # the torn last line of a killed writer
    return out


def regular_files(root: Path) -> list[Path]:
    """Regular files under ``root`` (never through a symlink), sorted."""
    return sorted(p for folder, _, files in os.walk(root) for p in (Path(folder) / f for f in files)
                  if not p.is_symlink() and p.is_file())


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def read_json(path: Path, default: Any = None) -> Any:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return default


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:300]}"


# -- the members -------------------------------------------------------------------------
class Worker:
    def __init__(self, role: str, run: Path, member: str, seed: int) -> None:
        self.role, self.run, self.member = role, run, member
        self.paths = run_paths(run)
        self.config = str(self.paths["embedded_config"])
        self.rng = random.Random(f"{seed}-{member}-{time.time_ns()}")
        self.journal = Journal(self.paths["journal"] / f"{member}.jsonl")
        self.hb = self.paths["hb"] / member
        self.journal.write("start", role=role)

    def beat(self, op: str | None) -> None:
        write_json(self.hb, {"op": op, "since": time.time(), "pid": os.getpid()})

    def call(self, op: str, fn: Any, *args: Any, **kwargs: Any) -> tuple[str, Any]:
        """Run one operation: ("ok", result), ("error", IsolaneError) or ("raw", exc)."""
        self.beat(op)
        try:
            return "ok", fn(*args, **kwargs)
        except IsolaneError as exc:
            return "error", exc
        except Exception as exc:  # a raw exception from the library is a finding
            self.journal.write("raw", op=op, error=f"{type(exc).__name__}: {exc}",
                               tb=traceback.format_exc()[-2000:])
            return "raw", exc
        finally:
            self.beat(None)

    def pause(self) -> None:
        STOP.wait(OP_PAUSE_S[self.role] * self.rng.uniform(0.5, 1.5))

    def remote_store(self) -> RemoteSnapshotStore:
        return RemoteSnapshotStore(read_json(self.paths["nodes"])["base"],
                                   timeout_s=REMOTE_READ_TIMEOUT_S, connect_timeout_s=2.0,
                                   retries=REMOTE_RETRIES)

    def stores(self) -> dict[str, Any]:
        return {"embedded": SnapshotStore(self.config), "remote": self.remote_store()}

    def acked_saves(self) -> list[dict[str, Any]]:
        """Acknowledged saves of the trainers and the 2-rank job, the overwrite name too."""
        return [{**ev, "member": member}
                for member, events in read_journals(self.paths["journal"]).items()
                for ev in events if ev["ev"] == "ack"]


def trainer(w: Worker) -> None:
    """sync, async, incremental, overwrite, race (two save the same new name in each 2 s
    slot: one must win), remote (through the nodes) and dist: a rank of the 2-rank
    torchrun job (gloo), each rank its rows of ``model.w``, rank 0 journaling. A rank
    killed by the soak breaks the group: torchrun ends the job, the soak starts it again."""
    pid, i, parent, rank, world = os.getpid(), 0, None, 0, 1
    if w.role == "dist":
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
        rank, world = dist.get_rank(), dist.get_world_size()
    store = w.remote_store() if w.role == "remote" else SnapshotStore(w.config)
    while not STOP.is_set():
        i += 1
        seed, name = (pid % 100_000) * 100_000 + i, f"{w.role}-{pid}-{i}"
        options: dict[str, Any] = {}
        if w.role == "overwrite":  # the seed grows across restarts: the newest ack wins
            seed, name, options = time.time_ns() // 1000, f"ow-{w.member}", {"overwrite": True}
        elif w.role == "race":
            slot = int(time.time() / RACE_SLOT_S) + 1
            STOP.wait(max(0.0, slot * RACE_SLOT_S - time.time()))
            name = f"race-{slot}"
        elif w.role == "incremental":
            options = {"parent": parent}
        elif w.role == "dist":  # rank 0 names the save, or stops the job at ctl/stop-dist
            order = [None, None] if (w.paths["ctl"] / "stop-dist").exists() else [name, seed]
            dist.broadcast_object_list(order, src=0)
            if not isinstance(name := order[0], str) or not isinstance(seed := order[1], int):
                break
            options = {"shards": {"model.w": Shard.even(rank, world, 1001)}}
        kind = w.role if w.role in ("incremental", "dist") else "plain"
        state = expected_state(kind, seed)
        nbytes = state_bytes(state)
        if w.role == "dist":
            state["model"]["w"] = state["model"]["w"].tensor_split(world)[rank].clone()
            state["rank"] = rank
        w.journal.write("begin", name=name, seed=seed, kind=kind)
        if w.role == "async":
            outcome, result = w.call("save_async", save_then_mutate, store, state, name, seed)
        else:
            outcome, result = w.call("save", store.save, state, name, {"seed": seed}, **options)
        if outcome == "raw" and w.role == "dist":
            raise result  # a raw error breaks the group: journaled, then the rank dies
        if outcome == "ok" and rank == 0:
            w.journal.write("ack", name=name, seed=seed, kind=kind, generation=result.generation,
                            bytes=nbytes, linked=result.linked_bytes,
                            store="remote" if w.role == "remote" else "embedded")
            parent = name
        elif rank == 0:
            if isinstance(result, SnapshotNotFoundError):
                parent = None  # rm took the parent meanwhile: the next save starts afresh
            w.journal.write("fail", name=name, seed=seed, error=_err(result))
        w.pause()
    if w.role != "async":
        store.close()  # the async trainer exits without close(): that must be clean too
    if w.role == "dist":
        dist.destroy_process_group()


def save_then_mutate(store: Any, state: Any, name: str, seed: int) -> Any:
    handle = store.save_async(state, name, {"seed": seed})
    for _, v in leaves(state):  # what a training loop does next: the save must not see it
        if isinstance(v, torch.Tensor):
            v.add_(1) if v.is_floating_point() else v.bitwise_not_()
    return handle.result(120)


def collector(w: Worker) -> None:
    store = SnapshotStore(w.config)
    while not STOP.is_set():
        outcome, result = w.call("gc", store.gc)
        if outcome == "ok":
            w.journal.write("gc", swept=list(result.swept_generations),
                            deleted=list(result.deleted_snapshots))
        else:
            w.journal.write("gc-fail", error=_err(result))
        w.pause()
    store.close()


def remover(w: Worker) -> None:
    """Deletes each saver's older snapshots, and now and then a random one."""
    stores = w.stores()
    removed = {ev["name"] for ev in read_journals(w.paths["journal"]).get(w.member, [])
               if ev["ev"] == "rm-intent"}  # by this member before a restart
    while not STOP.is_set():
        by_member: dict[str, list[dict[str, Any]]] = {}
        for ev in w.acked_saves():
            if not ev["name"].startswith("ow-"):
                by_member.setdefault(ev["member"], []).append(ev)
        doomed = []
        for evs in by_member.values():
            alive = [e for e in evs if e["name"] not in removed]
            doomed += alive[:-KEEP_PER_MEMBER]  # oldest first
            if len(alive) > 2 and w.rng.random() < 0.2:
                doomed.append(w.rng.choice(alive[:-1]))
        for ev in doomed[:6]:
            if STOP.is_set() or ev["name"] in removed:
                continue
            removed.add(ev["name"])
            w.journal.write("rm-intent", name=ev["name"], store=ev["store"])
            outcome, result = w.call("rm", stores[ev["store"]].delete, ev["name"])
            w.journal.write("rm-done" if outcome == "ok" else "rm-fail", name=ev["name"],
                            store=ev["store"], error=None if outcome == "ok" else _err(result))
        w.pause()
    for s in stores.values():
        s.close()


def verifier(w: Worker) -> None:
    """Loads acknowledged snapshots (and the overwrite names) and compares them."""
    stores = w.stores()
    while not STOP.is_set():
        saves = w.acked_saves()
        acked = [ev for ev in saves if not ev["name"].startswith("ow-")]
        overwrites = sorted({ev["name"] for ev in saves if ev["name"].startswith("ow-")})
        if not acked:
            w.pause()
            continue
        if w.rng.random() < 0.2:  # one damaged snapshot must not break the listing
            outcome, listed = w.call("list", stores["embedded"].list)
            w.journal.write("list", outcome=outcome,
                            count=len(listed) if outcome == "ok" else None,
                            error=None if outcome == "ok" else _err(listed))
        if overwrites and w.rng.random() < 0.2:
            name = w.rng.choice(overwrites)
            outcome, got = w.call("load", stores["embedded"].load, name)
            seed = got.get("step") if outcome == "ok" and isinstance(got, dict) else None
            ev = {"name": name, "store": "embedded", "kind": "plain", "seed": seed}
        else:
            ev = w.rng.choice(acked[-40:])
            shard = {"shard": (0, 1)} if ev["kind"] == "dist" else {}
            outcome, got = w.call("load", stores[ev["store"]].load, ev["name"], **shard)
        where = {"name": ev["name"], "store": ev["store"]}
        if outcome == "ok":
            want = expected_state(ev["kind"], ev["seed"]) if isinstance(ev["seed"], int) else {}
            diff = differences(got, want)
            w.journal.write("verify", **where, outcome="wrong" if diff else "ok", diff=diff[:5],
                            bytes=state_bytes(want), seed=ev["seed"])
        else:
            outcome = ("missing" if isinstance(got, SnapshotNotFoundError) else
                       "integrity" if isinstance(got, IntegrityError) else "error")
            w.journal.write("verify", **where, outcome=outcome, error=_err(got))
        w.pause()
    for s in stores.values():
        s.close()


def inference(w: Worker) -> None:
    """``kv`` on the embedded pool, ``kv-cluster`` through the nodes (it also carries out
    the joins and leaves ``soak.py`` asks for in ``ctl/members.json``)."""
    cluster = w.role == "kv-cluster"
    ctl = read_json(w.paths["members"])
    members, version = list(ctl["members"]), ctl["version"]  # kv-cluster's nodes
    dropped: set[bytes] = set()  # evicted by the embedded pool (its on_evict hook)
    pool: Any
    if cluster:
        pool = RemoteKVPool(members, **KV_ARGS, timeout_s=5.0, put_timeout_s=15.0)
    else:  # a small memory tier: most gets read the segment files
        pool = KVPool(w.config, **KV_ARGS, memory_budget=256 << 10)

        def journal_evictions(keys: list[bytes], forward: Any) -> None:
            dropped.update(keys)
            w.journal.write("evicted", keys=[k.hex() for k in keys])
            forward(keys)

        for log in pool.logs:  # a full device drops its oldest segments: those are misses
            log.on_evict = lambda keys, f=log.on_evict: journal_evictions(keys, f)
    w.call("layout", pool.put, [1], layout_tensor())
    prompts: list[list[int]] = []  # acknowledged prompts (their token ids)
    acked: set[bytes] = set()
    counts = dict.fromkeys(("puts", "put_blocks", "gets", "blocks_read", "misses",
                            "bytes_verified"), 0)
    last_flush = time.monotonic()
    while not STOP.is_set():
        ctl = (read_json(w.paths["members"]) or {}) if cluster else {}
        if ctl.get("version", version) != version:
            members, version = change_members(w, pool, members, ctl)
        # put: a new prompt, or an acknowledged one not evicted since, extended
        bases = [p for p in prompts[-50:] if not dropped & set(pool.block_keys(p))]
        base = w.rng.choice(bases) if bases and w.rng.random() < 0.3 else []
        tokens = base + [w.rng.randrange(1, 50_000)
                         for _ in range(KV_CHUNK_TOKENS * w.rng.randint(1, 6))]
        keys = pool.block_keys(tokens)
        new = [k for k in keys if k not in acked]
        if cluster and len(new) < len(keys):  # only the new blocks, routed by their chain
            outcome, stored = w.call("put_blocks", pool.put_blocks, new,
                                     [block_value(k) for k in new], chain=keys)
        else:
            outcome, stored = w.call("put", pool.put, tokens, kv_tensor(keys))
        # Blocks are spread over devices (nodes) by chain segment, each part stored or
        # not: a prompt is acknowledged only when every new block was.
        if outcome == "ok" and stored == len(new):
            acked.update(new)
            prompts.append(tokens)
            counts["puts"] += 1
            counts["put_blocks"] += len(new)
            w.journal.write("kv-ack", keys=[k.hex() for k in new])
        if prompts:
            tokens = w.rng.choice(prompts)
            outcome, got = w.call("get", pool.get, tokens)
            if outcome == "ok":  # served blocks, then the first one missing (if any)
                counts["gets"] += 1
                keys = pool.block_keys(tokens)
                values: list[bytes | None] = [*served_blocks(got), None][:len(keys)]
                judge(w, counts, "get", keys[:len(values)], values)
        if prompts and w.rng.random() < 0.3:  # a block-level read of part of a prompt
            chain = pool.block_keys(w.rng.choice(prompts))
            keys = chain[w.rng.randrange(len(chain)):]
            outcome, got = w.call("get_blocks", pool.get_blocks, keys,
                                  **({"chain": chain} if cluster else {}))
            if outcome == "ok":
                judge(w, counts, "get_blocks", keys, [None if v is None else bytes(v)
                                                      for v in got])
        if time.monotonic() - last_flush > 2.0:
            w.journal.write("kv-counts", **counts)
            last_flush = time.monotonic()
        w.pause()
    w.journal.write("kv-counts", **counts)
    pool.close()


def judge(w: Worker, counts: dict[str, int], via: str, keys: list[bytes],
          values: list[bytes | None]) -> None:
    """Every block read checked against its key; a miss (None) journaled with its key."""
    wrong = [k.hex() for k, v in zip(keys, values, strict=True)
             if v is not None and v != block_value(k)]
    if wrong:
        w.journal.write("kv-wrong", keys=wrong, via=via)
    for k in [k for k, v in zip(keys, values, strict=True) if v is None]:
        counts["misses"] += 1
        w.journal.write("kv-miss", key=k.hex(), via=via)
    good = sum(v is not None for v in values) - len(wrong)
    counts["blocks_read"] += good
    counts["bytes_verified"] += good * KV_BLOCK_BYTES


def change_members(w: Worker, pool: Any, members: list[str], ctl: dict[str, Any]
                   ) -> tuple[list[str], int]:
    """Join or leave as ``soak.py`` asked; moves the chains, then acknowledges."""
    wanted = list(ctl["members"])
    for url in (u for u in wanted if u not in members):
        w.call("add_node", pool.add_node, url)
    for url in (u for u in members if u not in wanted):
        w.call("remove_node", pool.remove_node, url)
    outcome, done = w.call("wait_moves", pool.wait_moves, 90.0)
    write_json(w.paths["ctl"] / f"members-ack-{ctl['version']}",
               {"moved": outcome == "ok" and bool(done)})
    return wanted, int(ctl["version"])


def etcd_client(folder: Path, name: str, url: str, seed: int) -> None:
    """KV puts and gets on ``KVPool.connect("etcd://...")`` until the soak writes
    ``phase``; then, the cluster settled, every acknowledged prompt read once more."""
    rng = random.Random(f"{seed}-{name}")
    out: dict[str, Any] = {"puts": 0, "errors": 0, "wrong": [], "raw": [], "blocks_checked": 0,
                           "asked_final": 0, "served_final": 0}
    pool = KVPool.connect(url, **{**KV_ARGS, "namespace": "soak-cluster"}, timeout_s=3.0,
                          put_timeout_s=10.0, poll_s=0.5)

    def call(fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except IsolaneError:
            out["errors"] += 1
        except Exception as exc:  # a raw error is a finding; the client carries on
            out["raw"].append(f"{type(exc).__name__}: {exc}: {traceback.format_exc()[-800:]}")
        return None

    def read(tokens: list[int], final: bool = False) -> None:
        keys = pool.block_keys(tokens)
        served = served_blocks(call(pool.get, tokens))
        out["wrong"] += [k.hex() for k, v in zip(keys, served, strict=False)
                         if v != block_value(k)]
        out["blocks_checked"] += len(served)
        if final:
            out["asked_final"] += len(keys)
            out["served_final"] += len(served)

    call(pool.put, [1], layout_tensor())
    acked: list[list[int]] = []
    while read_json(folder / "phase") != "final":
        tokens = [rng.randrange(1, 50_000) for _ in range(KV_CHUNK_TOKENS * PROMPT_BLOCKS)]
        if call(pool.put, tokens, kv_tensor(pool.block_keys(tokens))) == PROMPT_BLOCKS:
            acked.append(tokens)
            out["puts"] += 1
        if acked:
            read(rng.choice(acked))
        write_json(folder / f"status-{name}.json", {"acked": len(acked),
                                                   "nodes": sorted(pool.nodes)})
        time.sleep(0.05)
    # Settled: every node in the ring and probed up, no move in flight; then read all.
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline:
        state = pool.membership()
        if len(pool.nodes) == 3 and not state.get("moves_in_flight") \
                and state.get("reachable_share") == 1:
            break
        time.sleep(0.2)
    for tokens in acked:
        read(tokens, final=True)
    write_json(folder / f"result-{name}.json", {**out, "final_nodes": sorted(pool.nodes),
                                                "membership": pool.membership()})
    pool.close()


ROLES = {**dict.fromkeys(("sync", "async", "incremental", "overwrite", "race", "remote",
                         "dist"), trainer),
         "gc": collector, "rm": remover, "verify": verifier, "kv": inference,
         "kv-cluster": inference}

if __name__ == "__main__":
    if sys.argv[1] == "etcd-client":
        etcd_client(Path(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]))
    else:  # a dist rank other than 0 journals apart (rank 0 is the job's journal)
        rank = os.environ.get("RANK", "0")
        member = sys.argv[3] if rank == "0" else f"{sys.argv[3]}-rank{rank}"
        worker = Worker(sys.argv[1], Path(sys.argv[2]), member, int(sys.argv[4]))
        ROLES[worker.role](worker)
