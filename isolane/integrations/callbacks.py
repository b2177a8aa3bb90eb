"""Training-loop checkpointing through a SnapshotStore (embedded or remote).

- ``PeriodicSnapshot``: a plain PyTorch loop calls ``step()`` after each optimizer step;
  every ``every_n_steps`` it saves model, optimizer, LR scheduler, RNG states, the step
  and ``extra`` (async by default: the loop continues once the tensors are staged), keeps
  the newest ``keep_last`` snapshots of its prefix, and ``resume()`` restores the newest.
- ``IsolaneTrainerCallback`` (Hugging Face ``transformers``) and ``IsolaneCheckpointIO``
  (PyTorch Lightning) live in ``hf_trainer.py`` and ``lightning_io.py``; importing them
  from here imports transformers/lightning only then, with an install hint when missing.
  What the three share (the store API, listing and pruning ``<prefix><step>`` snapshots,
  starting a save from rank 0) is ``step_snapshots.py``: they import it, never this
  module, so this lazy re-export closes no import cycle.

What a snapshot holds (``PeriodicSnapshot``)::

    {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
     "scheduler": scheduler.state_dict() (only with a scheduler),
     "rng": capture_rng() (see rng.py), "step": int, "extra": extra (only when given)}

Optimizer state dicts (nested dicts with int keys, tuples of betas, None) are stored as
they are: the snapshot tree keeps int keys and tuples and never pickles. A value the
tree cannot store (a function, a custom object) is refused with its key path before any
I/O — convert it to tensors or plain values first.

Not thread-safe: call from the training loop's thread.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from isolane.errors import IntegrityError, InvalidArgumentError, MissingDependencyError
from isolane.integrations.rng import capture_rng, restore_rng
from isolane.integrations.step_snapshots import (
    PendingSave,
    SnapshotTarget,
    check_async,
    check_prefix,
    prune_snapshots,
    snapshots_with_prefix,
    start_save,
)

if TYPE_CHECKING:
    from isolane.integrations.hf_trainer import IsolaneTrainerCallback
    from isolane.integrations.lightning_io import IsolaneCheckpointIO

log = logging.getLogger(__name__)

__all__ = ["IsolaneCheckpointIO", "IsolaneTrainerCallback", "PeriodicSnapshot",
           "SnapshotTarget", "snapshots_with_prefix"]


class PeriodicSnapshot:
    """Save every ``every_n_steps`` optimizer steps; keep the newest ``keep_last``.

    Call order: ``resume()`` once before the loop (returns the step to continue after,
    0 when there is no snapshot), ``step(step, ...)`` after each optimizer (and
    scheduler) step with the number of steps done so far, ``close()`` at the end (waits
    for the last save and raises its error). With ``async_=True`` a save returns once
    its tensors are staged; the previous save must have committed before the next one
    starts (``step`` waits for it then, which is back-pressure, not a copy).
    """

    def __init__(self, store: SnapshotTarget, every_n_steps: int, keep_last: int | None = 3,
                 async_: bool = True, *, prefix: str = "step-") -> None:
        if every_n_steps < 1:
            raise InvalidArgumentError(f"every_n_steps must be >= 1, got {every_n_steps}")
        if keep_last is not None and keep_last < 1:
            raise InvalidArgumentError(f"keep_last must be >= 1 or None, got {keep_last}")
        check_async(store, async_)
        self.store = store
        self.every_n_steps = every_n_steps
        self.keep_last = keep_last
        self.async_ = async_
        self.prefix = check_prefix(prefix)
        self.extra: Any = None  # what the restored snapshot held as ``extra``
        self._pending: PendingSave | None = None

    def name(self, step: int) -> str:
        return f"{self.prefix}{step}"

    def step(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             scheduler: Any = None, extra: Any = None) -> bool:
        """Save when ``step`` is a multiple of ``every_n_steps``; True when a save started."""
        if step <= 0 or step % self.every_n_steps:
            return False
        self.save(step, model, optimizer, scheduler, extra)
        return True

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             scheduler: Any = None, extra: Any = None) -> None:
        """Save now, whatever the step (e.g. before a planned stop)."""
        self._finish_pending()
        state: dict[str, Any] = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                 "rng": capture_rng(), "step": int(step)}
        if scheduler is not None:
            state["scheduler"] = scheduler.state_dict()
        if extra is not None:
            state["extra"] = extra
        self._pending = start_save(self.store, state, self.name(step), {"step": int(step)},
                                   self.async_)
        if self._pending is None:
            prune_snapshots(self.store, self.prefix, self.keep_last)

    def _finish_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()  # raises the save's error here, in the loop
            prune_snapshots(self.store, self.prefix, self.keep_last)

    def resume(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
               scheduler: Any = None) -> int:
        """Restore the newest committed snapshot of this prefix into the given objects
        and the global RNGs; return its step (0 when there is none). A snapshot that
        fails its integrity check is skipped for the one before it, with a warning."""
        self._finish_pending()
        for step, name in reversed(snapshots_with_prefix(self.store, self.prefix)):
            try:
                state = self.store.load(name)
            except IntegrityError as exc:
                log.warning("snapshot '%s' is damaged, trying the one before it: %s", name, exc)
                continue
            model.load_state_dict(state["model"])
            if optimizer is not None:
                optimizer.load_state_dict(state["optimizer"])
            if scheduler is not None:
                if "scheduler" not in state:
                    raise InvalidArgumentError(f"snapshot '{name}' holds no scheduler state; "
                                               "resume without scheduler= or start afresh")
                scheduler.load_state_dict(state["scheduler"])
            restore_rng(state["rng"])
            self.extra = state.get("extra")
            return int(state.get("step", step))
        return 0

    def wait(self) -> None:
        """Wait for the save in flight to commit (raises its error), then prune."""
        self._finish_pending()

    def close(self) -> None:
        self.wait()

    def __enter__(self) -> PeriodicSnapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def __getattr__(name: str) -> Any:
    # The framework integrations import their framework: only when asked for.
    if name == "IsolaneTrainerCallback":
        try:
            from isolane.integrations.hf_trainer import IsolaneTrainerCallback
        except ImportError as exc:
            raise MissingDependencyError("transformers", "IsolaneTrainerCallback") from exc
        return IsolaneTrainerCallback
    if name == "IsolaneCheckpointIO":
        try:
            from isolane.integrations.lightning_io import IsolaneCheckpointIO
        except ImportError as exc:
            raise MissingDependencyError("lightning", "IsolaneCheckpointIO") from exc
        return IsolaneCheckpointIO
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
