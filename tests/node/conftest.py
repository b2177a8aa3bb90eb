"""A storage node shared by the API tests of this folder (one process, with a token).

Tests that stop, kill or restart a node start their own (``NodeProcess``); the shared
one only sees namespaces and snapshot names unique to each test.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest

from tests.support.node import NodeProcess, write_node_config

TOKEN = "test-token-" + secrets.token_hex(8)


@pytest.fixture(scope="session")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    config = write_node_config(tmp_path_factory.mktemp("node"))
    with NodeProcess(config, token=TOKEN, args=("--max-request-bytes", "1MiB",
                                                 "--max-block-bytes", "256KiB")) as proc:
        yield proc


@pytest.fixture
def unique() -> str:
    return secrets.token_hex(4)
