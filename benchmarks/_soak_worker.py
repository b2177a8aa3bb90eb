"""One member of the chaos soak (started, killed and restarted by ``soak.py``), and the
data every soak process derives from the journals.

usage: _soak_worker.py <role> <run folder> <member name> <seed>
       _soak_worker.py etcd-client <cluster folder> <name> <etcd url> <seed>
       torchrun --nproc-per-node 2 _soak_worker.py dist <run folder>

Roles: ``sync``, ``async``, ``incremental``, ``overwrite`` (trainers on the embedded
store), ``race`` (two of them save the same new name in each 2 s slot: one must win),
``remote`` (a trainer saving through the storage nodes), ``gc``, ``rm``,
``verify`` (loads acknowledged snapshots and compares them), ``kv`` (inference on the
embedded KV pool), ``kv-cluster`` (inference through the nodes; it also carries out
the node joins and leaves that ``soak.py`` asks for in ``ctl/members.json``),
``etcd-client`` (KV puts and gets on ``KVPool.connect("etcd://...")``, counting blocks
served per window of the cluster phase) and ``dist``, a rank of the 2-rank torchrun job
(gloo) saving sharded state.

Data describes itself: a state dict is rebuilt from its seed, a KV block's bytes from its
key, so whoever checks a save or a block needs only the journal line that acknowledged
it. Every outcome goes to ``journal/<member>.jsonl``: a save is acknowledged (``ack``)
only after the call returned; ``hb/<member>`` says which operation runs since when, so
the soak can tell a hang from a slow machine. SIGTERM: finish the operation, then exit 0
(a ``dist`` rank keeps the default: torchrun ends the job's ranks with it).
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

# Before the heavy imports: a SIGTERM during start-up (a member restarted just before
# the soak stops) must end the process cleanly too. A member that does not stop is
# asked for every thread's stack before it is killed (the report says where it hung).
STOP = threading.Event()
if __name__ == "__main__":
    if sys.argv[1:2] != ["dist"]:
        signal.signal(signal.SIGTERM, lambda *_: STOP.set())
    faulthandler.register(signal.SIGUSR1, all_threads=True)

import torch  # noqa: E402

# -- layout of one soak run (every process derives its paths from the run folder) --------
KV_NAMESPACE = "soak"
KV_CHUNK_TOKENS = 16
KV_SHAPE = (2, 2, KV_CHUNK_TOKENS, 2, 16)  # [layers, k/v, tokens, heads, head_dim], fp16
KV_TOKEN_DIM = 2
KV_BLOCK_BYTES = 2 * 2 * KV_CHUNK_TOKENS * 2 * 16 * 2  # 4 KiB
INC_BASE_SEED = 7  # the frozen base of the incremental trainer: the same in every save


def run_paths(run: Path) -> dict[str, Path]:
    return {"journal": run / "journal", "hb": run / "hb", "ctl": run / "ctl",
            "logs": run / "logs", "stores": run / "stores", "canary": run / "canary",
            "embedded_config": run / "stores" / "embedded.yaml",
            "nodes": run / "ctl" / "nodes.json", "members": run / "ctl" / "members.json"}


# -- state dicts ----------------------------------------------------------------------------
def plain_state(seed: int) -> dict[str, Any]:
    """~1.6 MB: one tensor over two 1 MiB chunks, small ones packed, JSON leaves."""
    gen = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(384, 1024, generator=gen),
                      "emb": torch.randn(64, 32, generator=gen).to(torch.bfloat16),
                      "b": torch.randn(1024, generator=gen),
                      "ids": torch.randint(0, 1 << 30, (257,), generator=gen)},
            "step": seed, "opt": {"lr": 0.001, "betas": [0.9, 0.999]}}


def incremental_state(seed: int) -> dict[str, Any]:
    """A frozen 4 MiB base (linked from the parent after the first save) and a small
    adapter that changes every step."""
    base = torch.Generator().manual_seed(INC_BASE_SEED)
    gen = torch.Generator().manual_seed(seed)
    return {"base": {"w": torch.randn(1024, 1024, generator=base)},
            "lora": {"a": torch.randn(1024, 8, generator=gen),
                     "b": torch.randn(8, 1024, generator=gen)},
            "step": seed}


def dist_full_state(seed: int) -> dict[str, torch.Tensor]:
    """The unsplit model of the 2-rank job (rows split with ``tensor_split``)."""
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(1001, 512, generator=gen), "bias": torch.randn(512, generator=gen)}


def expected_state(kind: str, seed: int) -> dict[str, Any]:
    """What a load of an acknowledged save of ``kind`` must return (whole tensors)."""
    if kind == "incremental":
        return incremental_state(seed)
    if kind == "dist":
        full = dist_full_state(seed)
        return {"model": {"w": full["w"], "bias": full["bias"]}, "step": seed, "rank": 0}
    return plain_state(seed)


def state_bytes(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(state_bytes(v) for v in state)
    return 0


def differences(got: Any, want: Any, path: str = "") -> list[str]:
    """Where ``got`` differs from ``want`` (bit-exact for tensors); [] when equal."""
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return [f"{path}: {type(got).__name__} instead of a tensor"]
        if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
            return [f"{path}: {got.dtype}{list(got.shape)} instead of "
                    f"{want.dtype}{list(want.shape)}"]
        a = got.contiguous().view(torch.uint8) if got.numel() else got
        b = want.contiguous().view(torch.uint8) if want.numel() else want
        return [] if torch.equal(a, b) else [f"{path}: bytes differ"]
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            return [f"{path}: keys {sorted(got) if isinstance(got, dict) else got!r} "
                    f"instead of {sorted(want)}"]
        out: list[str] = []
        for k in want:
            out += differences(got[k], want[k], f"{path}.{k}" if path else str(k))
        return out
    if isinstance(want, list | tuple):
        if not isinstance(got, list | tuple) or len(got) != len(want):
            return [f"{path}: {got!r} instead of {want!r}"]
        out = []
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            out += differences(g, w, f"{path}[{i}]")
        return out
    return [] if got == want else [f"{path}: {got!r} instead of {want!r}"]


def mutate_in_place(state: Any) -> None:
    """What a training loop does after ``save_async`` returned: change every tensor."""
    if isinstance(state, torch.Tensor):
        state.add_(1) if state.is_floating_point() else state.bitwise_not_()
    elif isinstance(state, dict):
        for v in state.values():
            mutate_in_place(v)


# -- KV blocks ----------------------------------------------------------------------------
def block_value(key: bytes, nbytes: int = KV_BLOCK_BYTES) -> bytes:
    """A block's bytes, derived from its key: wrong bytes under a key are detectable."""
    return hashlib.shake_128(b"isolane-soak" + bytes(key)).digest(nbytes)


def kv_tensor(keys: list[bytes]) -> torch.Tensor:
    """The KV tensor of a prompt whose full blocks have ``keys``, block i's slice built
    from ``block_value(keys[i])`` (so any block read back can be checked alone)."""
    blocks = [torch.frombuffer(bytearray(block_value(k)), dtype=torch.float16).view(KV_SHAPE)
              for k in keys]
    return torch.cat(blocks, dim=KV_TOKEN_DIM)


def layout_tensor() -> torch.Tensor:
    """Less than one block: fixes the namespace's layout and stores nothing."""
    shape = list(KV_SHAPE)
    shape[KV_TOKEN_DIM] = 1
    return torch.zeros(shape, dtype=torch.float16)


def block_bytes_of(kv: torch.Tensor, index: int) -> bytes:
    piece = kv.narrow(KV_TOKEN_DIM, index * KV_CHUNK_TOKENS, KV_CHUNK_TOKENS).contiguous()
    return bytes(piece.view(torch.uint8).reshape(-1).numpy())


# -- journals -----------------------------------------------------------------------------
class Journal:
    """One JSON object a line, appended with O_APPEND (a killed writer loses at most a
    torn last line, which readers skip). Safe for one writer process."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, event: str, **fields: Any) -> None:
        line = json.dumps({"t": time.time(), "ev": event, "pid": os.getpid(), **fields},
                          separators=(",", ":")) + "\n"
        os.write(self._fd, line.encode())

    def close(self) -> None:
        os.close(self._fd)


def read_journal(path: Path) -> Iterator[dict[str, Any]]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return
    for line in text.splitlines():
        try:
            yield json.loads(line)
        except ValueError:
            continue  # the torn last line of a killed writer


def read_journals(folder: Path) -> dict[str, list[dict[str, Any]]]:
    """Every member's journal: member name -> events in order."""
    return {p.stem: list(read_journal(p)) for p in sorted(folder.glob("*.jsonl"))}


def regular_files(root: Path) -> list[Path]:
    """Regular files under ``root`` (never through a symlink), sorted."""
    out = []
    for folder, dirs, files in os.walk(root, followlinks=False):
        for f in files:
            p = Path(folder) / f
            try:
                if p.is_symlink() or not p.is_file():
                    continue
            except OSError:
                continue
            out.append(p)
        dirs.sort()
    return sorted(out)


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def read_json(path: Path, default: Any = None) -> Any:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return default


# -- the members -------------------------------------------------------------------------
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


# -- the etcd cluster's KV clients -----------------------------------------------------------
PREFIX = "/soak"
NAMESPACE = "soak-cluster"
LEASE_TTL_S = 2  # short: a dead node leaves within seconds, so quick runs stay quick
PROMPT_BLOCKS = 8  # two segments of the default segment_blocks (4): spread over nodes
CLIENTS = ("etcd-client-a", "etcd-client-b")


def client_main(folder: Path, name: str, url: str, seed: int) -> None:
    from isolane import KVPool
    from isolane.errors import IsolaneError

    rng = random.Random(f"{seed}-{name}")
    out: dict[str, Any] = {"puts": 0, "errors": 0, "wrong": [], "raw": [], "blocks_checked": 0,
                           "asked_final": 0, "served_final": 0}
    pool = KVPool.connect(url, namespace=NAMESPACE, chunk_tokens=KV_CHUNK_TOKENS,
                          token_dim=KV_TOKEN_DIM, timeout_s=3.0, put_timeout_s=10.0,
                          poll_s=0.5)

    def call(fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except IsolaneError:
            out["errors"] += 1
        except Exception as exc:  # a raw error is a finding; the client carries on
            out["raw"].append(f"{type(exc).__name__}: {exc}: {traceback.format_exc()[-800:]}")
        return None

    def read(tokens: list[int], final: bool = False) -> None:
        """Every block served checked; the final reads count the blocks asked and served."""
        keys = pool.block_keys(tokens)
        got = call(pool.get, tokens)
        n = 0 if got is None else got[0] // KV_CHUNK_TOKENS
        for i in range(n):
            if block_bytes_of(got[1], i) != block_value(keys[i]):
                out["wrong"].append(keys[i].hex())
        out["blocks_checked"] += n
        if final:
            out["asked_final"] += len(keys)
            out["served_final"] += n

    call(pool.put, [1], layout_tensor())
    acked: list[list[int]] = []
    while read_json(folder / "phase") != "final":  # set by the soak once its faults are over
        tokens = [rng.randrange(1, 50_000) for _ in range(KV_CHUNK_TOKENS * PROMPT_BLOCKS)]
        stored = call(pool.put, tokens, kv_tensor(pool.block_keys(tokens)))
        if stored == PROMPT_BLOCKS:
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
    write_json(folder / f"result-{name}.json", {
        **out, "final_nodes": sorted(pool.nodes),
        "membership": pool.membership()})
    pool.close()


ROLES = {"sync": trainer, "async": trainer, "incremental": trainer, "overwrite": trainer,
         "remote": trainer, "race": trainer, "gc": collector, "rm": remover, "verify": verifier,
         "kv": inference, "kv-cluster": inference}


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    if sys.argv[1] == "dist":
        dist_job(Path(sys.argv[2]))
        return
    if sys.argv[1] == "etcd-client":
        client_main(Path(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]))
        return
    role, run, member, seed = sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    w = Worker(role, run, member, seed)
    ROLES[role](w)
    w.journal.write("exit")


if __name__ == "__main__":
    main()
