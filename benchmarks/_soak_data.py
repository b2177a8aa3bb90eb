"""Soak data that describes itself: state dicts rebuilt from a seed, KV blocks derived
from their key, and the append-only journals every soak process writes.

Whoever checks a snapshot or a KV block needs nothing but the journal line that
acknowledged it: the seed rebuilds the state dict bit for bit, the key rebuilds the
block's bytes, so a wrong byte anywhere is detected (and told apart from a miss).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

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
