"""Device-group lanes: job -> lane assignment and the LaneScheduler."""

from isolane.lanes.assignment import JobKind, lane_for
from isolane.lanes.scheduler import ByteBudget, Lane, LaneScheduler, SchedulerRegistry

__all__ = ["ByteBudget", "JobKind", "Lane", "LaneScheduler", "SchedulerRegistry", "lane_for"]
