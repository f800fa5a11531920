"""The lower bounds live with the schedule (megatron_app.schedule.bounds), so the trace tools compute the same ones."""

from megatron_app.schedule.bounds import LowerBounds, lower_bounds

__all__ = ["LowerBounds", "lower_bounds"]
