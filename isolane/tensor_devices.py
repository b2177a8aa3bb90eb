"""Whether isolane can read a tensor's bytes where it lies.

A meta tensor has no bytes, and a CUDA tensor cannot be copied in a process where CUDA
is not available (a tensor made elsewhere, or a fake): both are refused at the door, with
the way out, before anything is stored or any layout is fixed.
"""

from __future__ import annotations

import torch


def unreadable_device(t: torch.Tensor) -> str | None:
    """Why ``t``'s bytes cannot be read here, or None when they can."""
    kind = t.device.type
    if kind == "meta":
        return "a meta tensor holds no data; materialize it (load or compute its values) first"
    if kind == "cuda" and not torch.cuda.is_available():
        return (f"it is on {t.device} but CUDA is not available in this process; move it "
                "to the CPU (.cpu()) where it was made")
    return None
