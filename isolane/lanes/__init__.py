"""Device-group lanes: job -> lane assignment, the LaneScheduler and its governor."""

from isolane.lanes.assignment import JobKind, is_governed, lane_for, priority_of
from isolane.lanes.metrics import LatencyWindow
from isolane.lanes.qos import Governor, TokenBucket
from isolane.lanes.scheduler import (
    ByteBudget,
    Lane,
    LaneHandle,
    LaneScheduler,
    SchedulerRegistry,
)

__all__ = ["ByteBudget", "Governor", "JobKind", "Lane", "LaneHandle",
           "LaneScheduler", "LatencyWindow", "SchedulerRegistry", "TokenBucket", "is_governed",
           "lane_for", "priority_of"]
