"""Deprecated path: the module is ``isolane.integrations.callbacks`` now.

See docs/ARCHITECTURE.md, "Moved modules".

Kept so that existing imports and configs naming ``isolane.snapshot.callbacks`` keep
working; it warns once (DeprecationWarning) and hands every name on to the new module.
"""

import warnings
from typing import Any

import isolane.integrations.callbacks as _moved

warnings.warn("isolane.snapshot.callbacks is deprecated: "
              "import isolane.integrations.callbacks instead",
              DeprecationWarning, stacklevel=2)


def __getattr__(name: str) -> Any:
    return getattr(_moved, name)


def __dir__() -> list[str]:
    return dir(_moved)
