"""The snapshot-store contract on ``SnapshotStore`` over S3 (the session's SeaweedFS, a
bucket per test)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from isolane.snapshot import SnapshotStore
from tests.contracts.snapshot_store_contract import SnapshotStoreContract

pytestmark = pytest.mark.s3


class TestS3SnapshotStore(SnapshotStoreContract):
    @pytest.fixture
    def store(self, s3_url: tuple[str, dict[str, Any]]) -> Iterator[SnapshotStore]:
        url, options = s3_url
        store = SnapshotStore(url, storage_options=options)
        yield store
        store.close()
