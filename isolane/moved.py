"""Old module paths kept working after a move (docs/ARCHITECTURE.md, "Moved modules").

A module left at an old path is two lines: ``__getattr__, __dir__ =
forward(__name__, "isolane.new.path")``. Importing it warns once (DeprecationWarning,
where the import happened) and every name is looked up in the new module, so
``from old import Name`` and vLLM's ``kv_connector_module_path`` get the very same
objects.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any


def forward(old: str, new: str) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` of the shim at ``old``."""
    moved = importlib.import_module(new)
    # stacklevel 3: past this function and the shim's module body, to the importer
    warnings.warn(f"{old} is deprecated: import {new} instead", DeprecationWarning,
                  stacklevel=3)

    def getattr_(name: str) -> Any:
        return getattr(moved, name)

    def dir_() -> list[str]:
        return dir(moved)

    return getattr_, dir_
