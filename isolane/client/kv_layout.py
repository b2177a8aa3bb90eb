"""The layout of a remote KV namespace, as a ``RemoteKVPool`` comes to know it.

Given to the client (``layout=``), fixed by its first token-level put, or learnt from
the first node that knows the namespace (``GET /v1/kv/{ns}``). While no node knows it,
the nodes are asked again at most every ``down_s`` seconds. A learnt layout must agree
with the ``chunk_tokens``/``token_dim`` the client was opened with (``ConfigError``
naming the stored values otherwise). Set once, under a lock; thread-safe.
"""

from __future__ import annotations

import threading
import time

from isolane.client.kv_nodes import KVNodeClient
from isolane.errors import ConfigError, InvalidArgumentError, KeyNotFoundError, NodeUnavailableError
from isolane.kvpool.token_dim import resolve_token_dim
from isolane.wire.layout import NamespaceLayout


class RemoteLayout:
    """See the module docstring. ``chunk_tokens``: what the client asked for (None:
    whatever the namespace has); ``token_dim``: the index it asked for (may be negative)."""

    def __init__(self, namespace: str, nodes: KVNodeClient, *,
                 given: NamespaceLayout | None, chunk_tokens: int | None, token_dim: int,
                 down_s: float) -> None:
        self.namespace = namespace
        self._nodes = nodes
        self._chunk_tokens = chunk_tokens
        self._token_dim = token_dim
        self._down_s = down_s
        self._lock = threading.Lock()
        self.layout = given
        self._unknown_until = 0.0  # no node knew the namespace: do not ask again before

    def known(self, candidates: list[str]) -> NamespaceLayout | None:
        """The layout, asking the live ``candidates`` for it while it is not known."""
        if self.layout is not None or time.monotonic() < self._unknown_until:
            return self.layout
        for node in self._nodes.live(candidates):
            try:
                answer = self._nodes.call_json(node, "GET")
            except KeyNotFoundError:
                continue
            except NodeUnavailableError as exc:
                self._nodes.mark_down(node, exc)
                continue
            return self.adopt(NamespaceLayout.from_dict(answer.get("layout")))
        self._unknown_until = time.monotonic() + self._down_s
        return None

    def adopt(self, layout: NamespaceLayout) -> NamespaceLayout:
        """Fix the layout to ``layout`` unless one is known; the layout in force."""
        with self._lock:
            if self.layout is not None:
                return self.layout
            try:
                token_dim = resolve_token_dim(self._token_dim, len(layout.shape) + 1)
            except InvalidArgumentError:
                token_dim = -1
            wanted = self._chunk_tokens
            if (wanted is not None and wanted != layout.chunk_tokens) or (
                    layout.token_dim != token_dim):
                raise ConfigError("kvpool.chunk_tokens", (
                    f"namespace '{self.namespace}' was stored with chunk_tokens="
                    f"{layout.chunk_tokens} and token_dim={layout.token_dim}; open it with "
                    "the same values or use another namespace"))
            self.layout = layout
            return layout
