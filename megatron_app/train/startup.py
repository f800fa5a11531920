"""Where a rank's start-up time goes: seconds from the process's start to each phase's end, kept in the JSON log;
and where its end goes (EndingClock): the training loop, closing the schedule's transport and tracer, and the
process group's teardown, so a launcher can tell what comes after the rank's last step from the rank's own exit.

On the first GPU hosts a launch cost about a minute around a few seconds of training (docs/gpu.md); the phases
say which part: the interpreter and imports (torch, megatron-core), the process group, Megatron's model-parallel
groups, and the trainer (model, optimizer, datasets, trace run); and, under run_single.sh, the launcher's own
phases before the rank started (launcher_s). `process_started_unix` lets a launcher that noted
its own start (tools/gpu_check.py) tell its time before the rank from the rank's.
"""

from __future__ import annotations

import os
import time
from typing import Dict, Optional

# "gate": waiting for the start gate (start_gate.py), marked only where one is set.
PHASES = ("imports", "gate", "process_group", "model_parallel", "trainer")
# The trainer's set-up, in parts (build_trainer): the model (built and initialised), the optimizer (with a checkpoint
# restored), the data sets and iterators, and the runtime (trace run, schedule, reporter). On an H200 the trainer took
# 33 s a launch (44 s for a 1.6 B-parameter model) and nothing said where.
TRAINER_PARTS = ("model", "optimizer", "data", "runtime")
ENDING_PHASES = ("loop", "closing", "process_group")   # the iterations' loop, closing the schedule, the group's end
LAUNCH_MARKS_ENV = "MEGATRON_APP_LAUNCH_MARKS"   # run_single.sh: unix times it started, set up, checked the config
LAUNCHER_PHASES = ("setup_env", "check_config", "to_rank")


def process_age_s() -> Optional[float]:
    """Seconds since this process started (Linux's /proc, 10 ms resolution); None where /proc cannot tell."""
    try:
        with open("/proc/self/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()   # the command name may hold spaces: cut after it
        with open("/proc/uptime") as uptime:
            since_boot = float(uptime.read().split()[0])
        return since_boot - int(fields[19]) / os.sysconf("SC_CLK_TCK")   # field 22 of stat: starttime, in ticks
    except (OSError, ValueError, IndexError):
        return None


class StartupClock:
    """mark(phase) at each phase's end, mark_part(part) at the end of each part of the trainer's; report() ->
    {"process_started_unix", "seconds": {phase: its own seconds}, "total_s", "trainer_parts": {part: its own
    seconds}}, or None where the process's start is unknown."""

    def __init__(self):
        age = process_age_s()
        now = time.time()
        self.started_unix = None if age is None else now - age
        self._ends: Dict[str, float] = {}
        self._part_ends: Dict[str, float] = {}

    def mark(self, phase: str) -> None:
        assert phase in PHASES, phase
        self._ends[phase] = time.time()

    def mark_part(self, part: str) -> None:
        """The end of one part of the trainer's set-up (TRAINER_PARTS), inside the "trainer" phase."""
        assert part in TRAINER_PARTS, part
        self._part_ends[part] = time.time()

    def report(self) -> Optional[dict]:
        if self.started_unix is None or not self._ends:
            return None
        seconds, previous = _consecutive(PHASES, self._ends, self.started_unix)
        report = {"process_started_unix": round(self.started_unix, 3), "seconds": seconds,
                  "total_s": round(previous - self.started_unix, 3)}
        trainer_began = self._ends.get("model_parallel")
        if self._part_ends and trainer_began is not None:
            report["trainer_parts"] = _consecutive(TRAINER_PARTS, self._part_ends, trainer_began)[0]
        launcher = launcher_seconds(os.environ.get(LAUNCH_MARKS_ENV), self.started_unix)
        if launcher is not None:
            report["launcher_s"] = launcher
        return report


def _consecutive(phases, ends: Dict[str, float], started: float):
    """({phase: seconds from the previous marked phase's end, or `started`, to its own}, the last marked end)."""
    seconds, previous = {}, started
    for phase in phases:
        if phase in ends:
            seconds[phase] = round(ends[phase] - previous, 3)
            previous = ends[phase]
    return seconds, previous


def launcher_seconds(marks: Optional[str], process_started_unix: float) -> Optional[Dict[str, float]]:
    """run_single.sh's phases before this rank: its set-up check (tools/setup_env.sh), --check-config, and from
    there to this process's start (run_ranks.py, torchrun); None without (or with unreadable) marks."""
    try:
        started, set_up, checked = (float(value) for value in (marks or "").split())
    except ValueError:
        return None
    ends = (set_up, checked, process_started_unix)
    return {phase: round(end - begin, 3) for phase, begin, end in zip(LAUNCHER_PHASES, (started,) + ends[:2], ends)}


class EndingClock:
    """Started as the training loop begins; mark(phase) at the end of each of ENDING_PHASES; report() ->
    {"seconds": {phase: its own seconds}, "ended_unix": the last mark's unix time}, kept in the JSON log as
    "ending" (the launch's time after it is the process's exit and the launcher's)."""

    def __init__(self):
        self._started = time.time()
        self._ends: Dict[str, float] = {}

    def mark(self, phase: str) -> None:
        assert phase in ENDING_PHASES, phase
        self._ends[phase] = time.time()

    def report(self) -> Optional[dict]:
        if not self._ends:
            return None
        seconds, previous = _consecutive(ENDING_PHASES, self._ends, self._started)
        return {"seconds": seconds, "ended_unix": round(previous, 3)}
