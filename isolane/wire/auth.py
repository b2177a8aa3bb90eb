"""Bearer tokens: where a node's token comes from, and a constant-time check (pure).

A node with a token refuses every request that does not carry
``Authorization: Bearer <token>`` (HTTP 401) before its handler runs, so nothing is
read or written for it. The token comes from ``ISOLANE_TOKEN``, else the config's
``node.token``; none at all means no check, which ``isolane serve`` allows only on a
loopback address.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from collections.abc import Mapping

ENV_TOKEN = "ISOLANE_TOKEN"


def resolve_token(config_token: str | None, env: Mapping[str, str] | None = None
                  ) -> str | None:
    """``ISOLANE_TOKEN`` > ``node.token`` > no token; an empty value counts as none."""
    env = os.environ if env is None else env
    return env.get(ENV_TOKEN) or config_token or None


def authorized(expected: str | None, header: str | None) -> bool:
    """Whether an ``Authorization`` header carries ``expected`` (always, without one).
    The comparison takes the same time wherever the first wrong byte is."""
    if expected is None:
        return True
    scheme, _, given = (header or "").partition(" ")
    if scheme.lower() != "bearer":
        given = ""
    return hmac.compare_digest(given.strip().encode(), expected.encode())


def bearer(token: str | None) -> dict[str, str]:
    """The request header that carries ``token`` ({} without one)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
