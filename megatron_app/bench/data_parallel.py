"""Compositions across data-parallel replicas in the real runtime on emulated compute, alternated runs, with the
simulator's prediction of the same iterations beside each row.

Every run is run_single.sh with D replicas of a P x V pipeline; tasks are timed waits of the simulator's cost of
their microbatch (--emulate-compute, --emulate-lengths-file, --documents-per-microbatch), so the runtime, the
transport and the plan are real and the compute is the model's. Each iteration draws the same D x m x K documents
(seeded) whatever the composition, as the simulator's rows do; --slow-replica R makes every task of replica R
--slow-factor times longer. Rows: loader (padded), dp-balanced (Megatron-LM's DpBalancedScheduler's algorithm),
balanced-local (each replica its own share), balanced (documents moved between replicas by cost and learnt speed).
"""

from __future__ import annotations

import statistics
from typing import Dict, List, Optional, Sequence

from megatron_app.sim.composition import CompositionSimConfig, simulate_composition
from megatron_app.sim.lengths import MicrobatchLengths

from .real_composition import CompositionRun

TRAINER_SEED = 1234     # the trainer's default --seed: the emulated draws' seed
SPEED_BLIND = "balanced-blind"   # a row, not a composition: balanced planning every replica as equally fast


def row_flags(row: str) -> List[str]:
    """The trainer flags of a row: --composition ROW, or balanced without replica speeds for the speed-blind row."""
    return ["--composition", "balanced", "--no-replica-speeds"] if row == SPEED_BLIND else ["--composition", row]


def launcher_flags(pipeline_parallel: int, model_chunks: int, data_parallel: int, microbatches: int,
                   documents_per_microbatch: int, lengths_file: str, fwd_ms: float, bwd_ms: float, iters: int,
                   slow_replica: Optional[int], slow_factor: float, extra: Sequence[str] = ()) -> List[str]:
    flags = ["--pipeline_parallel", str(pipeline_parallel), "--model_chunks", str(model_chunks),
             "--data_parallel", str(data_parallel), "--emulate-compute", f"{fwd_ms:g},{bwd_ms:g}",
             "--emulate-lengths-file", lengths_file, "--documents-per-microbatch", str(documents_per_microbatch),
             "--micro-batch-size", "1",
             "--global-batch-size", str(microbatches * data_parallel), "--iters", str(iters),
             "--seed", str(TRAINER_SEED)]
    if slow_replica is not None:
        flags += ["--slow-replica", str(slow_replica), "--slow-factor", f"{slow_factor:g}"]
    return flags + list(extra)


def simulated_ms(composition: str, pipeline_parallel: int, model_chunks: int, data_parallel: int, microbatches: int,
                 documents_per_microbatch: int, lengths_file: str, fwd_ms: float, bwd_ms: float, iters: int,
                 host_ms: float, slow_replica: Optional[int], slow_factor: float) -> float:
    """The simulator's mean iteration over the runs' measured iterations (all but the first)."""
    speeds = None if slow_replica is None else tuple(1.0 / slow_factor if r == slow_replica else 1.0
                                                      for r in range(data_parallel))
    config = CompositionSimConfig(pipeline_parallel, model_chunks, microbatches, documents_per_microbatch,
                                  MicrobatchLengths.from_file(lengths_file), forward_us=fwd_ms * 1e3,
                                  backward_us=bwd_ms * 1e3, host_us=host_ms * 1e3, iterations=iters,
                                  seed=TRAINER_SEED, data_parallel=data_parallel, replica_speeds=speeds,
                                  speed_aware=composition != SPEED_BLIND)
    return simulate_composition(config, "balanced" if composition == SPEED_BLIND else composition).makespan_us / 1e3


def format_rows(runs: Sequence[CompositionRun], baseline: str, simulated: Dict[str, float]) -> str:
    by_name: Dict[str, List[CompositionRun]] = {}
    for run in runs:
        by_name.setdefault(run.composition, []).append(run)
    base = statistics.median([s for run in by_name[baseline] for s in run.seconds])
    lines = [f"{'composition':<15} {'iter ms':>9} {'x ' + baseline:>10} {'predicted ms':>13} {'sim ms':>9} "
             f"{'measured/sim':>13}"]
    for name, own in by_name.items():
        seconds = statistics.median([s for run in own for s in run.seconds])
        predicted = [p for run in own for p in run.predicted_ms if p is not None]
        predicted_text = f"{statistics.median(predicted):>13.1f}" if predicted else f"{'-':>13}"
        sim = simulated.get(name)
        lines.append(f"{name:<15} {seconds * 1e3:>9.1f} {base / seconds:>10.3f} {predicted_text} "
                     f"{sim:>9.1f} {seconds * 1e3 / sim:>13.3f}" if sim else
                     f"{name:<15} {seconds * 1e3:>9.1f} {base / seconds:>10.3f} {predicted_text}")
    return "\n".join(lines)
