from __future__ import annotations

import sys

import pytest

from isolane.config import config_from_dict
from isolane.lanes.assignment import JobKind
from isolane.lanes.ioprio import IOPRIO_CLASS_BE, IOPRIO_CLASS_RT, thread_io_priority
from isolane.lanes.scheduler import LaneScheduler

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or
                                thread_io_priority() is None,
                                reason="per-thread I/O priorities are a Linux feature")


def _config(tmp_path: object, **qos: object) -> object:
    return config_from_dict({"device_groups": {
        "ckpt": {"role": "write", "devices": [f"{tmp_path}/w"]},
        "kv": {"role": "read", "devices": [f"{tmp_path}/r"]}}, "qos": qos})


def test_lane_threads_carry_their_io_priority(tmp_path: object) -> None:
    scheduler = LaneScheduler(_config(tmp_path))  # type: ignore[arg-type]
    try:
        read = scheduler.lane(JobKind.KV_GET).submit(thread_io_priority).result()
        write = scheduler.lane(JobKind.CHECKPOINT_WRITE).submit(thread_io_priority).result()
        background = scheduler.lane(JobKind.MIRROR).submit(thread_io_priority).result()
    finally:
        scheduler.close()
    assert read in ((IOPRIO_CLASS_RT, 4), (IOPRIO_CLASS_BE, 0))  # RT needs CAP_SYS_ADMIN
    assert write == (IOPRIO_CLASS_BE, 7) and background == (IOPRIO_CLASS_BE, 7)
    assert thread_io_priority() != write  # the caller's own thread is left alone


def test_io_priorities_can_be_switched_off(tmp_path: object) -> None:
    config = _config(tmp_path, io_priorities=False)
    scheduler = LaneScheduler(config)  # type: ignore[arg-type]
    try:
        write = scheduler.lane(JobKind.CHECKPOINT_WRITE).submit(thread_io_priority).result()
    finally:
        scheduler.close()
    assert write == thread_io_priority()  # inherited from the process, not lowered
