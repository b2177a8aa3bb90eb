"""The soak's checks, run by ``soak.py`` once every member has stopped.

usage: _soak_check.py remote|local <run folder> <result.json>

``remote`` (nodes up): every acknowledged save through the nodes loads bit-exact, and
every acknowledged KV block of the cluster is on some node with the right bytes.
``local`` (nodes stopped): the embedded store's acknowledged saves, the overwrite
names, the during-run verifier's results, gc's sweeps, a final gc and the orphan check
on the embedded store and every node's store, and every acknowledged block of the
embedded KV pool. Misses and integrity errors are excused only by the fault journal
(bytes flipped there) or the pool's eviction journal; deletions only by rm's journal.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._soak_data import (
    KV_BLOCK_BYTES,
    KV_CHUNK_TOKENS,
    KV_NAMESPACE,
    KV_TOKEN_DIM,
    block_value,
    differences,
    expected_state,
    read_journals,
    read_json,
    regular_files,
    run_paths,
    write_json,
)

BATCH = 256


class Evidence:
    """What the journals say was done on purpose: damage, evictions, removals."""

    def __init__(self, run: Path) -> None:
        self.run = run
        self.paths = run_paths(run)
        self.journals = read_journals(self.paths["journal"])
        faults = [ev for ev in self.journals.get("chaos", []) if ev["ev"] == "fault"]
        self.file_flips = [ev for ev in faults if ev["fault"] in ("flip-chunk", "flip-manifest")
                           and "ino" in ev]
        self.flipped_paths = {p for ev in self.file_flips
                              for p in [ev["path"], *ev.get("links", [])]}
        self.damaged_keys = {ev["key"] for ev in faults if ev["fault"] == "flip-segment"
                             and "key" in ev}
        self.evicted = {k for evs in self.journals.values() for ev in evs
                        if ev["ev"] == "evicted" for k in ev["keys"]}
        self.removed = {(ev["store"], ev["name"]) for evs in self.journals.values()
                        for ev in evs if ev["ev"] == "rm-intent"}
        self.acks = [dict(ev, member=m) for m, evs in self.journals.items() for ev in evs
                     if ev["ev"] == "ack"]
        nodes = read_json(self.paths["nodes"])
        self.node_roots = [Path(p) for p in nodes["roots"].values()]
        self.node_urls = list(nodes["urls"].values())
        emb = self.paths["stores"] / "embedded"
        self.embedded_roots = [emb / "ckpt0", emb / "small" / "ckpt1"]

    def roots(self, store: str) -> list[Path]:
        return self.embedded_roots if store == "embedded" else [r / "ckpt" for r in
                                                                self.node_roots]

    def damaged(self, store: str, name: str) -> bool:
        """Whether a recorded flip hit a file of snapshot ``name`` (by path at the time,
        or by the inode of a file it holds now, as hard links share it)."""
        marker = f"/snapshots/{name}/"
        if any(marker in p for p in self.flipped_paths):
            return True
        inodes = {(ev["dev"], ev["ino"]): ev for ev in self.file_flips}
        for root in self.roots(store):
            for p in regular_files(root / "snapshots" / name):
                try:
                    st = p.stat()
                except OSError:
                    continue
                ev = inodes.get((st.st_dev, st.st_ino))
                if ev is not None:
                    return True
        return False


class Result:
    def __init__(self) -> None:
        self.violations: list[dict[str, str]] = []
        self.counts: Counter[str] = Counter()

    def violate(self, invariant: str, detail: str) -> None:
        self.violations.append({"invariant": invariant, "detail": detail})

    def lost(self, detail: str) -> None:
        """An acknowledged save that does not load back."""
        self.violate("acknowledged saves load bit-exact", detail)
        self.counts["lost"] += 1

    def to_json(self) -> dict[str, Any]:
        return {"violations": self.violations, "counts": dict(self.counts)}


# -- snapshots ------------------------------------------------------------------------------
def check_load(res: Result, ev: Evidence, store: Any, store_kind: str, ack: dict[str, Any]
               ) -> None:
    from isolane.errors import IntegrityError, SnapshotNotFoundError

    name = ack["name"]
    try:
        got = store.load(name, shard=(0, 1)) if ack["kind"] == "dist" else store.load(name)
    except IntegrityError as exc:
        if ev.damaged(store_kind, name):
            res.counts["final: damaged on purpose, IntegrityError"] += 1
        else:
            res.violate("acknowledged saves load bit-exact",
                        f"{store_kind} '{name}': IntegrityError without recorded damage: {exc}")
        return
    except SnapshotNotFoundError:
        res.lost(f"{store_kind} '{name}' (generation {ack.get('generation')}) is gone: lost")
        return
    except Exception as exc:
        res.lost(f"{store_kind} '{name}': {type(exc).__name__}: {exc}")
        return
    diff = differences(got, expected_state(ack["kind"], ack["seed"]))
    if diff:
        if ev.damaged(store_kind, name):
            res.violate("damage is detected", f"{store_kind} '{name}' was damaged on purpose "
                        f"and loaded without an IntegrityError, wrong: {diff[:3]}")
        else:
            res.violate("acknowledged saves load bit-exact", f"{store_kind} '{name}': {diff[:3]}")
        res.counts["wrong"] += 1
        return
    res.counts["final: snapshots loaded bit-exact"] += 1
    res.counts["bytes verified: snapshots (final)"] += int(ack["bytes"])


def check_snapshots(res: Result, ev: Evidence, store: Any, store_kind: str) -> None:
    by_name: dict[str, list[dict[str, Any]]] = {}
    for ack in ev.acks:
        if ack.get("store") == store_kind and not ack["name"].startswith("ow-"):
            by_name.setdefault(ack["name"], []).append(ack)
    for name, acks in by_name.items():
        if len(acks) > 1:
            res.violate("one save wins a new name", f"{store_kind} '{name}' acknowledged to "
                        f"{len(acks)} savers: {[a['member'] for a in acks]}")
    for ack in ev.acks:
        if ack.get("store") != store_kind or ack["name"].startswith("ow-"):
            continue
        if (store_kind, ack["name"]) in ev.removed:
            res.counts["final: removed by rm (skipped)"] += 1
            continue
        check_load(res, ev, store, store_kind, ack)


def check_overwrites(res: Result, ev: Evidence, store: Any) -> None:
    """The overwrite trainer's name loads as its newest acknowledged save or as a save
    that started after it (killed between commit and journal)."""
    from isolane.errors import IntegrityError

    names = sorted({a["name"] for a in ev.acks if a["name"].startswith("ow-")})
    for name in names:
        acked = [a["seed"] for a in ev.acks if a["name"] == name]
        begun = {e["seed"] for evs in ev.journals.values() for e in evs
                 if e["ev"] == "begin" and e.get("name") == name}
        try:
            got = store.load(name)
        except IntegrityError as exc:
            if not ev.damaged("embedded", name):
                res.violate("acknowledged saves load bit-exact",
                            f"overwrite '{name}': IntegrityError without damage: {exc}")
            continue
        except Exception as exc:
            res.lost(f"overwrite '{name}': {type(exc).__name__}: {exc}")
            continue
        seed = got.get("step") if isinstance(got, dict) else None
        if seed not in begun or seed < max(acked):
            res.violate("overwrite keeps the newest commit",
                        f"'{name}' holds step {seed}; newest acknowledged {max(acked)}")
            continue
        diff = differences(got, expected_state("plain", seed))
        if diff:
            res.violate("acknowledged saves load bit-exact", f"overwrite '{name}': {diff[:3]}")
            res.counts["wrong"] += 1
        else:
            res.counts["final: overwrite names loaded bit-exact"] += 1


def check_verifier(res: Result, ev: Evidence) -> None:
    """The verifier's loads during the run, judged with the complete journals."""
    for e in ev.journals.get("verify", []):
        if e["ev"] != "verify":
            continue
        outcome, key = e["outcome"], (e["store"], e["name"])
        res.counts[f"run: verify {outcome}"] += 1
        if outcome == "ok":
            res.counts["bytes verified: snapshots (during run)"] += int(e.get("bytes", 0))
        elif outcome == "wrong":
            if ev.damaged(e["store"], e["name"]):
                res.violate("damage is detected", f"{key}: damaged and loaded wrong during the "
                            f"run without an IntegrityError: {e.get('diff')}")
            else:
                res.violate("acknowledged saves load bit-exact", f"{key} during the run: "
                            f"{e.get('diff')}")
            res.counts["wrong"] += 1
        elif outcome == "missing" and key not in ev.removed:
            res.violate("acknowledged saves load bit-exact",
                        f"{key} missing during the run, never removed: {e.get('error')}")
        elif outcome == "integrity" and not ev.damaged(*key) and key not in ev.removed:
            res.violate("acknowledged saves load bit-exact",
                        f"{key}: IntegrityError during the run without damage: {e.get('error')}")
        elif outcome == "error" and e["store"] == "embedded" and key not in ev.removed:
            res.violate("acknowledged saves load bit-exact",
                        f"{key}: load failed during the run: {e.get('error')}")


def check_listing(res: Result, ev: Evidence) -> None:
    for e in ev.journals.get("verify", []):
        if e["ev"] == "list":
            res.counts[f"run: list {e['outcome']}"] += 1
            if e["outcome"] != "ok":
                res.violate("one damaged snapshot fails alone",
                            f"list() failed during the run: {e['error']}")


def check_damage_detected(res: Result, ev: Evidence, store: Any, store_kind: str) -> None:
    """Every acknowledged snapshot with a flipped chunk in its generation: verify raises."""
    from isolane.errors import IntegrityError, SnapshotNotFoundError

    chunk_flips = [e for e in ev.file_flips if e["fault"] == "flip-chunk"]
    for ack in ev.acks:
        if ack.get("store") != store_kind or ack["name"].startswith("ow-") \
                or (store_kind, ack["name"]) in ev.removed:
            continue
        folder = f"/snapshots/{ack['name']}/{ack['generation']}/"
        if not any(folder in p for e in chunk_flips for p in [e["path"], *e.get("links", [])]):
            continue
        try:
            store.verify(ack["name"])
        except IntegrityError:
            res.counts["final: damaged snapshots that verify refuses"] += 1
        except SnapshotNotFoundError:
            pass  # reported as lost by check_snapshots
        else:
            res.violate("damage is detected", f"{store_kind} '{ack['name']}': a chunk was "
                        "flipped and verify() says OK")


def check_gc_journal(res: Result, ev: Evidence) -> None:
    acked = {(a["name"], a["generation"]) for a in ev.acks if a.get("store") == "embedded"
             and not a["name"].startswith("ow-")}
    for e in ev.journals.get("gc", []):
        if e["ev"] != "gc":
            continue
        res.counts["run: gc sweeps"] += len(e["swept"])
        for item in e["swept"]:
            rest = item.partition(":")[2]
            name, _, gen = rest.partition("/")
            if (name, gen) in acked and ("embedded", name) not in ev.removed:
                res.violate("gc deletes nothing committed",
                            f"gc swept acknowledged {name}/{gen}")
        for name in e["deleted"]:
            res.violate("gc deletes nothing committed", f"gc deleted snapshot {name} "
                        "(no retention is configured)")


def final_gc_and_orphans(res: Result, ev: Evidence, label: str, config: Any,
                         roots: list[Path], acked_store: str | None) -> None:
    from isolane import SnapshotStore

    acked = {(a["name"], a["generation"]) for a in ev.acks if a.get("store") == acked_store}
    with SnapshotStore(config) as store:
        try:
            report = store.gc()
        except Exception as exc:
            res.violate("gc leaves no orphan", f"{label}: final gc failed: "
                        f"{type(exc).__name__}: {exc}")
            return
    for item in report.swept_generations:
        name, _, gen = item.partition(":")[2].partition("/")
        res.counts["final gc: generations swept"] += 1
        if (name, gen) in acked and (acked_store, name) not in ev.removed \
                and not name.startswith("ow-"):
            res.violate("gc deletes nothing committed", f"{label}: final gc swept acknowledged "
                        f"{name}/{gen}")
    # Orphans: every generation folder left must be the committed newest of its name.
    primary = roots[0] / "snapshots"
    for root in roots:
        snaps = root / "snapshots"
        if not snaps.is_dir():
            continue
        for entry in sorted(snaps.iterdir()):
            if entry.is_symlink():
                res.counts["planted symlinks still in place"] += 1
                continue
            gens = sorted(g.name for g in entry.iterdir() if not g.is_symlink()) \
                if entry.is_dir() else []
            if not gens:
                res.violate("gc leaves no orphan", f"{label}: empty folder {entry}")
                res.counts["orphans"] += 1
                continue
            committed = sorted(g.name for g in (primary / entry.name).iterdir()
                               if (g / "isolane.json").exists()) \
                if (primary / entry.name).is_dir() else []
            newest = committed[-1] if committed else None
            for gen in gens:
                if gen != newest:
                    res.violate("gc leaves no orphan", f"{label}: {entry / gen} "
                                f"(committed newest: {newest})")
                    res.counts["orphans"] += 1
    res.counts[f"orphan check: {label}"] += 1


# -- KV ---------------------------------------------------------------------------------------
def acked_keys(ev: Evidence, member: str) -> list[str]:
    return list(dict.fromkeys(k for e in ev.journals.get(member, []) if e["ev"] == "kv-ack"
                              for k in e["keys"]))


def run_kv_events(res: Result, ev: Evidence, member: str, strict_misses: bool) -> None:
    label = "embedded" if member == "kv" else "cluster"
    for e in ev.journals.get(member, []):
        if e["ev"] == "kv-wrong":
            res.violate("no KV get returns wrong bytes", f"{label} during the run ({e['via']}): "
                        f"{len(e['keys'])} blocks, e.g. {e['keys'][0]}")
            res.counts["wrong"] += len(e["keys"])
        elif e["ev"] == "kv-miss":
            res.counts[f"run: {label} KV misses"] += 1
            if strict_misses and e["key"] not in ev.damaged_keys | ev.evicted:
                res.violate("KV misses only for damaged or evicted blocks",
                            f"{label}: block {e['key']} missed during the run ({e['via']})")
    last: dict[int, dict[str, Any]] = {}
    for e in ev.journals.get(member, []):
        if e["ev"] == "kv-counts":
            last[e["pid"]] = e
    for e in last.values():
        for k in ("puts", "put_blocks", "gets", "blocks_read", "misses"):
            res.counts[f"run: {label} KV {k}"] += int(e[k])
        res.counts["bytes verified: KV (during run)"] += int(e["bytes_verified"])


def judge_blocks(res: Result, ev: Evidence, label: str, keys: list[str],
                 found: dict[str, bytes | None]) -> None:
    for key in keys:
        value = found.get(key)
        if value is None:
            if key in ev.damaged_keys:
                res.counts[f"final: {label} KV blocks missing, damaged on purpose"] += 1
            elif key in ev.evicted:
                res.counts[f"final: {label} KV blocks missing, evicted (device full)"] += 1
            else:
                res.counts["lost"] += 1
                res.counts[f"final: {label} KV blocks lost"] += 1
        elif value != block_value(bytes.fromhex(key)):
            res.counts["wrong"] += 1
            res.violate("no KV get returns wrong bytes", f"{label}: block {key} final read wrong")
        else:
            res.counts[f"final: {label} KV blocks read back"] += 1
            res.counts["bytes verified: KV (final)"] += KV_BLOCK_BYTES
    lost = res.counts[f"final: {label} KV blocks lost"]
    if lost:
        res.violate("KV misses only for damaged or evicted blocks",
                    f"{label}: {lost} acknowledged blocks found nowhere")


def check_cluster_kv(res: Result, ev: Evidence) -> None:
    from isolane.client.kv_pool import RemoteKVPool

    keys = acked_keys(ev, "kv-cluster")
    found: dict[str, bytes | None] = {}
    for url in ev.node_urls:  # on any node: moves and reroutes put blocks elsewhere
        with RemoteKVPool([url], namespace=KV_NAMESPACE, chunk_tokens=KV_CHUNK_TOKENS,
                          token_dim=KV_TOKEN_DIM, poll_s=None, timeout_s=30.0) as pool:
            todo = [k for k in keys if found.get(k) is None]
            for i in range(0, len(todo), BATCH):
                batch = todo[i:i + BATCH]
                for k, v in zip(batch, pool.get_blocks([bytes.fromhex(k) for k in batch]),
                                strict=True):
                    if v is not None:
                        if bytes(v) != block_value(bytes.fromhex(k)):
                            res.counts["wrong"] += 1
                            res.violate("no KV get returns wrong bytes",
                                        f"cluster: block {k} wrong on {url}")
                        found[k] = bytes(v)
    judge_blocks(res, ev, "cluster", keys, found)


def check_embedded_kv(res: Result, ev: Evidence) -> None:
    from isolane.kvpool.pool import KVPool

    keys = acked_keys(ev, "kv")
    found: dict[str, bytes | None] = {}
    with KVPool(str(ev.paths["embedded_config"]), namespace=KV_NAMESPACE,
                chunk_tokens=KV_CHUNK_TOKENS, token_dim=KV_TOKEN_DIM, memory_budget=0) as pool:
        for i in range(0, len(keys), BATCH):
            batch = keys[i:i + BATCH]
            for k, v in zip(batch, pool.get_blocks([bytes.fromhex(k) for k in batch]),
                            strict=True):
                found[k] = None if v is None else bytes(v)
    judge_blocks(res, ev, "embedded", keys, found)


def main() -> None:
    phase, run, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    ev = Evidence(run)
    res = Result()
    if phase == "remote":
        from isolane.client.snapshot_store import RemoteSnapshotStore

        store = RemoteSnapshotStore(read_json(ev.paths["nodes"])["base"], timeout_s=120.0)
        check_snapshots(res, ev, store, "remote")
        check_damage_detected(res, ev, store, "remote")
        store.close()
        check_cluster_kv(res, ev)
        run_kv_events(res, ev, "kv-cluster", strict_misses=False)
    else:
        from isolane import SnapshotStore

        config = str(ev.paths["embedded_config"])
        with SnapshotStore(config) as store:
            check_snapshots(res, ev, store, "embedded")
            check_damage_detected(res, ev, store, "embedded")
            check_overwrites(res, ev, store)
        check_verifier(res, ev)
        check_listing(res, ev)
        check_gc_journal(res, ev)
        final_gc_and_orphans(res, ev, "embedded", config, ev.embedded_roots, "embedded")
        for root in ev.node_roots:
            final_gc_and_orphans(res, ev, root.name, str(root / "isolane.yaml"),
                                 [root / "ckpt"], "remote")
        check_embedded_kv(res, ev)
        run_kv_events(res, ev, "kv", strict_misses=True)
    raw = [e for evs in ev.journals.values() for e in evs if e["ev"] == "raw"] \
        if phase == "local" else []
    if raw:
        res.counts["raw (non-isolane) exceptions"] = len(raw)
        for e in raw[:20]:
            res.violate("errors are IsolaneErrors", f"{e['op']}: {e['error'][:300]}")
    write_json(out, {**res.to_json(), "raw": [{"op": e["op"], "error": e["error"]}
                                              for e in raw[:50]]})
    os._exit(0)  # skip the interpreter's teardown of lanes and torch threads


if __name__ == "__main__":
    main()
