"""Schedule spaces per kernel class, search, cost model and measurement."""
from flashgen.schedules.space import Schedule, ScheduleSpace

__all__ = ["Schedule", "ScheduleSpace"]
