"""Deprecated path, kept for old imports and configs (see ``isolane.moved``)."""

from isolane.moved import forward

__getattr__, __dir__ = forward(__name__, "isolane.integrations.vllm.connector")
