"""Real (not emulated) training runs of the Megatron-Core GPT model on CPU, one per composition, alternated, for
tokens/s side by side: what regrouping documents (no padding, balanced microbatches) buys on real compute.

Each round runs every composition once through run_single.sh with the same data, seed and model; the first
iteration of each run is a warm-up and is left out. Tokens are the trainer's count (document tokens, padding
excluded), so a composition that computes on padding shows it as lower tokens/s. The same documents form every
iteration whatever the composition, so the runs' losses must agree (printed as a check).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parents[2]
PREDICTION_WARMUP = 1     # measured iterations (after the run's warm-up) left out of the prediction error


@dataclass
class CompositionRun:
    composition: str
    round: int
    seconds: List[float]              # per measured iteration
    tokens_per_s: List[float]
    losses: List[float]
    predicted_ms: List[Optional[float]] = field(default_factory=list)   # the plan's, per measured iteration


@dataclass
class CompositionSummary:
    composition: str
    median_tokens_per_s: float
    median_iteration_ms: float
    iterations: int
    speedup_over_baseline: float
    max_loss_difference: float        # against the baseline's losses, same iterations
    runs: List[CompositionRun] = field(default_factory=list)
    # predicted / measured - 1 of each iteration the plan predicted, from the second measured one (the cost model's
    # warm-up: the first call teaches it, the next ones fill its fits); empty when nothing was predicted
    prediction_errors: List[float] = field(default_factory=list)

    @property
    def median_abs_prediction_error(self) -> Optional[float]:
        return statistics.median(abs(e) for e in self.prediction_errors) if self.prediction_errors else None

    @property
    def max_abs_prediction_error(self) -> Optional[float]:
        return max(abs(e) for e in self.prediction_errors) if self.prediction_errors else None


def composition_flags(row: str) -> List[str]:
    """A row's trainer flags: --composition ROW."""
    return ["--composition", row]


def run_once(composition: str, round_index: int, launcher_flags: Sequence[str], warmup: int,
             env: Dict[str, str], row_flags=composition_flags, trace_dir: Optional[str] = None) -> CompositionRun:
    """One run_single.sh run of a row; trace_dir: trace it there (default: untraced)."""
    with tempfile.TemporaryDirectory() as scratch:
        log = os.path.join(scratch, "log.json")
        command = ["bash", str(REPO_ROOT / "run_single.sh"), *launcher_flags, *row_flags(composition),
                   "--log-json", log, *(["--no-trace"] if trace_dir is None else ["--trace-dir", str(trace_dir)])]
        done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
            raise RuntimeError(f"composition {composition}: run_single.sh exited {done.returncode}: {tail[0]}")
        iterations = json.loads(Path(log).read_text())["iterations"][warmup:]
    return CompositionRun(composition, round_index, [it["time_ms"] / 1e3 for it in iterations],
                          [it["tokens_per_s"] for it in iterations], [it["loss"] for it in iterations],
                          [it.get("composed", {}).get("predicted_ms") for it in iterations])


def summarise(runs: Sequence[CompositionRun], baseline: str) -> List[CompositionSummary]:
    by_name: Dict[str, List[CompositionRun]] = {}
    for run in runs:
        by_name.setdefault(run.composition, []).append(run)
    base_rate = statistics.median([rate for run in by_name[baseline] for rate in run.tokens_per_s])
    base_losses = by_name[baseline][0].losses
    summaries = []
    for name, own in by_name.items():
        rates = [rate for run in own for rate in run.tokens_per_s]
        times = [seconds for run in own for seconds in run.seconds]
        rate = statistics.median(rates)
        difference = max((abs(a - b) for run in own for a, b in zip(run.losses, base_losses)), default=0.0)
        errors = [predicted / (seconds * 1e3) - 1.0 for run in own
                  for predicted, seconds in list(zip(run.predicted_ms, run.seconds))[PREDICTION_WARMUP:]
                  if predicted is not None]
        summaries.append(CompositionSummary(name, rate, statistics.median(times) * 1e3, len(rates),
                                            rate / base_rate, difference, list(own), errors))
    return summaries


def format_table(summaries: Sequence[CompositionSummary], baseline: str, label: str = "composition") -> str:
    """One line per row; label: the first column's title (what a row is)."""
    width = max(12, len(label), *(len(s.composition) for s in summaries))
    ratio = max(10, len(baseline) + 2)
    lines = [f"{label:<{width}} {'tokens/s':>10} {'iter ms':>9} {'n':>3} {'x ' + baseline:>{ratio}} "
             f"{'max |loss diff|':>16} {'|predicted/measured - 1|: median, max':>38}"]
    for s in summaries:
        error = ("not predicted" if s.median_abs_prediction_error is None else
                 f"{100 * s.median_abs_prediction_error:.1f}%, {100 * s.max_abs_prediction_error:.1f}% "
                 f"(n={len(s.prediction_errors)})")
        lines.append(f"{s.composition:<{width}} {s.median_tokens_per_s:>10.0f} {s.median_iteration_ms:>9.0f} "
                     f"{s.iterations:>3} {s.speedup_over_baseline:>{ratio}.3f} {s.max_loss_difference:>16.2e} "
                     f"{error:>38}")
    return "\n".join(lines)


def trace_run_dir(trace_root: str, row: str, round_index: int) -> Path:
    """Where run_alternated traces a row's run of one round (the trainer adds its own run directory below it)."""
    return Path(trace_root) / f"{row}-round{round_index + 1}"


def run_alternated(compositions: Sequence[str], rounds: int, launcher_flags: Sequence[str], warmup: int,
                   progress=print, row_flags=composition_flags, env: Optional[Dict[str, str]] = None,
                   around_run=None, trace_root: Optional[str] = None) -> List[CompositionRun]:
    """Every row once per round, the order reversed every other round. env: the runs' environment (default this
    process's); around_run(row, round_index): a context manager each run happens inside (e.g. a slowdown it starts
    and stops); trace_root: trace each run into trace_run_dir(trace_root, row, round_index) (default: untraced)."""
    env = dict(os.environ) if env is None else env
    runs = []
    for round_index in range(rounds):
        order = list(compositions) if round_index % 2 == 0 else list(reversed(compositions))
        for composition in order:
            with around_run(composition, round_index) if around_run is not None else contextlib.nullcontext():
                run = run_once(composition, round_index, launcher_flags, warmup, env, row_flags,
                               None if trace_root is None else trace_run_dir(trace_root, composition, round_index))
            progress(f"round {round_index + 1}/{rounds} {composition}: median "
                     f"{statistics.median(run.tokens_per_s):.0f} tokens/s over {len(run.tokens_per_s)} iterations")
            runs.append(run)
    return runs


def write_json(path: str, summaries: Sequence[CompositionSummary], launcher_flags: Sequence[str]) -> None:
    payload = {"launcher_flags": list(launcher_flags), "load_average": os.getloadavg(),
               "summaries": [{**asdict(s), "median_abs_prediction_error": s.median_abs_prediction_error,
                              "max_abs_prediction_error": s.max_abs_prediction_error} for s in summaries]}
    Path(path).write_text(json.dumps(payload, indent=1))
