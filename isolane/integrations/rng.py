"""Random number generator states as snapshot-storable values (tensors and numbers).

A resumed run continues bit-exact only if every generator the loop draws from is back
where it was: torch's CPU generator, the CUDA generators when CUDA is in use, Python's
``random`` and NumPy's legacy global ``np.random``. ``capture_rng`` turns their states
into a dict of tensors, ints, floats and strings (what a snapshot stores without
pickling); ``restore_rng`` puts them back. Layout (``RNG_FORMAT`` = 1)::

    {"format": 1,
     "torch": uint8 tensor (torch.get_rng_state()),
     "cuda": [uint8 tensor per device]            # only when CUDA was initialised
     "python": {"version": int, "state": int64 tensor [625], "gauss_next": float|None},
     "numpy": {"kind": "MT19937", "keys": int64 tensor [624], "pos": int,
               "has_gauss": int, "cached_gaussian": float}}

Generators created by the user (``torch.Generator`` objects, ``np.random.default_rng``)
are not global and not captured; keep their states in ``extra``.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from isolane.errors import InvalidArgumentError

RNG_FORMAT = 1


def capture_rng() -> dict[str, Any]:
    """The global generators' states, as plain values and tensors (copies)."""
    version, state, gauss_next = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    keys = np.asarray(keys)
    out: dict[str, Any] = {
        "format": RNG_FORMAT,
        "torch": torch.get_rng_state(),
        "python": {"version": int(version), "state": torch.tensor(state, dtype=torch.int64),
                   "gauss_next": gauss_next},
        "numpy": {"kind": str(kind), "keys": torch.from_numpy(keys.astype(np.int64)),
                  "pos": int(pos), "has_gauss": int(has_gauss),
                  "cached_gaussian": float(cached)},
    }
    # Reading CUDA states would initialise CUDA in a CPU-only process; skip it then.
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        out["cuda"] = list(torch.cuda.get_rng_state_all())
    return out


def restore_rng(state: dict[str, Any]) -> None:
    """Put back the states ``capture_rng`` returned (also after a store round trip)."""
    if not isinstance(state, dict) or state.get("format") != RNG_FORMAT:
        raise InvalidArgumentError(
            f"not an RNG state of format {RNG_FORMAT} (got {type(state).__name__} with format "
            f"{state.get('format') if isinstance(state, dict) else None!r}); pass what "
            "isolane.integrations.rng.capture_rng() returned")
    torch.set_rng_state(state["torch"].to(torch.uint8))
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()),
                     py["gauss_next"]))
    npst = state["numpy"]
    np.random.set_state((npst["kind"], npst["keys"].numpy().astype(np.uint32), npst["pos"],
                         npst["has_gauss"], npst["cached_gaussian"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([t.to(torch.uint8) for t in state["cuda"]])
