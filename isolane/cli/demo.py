"""``isolane demo``: a small LoRA-style fine-tune checkpointed end to end.

On the current store: build an MLP with a low-rank adapter and AdamW state (about
``size_mb`` MiB in all), train two steps, save ``demo-step-1``; change only the
adapter, save ``demo-step-2`` with ``save_async`` (unchanged chunks are linked, not
written); list, verify, restore bit-exact, export the model to .safetensors, and keep
only the newest snapshot. Re-running overwrites the demo's own snapshots; snapshots
with other names are never removed.
"""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from isolane.cli.formats import flatten_tensors, tensor_bytes, write_state
from isolane.cli.progress import ProgressBar, human_bytes, rate_text
from isolane.cli.render import snapshot_table
from isolane.errors import IntegrityError

if TYPE_CHECKING:
    from isolane.snapshot import SnapshotInfo, SnapshotStore

STEP_1 = "demo-step-1"
STEP_2 = "demo-step-2"
DEMO_NAMES = (STEP_1, STEP_2)
RANK = 8
STEPS = 9


class DemoModel(nn.Module):
    """``base(x) + x A^T B^T``: a frozen-size MLP plus a rank-``rank`` adapter."""

    def __init__(self, width: int, rank: int = RANK) -> None:
        super().__init__()
        self.base = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))
        self.adapter_a = nn.Parameter(torch.randn(rank, width) * 0.01)
        self.adapter_b = nn.Parameter(torch.zeros(width, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.base(x) + (x @ self.adapter_a.T) @ self.adapter_b.T
        return out


def width_for(size_mb: int) -> int:
    """MLP width whose weights plus AdamW's two moments take about ``size_mb`` MiB:
    3 copies x 4 bytes x 2 width^2 weights = 24 width^2 bytes."""
    return max(16, int(math.sqrt(size_mb * (1 << 20) / 24)))


def clone_state(value: Any) -> Any:
    """A deep copy of a state dict's tensors (what a snapshot must give back)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, Mapping):
        return {k: clone_state(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(clone_state(v) for v in value)
    return value


def first_difference(expected: Any, actual: Any, path: str = "") -> str | None:
    """The dotted key of the first leaf that is not bit-identical, or None."""
    where = path or "(root)"
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            return f"{where}: expected a tensor, got {type(actual).__name__}"
        if expected.dtype != actual.dtype or expected.shape != actual.shape:
            return (f"{where}: expected {expected.dtype} {tuple(expected.shape)}, got "
                    f"{actual.dtype} {tuple(actual.shape)}")
        a = expected.contiguous().reshape(-1).view(torch.uint8)
        b = actual.contiguous().reshape(-1).view(torch.uint8)
        return None if torch.equal(a, b) else f"{where}: bytes differ"
    if isinstance(expected, Mapping):
        if not isinstance(actual, Mapping) or set(expected) != set(actual):
            return f"{where}: keys differ"
        for key in expected:
            diff = first_difference(expected[key], actual[key], f"{path}.{key}".lstrip("."))
            if diff:
                return diff
        return None
    if isinstance(expected, list | tuple):
        if type(expected) is not type(actual) or len(expected) != len(actual):
            return f"{where}: expected a {type(expected).__name__} of {len(expected)}"
        for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
            diff = first_difference(e, a, f"{path}.{i}".lstrip("."))
            if diff:
                return diff
        return None
    return None if expected == actual and type(expected) is type(actual) else (
        f"{where}: expected {expected!r}, got {actual!r}")


def training_state(model: DemoModel, optimizer: torch.optim.Optimizer, step: int
                   ) -> dict[str, Any]:
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}


def run_demo(store: SnapshotStore, size_mb: int, *, say: Callable[[str], None],
             progress: Callable[[str], ProgressBar]) -> None:
    torch.manual_seed(0)
    width = width_for(size_mb)
    model = DemoModel(width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, target = torch.randn(64, width), torch.randn(64, width)
    losses = []
    for _ in range(2):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), target)
        torch.autograd.backward(loss)
        optimizer.step()
        losses.append(loss.item())
    state = training_state(model, optimizer, step=2)
    n_params = sum(p.numel() for p in model.parameters())
    say(f"[1/{STEPS}] model: MLP width {width} + rank-{RANK} adapter, {n_params:,} parameters "
        f"+ AdamW state = {human_bytes(tensor_bytes(state))}; store {store.url}")
    say(f"[2/{STEPS}] trained 2 steps: loss {losses[0]:.4f} -> {losses[1]:.4f}")

    with progress(f"saving {STEP_1}") as bar:
        t0 = time.perf_counter()
        info1 = store.save(state, STEP_1, {"step": 2, "demo": True}, overwrite=True,
                           parent=False, progress=bar)
        seconds = time.perf_counter() - t0
    say(f"[3/{STEPS}] saved {STEP_1} (sync): {info1.tensors} tensors, "
        f"{human_bytes(info1.logical_bytes)} in {seconds:.2f} s "
        f"({rate_text(info1.logical_bytes, seconds)}); {_written_linked(info1)}")

    with torch.no_grad():  # an adapter-only update, as a LoRA step makes
        model.adapter_b.add_(torch.randn_like(model.adapter_b) * 1e-2)
    state = training_state(model, optimizer, step=3)
    expected = clone_state(state)
    with progress(f"saving {STEP_2}") as bar:
        t0 = time.perf_counter()
        handle = store.save_async(state, STEP_2, {"step": 3, "demo": True}, overwrite=True,
                                  parent=STEP_1, progress=bar)
        blocked_s = time.perf_counter() - t0
        with torch.no_grad():  # the training loop goes on while the save commits
            model.adapter_b.zero_()
        info2 = handle.result()
        seconds = time.perf_counter() - t0
    say(f"[4/{STEPS}] saved {STEP_2} (async, adapter changed): training blocked "
        f"{blocked_s:.3f} s, committed after {seconds:.2f} s "
        f"({rate_text(info2.logical_bytes, seconds)})")
    share = info2.linked_bytes / info2.stored_bytes * 100 if info2.stored_bytes else 0.0
    say(f"      incremental: {_written_linked(info2)} — {share:.1f}% of the bytes "
        f"linked from {STEP_1}, not rewritten")

    say(f"[5/{STEPS}] isolane ls:")
    say(snapshot_table(store.list()))

    for name in DEMO_NAMES:
        with progress(f"verifying {name}") as bar:
            t0 = time.perf_counter()
            info = store.verify(name, progress=bar)
            seconds = time.perf_counter() - t0
        say(f"[6/{STEPS}] verified {name}: {human_bytes(info.stored_bytes)} checked in "
            f"{seconds:.2f} s ({rate_text(info.stored_bytes, seconds)})")

    with progress(f"restoring {STEP_2}") as bar:
        t0 = time.perf_counter()
        restored = store.load(STEP_2, progress=bar)
        seconds = time.perf_counter() - t0
    diff = first_difference(expected, restored)
    if diff is not None:
        raise IntegrityError(f"snapshot '{STEP_2}'", f"restored state differs at {diff}")
    nbytes = tensor_bytes(restored)
    say(f"[7/{STEPS}] restored {STEP_2}: bit-exact, {human_bytes(nbytes)} in {seconds:.2f} s "
        f"({rate_text(nbytes, seconds)})")

    with tempfile.TemporaryDirectory(prefix="isolane-demo-") as folder:
        dest = Path(folder) / f"{STEP_2}.safetensors"
        t0 = time.perf_counter()
        weights = store.load(STEP_2, keys=["model"])
        size = write_state(weights, dest, overwrite=False)
        seconds = time.perf_counter() - t0
        from safetensors.torch import load_file

        exported = load_file(dest)
        diff = first_difference(flatten_tensors(expected["model"]),
                                {k.removeprefix("model."): v for k, v in exported.items()})
        if diff is not None:
            raise IntegrityError(f"export {dest}", f"exported weights differ at {diff}")
        say(f"[8/{STEPS}] exported the model weights to {dest.name}: {human_bytes(size)} in "
            f"{seconds:.2f} s ({rate_text(size, seconds)}), read back bit-exact")

    others = [i.name for i in store.list() if i.name not in DEMO_NAMES]
    if others:
        store.delete(STEP_1)
        say(f"[9/{STEPS}] the store also holds {len(others)} other snapshot(s), which "
            f"'gc --keep-last 1' would remove; removed {STEP_1} only")
    else:
        report = store.gc(keep_last=1)
        removed = ", ".join(report.deleted_snapshots) or "nothing"
        say(f"[9/{STEPS}] gc --keep-last 1: removed {removed}; {STEP_2} stays "
            f"(its chunks are self-contained: links, not references)")
    say(f"done: try 'isolane show {STEP_2}' or 'isolane restore {STEP_2} model.pt' on this "
        "store")


def _written_linked(info: SnapshotInfo) -> str:
    return (f"written {human_bytes(info.written_bytes)}, linked "
            f"{human_bytes(info.linked_bytes)}")
