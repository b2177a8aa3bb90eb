"""One member of the chaos soak (started, killed and restarted by ``soak.py``).

usage: _soak_worker.py <role> <run folder> <member name> <seed>
       torchrun --nproc-per-node 2 _soak_worker.py dist <run folder>

Roles: ``sync``, ``async``, ``incremental``, ``overwrite`` (trainers on the embedded
store), ``race`` (two of them save the same new name in each 2 s slot: one must win),
``remote`` (a trainer saving through the storage nodes), ``gc``, ``rm``,
``verify`` (loads acknowledged snapshots and compares them), ``kv`` (inference on the
embedded KV pool), ``kv-cluster`` (inference through the nodes; it also carries out
the node joins and leaves that ``soak.py`` asks for in ``ctl/members.json``), and
``dist``, a rank of the 2-rank torchrun job (gloo) saving sharded state.

Every outcome goes to ``journal/<member>.jsonl``: a save is acknowledged (``ack``) only
after the call returned; ``hb/<member>`` says which operation runs since when, so the
soak can tell a hang from a slow machine. SIGTERM: finish the operation, then exit 0
(a ``dist`` rank keeps the default: torchrun ends the job's ranks with it).
"""

from __future__ import annotations

import faulthandler
import os
import random
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

# Before the heavy imports: a SIGTERM during start-up (a member restarted just before
# the soak stops) must end the process cleanly too.
STOP = threading.Event()
if sys.argv[1:2] != ["dist"]:
    signal.signal(signal.SIGTERM, lambda *_: STOP.set())
# A member that does not stop is asked for every thread's stack before it is killed:
# the soak's report then says where it hung.
faulthandler.register(signal.SIGUSR1, all_threads=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._soak_data import (  # noqa: E402
    KV_BLOCK_BYTES,
    KV_CHUNK_TOKENS,
    KV_NAMESPACE,
    KV_TOKEN_DIM,
    Journal,
    block_bytes_of,
    block_value,
    differences,
    dist_full_state,
    expected_state,
    incremental_state,
    kv_tensor,
    layout_tensor,
    mutate_in_place,
    plain_state,
    read_journals,
    read_json,
    run_paths,
    state_bytes,
    write_json,
)

OP_PAUSE_S = {"race": 0.0, "sync": 0.4, "async": 0.4, "incremental": 0.4, "overwrite": 0.6,
              "remote": 0.6,
              "gc": 0.7, "rm": 1.0, "verify": 0.3, "kv": 0.03, "kv-cluster": 0.05}
SAVED_KINDS = ("sync", "async", "incremental", "remote", "dist")
KEEP_PER_MEMBER = 8
RACE_SLOT_S = 2.0  # rm keeps each trainer's newest snapshots, deletes older ones


class Worker:
    def __init__(self, role: str, run: Path, member: str, seed: int) -> None:
        self.role, self.run, self.member = role, run, member
        self.paths = run_paths(run)
        self.rng = random.Random(f"{seed}-{member}-{time.time_ns()}")
        self.journal = Journal(self.paths["journal"] / f"{member}.jsonl")
        self.stop = STOP
        self.hb = self.paths["hb"] / member
        self.hb.parent.mkdir(parents=True, exist_ok=True)
        self.journal.write("start", role=role)

    def beat(self, op: str | None) -> None:
        write_json(self.hb, {"op": op, "since": time.time(), "pid": os.getpid()})

    def call(self, op: str, fn: Any, *args: Any, **kwargs: Any) -> tuple[str, Any]:
        """Run one operation: ("ok", result), ("error", IsolaneError) or ("raw", exc)."""
        from isolane.errors import IsolaneError

        self.beat(op)
        try:
            return "ok", fn(*args, **kwargs)
        except IsolaneError as exc:
            return "error", exc
        except Exception as exc:  # a raw exception from the library is a finding: journaled
            self.journal.write("raw", op=op, error=f"{type(exc).__name__}: {exc}",
                               tb=traceback.format_exc()[-2000:])
            return "raw", exc
        finally:
            self.beat(None)

    def pause(self) -> None:
        self.stop.wait(OP_PAUSE_S[self.role] * self.rng.uniform(0.5, 1.5))


# A stalled node costs a remote request at most (1 + retries) x the read timeout, and a
# save makes at most three holder checks and then a plan and an upload on each of the
# three nodes: 3 x 20 s + 3 x (20 + 10) s = 150 s. soak.py's --stop-timeout (240 s) is
# above that, so only a real hang trips "no process hangs".
REMOTE_READ_TIMEOUT_S = 10.0
REMOTE_RETRIES = 1


def remote_store(w: Worker) -> Any:
    from isolane.client.snapshot_store import RemoteSnapshotStore

    return RemoteSnapshotStore(read_json(w.paths["nodes"])["base"],
                               timeout_s=REMOTE_READ_TIMEOUT_S, connect_timeout_s=2.0,
                               retries=REMOTE_RETRIES)


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:300]}"


# -- trainers -------------------------------------------------------------------------------
def trainer(w: Worker) -> None:
    from isolane import SnapshotStore
    from isolane.errors import SnapshotNotFoundError

    store: Any
    if w.role == "remote":

        store = remote_store(w)
    else:
        store = SnapshotStore(str(w.paths["embedded_config"]))
    pid, i = os.getpid(), 0
    parent: str | None = None
    overwrite_name = f"ow-{w.member}"
    while not w.stop.is_set():
        i += 1
        seed = (pid % 100_000) * 100_000 + i
        if w.role == "overwrite":
            seed = time.time_ns() // 1000  # grows across restarts: the newest ack wins
            name = overwrite_name
        elif w.role == "race":  # both racers save the same new name in each time slot
            slot = int(time.time() / RACE_SLOT_S) + 1
            w.stop.wait(max(0.0, slot * RACE_SLOT_S - time.time()))
            name = f"race-{slot}"
        else:
            name = f"{w.role[:3]}-{pid}-{i}"
        kind = "incremental" if w.role == "incremental" else "plain"
        state = incremental_state(seed) if kind == "incremental" else plain_state(seed)
        w.journal.write("begin", name=name, seed=seed, kind=kind)
        if w.role == "async":
            outcome, result = w.call("save_async", save_then_mutate, store, state, name, seed)
        elif w.role == "incremental":
            outcome, result = w.call("save", store.save, state, name, {"seed": seed},
                                     parent=parent if parent else None)
            if outcome == "error" and isinstance(result, SnapshotNotFoundError) and parent:
                parent = None  # rm took the parent meanwhile: the next save picks another
        elif w.role == "overwrite":
            outcome, result = w.call("save", store.save, state, name, {"seed": seed},
                                     overwrite=True)
        else:
            outcome, result = w.call("save", store.save, state, name, {"seed": seed})
        if outcome == "ok":
            w.journal.write("ack", name=name, seed=seed, kind=kind,
                            generation=result.generation, bytes=state_bytes(state),
                            linked=result.linked_bytes,
                            store="remote" if w.role == "remote" else "embedded")
            parent = name
        else:
            w.journal.write("fail", name=name, seed=seed, error=_err(result))
        w.pause()
    if w.role != "async":
        store.close()  # the async trainer exits without close(): that must be clean too


def save_then_mutate(store: Any, state: Any, name: str, seed: int) -> Any:
    handle = store.save_async(state, name, {"seed": seed})
    mutate_in_place(state)  # staged: the save must not see this
    return handle.result(120)


# -- gc, rm, verify -------------------------------------------------------------------------
def collector(w: Worker) -> None:
    from isolane import SnapshotStore

    store = SnapshotStore(str(w.paths["embedded_config"]))
    while not w.stop.is_set():
        outcome, result = w.call("gc", store.gc)
        if outcome == "ok":
            w.journal.write("gc", swept=list(result.swept_generations),
                            deleted=list(result.deleted_snapshots))
        else:
            w.journal.write("gc-fail", error=_err(result))
        w.pause()
    store.close()


def acked_saves(run: Path) -> list[dict[str, Any]]:
    """Acknowledged saves of the trainers and the 2-rank job (not the overwrite name)."""
    out = []
    for member, events in read_journals(run_paths(run)["journal"]).items():
        for ev in events:
            if ev["ev"] == "ack" and not ev["name"].startswith("ow-"):
                out.append({**ev, "member": member})
    return out


def remover(w: Worker) -> None:
    from isolane import SnapshotStore

    stores = {"embedded": SnapshotStore(str(w.paths["embedded_config"])),
              "remote": remote_store(w)}
    removed = {ev["name"] for ev in read_journals(w.paths["journal"]).get(w.member, [])
               if ev["ev"] == "rm-intent"}  # by this member before a restart
    while not w.stop.is_set():
        by_member: dict[str, list[dict[str, Any]]] = {}
        for ev in acked_saves(w.run):
            by_member.setdefault(ev["member"], []).append(ev)
        doomed = []
        for evs in by_member.values():
            alive = [e for e in evs if e["name"] not in removed]
            doomed += alive[:-KEEP_PER_MEMBER]  # oldest first
            if len(alive) > 2 and w.rng.random() < 0.2:
                doomed.append(w.rng.choice(alive[:-1]))  # and now and then a random one
        for ev in doomed[:6]:
            if w.stop.is_set() or ev["name"] in removed:
                continue
            removed.add(ev["name"])
            w.journal.write("rm-intent", name=ev["name"], store=ev["store"])
            outcome, result = w.call("rm", stores[ev["store"]].delete, ev["name"])
            w.journal.write("rm-done" if outcome == "ok" else "rm-fail", name=ev["name"],
                            store=ev["store"], error=None if outcome == "ok" else _err(result))
        w.pause()
    for s in stores.values():
        s.close()


def load_expected(store: Any, kind: str, name: str) -> Any:
    return store.load(name, shard=(0, 1)) if kind == "dist" else store.load(name)


def verifier(w: Worker) -> None:
    from isolane import SnapshotStore
    from isolane.errors import IntegrityError, SnapshotNotFoundError

    stores = {"embedded": SnapshotStore(str(w.paths["embedded_config"])),
              "remote": remote_store(w)}
    while not w.stop.is_set():
        acked = acked_saves(w.run)
        overwrites = [ev["name"] for evs in read_journals(w.paths["journal"]).values()
                      for ev in evs if ev["ev"] == "ack" and ev["name"].startswith("ow-")]
        if not acked:
            w.pause()
            continue
        if w.rng.random() < 0.2:  # one damaged snapshot must not break the listing
            outcome, listed = w.call("list", stores["embedded"].list)
            w.journal.write("list", outcome=outcome,
                            count=len(listed) if outcome == "ok" else None,
                            error=None if outcome == "ok" else _err(listed))
        if overwrites and w.rng.random() < 0.2:
            name = w.rng.choice(sorted(set(overwrites)))
            outcome, got = w.call("load", stores["embedded"].load, name)
            seed = got.get("step") if outcome == "ok" and isinstance(got, dict) else None
            ev = {"name": name, "store": "embedded", "kind": "plain", "seed": seed}
        else:
            ev = w.rng.choice(acked[-40:])
            outcome, got = w.call("load", load_expected, stores[ev["store"]], ev["kind"],
                                  ev["name"])
        if outcome == "ok":
            want = expected_state(ev["kind"], ev["seed"]) if isinstance(ev["seed"], int) else {}
            diff = differences(got, want)
            w.journal.write("verify", name=ev["name"], store=ev["store"],
                            outcome="wrong" if diff else "ok", diff=diff[:5],
                            bytes=state_bytes(want), seed=ev["seed"])
        elif isinstance(got, SnapshotNotFoundError):
            w.journal.write("verify", name=ev["name"], store=ev["store"], outcome="missing",
                            error=_err(got))
        elif isinstance(got, IntegrityError):
            w.journal.write("verify", name=ev["name"], store=ev["store"], outcome="integrity",
                            error=_err(got))
        else:
            w.journal.write("verify", name=ev["name"], store=ev["store"], outcome="error",
                            error=_err(got))
        w.pause()
    for s in stores.values():
        s.close()


# -- inference ------------------------------------------------------------------------------
def inference(w: Worker) -> None:
    cluster = w.role == "kv-cluster"
    members: list[str] = []
    version = -1
    dropped: set[bytes] = set()  # evicted by the embedded pool (its on_evict hook)
    pool: Any
    if cluster:
        from isolane.client.kv_pool import RemoteKVPool

        ctl = read_json(w.paths["members"])
        members, version = list(ctl["members"]), ctl["version"]
        pool = RemoteKVPool(members, namespace=KV_NAMESPACE, chunk_tokens=KV_CHUNK_TOKENS,
                            token_dim=KV_TOKEN_DIM, timeout_s=5.0, put_timeout_s=15.0)
    else:
        from isolane.kvpool.pool import KVPool

        pool = KVPool(str(w.paths["embedded_config"]), namespace=KV_NAMESPACE,
                      chunk_tokens=KV_CHUNK_TOKENS, token_dim=KV_TOKEN_DIM,
                      memory_budget=256 << 10)  # small: most gets read the segment files

        def journal_evictions(keys: list[bytes], forward: Any) -> None:
            dropped.update(keys)
            w.journal.write("evicted", keys=[k.hex() for k in keys])
            forward(keys)

        for log in pool.logs:  # a full device drops its oldest segments: those are misses
            forward = log.on_evict
            log.on_evict = lambda keys, f=forward: journal_evictions(keys, f)
    w.call("layout", pool.put, [1], layout_tensor())
    prompts: list[list[int]] = []  # acknowledged prompts (their token ids)
    acked: set[bytes] = set()
    counts = {"puts": 0, "put_blocks": 0, "gets": 0, "blocks_read": 0, "misses": 0,
              "bytes_verified": 0}
    last_flush = time.monotonic()
    while not w.stop.is_set():
        if cluster:
            ctl = read_json(w.paths["members"]) or {}
            if ctl.get("version", version) != version:
                members, version = change_members(w, pool, members, ctl)
        # put: a new prompt, or an acknowledged one extended (a shared prefix)
        # put: a new prompt, or an acknowledged one extended (a shared prefix) whose
        # blocks were not evicted meanwhile
        bases = [p for p in prompts[-50:] if not dropped & set(pool.block_keys(p))]
        base = w.rng.choice(bases) if bases and w.rng.random() < 0.3 else []
        tokens = base + [w.rng.randrange(1, 50_000)
                         for _ in range(KV_CHUNK_TOKENS * w.rng.randint(1, 6))]
        keys = pool.block_keys(tokens)
        new = [k for k in keys if k not in acked]
        kv = kv_tensor(keys)
        if cluster and len(new) < len(keys):  # only the new blocks, routed by their chain
            outcome, stored = w.call("put_blocks", pool.put_blocks, new,
                                     [block_bytes_of(kv, keys.index(k)) for k in new],
                                     chain=keys)
        else:
            outcome, stored = w.call("put", pool.put, tokens, kv)
        # A prompt's blocks are spread over devices (nodes) by chain segment, each part
        # stored or not: acknowledged only when every new block was.
        if outcome == "ok" and stored == len(new):
            acked.update(new)
            prompts.append(tokens)
            counts["puts"] += 1
            counts["put_blocks"] += len(new)
            w.journal.write("kv-ack", keys=[k.hex() for k in new])
        else:
            w.journal.write("kv-put-partial", stored=stored if outcome == "ok" else None,
                            wanted=len(new), error=None if outcome == "ok" else _err(stored))
        if prompts:
            check_get(w, pool, w.rng.choice(prompts), counts)
        if prompts and w.rng.random() < 0.3:
            chain = pool.block_keys(w.rng.choice(prompts))
            check_blocks(w, pool, chain[w.rng.randrange(len(chain)):], chain, counts)
        if time.monotonic() - last_flush > 2.0:
            w.journal.write("kv-counts", **counts)
            last_flush = time.monotonic()
        w.pause()
    w.journal.write("kv-counts", **counts)
    pool.close()


def check_get(w: Worker, pool: Any, tokens: list[int], counts: dict[str, int]) -> None:
    keys = pool.block_keys(tokens)
    outcome, result = w.call("get", pool.get, tokens)
    if outcome != "ok":
        w.journal.write("kv-get-fail", error=_err(result))
        return
    n_tokens, kv = result
    n = n_tokens // KV_CHUNK_TOKENS
    counts["gets"] += 1
    wrong = [keys[i].hex() for i in range(n) if block_bytes_of(kv, i) != block_value(keys[i])]
    if wrong:
        w.journal.write("kv-wrong", keys=wrong, via="get")
    counts["blocks_read"] += n
    counts["bytes_verified"] += (n - len(wrong)) * KV_BLOCK_BYTES
    if n < len(keys):
        counts["misses"] += 1
        w.journal.write("kv-miss", key=keys[n].hex(), via="get")


def check_blocks(w: Worker, pool: Any, keys: list[bytes], chain: list[bytes],
                 counts: dict[str, int]) -> None:
    """A block-level read of part of a prompt (through nodes, routed by its chain)."""
    if w.role == "kv-cluster":
        outcome, values = w.call("get_blocks", pool.get_blocks, keys, chain=chain)
    else:
        outcome, values = w.call("get_blocks", pool.get_blocks, keys)
    if outcome != "ok":
        w.journal.write("kv-get-fail", error=_err(values))
        return
    for key, value in zip(keys, values, strict=True):
        if value is None:
            counts["misses"] += 1
            w.journal.write("kv-miss", key=key.hex(), via="get_blocks")
        elif bytes(value) != block_value(key):
            w.journal.write("kv-wrong", keys=[key.hex()], via="get_blocks")
        else:
            counts["blocks_read"] += 1
            counts["bytes_verified"] += KV_BLOCK_BYTES


def change_members(w: Worker, pool: Any, members: list[str], ctl: dict[str, Any]
                   ) -> tuple[list[str], int]:
    """Join or leave as ``soak.py`` asked; moves the chains, then acknowledges."""
    wanted = list(ctl["members"])
    for url in wanted:
        if url not in members:
            w.journal.write("join-begin", url=url)
            w.call("add_node", pool.add_node, url)
    for url in members:
        if url not in wanted:
            w.journal.write("leave-begin", url=url)
            w.call("remove_node", pool.remove_node, url)
    outcome, done = w.call("wait_moves", pool.wait_moves, 90.0)
    w.journal.write("members", members=wanted, version=ctl["version"],
                    moved=bool(done) if outcome == "ok" else False)
    write_json(w.paths["ctl"] / f"members-ack-{ctl['version']}", {"moved": done})
    return wanted, int(ctl["version"])


# -- the 2-rank training job ----------------------------------------------------------------
def dist_job(run: Path) -> None:
    """One rank under torchrun (gloo on CPU): saves in a loop, every rank its rows of
    ``w`` (``Shard``-marked) and the replicated ``bias``; rank 0 journals each
    acknowledged save to ``journal/dist.jsonl``. Stops when ``ctl/stop-dist`` exists
    (rank 0 decides, every rank follows). A rank killed by the soak breaks the group:
    torchrun then ends the job and the soak starts it again."""
    import torch.distributed as dist

    from isolane import SnapshotStore
    from isolane.errors import IsolaneError
    from isolane.snapshot.sharding import Shard

    paths = run_paths(run)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    journal = Journal(paths["journal"] / "dist.jsonl") if rank == 0 else None
    hb = paths["hb"] / f"dist-rank{rank}"
    store = SnapshotStore(str(paths["embedded_config"]))
    i = 0
    while True:
        i += 1
        order: list[object] = [None, None]
        if rank == 0:
            stop = (paths["ctl"] / "stop-dist").exists()
            order = [None if stop else f"dist-{os.getpid()}-{i}",
                     (os.getpid() % 100_000) * 100_000 + i]
        dist.broadcast_object_list(order, src=0)
        name, seed = order
        if name is None:
            break
        assert isinstance(name, str) and isinstance(seed, int)
        full = dist_full_state(seed)
        state = {"model": {"w": full["w"].tensor_split(world)[rank].clone(),
                           "bias": full["bias"]}, "step": seed, "rank": rank}
        write_json(hb, {"op": "save", "since": time.time(), "pid": os.getpid()})
        try:
            info = store.save(state, name, {"seed": seed},
                              shards={"model.w": Shard.even(rank, world, 1001)})
        except IsolaneError as exc:
            if journal is not None:
                journal.write("fail", name=name, seed=seed,
                              error=f"{type(exc).__name__}: {str(exc)[:300]}")
        except Exception as exc:  # a raw error breaks the group: journal it, then die
            Journal(paths["journal"] / f"dist-rank{rank}.jsonl").write(
                "raw", op="save", error=f"{type(exc).__name__}: {exc}"[:500])
            raise
        else:
            if journal is not None:
                journal.write("ack", name=name, seed=seed, kind="dist",
                              generation=info.generation, bytes=state_bytes(full),
                              linked=info.linked_bytes, store="embedded")
        write_json(hb, {"op": None, "since": time.time(), "pid": os.getpid()})
        time.sleep(0.5)
    store.close()
    dist.destroy_process_group()
    if journal is not None:
        journal.write("exit")


ROLES = {"sync": trainer, "async": trainer, "incremental": trainer, "overwrite": trainer,
         "remote": trainer, "race": trainer, "gc": collector, "rm": remover, "verify": verifier,
         "kv": inference, "kv-cluster": inference}


def main() -> None:
    if sys.argv[1] == "dist":
        dist_job(Path(sys.argv[2]))
        return
    role, run, member, seed = sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    w = Worker(role, run, member, seed)
    ROLES[role](w)
    w.journal.write("exit")


if __name__ == "__main__":
    main()
