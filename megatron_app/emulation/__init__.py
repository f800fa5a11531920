"""Emulation for benchmarking schedules on few cores: timed-wait compute, slow pipeline links, and the simulator fed
with the same durations (or with a traced run's).

    spec.py        EmulationSpec, TaskDurations, spec_from_args       per-task durations (megatron_app.sim's draws)
    compute.py     EmulatedChunk, TimedScale, emulated_forward_step    chunks whose compute is a timed wait (torch)
    wait.py        emulated_wait, set_wait_function                    how emulated compute waits
    link_delay.py  DelayedSendTransport, LinkDelay                     --link-delay as a transport wrapper (torch)
    sim_replay.py  SlowLinkNetwork, simulate_emulation, replay_trace_iteration, measured_durations
The slow-link type is megatron_app.sim's SlowLink (parse_delay for the trainer's --link-delay). This package imports
only the torch-free parts; import compute and link_delay from their modules.
"""

from megatron_app.sim.network import SlowLink

from .sim_replay import (SimulatedIteration, SlowLinkNetwork, measured_durations, replay_trace_iteration,
                         simulate_emulation)
from .spec import EmulationSpec, TaskDurations, spec_from_args

__all__ = [
    "EmulationSpec", "SimulatedIteration", "SlowLink", "SlowLinkNetwork", "TaskDurations", "measured_durations",
    "replay_trace_iteration", "simulate_emulation", "spec_from_args",
]
