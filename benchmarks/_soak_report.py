"""The soak's results: counted from the journals and the checks, written as markdown."""

from __future__ import annotations

from collections import Counter
from typing import Any

from benchmarks._common import markdown_table
from benchmarks._results import Result

INVARIANTS = (
    "acknowledged saves load bit-exact",
    "damage is detected",
    "one damaged snapshot fails alone",
    "overwrite keeps the newest commit",
    "one save wins a new name",
    "no KV get returns wrong bytes",
    "KV misses only for damaged or evicted blocks",
    "gc deletes nothing committed",
    "gc leaves no orphan",
    "nothing outside the stores changes",
    "no process hangs",
    "no member exits by itself",
    "no cluster client crashes",
    "every node back in the membership",
    "members exit cleanly",
    "members restart",
    "nodes log no tracebacks",
    "errors are IsolaneErrors",
    "final check runs",
)
SAVERS = ("sync", "async", "incremental", "overwrite", "race-a", "race-b", "dist", "remote")


def summarize(journals: dict[str, list[dict[str, Any]]], checks: list[dict[str, Any]],
              findings: list[dict[str, str]], *, canary_changed: int, canary_entries: int,
              tmpfs_note: str, minutes: float, seed: int, starts: dict[str, int],
              cluster: dict[str, Any]) -> dict[str, Any]:
    counts: Counter[str] = Counter()
    for check in checks:
        counts.update(check.get("counts", {}))
    ops: list[tuple[str, int, str]] = []
    for member in SAVERS:
        evs = journals.get(member, [])
        acked = [e for e in evs if e["ev"] == "ack"]
        failed = [e for e in evs if e["ev"] == "fail"]
        linked = sum(int(e.get("linked", 0)) for e in acked)
        errors = Counter(e["error"].split(":")[0] for e in failed)
        detail = ", ".join(f"{n} {k}" for k, n in errors.most_common(4))
        if member == "incremental":
            detail = f"{linked / 1e6:.0f} MB linked from parents" + (f"; {detail}" if detail
                                                                     else "")
        ops.append((f"save ({member}) acknowledged / failed", len(acked),
                    f"{len(failed)} failed" + (f": {detail}" if detail else "")))
    gc = journals.get("gc", [])
    ops.append(("gc runs", sum(e["ev"] == "gc" for e in gc),
                f"{sum(len(e['swept']) for e in gc if e['ev'] == 'gc')} generations swept, "
                f"{sum(e['ev'] == 'gc-fail' for e in gc)} runs failed"))
    rm = journals.get("rm", [])
    ops.append(("rm", sum(e["ev"] == "rm-done" for e in rm),
                f"{sum(e['ev'] == 'rm-fail' for e in rm)} failed"))
    verify = Counter(e["outcome"] for e in journals.get("verify", []) if e["ev"] == "verify")
    ops.append(("verify loads (during run)", sum(verify.values()),
                ", ".join(f"{n} {k}" for k, n in sorted(verify.items()))))
    for label in ("embedded", "cluster"):
        ops.append((f"KV puts ({label})", counts[f"run: {label} KV puts"],
                    f"{counts[f'run: {label} KV put_blocks']} blocks acknowledged"))
        ops.append((f"KV gets ({label})", counts[f"run: {label} KV gets"],
                    f"{counts[f'run: {label} KV blocks_read']} blocks read and checked, "
                    f"{counts[f'run: {label} KV misses']} misses"))
    members = [e for e in journals.get("chaos", []) if e["ev"] == "membership-done"]
    ops.append(("node joins / leaves", len(members),
                ", ".join(f"{e['action']} ({'moved' if e.get('moved') else 'not moved'})"
                          for e in members)))
    faults = [e for e in journals.get("chaos", []) if e["ev"] == "fault"]
    kills = Counter(e["target"].split("-")[0] if e["target"].startswith("node") else e["target"]
                    for e in faults if e["fault"] == "kill" and "target" in e)
    injected = Counter(e["fault"] for e in faults if "skipped" not in e)
    skipped = Counter(e["fault"] for e in faults if "skipped" in e)
    filled = sum(int(e.get("bytes", 0)) for e in faults if e["fault"] == "fill-disk")
    violations = [*findings, *[v for c in checks for v in c.get("violations", [])]]
    by_invariant = Counter(v["invariant"] for v in violations)
    bytes_verified = sum(n for k, n in counts.items() if k.startswith("bytes verified"))
    raw = [r for c in checks for r in c.get("raw", [])]
    return {
        "minutes": minutes, "seed": seed, "disk_full": tmpfs_note,
        "operations": ops, "kills": dict(kills), "faults": dict(injected),
        "faults_skipped": dict(skipped), "filled_bytes": filled,
        "bytes_verified": bytes_verified, "lost": counts["lost"], "wrong": counts["wrong"],
        "orphans": counts["orphans"], "canary_changed": canary_changed,
        "canary_entries": canary_entries, "violations": violations,
        "by_invariant": dict(by_invariant), "counts": dict(counts), "raw": raw,
        "starts": starts, "cluster": cluster,
    }


def headline_rows(r: dict[str, Any], *, command: str, when: str, machine: str
                  ) -> list[Result]:
    """The results page's rows: the invariants held, the bytes checked, the canary."""
    run = {"area": "Robustness", "machine": machine, "date": when, "command": command}
    return [
        Result(measure=f"violations of {len(INVARIANTS)} invariants in {r['minutes']:g} "
                       f"minutes of chaos, seed {r['seed']} (lost, wrong, orphaned, hung)",
               value=len(r["violations"]), unit="violations", target="0",
               met=not r["violations"], **run),
        Result(measure="bytes read back and checked", value=round(r["bytes_verified"] / 1e9, 2),
               unit="GB", **run),
        Result(measure="entries changed in a canary tree beside the stores",
               value=r["canary_changed"], unit=f"of {r['canary_entries']}", target="0",
               met=not r["canary_changed"], **run),
    ]


def report_markdown(r: dict[str, Any], *, command: str, when: str, machine: str) -> str:
    ok = not r["violations"]
    lines = [
        "## Chaos soak (`benchmarks/soak.py`)", "",
        f"`{command}` — {when}, {r.get('wall_s', '?')} s wall. {machine}", "",
        f"{r['minutes']:g} minutes of chaos on seed {r['seed']}: trainers (sync, async, "
        "incremental, overwrite, a 2-rank torchrun job with gloo) on the embedded store, a "
        "trainer through three `isolane serve` nodes, gc and rm running concurrently, a "
        "verifier loading acknowledged snapshots, inference putting and getting KV prompts "
        "on the embedded pool and through the nodes, a fourth node joining and leaving; "
        "beside them three nodes found through etcd under node kills, a stop and an etcd "
        "restart. "
        "Disk full: " + r["disk_full"] + " holding the second checkpoint and KV device of "
        "the embedded store. KV values are derived from their keys, state dicts from their "
        "seeds, so every byte read back is checked. Not a timing benchmark: the numbers "
        "of operations depend on the machine's load.", "",
        f"**Result: {'PASS' if ok else 'FAIL'}** — lost = {r['lost']}, wrong = {r['wrong']}, "
        f"orphans = {r['orphans']}, canary entries changed = {r['canary_changed']} of "
        f"{r['canary_entries']}, bytes verified = {r['bytes_verified'] / 1e9:.2f} GB, "
        f"violations = {len(r['violations'])}.", "",
        "### Invariants", "",
        markdown_table(["invariant", "violations"],
                       [(name, r["by_invariant"].get(name, 0)) for name in INVARIANTS]),
        "", "### Operations", "",
        markdown_table(["operation", "count", "detail"], r["operations"]),
        "", "### Faults injected", "",
        markdown_table(["fault", "count"], [
            *[(f"SIGKILL {target}", n) for target, n in sorted(r["kills"].items())],
            *[(kind, n) for kind, n in sorted(r["faults"].items()) if kind != "kill"],
            ("disk filled to ENOSPC (bytes written in total)", r["filled_bytes"]),
        ]), "",
        "Faults without a target at that moment (e.g. no file yet): " + (", ".join(
            f"{n} {k}" for k, n in sorted(r["faults_skipped"].items())) or "none") + ".", "",
        *cluster_markdown(r.get("cluster") or {}),
        "### Final check", "",
        markdown_table(["count", "value"], sorted(
            (k, v) for k, v in r["counts"].items() if not k.startswith("run: "))),
    ]
    if r["violations"]:
        lines += ["", "### Violations", ""]
        seen: Counter[str] = Counter()
        for v in r["violations"]:
            seen[v["invariant"]] += 1
            if seen[v["invariant"]] <= 5:
                lines.append(f"- {v['invariant']}: {v['detail'][:400]}")
        more = {k: n - 5 for k, n in seen.items() if n > 5}
        if more:
            lines.append("- and " + ", ".join(f"{n} more of '{k}'" for k, n in more.items()))
    return "\n".join(lines) + "\n"


def cluster_markdown(c: dict[str, Any]) -> list[str]:
    """The etcd cluster phase: its faults, and the share of blocks served per window."""
    if not c:
        return ["### Cluster through etcd", "", "(did not run)", ""]
    rows = [(w, n_gets, asked, served, "-" if not asked else f"{served / asked:.1%}", full)
            for w, (asked, served, n_gets, full) in c["windows"].items()]
    faults = [(e["fault"], e.get("node", "etcd"),
               ", ".join(f"{k} {v}" for k, v in e.items() if k.endswith("_s")))
              for e in c["events"]]
    return [
        "### Cluster through etcd", "",
        f"Three `isolane serve --cluster etcd://...` nodes (2 s leases) and {c['clients']} "
        "client processes on `KVPool.connect(\"etcd://...\")` putting and reading 8-block "
        f"prompts: {c['puts']} prompts acknowledged, {c['blocks_checked']} blocks read and "
        f"checked, {c['wrong']} wrong, {c['errors']} calls failed with an IsolaneError; "
        f"{c['registered']} nodes registered in etcd at the end. Served share after the "
        f"churn (every acknowledged prompt read once more): **{c['served_share_after']}**.",
        "", markdown_table(["fault", "target", "seconds (left / back)"], faults), "",
        markdown_table(["window", "gets", "blocks asked", "blocks served", "share",
                        "full hits"], rows), ""]
