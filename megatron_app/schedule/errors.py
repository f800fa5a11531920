"""Errors of the schedule package: a bad configuration versus a driver that breaks the task protocol."""


class ScheduleConfigError(ValueError):
    """A pipeline shape, rank, task or policy option that cannot be scheduled; the message says why in one line."""


class MicrobatchGroupError(ScheduleConfigError):
    """Interleaving: the microbatch group size lies outside [num_stages, num_microbatches]."""


class LastMicrobatchGroupError(ScheduleConfigError):
    """Interleaving: the last group of microbatches is shorter than the pipeline (a dependency bubble)."""


class ScheduleStateError(RuntimeError):
    """A driver called RankState out of protocol (started a task that is not ready, finished one twice, ...)."""


class ScheduleStallError(RuntimeError):
    """No rank can run anything and no input is on its way: the schedule would hang. The message dumps the states."""
