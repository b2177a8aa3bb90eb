"""Deprecated path: the module is ``isolane.integrations.vllm.connector`` now.

See docs/ARCHITECTURE.md, "Moved modules".

Kept so that existing imports and configs naming ``isolane.kvpool.vllm_connector`` keep
working; it warns once (DeprecationWarning) and hands every name on to the new module.
"""

import warnings
from typing import Any

import isolane.integrations.vllm.connector as _moved

warnings.warn("isolane.kvpool.vllm_connector is deprecated: "
              "import isolane.integrations.vllm.connector instead",
              DeprecationWarning, stacklevel=2)


def __getattr__(name: str) -> Any:
    return getattr(_moved, name)


def __dir__() -> list[str]:
    return dir(_moved)
