"""Fixtures the contract modules share: one real ``isolane serve`` node per module,
with a token of its own (``node.token``)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest

from tests.support.node import NodeProcess, write_node_config


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    config = write_node_config(tmp_path_factory.mktemp("contract-node"))
    with NodeProcess(config, token="contract-" + secrets.token_hex(8)) as proc:
        yield proc
