"""The GPU proof: runs every check of the GPU issues on this host and writes report.json and report.txt.

    bash tools/gpu_check.sh --out DIR [--wheels DIR]     # on a CUDA host (set-up, then this script)
    bash tools/gpu_check.sh --cpu --out DIR              # the same steps at small sizes on CPU (the suite runs it)

    bash tools/gpu_check.sh --out DIR --budget-s 420     # stop starting steps after 420 s (set-up not counted)

Steps, in this order (each one passes, fails or is skipped with its reason; one failing step never stops the others;
under --budget-s a step not started in time is reported as `cut`, which fails the check; host and pytest run side
by side, so do equality and own-loop, and composition and ipc-sends; the other steps that time something alone):
  setup       tools/setup_env.sh's time (measured by gpu_check.sh)
  host        host, GPU, driver and package versions; seconds of a fresh interpreter's imports, first CUDA tensor
              and host-name lookups (what every launch pays before it trains)
  pytest      the tests marked `cuda` (on a GPU host all but those the equality and transport steps repeat; on CPU
              they skip, which is reported)
  equality    P=1 against P=2 V=2 on one device: per-iteration losses within each row's tolerance (rows `+ipc`,
              `+ipc-copy`: the P=2 V=2 run's device tensors cross by CUDA IPC, lent or copied out)
  own-loop    examples/simple_train_loop.py (a user's own Megatron loop) as its CI test runs it: P=2 V=2 under
              our schedule against P=1 under Megatron's, dropout 0.1, fixed and variable lengths
  transport   tools/bench_transport.py --device cuda (its table and JSON; fails on a row not bit-exact or one whose
              path is not the one planned)
  prediction  predicted against measured iteration after warm-up (P=1 and P=2 V=2), and a rank's compute spans
              against its forward_backward call's span (the trace's iteration event)
  curves      event-timed cost curves from one P=1 run per hidden size (2048 and 4096) of the prediction model on
              a sweep of compositions (--synthetic-microbatches: 128..8,192 tokens and 1..16 documents a
              microbatch), in the simulator's --cost-curves format
  composition the simulator's composition rows (copyright 2,048 / 8,192; P=4 V=2 m=16, P=8 V=2 m=32, D=4) under the
              curves step's event-timed curves: `balanced` against `packed` and the DpBalanced-style packer
  ipc-sends   the prediction step's P=2 V=2 run with device tensors by CUDA IPC (opt-in for users): the transport
              issue's send share (under 10% of the iteration) on the path a host allows; last (beside
              composition, which computes on one CPU core), so a budget cuts it first
  slots8      only when --steps names it: that run again staged through 8 MiB slots (a setting users may choose),
              its send share measured, not judged (about 20-40 s more of a GPU host's check)
The report's `launch` line: the median seconds of each trainer launch before its rank started, in the rank's
start-up phases (train/startup.py), in iterations and after them. The timing steps' runs (prediction, curves,
ipc-sends, slots8) are started one ahead: the next run's launcher, torchrun and imports overlap the current run's set-up
(the first run's overlap the equality step), and its ranks wait behind a start gate (train/start_gate.py) until
the current run ends. `exposed` is what a launch added to the check; `ahead_overlap`, how many seconds of its
start-up before the gate ran on past the previous run's set-up, beside its iterations (0 where the previous set-up
was the longer).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_app.train.start_gate import (START_GATE_ENV, START_GATE_OWNER_ENV,  # noqa: E402
                                           START_GATE_TIMEOUT_ENV)

# Tolerances on the relative difference of per-iteration losses between P=1 and P=2 V=2.
# fp32 on CUDA: cuBLAS may pick other kernels (other reduction orders) for the other microbatch shapes a layout
# composes; measured exact or ~1e-7 on the first H200 run, so 2e-5 leaves two orders of margin.
# bf16: the README's "bf16 and fp16" section derives 2u/sqrt(512) = 3.5e-4 (u = 2^-8; independent roundings of the
# per-token losses average over >= 512 loss tokens an iteration) and measured 2e-7..1.2e-5 on CPU. On CUDA, flash
# and cuBLAS kernels add their own order differences (split-K, non-deterministic flash backward): 1e-3 there.
FP32_TOLERANCE = 2e-5
BF16_TOLERANCE = 1e-3
CPU_BF16_TOLERANCE = 3.5e-4
# CPU fp32: the same kernels on both layouts; the suite's equality grid holds 1e-6 and better.
CPU_FP32_TOLERANCE = 1e-5


@dataclass
class Sizes:
    """Model and data sizes of one mode (GPU or the CPU rehearsal)."""
    equality_model: List[str]
    equality_iters: int
    prediction_model: List[str]
    prediction_iters: int
    curve_heads: Dict[int, int]        # hidden size -> attention heads of each curve run (the prediction model's rest)
    curve_sweep: Tuple[int, int, int]  # the curve runs' microbatches: fewest and most tokens, most documents
    curve_iters: int
    curve_skip: int
    transport_flags: List[str]
    device: str
    parallel_runs: int
    rows: List[str] = field(default_factory=list)
    own_loop_rows: List[str] = field(default_factory=list)


GPU = Sizes(
    equality_model=["--num-layers", "8", "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "1024",
                    "--micro-batch-size", "2", "--global-batch-size", "16"],
    equality_iters=3,
    # GPU-bound microbatches, as users train: on the first H100 the 4-document microbatches (94-1,601 tokens) of
    # hidden 2048 were host-bound, every task 10-28 ms whatever its tokens (the GPU's share ~3 ms), so what there was
    # to predict was host jitter. 32 documents (about 2,300 tokens) at hidden 4096 give a forward ~7 TFLOP (~20 ms),
    # twice the host's ~10 ms to launch 8 layers; 1.6 B parameters, ~30 GB with the optimizer on one GPU.
    prediction_model=["--num-layers", "8", "--hidden-size", "4096", "--num-attention-heads", "32", "--seq-length",
                      "8192", "--micro-batch-size", "32", "--global-batch-size", "256", "--bf16"],
    # 14: the median is over 12 scored iterations. At 6 the model's one-iteration learning transient (H100: iteration
    # 3 planned from one size of microbatch) was a quarter of them; on the H200 of 2026-11-27, at 10, `balanced`'s
    # switch from 1-2 to 8 microbatches a call (iterations 4-5, +17% and +11%) was a quarter of 8, beside steady
    # iterations within +-4% but one. Users train for thousands of iterations: the steady state is what to judge.
    # Each iteration adds about half a second (three such runs by default, four with slots8: ~6-8 s).
    prediction_iters=14,
    # The curves: P=1 runs of the prediction model at hidden 2048 and 4096 (head size 128) on a sweep of 16
    # documents an iteration, 1, 2, 4, 8 or 16 a microbatch, 128..8,192 tokens a microbatch (the composition rows
    # replay 2,048 and 8,192-token microbatches; `balanced` microbatches of the corpus span a narrow range). The
    # first two iterations are left out of the fit; the eight after them hold every document count twice.
    curve_heads={2048: 16, 4096: 32}, curve_sweep=(128, 8192, 16), curve_iters=10, curve_skip=2,
    transport_flags=["--device", "cuda"],
    # Every equality launch at once (8 references, 10 P=2 V=2 runs; own-loop's 5 beside them): on the first H100 a
    # launch took 51-68 s with 7 side by side and 55-65 s alone, so a launch waits rather than computes.
    device="cuda", parallel_runs=18,
    rows=["mock-fp32", "mock-bf16-optim", "loader-fp32-dropout", "packed-fp32-dropout", "balanced-fp32-dropout",
          "packed-bf16-dropout-llama", "balanced-bf16-dropout", "balanced-bf16-dropout-recompute",
          "balanced-fp32-dropout+ipc", "packed-bf16-dropout+ipc-copy"],
    own_loop_rows=["fixed", "packed", "balanced"],
)
CPU = Sizes(
    equality_model=["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "128",
                    "--micro-batch-size", "2", "--global-batch-size", "8"],
    equality_iters=2,
    prediction_model=["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "128",
                      "--micro-batch-size", "2", "--global-batch-size", "8"],
    prediction_iters=3,
    curve_heads={32: 4, 48: 4}, curve_sweep=(16, 128, 16), curve_iters=6, curve_skip=1,
    transport_flags=["--backends", "shm", "--quick"],
    device="cpu", parallel_runs=2,
    rows=["mock-fp32-optim", "balanced-fp32-dropout-llama-recompute"],   # its P=1 reference without recomputation
    # One row: the step's code is the same for each, and tests/test_simple_train_loop.py runs both (fixed lengths and
    # `balanced`) on CPU already; the second row cost the suite's longest test about half a minute.
    own_loop_rows=["balanced"],
)


# A row's `+ipc` / `+ipc-copy` suffix: its P=2 V=2 run moves device tensors by CUDA IPC (lent slots / copied out of
# them: what a training receive holds until its backward) instead of the staged default; the same P=1 reference.
# `+slots8`: the staged default with 8 MiB receive slots (4) instead of 1 MiB ones (16): on the H200 of 2026-11-27
# the transport bench moved 16-256 MiB 1.9-2.3x faster so (users: MEGATRON_APP_SLOT_MIB / MEGATRON_APP_SLOTS).
TRANSPORT_ENVS = {"default": {}, "ipc": {"MEGATRON_APP_CUDA_IPC": "1"},
                  "ipc-copy": {"MEGATRON_APP_CUDA_IPC": "1", "MEGATRON_APP_CUDA_IPC_LEND": "0"},
                  "slots8": {"MEGATRON_APP_SLOT_MIB": "8", "MEGATRON_APP_SLOTS": "4"}}


# A row's `-optim`: Megatron-LM's optimizer defaults (clipping at 1.0, weight decay 0.01) and a cosine decay: the
# clipping norm crosses the pipeline ranks' group on the device.
OPTIMIZER_FLAGS = ["--clip-grad", "1.0", "--weight-decay", "0.01", "--lr-decay-style", "cosine", "--min-lr", "1e-4"]
# A row's `-llama`: a Llama-shaped model (RMSNorm, SwiGLU, no biases, grouped-query attention, rotary embeddings that
# restart at every packed document, an output layer untied from the embedding); the other rows tie them
# (Megatron-LM's default), so both kinds of output layer run on the device.
LLAMA_FLAGS = ["--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--group-query-attention",
               "--num-query-groups", "2", "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights"]
# A row's `-recompute`: Megatron-LM's full activation recomputation at P=2 V=2 only, against P=1 without it (the row
# without `-recompute`): every layer reruns in the backward pass and must redraw its forward's dropout masks, which on
# CUDA also restores CUDA's generator (runtime/recompute_randomness.py).
RECOMPUTE_FLAGS = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
RECOMPUTE = "-recompute"


# The prediction step's runs: (P, V, target of the median |error|); the ipc-sends step's: the P=2 V=2 run with its
# device tensors crossing by CUDA IPC (the transport issue's send share on the path a host allows); the opt-in
# slots8 step's: staged through 8 MiB slots.
PREDICTION_ROWS = {"p1": (1, 1, 0.05), "p2v2": (2, 2, 0.10)}
# The first timed run starts ahead beside these steps (they time nothing), then waits at its gate through transport.
EARLY_START_STEPS = {"equality", "own-loop"}
IPC_PREDICTION_ROWS = {"p2v2+ipc": (2, 2, 0.10)}
# The prediction rows that train one iteration more under torch.profiler (the trainer's --profile
# --use-pytorch-profiler), left out of every figure: where its tasks' host time went (the row's `profile`; on the H200
# of 2026-11-27 some P=1 tasks took 2-10x their like, and host_bound_share says whether that time was the host's).
PROFILED_ROWS = {"p1"}
SLOTS8_PREDICTION_ROWS = {"p2v2+slots8": (2, 2, 0.10)}
PREDICTION_DEFINITION = (
    "error = predicted_ms / time_ms - 1 per iteration from the third; span_coverage = sum of a rank's compute spans "
    "/ its forward_backward call's span, median over iterations from the third (P=1 target: within 5% of 1); "
    "task_gap_us: per rank, the median of the calls' mean time between tasks run back to back (added to every task "
    "of the rank by the planner); host_bound_share: per rank, the median share of its compute time in tasks whose "
    "device end came within 10% of their span after the host's (the device waited for the host: launches or a host "
    "stall); gc: per rank, Python's garbage collections from the third iteration (count, total and longest ms, how "
    "many inside a task as the host ran it); replay: the cost model replayed on the trace "
    "(tools/bench_cost_model.py), median |error| of the pipeline without and with that gap; transfer_shares: per "
    "rank, the share of the call's span with a send in flight (a device tensor's from its data ready on the device "
    "to its copies' end, device-timed; a host tensor's from posting to the completion the rank saw), taking inputs "
    "(recv) and blocked on one (wait), median from the third; send_share: the largest rank's (the transport issue's "
    "target: under 0.10; not part of the prediction step's pass); profile (P=1): one iteration more under "
    "torch.profiler, left out of every figure above (not of the launch line's time): its trace and operators "
    "summary in runs.tar.gz, and top_host_ms, the operators with the most host time of their own [name, host ms, "
    "device ms]")


def own_loop_reference(row: str) -> str:
    """The P=1 run an own-loop row is compared with: fixed lengths, or whole documents on the loader's microbatches."""
    return "p1-fixed" if row == "fixed" else "p1-documents"


def split_row(row: str) -> tuple:
    """'balanced-fp32-dropout+ipc' -> ('balanced-fp32-dropout', 'ipc'); no suffix: 'default'."""
    data_row, _, transport = row.partition("+")
    return data_row, transport or "default"


def reference_row(row: str) -> str:
    """The data row of an equality row's P=1 reference: its own, without the transport and without recomputation."""
    return split_row(row)[0].replace(RECOMPUTE, "")


def equality_flags(row: str, corpus: dict) -> List[str]:
    """A row's trainer flags: data (mock | the copyright corpus, variable lengths), composition, dtype, dropout."""
    data, *rest = row.split("-")
    flags = []
    if data == "mock":
        flags += ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
    else:
        flags += ["--data-path", corpus["data_path"], "--tokenizer-json", corpus["tokenizer_json"],
                  "--variable-seq-lengths", "--composition", data, "--calculate-per-token-loss"]
    if "bf16" in rest:
        flags.append("--bf16")
    if "dropout" in rest:
        flags += ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
    elif data != "mock":
        flags += ["--hidden-dropout", "0.0", "--attention-dropout", "0.0"]
    if "optim" in rest:
        flags += OPTIMIZER_FLAGS
    if "llama" in rest:
        flags += LLAMA_FLAGS
    if "recompute" in rest:
        flags += RECOMPUTE_FLAGS
    return flags


def tolerance_of(row: str, device: str) -> float:
    if "bf16" in row:
        return BF16_TOLERANCE if device == "cuda" else CPU_BF16_TOLERANCE
    return FP32_TOLERANCE if device == "cuda" else CPU_FP32_TOLERANCE


def _run_logged(command: List[str], env: dict, timeout_s: float, output: Path) -> subprocess.CompletedProcess:
    """The command run in the repository, its output kept in `output` (with the command); one that runs past
    timeout_s ends with rc 124 and a line saying so."""
    try:
        result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as expired:
        result = subprocess.CompletedProcess(command, 124, _text(expired.stdout),
                                             _text(expired.stderr) + f"\ngpu_check: the run took over {timeout_s} s")
    output.write_text(" ".join(command) + "\n" + result.stdout + result.stderr)
    return result


@dataclass(frozen=True)
class RunSpec:
    """One trainer launch: what Check.train runs (equal specs, equal commands)."""
    name: str
    pipeline: int
    chunks: int
    flags: Tuple[str, ...]
    iters: int
    trace: bool
    env: Tuple[Tuple[str, str], ...]

    @staticmethod
    def of(name: str, pipeline: int, chunks: int, flags: List[str], iters: int, trace: bool = False,
           extra_env: Optional[Dict[str, str]] = None) -> "RunSpec":
        return RunSpec(name, pipeline, chunks, tuple(flags), iters, trace, tuple(sorted((extra_env or {}).items())))


class Launch:
    """A run_single.sh run in its own process group, its output in files (a run started ahead may wait minutes
    behind its gate, so no pipe fills). `gate`: the file whose creation lets its ranks go on (None: not gated)."""

    def __init__(self, spec: RunSpec, run_dir: Path, command: List[str], env: dict, gate: Optional[Path]):
        self.spec, self.run_dir, self.command, self.gate = spec, run_dir, command, gate
        self.gate_opened_unix: Optional[float] = None
        self._stdout, self._stderr = run_dir / "stdout.txt", run_dir / "stderr.txt"
        self.started, self.started_unix = time.perf_counter(), time.time()
        with open(self._stdout, "w") as stdout, open(self._stderr, "w") as stderr:
            self.process = subprocess.Popen(command, cwd=REPO, env=env, stdout=stdout, stderr=stderr,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        self._timed_out: Optional[float] = None

    def open_gate(self) -> None:
        self.gate_opened_unix = time.time()
        self.gate.touch()

    def wait(self, timeout_s: float) -> Tuple[int, float]:
        """(exit status, seconds since the start); a run past timeout_s is stopped and ends with 124."""
        try:
            rc = self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            self._timed_out, rc = timeout_s, 124
        return rc, time.perf_counter() - self.started

    def stop(self) -> None:
        """Ends the whole process group (run_single.sh, torchrun, the ranks): TERM, then KILL to whatever of it is
        left after 10 s (a rank may outlive the launcher that started it)."""
        if not self._signal_group(signal.SIGTERM):
            return
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            self.process.poll()   # reaps the leader, whose zombie would answer for the group
            if not self._signal_group(0):
                return
            time.sleep(0.05)
        self._signal_group(signal.SIGKILL)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def _signal_group(self, sig: int) -> bool:
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            return False
        return True

    def output(self) -> str:
        """The command, its stdout and stderr, kept as output.txt (and returned)."""
        text = self._stdout.read_text(errors="replace") + self._stderr.read_text(errors="replace")
        if self._timed_out is not None:
            text += f"\ngpu_check: the run took over {self._timed_out} s"
        (self.run_dir / "output.txt").write_text(" ".join(self.command) + "\n" + text)
        self._stdout.unlink()
        self._stderr.unlink()
        return text


class Check:
    def __init__(self, out: Path, sizes: Sizes, python: str, deadline: Optional[float] = None):
        self.out, self.sizes, self.python = out, sizes, python
        self.deadline = deadline     # time.monotonic() by which every command must have ended (None: no budget)
        self.work = out / "work"
        self.work.mkdir(parents=True, exist_ok=True)
        self.report: Dict[str, dict] = {}
        self.launches: Dict[str, dict] = {}   # run name -> launch_phases(...): where each trainer launch's time went
        self._corpus: Optional[dict] = None
        self._sweep = None                     # (file, SyntheticPlan) of the curves runs, written once
        self._lock = threading.Lock()          # steps that run side by side share the corpus and the launches
        self.timed_plan: Dict[str, Callable[[], RunSpec]] = {}   # set_timed_plan: the timed runs, in order
        self._ahead: Dict[str, Launch] = {}    # run name -> its launch, started behind its gate
        self._setup_ends: Dict[str, float] = {}   # run name -> unix time its rank 0 began iterating
        self.launcher = ["bash", str(REPO / "run_single.sh")]
        self._live: set = set()                # launches started and not yet waited for
        self._closing = False

    def limit(self, seconds: float) -> float:
        """A command's time limit: `seconds`, or what is left of the budget when that is less (at least 1 s)."""
        if self.deadline is None:
            return seconds
        return max(1.0, min(seconds, self.deadline - time.monotonic()))

    # ---- running the trainer ----------------------------------------------------------------------------------
    def train(self, name: str, pipeline: int, chunks: int, flags: List[str], iters: int,
              trace: bool = False, extra_env: Optional[Dict[str, str]] = None) -> dict:
        """One run_single.sh run; returns {'rc', 'log', 'seconds', 'json', 'trace_dir'} (run)."""
        return self.run(RunSpec.of(name, pipeline, chunks, flags, iters, trace, extra_env))

    def run(self, spec: "RunSpec") -> dict:
        """`spec`'s run, as train. A timed run (timed_plan) may have been started ahead, behind its start gate: its
        gate opens now. Then the plan's next run is started behind its own gate, so its launcher, torchrun and
        imports overlap this run's set-up."""
        name = spec.name
        with self._lock:
            launch = self._ahead.pop(name, None)
        if launch is not None and launch.spec != spec:   # the plan foresaw another run under this name
            launch.stop()
            launch = None
        if launch is None:
            launch = self._start(spec, gated=False)
        else:
            launch.open_gate()
        self._start_next_ahead(name)
        return self._finish(launch)

    def _run_dir(self, name: str) -> Path:
        run_dir = self.work / name
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        return run_dir

    def _start(self, spec: "RunSpec", gated: bool) -> "Launch":
        if self._closing:
            raise RuntimeError(f"gpu_check is stopping: {spec.name} not started")
        run_dir = self._run_dir(spec.name)
        command = [*self.launcher, "--pipeline_parallel", str(spec.pipeline), "--model_chunks",
                   str(spec.chunks), "--device", self.sizes.device, "--iters", str(spec.iters), "--seed", "1234",
                   "--log-json", str(run_dir / "log.json"), *spec.flags]
        command += ["--trace-dir", str(run_dir / "trace")] if spec.trace else ["--no-trace"]
        env = dict(os.environ, LOG_DIR=str(run_dir / "logs"), PYTHONUNBUFFERED="1", **dict(spec.env))
        gate = None
        if gated:   # the rank waits past its imports until the gate file exists (train/start_gate.py)
            gate = run_dir / "start_gate"
            env.update({START_GATE_ENV: str(gate), START_GATE_OWNER_ENV: str(os.getpid()),
                        START_GATE_TIMEOUT_ENV: str(round(self.limit(1800) + 600))})
        launch = Launch(spec, run_dir, command, env, gate)
        with self._lock:
            self._live.add(launch)
        if self._closing:   # close() ran while this one started: it never saw it
            launch.stop()
        return launch

    def _planned_beside(self, name: str, step: int) -> Optional[str]:
        """The timed plan's run `step` places after `name` (-1: before it); None where there is none."""
        names = list(self.timed_plan)
        at = names.index(name) + step if name in names else -1
        return names[at] if 0 <= at < len(names) else None

    def start_first_ahead(self) -> None:
        """The timed plan's first run, behind its gate, beside the steps that time nothing (they must still run)."""
        if self.timed_plan:
            self._start_ahead_or_leave(next(iter(self.timed_plan)))

    def _start_next_ahead(self, name: str) -> None:
        """Starts the timed plan's run after `name` behind its gate (`name`'s launch is running and must be waited
        for)."""
        following = self._planned_beside(name, 1)
        if following is not None and not self._closing:
            self._start_ahead_or_leave(following)

    def _start_ahead_or_leave(self, name: str) -> None:
        """start_ahead(name); whatever fails there (its flags need the corpus, say) is left for that run's own turn to
        report."""
        try:
            self.start_ahead(name)
        except Exception:  # noqa: BLE001 - see above
            pass

    def start_ahead(self, name: str) -> None:
        """Starts the timed plan's run `name` behind its gate (once; not where the budget is spent)."""
        make_spec = self.timed_plan.get(name)
        if make_spec is None or (self.deadline is not None and time.monotonic() >= self.deadline):
            return
        with self._lock:
            if name in self._ahead or name in self.launches:
                return
        launch = self._start(make_spec(), gated=True)
        with self._lock:
            self._ahead[name] = launch

    def _finish(self, launch: "Launch") -> dict:
        rc, seconds = launch.wait(self.limit(600))
        with self._lock:
            self._live.discard(launch)
        output = launch.output()
        log_json = launch.run_dir / "log.json"
        payload = json.loads(log_json.read_text()) if log_json.exists() else None
        launch_record = launch_phases(launch.started_unix, seconds, payload, launch.gate_opened_unix)
        if launch_record is not None:
            startup = payload["startup"]
            with self._lock:
                self._setup_ends[launch.spec.name] = startup["process_started_unix"] + startup["total_s"]
                before = self._planned_beside(launch.spec.name, -1)
                if launch.gate is not None and before in self._setup_ends:   # its start-up past the run before's
                    at_gate = startup["process_started_unix"] + startup["seconds"].get("imports", 0.0)   # set-up
                    launch_record["ahead_overlap"] = round(max(0.0, at_gate - self._setup_ends[before]), 2)
                self.launches[launch.spec.name] = launch_record
        said = [line for line in output.splitlines() if "CUDA IPC to peer" in line]
        return {"rc": rc, "seconds": round(seconds, 1), "json": payload, "launch": launch_record,
                "trace_dir": launch.run_dir / "trace", "tail": output.strip().splitlines()[-3:],
                "ipc_fallback": said[0].strip() if said else None}

    def set_timed_plan(self, steps: List[str]) -> None:
        """The runs of the steps that time something alone, in the order they run: each one's launcher, torchrun
        and imports overlap the one before it (train)."""
        plan = {}
        if "prediction" in steps:
            plan.update((_predicted_name(row), partial(self._predicted_spec, row, layout[:2]))
                        for row, layout in PREDICTION_ROWS.items())
        if "curves" in steps:
            plan.update((f"curve-h{hidden}", partial(self._curve_spec, hidden, heads))
                        for hidden, heads in self.sizes.curve_heads.items())
        for step, rows in (("ipc-sends", IPC_PREDICTION_ROWS), ("slots8", SLOTS8_PREDICTION_ROWS)):
            if step in steps:
                plan.update((_predicted_name(row), partial(self._predicted_spec, row, layout[:2]))
                            for row, layout in rows.items())
        self.timed_plan = plan

    def _predicted_spec(self, row: str, layout: tuple) -> RunSpec:
        flags, iters = self.model_flags(), self.sizes.prediction_iters
        if row in PROFILED_ROWS:   # steps count from 0: step `iters` is the log's iteration iters + 1
            flags += ["--profile", "--use-pytorch-profiler", "--profile-step-start", str(iters),
                      "--profile-step-end", str(iters + 1)]
            iters += 1
        return RunSpec.of(_predicted_name(row), layout[0], layout[1], flags, iters,
                          trace=True, extra_env=TRANSPORT_ENVS[split_row(row)[1]])

    def _curve_spec(self, hidden: int, heads: int) -> RunSpec:
        return RunSpec.of(f"curve-h{hidden}", 1, 1, self.curve_flags(hidden, heads), self.sizes.curve_iters,
                          trace=True)

    def close(self) -> None:
        """Stops every launch still running and those started ahead that no step took (a step failed, the budget
        cut it, or gpu_check was told to stop), and starts no more: the launches run in sessions of their own, so a
        signal to gpu_check's process group does not reach them."""
        self._closing = True
        with self._lock:
            left, self._ahead = list(self._live | set(self._ahead.values())), {}
        for launch in left:
            launch.stop()

    def corpus(self) -> dict:
        with self._lock:
            return self._make_corpus()

    def _make_corpus(self) -> dict:
        if self._corpus is None:
            directory = self.work / "corpus"
            subprocess.run([self.python, str(REPO / "tools" / "make_corpus.py"), "--output-dir", str(directory)],
                           check=True, capture_output=True, text=True, timeout=self.limit(600))
            self._corpus = {"data_path": str(directory / "corpus_text_document"),
                            "tokenizer_json": str(directory / "tokenizer.json")}
        return self._corpus

    def model_flags(self) -> List[str]:
        """The prediction step's trainer flags: its model on the corpus, variable lengths, the planned policy."""
        model = list(self.sizes.prediction_model)
        corpus = self.corpus()
        return model + ["--data-path", corpus["data_path"], "--tokenizer-json", corpus["tokenizer_json"],
                        "--variable-seq-lengths", "--calculate-per-token-loss", "--policy", "planned"]

    def curve_sweep(self):
        """(file, plan) of the sweep of compositions the curves runs train on, written once."""
        from megatron_app.data.synthetic_documents import sweep_iterations

        with self._lock:
            if self._sweep is None:
                low, high, documents = self.sizes.curve_sweep
                plan = sweep_iterations(low, high, documents, self.sizes.curve_iters, documents_per_iteration=16)
                path = self.work / "curve_sweep.json"
                path.write_text(json.dumps(plan.to_json()))
                self._sweep = (path, plan)
            return self._sweep

    def curve_flags(self, hidden: int, heads: int) -> List[str]:
        """A curves run's trainer flags: the prediction model at this hidden size and head count, trained on the
        sweep of compositions instead of the corpus, the planned policy."""
        model = list(self.sizes.prediction_model)
        for flag, value in (("--hidden-size", hidden), ("--num-attention-heads", heads), ("--micro-batch-size", 1)):
            model[model.index(flag) + 1] = str(value)
        at = model.index("--global-batch-size")    # the sweep's 16 documents an iteration are the global batch
        del model[at:at + 2]
        return model + ["--synthetic-microbatches", str(self.curve_sweep()[0]), "--policy", "planned"]

    # ---- steps ------------------------------------------------------------------------------------------------
    def host(self) -> dict:
        import torch

        info = {"python": platform.python_version(), "platform": platform.platform(), "torch": torch.__version__,
                "cuda_available": torch.cuda.is_available(), "cpus": os.cpu_count()}
        try:
            from importlib.metadata import version
            info["megatron_core"] = version("megatron-core")
        except Exception as error:   # noqa: BLE001 (reported, not raised)
            info["megatron_core"] = f"not found ({error})"
        # "-dirty": the tree differs from that commit (a copied working tree keeps its checkout's HEAD).
        commit = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=12"], cwd=REPO,
                                capture_output=True, text=True)
        info["commit"] = commit.stdout.strip() or "unknown"
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            smi = shutil.which("nvidia-smi")
            if smi:
                query = subprocess.run([smi, "--query-gpu=driver_version,memory.total", "--format=csv,noheader"],
                                       capture_output=True, text=True)
                info["driver_and_memory"] = query.stdout.strip()
        info["startup_probes_s"] = self.startup_probes()
        return {"status": "pass", **info}

    def startup_probes(self) -> Dict[str, Optional[float]]:
        """Seconds of what every launch does before it trains, each in a fresh interpreter (as a launch's processes
        are), each with its exit: the interpreter alone, importing torch, importing megatron.core under the trainer's
        collector policy (train/gc_phases.py), torch plus the first CUDA tensor, and the host-name lookups torchrun
        and NCCL make (a host whose name no resolver answers waits out timeouts). The import of megatron.core with
        the collector on is no longer probed: on an H200 it took 16.6 s against 12.2 s paused (BENCHMARKS.md,
        2026-11-27), the two of them over a third of the check's host step."""
        probes = {"python": "pass", "import_torch": "import torch",
                  "import_megatron_core_gc_paused": ("import atexit, gc; gc.disable(); atexit.register(gc.freeze); "
                                                     "import megatron.core"),
                  "getfqdn": "import socket; socket.getfqdn()",
                  "gethostbyname": "import socket; socket.gethostbyname(socket.gethostname())"}
        if self.sizes.device == "cuda":
            probes["torch_and_first_cuda_tensor"] = "import torch; torch.zeros(1, device='cuda')"
        timings = {}
        for name, code in probes.items():
            started = time.perf_counter()
            try:
                done = subprocess.run([self.python, "-W", "ignore", "-c", code], capture_output=True,
                                      timeout=self.limit(60))
                timings[name] = round(time.perf_counter() - started, 2) if done.returncode == 0 else None
            except subprocess.TimeoutExpired:
                timings[name] = None
        return timings

    def pytest(self) -> dict:
        junit = self.work / "pytest.xml"
        selection = [] if self.sizes.device == "cuda" else ["tests/test_core_attention.py", "tests/test_task_clock.py"]
        # The equality rows' tests (marked `training` too) run the same runs as the equality step below, and the
        # transport bench's CUDA test a short form of the transport step's bench (21 s of 68 on the H200): not twice.
        result = subprocess.run([self.python, "-m", "pytest", "-m", "cuda and not training", "-q", "-p", "no:cacheprovider",
                                 "--deselect", "tests/test_transport_bench.py::test_cuda_section_on_the_gpu",
                                 "--timeout", "120",   # a hung CUDA test fails alone instead of eating the budget
                                 f"--junitxml={junit}", *selection], cwd=REPO, capture_output=True, text=True,
                                timeout=self.limit(900))
        (self.work / "pytest.txt").write_text(result.stdout + result.stderr)
        counts = _junit_counts(junit)
        failed = counts.get("failures", 0) + counts.get("errors", 0)
        if result.returncode not in (0, 5) or failed:
            status = "fail"
        elif self.sizes.device != "cuda":
            status = "skip"
        else:
            status = "pass" if counts.get("passed", 0) else "fail"
        tail = [line for line in (result.stdout + result.stderr).splitlines() if "FAILED" in line or "ERROR" in line]
        return {"status": status, **counts, "failures": tail[:20],
                "reason": "no CUDA device: every cuda-marked test skips" if status == "skip" else ""}

    def equality(self) -> dict:
        rows = {}
        corpus = self.corpus()

        def launch(row_and_layout) -> dict:
            row, (name, pipeline, chunks) = row_and_layout
            data_row, transport = split_row(row)
            flags = self.sizes.equality_model + equality_flags(data_row, corpus)
            return self.train(f"eq-{row}-{name}", pipeline, chunks, flags, self.sizes.equality_iters,
                              extra_env=TRANSPORT_ENVS[transport])

        # P=1 once per data row (a `+ipc` or `-recompute` row compares its P=2 V=2 with the same reference); all side
        # by side
        references = list(dict.fromkeys(reference_row(row) for row in self.sizes.rows))
        launches = [(row, ("p1", 1, 1)) for row in references] + [(row, ("p2v2", 2, 2)) for row in self.sizes.rows]
        with ThreadPoolExecutor(max_workers=self.sizes.parallel_runs) as pool:
            done = dict(zip(((row, layout[0]) for row, layout in launches), pool.map(launch, launches)))

        def one_row(row: str) -> dict:
            reference, pipelined = done[reference_row(row), "p1"], done[row, "p2v2"]
            tolerance = tolerance_of(row, self.sizes.device)
            entry = {"tolerance": tolerance, "seconds": [reference["seconds"], pipelined["seconds"]]}
            if split_row(row)[1] != "default":   # the path it asked for, or the line that said it fell back
                entry["transport"] = pipelined["ipc_fallback"] or f"{split_row(row)[1]} (no fallback said)"
            if reference["rc"] or pipelined["rc"] or not reference["json"] or not pipelined["json"]:
                failed = reference if reference["rc"] or not reference["json"] else pipelined
                return {**entry, "status": "fail", "error": failed["tail"][-1] if failed["tail"] else "no output"}
            a = [it["loss"] for it in reference["json"]["iterations"]]
            b = [it["loss"] for it in pipelined["json"]["iterations"]]
            worst = max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b)) if len(a) == len(b) else float("inf")
            return {**entry, "status": "pass" if worst <= tolerance else "fail", "losses_p1": a, "losses_p2v2": b,
                    "max_relative_difference": worst}

        for row in self.sizes.rows:
            rows[row] = one_row(row)
        status = "pass" if all(r["status"] == "pass" for r in rows.values()) else "fail"
        return {"status": status, "rows": rows}

    def own_loop(self) -> dict:
        """examples/simple_train_loop.py under torchrun, as tests/test_simple_train_loop.py runs it on CPU: P=2 V=2
        under our schedule against P=1 under Megatron's own (--reference), dropout 0.1 (the example's default);
        row `fixed` on fixed-length microbatches, rows `packed` / `balanced` on whole documents through
        wrap_data_iterator against P=1 on the loader's padded microbatches. The example's own size (4 layers,
        hidden 32, 3 iterations): it proves the user's loop runs on this device, not a speed."""
        reference = ["--pipeline_parallel", "1", "--reference"]
        references = {"p1-fixed": (1, reference),
                      "p1-documents": (1, [*reference, "--variable-lengths", "--composition", "loader"])}
        # only the references the rows compare with (the CPU rehearsal's one row needs one)
        runs = {name: references[name] for name in dict.fromkeys(map(own_loop_reference, self.sizes.own_loop_rows))}
        for row in self.sizes.own_loop_rows:
            flags = [] if row == "fixed" else ["--variable-lengths", "--composition", row]
            runs[f"p2v2-{row}"] = (2, ["--pipeline_parallel", "2", "--model_chunks", "2", *flags])
        with ThreadPoolExecutor(max_workers=self.sizes.parallel_runs) as pool:
            done = dict(zip(runs, pool.map(lambda name: self.example(name, *runs[name]), runs)))
        tolerance = FP32_TOLERANCE if self.sizes.device == "cuda" else CPU_FP32_TOLERANCE
        rows = {}
        for row in self.sizes.own_loop_rows:
            reference, pipelined = done[own_loop_reference(row)], done[f"p2v2-{row}"]
            entry = {"tolerance": tolerance, "seconds": [reference["seconds"], pipelined["seconds"]]}
            failed = next((run for run in (reference, pipelined) if run["rc"] or run["losses"] is None), None)
            if failed is not None:
                rows[row] = {**entry, "status": "fail", "error": failed["error"]}
                continue
            a, b = reference["losses"], pipelined["losses"]
            worst = (max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b)) if a and len(a) == len(b)
                     else float("inf"))
            rows[row] = {**entry, "status": "pass" if worst <= tolerance else "fail", "losses_p1": a,
                         "losses_p2v2": b, "max_relative_difference": worst}
        status = "pass" if all(r["status"] == "pass" for r in rows.values()) else "fail"
        return {"status": status, "rows": rows}

    def example(self, name: str, ranks: int, flags: List[str]) -> dict:
        """One torchrun of examples/simple_train_loop.py; returns {'rc', 'seconds', 'losses', 'error'}."""
        run_dir = self.work / f"own-loop-{name}"
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        command = [self.python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
                   "--max_restarts", "0", str(REPO / "examples" / "simple_train_loop.py"), "--device",
                   self.sizes.device, "--out", str(run_dir), *flags]
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                   PYTHONWARNINGS="ignore")
        started = time.perf_counter()
        result = _run_logged(command, env, self.limit(300), run_dir / "output.txt")
        losses = run_dir / "losses.json"
        return {"rc": result.returncode, "seconds": round(time.perf_counter() - started, 1),
                "losses": json.loads(losses.read_text()) if losses.exists() else None,
                "error": _error_line(result.stdout + result.stderr)}

    def prediction(self) -> dict:
        rows = self._predicted_rows(PREDICTION_ROWS)
        status = "pass" if all(r["status"] == "pass" for r in rows.values()) else "fail"
        return {"status": status, "rows": rows, "definition": PREDICTION_DEFINITION}

    def ipc_sends(self) -> dict:
        """The prediction step's P=2 V=2 run again with its device tensors crossing by CUDA IPC (opt-in for users):
        the transport issue's send share on the path a host allows. Last, so that a budget cuts it first."""
        rows = self._predicted_rows(IPC_PREDICTION_ROWS)
        status = "pass" if all(r["status"] == "pass" and r["send_share"] <= r["send_share_target"]
                               for r in rows.values()) else "fail"
        return {"status": status, "rows": rows,
                "definition": "the prediction step's P=2 V=2 row on the CUDA IPC path (transport: which path ran); "
                              "passes when its prediction is within its target and its send_share under 0.10 (the "
                              "transport issue's target). " + PREDICTION_DEFINITION}

    def slots8(self) -> dict:
        """Opt-in (--steps): the prediction step's P=2 V=2 run staged through 8 MiB slots, its send share measured,
        not judged (a setting users may choose, not the default); passes when its prediction is within target."""
        rows = self._predicted_rows(SLOTS8_PREDICTION_ROWS)
        return {"status": "pass" if all(r["status"] == "pass" for r in rows.values()) else "fail", "rows": rows,
                "definition": "the prediction step's P=2 V=2 row staged through 8 MiB slots x 4 "
                              "(MEGATRON_APP_SLOT_MIB=8 MEGATRON_APP_SLOTS=4). " + PREDICTION_DEFINITION}

    def _predicted_rows(self, which: Dict[str, tuple]) -> Dict[str, dict]:
        from megatron_app.trace.reader import read_trace_dir

        rows = {}
        for name, (pipeline, chunks, target) in which.items():
            _, transport = split_row(name)
            run = self.run(self._predicted_spec(name, (pipeline, chunks)))
            if run["rc"] or not run["json"]:
                rows[name] = {"status": "fail", "error": run["tail"][-1] if run["tail"] else "no output"}
                continue
            errors = []
            scored = self.sizes.prediction_iters   # a profiled iteration after them is left out
            for it in run["json"]["iterations"][2:scored]:   # after warm-up: the first two compile and learn
                predicted = (it.get("composed") or {}).get("predicted_ms")
                if predicted:
                    errors.append(predicted / it["time_ms"] - 1.0)
            trace = through_iteration(read_trace_dir(run["trace_dir"] / "latest", pipeline, chunks), scored)
            coverage = span_coverage(trace, skip=2)
            transfers = transfer_shares(trace, skip=2)
            median = statistics.median(abs(e) for e in errors) if errors else None
            ok = median is not None and median <= target
            if pipeline == 1:   # the GPU-true spans check: at P=1 the GPU is busy through the whole call
                ok = ok and all(abs(c - 1.0) <= 0.05 for c in coverage.values())
            rows[name] = {"status": "pass" if ok else "fail", "target": target,
                          "median_abs_error": median, "errors": errors, "span_coverage": coverage,
                          "task_gap_us": task_gaps(trace, skip=2), "host_bound_share": host_bound_shares(trace, skip=2),
                          "gc": gc_pauses(trace, skip=2), "peak_memory_mib": peak_memory(trace, skip=2),
                          "replay": replayed_errors(trace)}
            if name in PROFILED_ROWS:
                rows[name]["profile"] = profile_summary(run["trace_dir"] / "latest" / "profile", self.work)
            if pipeline > 1:   # the transport issue's target for this run: sends in flight under 10% of the iteration
                rows[name].update(transfer_shares=transfers, send_share=max(t["send"] for t in transfers.values()),
                                  send_share_target=0.10)
            if transport == "slots8":
                rows[name]["transport"] = "staged, 8 MiB slots x 4"
            elif transport != "default":
                rows[name]["transport"] = run["ipc_fallback"] or f"{transport} (no fallback said)"
        return rows

    def curves(self) -> dict:
        """One P=1 run traced with events per hidden size on the sweep of compositions, each fitted as a whole model
        spread evenly over its layers (sim/cost_curves.fit_whole_curves): the output layer and loss are a small
        share of these models (the share each file's source states), so one depth does."""
        from megatron_app.schedule import ScheduleConfigError
        from megatron_app.sim.cost_curves import fit_whole_curves
        from megatron_app.trace.reader import read_trace_dir

        fitted = {}
        for hidden, heads in self.sizes.curve_heads.items():
            spec = self._curve_spec(hidden, heads)
            name, flags = spec.name, list(spec.flags)
            run = self.run(spec)
            if run["rc"] or not run["json"]:   # the other hidden size still gets its curves
                fitted[f"h{hidden}"] = {"status": "fail", "run": name,
                                        "error": run["tail"][-1] if run["tail"] else "no output"}
                continue
            layers = int(flags[flags.index("--num-layers") + 1])
            try:
                curves = fit_whole_curves(read_trace_dir(run["trace_dir"] / "latest", 1, 1), layers,
                                          skip_iterations=self.sizes.curve_skip)
            except ScheduleConfigError as error:   # too few samples with tokens, say
                fitted[f"h{hidden}"] = {"status": "fail", "run": name, "error": str(error)}
                continue
            sweep = self.curve_sweep()[1]
            curves.source.update({"hidden_size": hidden, "device": self.sizes.device, "run": name,
                                  "flags": " ".join(flags[:flags.index("--synthetic-microbatches")]),
                                  "sweep": {"tokens_range": list(sweep.tokens_range),
                                            "documents_range": list(sweep.documents_range),
                                            "iterations": len(sweep.iterations), "skipped": self.sizes.curve_skip},
                                  "output_layer_share": output_layer_share(curves.model)})
            path = self.out / f"cost_curves_h{hidden}.json"
            path.write_text(json.dumps(curves.to_json(), indent=1))
            fitted[f"h{hidden}"] = {"status": "pass", "file": path.name, "run": name, "layer": curves.layer,
                                    "tokens_range": curves.source.get("tokens_range"),
                                    "documents_range": curves.source.get("documents_range"),
                                    "output_layer_share": curves.source["output_layer_share"]}
        status = "pass" if all(entry["status"] == "pass" for entry in fitted.values()) else "fail"
        return {"status": status, "curves": fitted}

    def transport(self) -> dict:
        bench = REPO / "tools" / "bench_transport.py"
        target = self.out / "transport.json"
        command = [self.python, str(bench), *self.sizes.transport_flags, "--json", str(target)]
        result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=self.limit(600))
        (self.out / "transport.txt").write_text(result.stdout + result.stderr)
        table = result.stdout.strip().splitlines()[-12:]   # printed also when one section failed (the IPC one)
        if result.returncode:
            tail = (result.stdout + result.stderr).strip().splitlines()
            return {"status": "fail", "error": tail[-1] if tail else f"exit {result.returncode}", "table": table}
        problems = cuda_bench_problems(json.loads(target.read_text()))
        if problems:
            return {"status": "fail", "error": "; ".join(problems), "table": table}
        return {"status": "pass", "table": table}

    def composition(self) -> dict:
        """Needs the curves step's files; measures nothing on the device itself (the simulator replays them)."""
        files = sorted(self.out.glob("cost_curves_h*.json"))
        if not files:
            return {"status": "skip", "reason": "no cost curves (the curves step did not run or failed)"}
        rows = COMPOSITION_ROWS if self.sizes.device == "cuda" else COMPOSITION_ROWS[:1]
        results = {}
        for curves in files:
            for name, entry in composition_rows(self.python, curves, rows, self.work, self.limit).items():
                results[f"{curves.stem}:{name}"] = entry
        status = "pass" if all(entry["status"] == "pass" for entry in results.values()) else "fail"
        return {"status": status, "rows": results}


def output_layer_share(model: Optional[dict]) -> Optional[float]:
    """The output layer's share of a token's forward matrix FLOPs (2 h vocab against each layer's 8 h^2 + 4 h ffn
    and itself; attention's score FLOPs left out, so an upper bound): what a whole-model fit spreads over the layers
    (None when the trace did not record the shape)."""
    try:
        h, ffn, vocab, layers = (int(model[key]) for key in ("hidden_size", "ffn_hidden_size", "vocab_size",
                                                              "num_layers"))
    except (TypeError, KeyError, ValueError):
        return None
    output = 2 * h * vocab
    return round(output / (layers * (8 * h * h + 4 * h * ffn) + output), 4)


def composition_rows(python: str, curves: Path, rows, work: Path, limit=lambda seconds: seconds) -> Dict[str, dict]:
    """Each row's simulator run under ``curves``: makespans and `balanced`'s ratios to `packed` and DpBalanced.
    limit(seconds): a run's time limit (Check.limit: what is left of the budget)."""
    results = {}
    for name, lengths, pipeline, chunks, microbatches, replicas, layers in rows:
        target = work / f"sim-{curves.stem}-{name}.json"
        command = [python, "-m", "megatron_app.sim", "--pipeline_parallel", str(pipeline), "--model_chunks",
                   str(chunks), "--microbatches", str(microbatches), "--lengths-file",
                   str(REPO / "docs" / "results" / "lengths" / f"{lengths}.txt"), "--documents-per-microbatch", "2",
                   "--iterations", "4", "--cost-curves", str(curves), "--num-layers", str(layers), "--json",
                   str(target)] + (["--data-parallel", str(replicas)] if replicas > 1 else [])
        result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=limit(600))
        if result.returncode:
            tail = (result.stdout + result.stderr).strip().splitlines()
            results[name] = {"status": "fail", "error": tail[-1] if tail else f"exit {result.returncode}"}
            continue
        makespans = {row["row"]: row["makespan_us"] / 1e3 for row in json.loads(target.read_text())["results"]}
        results[name] = {"status": "pass", "makespan_ms": makespans,
                         "balanced_over_packed": makespans["packed"] / makespans["balanced"],
                         "balanced_over_dp_balanced": makespans["dp-balanced"] / makespans["balanced"]}
    return results


def _predicted_name(row: str) -> str:
    return f"predict-{row.replace('+', '-')}"


def cuda_bench_problems(document: dict) -> List[str]:
    """What is wrong with the transport bench's CUDA section (none where it has none): a row whose tensors did not
    arrive bit-exact, a staged column that went another way than through the slots, an IPC column that fell back (the
    check's host is one GPU: IPC works there). tests/test_transport_bench.py's CUDA test asked the same of a short run;
    the pytest step leaves it to this step."""
    rows = (document.get("cuda") or {}).get("rows", [])
    problems = [f"{row['size']} bytes not bit-exact" for row in rows if row.get("bit_exact") is not True]
    problems += [f"{row['size']} bytes: ours went by {row.get('ours_path')}" for row in rows
                 if row.get("ours_path") not in ("slots, registered", "slots, not registered")]
    problems += [f"{row['size']} bytes: ipc went by {row.get('ipc_path')}" for row in rows
                 if not str(row.get("ipc_path")).startswith("cuda ipc")]
    return problems


def launch_phases(started_unix: float, seconds: float, log: Optional[dict],
                  gate_opened_unix: Optional[float] = None) -> Optional[dict]:
    """One run_single.sh launch's seconds: before the rank process started (and in it: set-up check, --check-config,
    from there to the rank: run_ranks.py and torchrun), the rank's start-up phases (its log's "startup": imports,
    process group, model parallel, trainer, and the trainer's parts: model, optimizer, data, runtime), its iterations,
    and after them; where the rank's log has its "ending"
    (startup.EndingClock), `after` splits into the loop's time outside the iterations (reports, evaluation,
    checkpoints), closing the schedule (transport, tracer), the process group's teardown, and from the rank's last
    mark to the launch's end (the interpreter's exit, torchrun's, the launcher's clean-up). None without the rank's
    start-up record. `exposed`: the seconds the launch added to the check: all of them, or for a run started ahead
    behind its gate (its rank's `gate` phase is the wait) those from the gate's opening (`gate_opened`: seconds
    from its start)."""
    startup = (log or {}).get("startup")
    if not startup:
        return None
    iterations = sum(it["time_ms"] for it in log.get("iterations", [])) / 1e3
    before = startup["process_started_unix"] - started_unix
    gate_opened = 0.0 if gate_opened_unix is None else gate_opened_unix - started_unix
    phases = {"total": round(seconds, 2), "exposed": round(seconds - gate_opened, 2),
              **({"gate_opened": round(gate_opened, 2)} if gate_opened_unix is not None else {}),
              "before_rank": round(before, 2),
              **{f"launcher_{phase}": value for phase, value in startup.get("launcher_s", {}).items()},
              **{f"rank_{phase}": value for phase, value in startup["seconds"].items()},
              **{f"rank_trainer_{part}": value for part, value in startup.get("trainer_parts", {}).items()},
              "iterations": round(iterations, 2),
              "after": round(seconds - before - startup["total_s"] - iterations, 2)}
    ending = log.get("ending")
    if ending:
        spent = ending["seconds"]
        if "loop" in spent:
            phases["after_loop_outside_iterations"] = round(spent["loop"] - iterations, 2)
        for phase in ("closing", "process_group"):
            if phase in spent:
                phases[f"after_rank_{phase}"] = spent[phase]
        phases["after_rank_exit"] = round(started_unix + seconds - ending["ended_unix"], 2)
    return phases


def launch_summary(launches: Dict[str, dict]) -> Optional[dict]:
    """The median of each phase over the launches that ran alone (the timing steps': prediction, curves) and over
    all of them; None when no launch reported."""
    if not launches:
        return None

    def medians(runs):   # launch_phases' order, that of the run with the most phases first
        keys = list(dict.fromkeys(key for run in sorted(runs, key=len, reverse=True) for key in run))
        return {key: round(statistics.median(run[key] for run in runs if key in run), 2) for key in keys}

    alone = [run for name, run in launches.items() if name.startswith(("predict-", "curve-"))]
    overlaps = [run["ahead_overlap"] for run in launches.values() if "ahead_overlap" in run]
    return {"launches": len(launches), "started_ahead": sum("gate_opened" in run for run in launches.values()),
            **({"ahead_overlap_max": max(overlaps)} if overlaps else {}),
            "median_all": medians(list(launches.values())), **({"median_alone": medians(alone)} if alone else {})}


def _median_per_rank(run, skip: int, measure) -> Dict[str, Dict[str, float]]:
    """Per pipeline rank ("ppR"): for each iteration from `skip` with a call span, measure(events, call) -> {name:
    share}; the median of each share over those iterations."""
    from megatron_app.trace.schema import ITERATION

    result = {}
    for rank in run.pipeline_view():
        shares: Dict[str, list] = {}
        for iteration in run.iterations()[skip:]:
            events = rank.events_of(iteration)
            call = next((e for e in events if e.kind == ITERATION), None)
            if call is None or call.duration <= 0:
                continue
            for name, share in measure(events, call).items():
                shares.setdefault(name, []).append(share)
        if shares:
            result[f"pp{rank.meta.pp_rank}"] = {name: statistics.median(values) for name, values in shares.items()}
    return result


def span_coverage(run, skip: int) -> Dict[str, float]:
    """Per pipeline rank: median over iterations of (sum of compute spans) / (the call's iteration span)."""
    from megatron_app.trace.schema import COMPUTE_KINDS

    def compute(events, call):
        return {"compute": sum(e.duration for e in events if e.kind in COMPUTE_KINDS) / call.duration}

    return {rank: shares["compute"] for rank, shares in _median_per_rank(run, skip, compute).items()}


def through_iteration(run, last: int):
    """The trace run without the events of iterations after ``last`` (a profiled one)."""
    import dataclasses

    from megatron_app.trace.reader import TraceRun

    return TraceRun(run.trace_dir, [dataclasses.replace(rank, events=[e for e in rank.events if e.iteration <= last])
                                    for rank in run.ranks])


def profile_summary(directory: Path, work: Path, most: int = 8) -> dict:
    """The profiled iteration of a prediction row: its files (as runs.tar.gz holds them) and the operators with the
    most host time of their own (ms), with their device time; or why there is none."""
    summaries = sorted(directory.glob("rank*.ops.json"))
    if not summaries:
        return {"error": f"no profile in {directory} (the run's output says why)"}
    try:
        summary = json.loads(summaries[0].read_text())
        operators = [[op["name"], round(op["self_host_us"] / 1e3, 2), round(op["self_device_us"] / 1e3, 2)]
                     for op in summary["operators"][:most]]
    except (ValueError, KeyError, TypeError) as error:   # the row's figures stand without it
        return {"error": f"{summaries[0].name}: {type(error).__name__}: {error}"}
    trace = next(iter(sorted(directory.glob("rank*.pt.trace.json.gz"))), None)

    def archived(path: Optional[Path]) -> Optional[str]:
        return None if path is None else "runs/" + str(path.resolve().relative_to(work.resolve()))

    return {"iterations": summary.get("iterations"), "trace": archived(trace), "operators": archived(summaries[0]),
            "top_host_ms": operators}


def gc_pauses(run, skip: int) -> Dict[str, dict]:
    """Per pipeline rank, over the iterations from `skip`: Python's garbage collections (the trace's `gc` events):
    how many, their total and longest ms, and how many fell inside a compute task as the host ran it (a
    device-timed task's host span: start - queued_us, for host_us)."""
    from megatron_app.trace.metrics import host_span
    from megatron_app.trace.schema import COMPUTE_KINDS, GC

    result = {}
    for rank in run.pipeline_view():
        pauses, inside = [], 0
        for iteration in run.iterations()[skip:]:
            events = rank.events_of(iteration)
            tasks = [host_span(e) or (e.start, e.end) for e in events if e.kind in COMPUTE_KINDS]
            for pause in (e for e in events if e.kind == GC):
                pauses.append(pause.duration)
                inside += any(start <= pause.start < end for start, end in tasks)
        if pauses:
            result[f"pp{rank.meta.pp_rank}"] = {"collections": len(pauses), "total_ms": round(sum(pauses) / 1e3, 2),
                                                "longest_ms": round(max(pauses) / 1e3, 2), "inside_tasks": inside}
    return result


def peak_memory(run, skip: int) -> Dict[str, float]:
    """Per pipeline rank: its largest peak memory (MiB) of the iterations from `skip` (the trace's `memory` events: on
    CUDA the allocator's most allocated in an iteration); empty for a trace without them."""
    from megatron_app.trace.schema import MEMORY

    result = {}
    for rank in run.pipeline_view():
        peaks = [e.extra["peak_mib"] for iteration in run.iterations()[skip:] for e in rank.events_of(iteration)
                 if e.kind == MEMORY and "peak_mib" in e.extra]
        if peaks:
            result[f"pp{rank.meta.pp_rank}"] = max(peaks)
    return result


def host_bound_shares(run, skip: int) -> Dict[str, float]:
    """Per pipeline rank: median over iterations of the share of its compute time in tasks whose time was the
    host's (trace.metrics.host_bound_us: the device's end came within 10% of the span after the host's); empty for a
    host-timed trace. Tells launch-bound tasks and host stalls inside tasks from slow kernels."""
    from megatron_app.trace.metrics import host_bound_us
    from megatron_app.trace.schema import COMPUTE_KINDS

    def share(events, call):
        bound = host_bound_us(events)
        compute = sum(e.duration for e in events if e.kind in COMPUTE_KINDS)
        return {} if bound is None or compute <= 0 else {"host_bound": bound / compute}

    return {rank: shares["host_bound"] for rank, shares in _median_per_rank(run, skip, share).items()}


def replayed_errors(run) -> Dict[str, Optional[float]]:
    """The cost model replayed over this trace (bench/cost_model_replay.py) without and with the time between
    tasks: median |predicted / measured - 1| of the pipeline, so a GPU run says what that term buys there."""
    from megatron_app.bench.cost_model_replay import replay

    results = replay(run, warmup=2)
    return {"without_gaps": results["per rank, growth aside"].median_abs,
            "with_gaps": results["per rank, growth aside, gaps (now)"].median_abs}


def task_gaps(run, skip: int) -> Dict[str, float]:
    """Per pipeline rank: the median over iterations of the call's mean time between tasks run back to back, in
    microseconds (the iteration event's task_gap_us: what the planner adds to every task of the rank)."""
    def gap(events, call):
        return {"gap": call.extra["task_gap_us"]} if "task_gap_us" in call.extra else {}

    return {rank: values["gap"] for rank, values in _median_per_rank(run, skip, gap).items()}


def transfer_shares(run, skip: int) -> Dict[str, Dict[str, float]]:
    """Per pipeline rank, the median over iterations (from skip) of the share of the call's span during which a send
    was in flight (its trace span: a device tensor's own transfer, a host tensor's posting to the completion the
    rank saw; asynchronous, it overlaps compute; the union of the spans, so at most 1), spent taking inputs (recv)
    and blocked waiting for one (wait)."""
    from megatron_app.trace.intervals import union_length
    from megatron_app.trace.schema import RECV, SEND, WAIT

    def transfers(events, call):
        return {kind: union_length((e.start, e.end) for e in events if e.kind == kind) / call.duration
                for kind in (SEND, RECV, WAIT)}

    return _median_per_rank(run, skip, transfers)


def _error_line(output: str) -> str:
    """A failed run's own error: the last line naming an exception, not torchrun's report of its child's exit
    (ChildFailedError, which follows it); else the output's last line."""
    lines = output.strip().splitlines()
    named = [line.strip() for line in lines if ("Error" in line or "error:" in line) and "ChildFailedError" not in line]
    return named[-1] if named else (lines[-1] if lines else "no output")


def _text(output) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else (output or "")


def _junit_counts(path: Path) -> dict:
    if not path.exists():
        return {}
    import xml.etree.ElementTree as ElementTree

    suite = ElementTree.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    tests = int(suite.get("tests", 0))
    failures, errors, skipped = (int(suite.get(k, 0)) for k in ("failures", "errors", "skipped"))
    return {"tests": tests, "passed": tests - failures - errors - skipped, "failures": failures, "errors": errors,
            "skipped": skipped}


# In the order they run: what judges the GPU issues first (equality, transport, prediction), the long curves runs
# late, composition last (it reads the curves step's files). The steps of one phase run side by side: equality and
# own-loop only check losses (each launch costs about a minute on the first GPU hosts, mostly start-up); the host
# step's import probes take a core or two of 16 beside pytest's GPU tests, and composition (the simulator, one core)
# beside ipc-sends (22 s and 23 s of the H200's 11-minute run); transport, prediction and curves run alone.
PHASES = (("host", "pytest"), ("equality", "own-loop"), ("transport",), ("prediction",), ("curves",),
          ("composition", "ipc-sends"), ("slots8",))
STEPS = tuple(name for phase in PHASES for name in phase)
# Run only when --steps names them: they measure what judges no issue, and the check's time is one of its targets.
OPT_IN_STEPS = ("slots8",)
DEFAULT_STEPS = tuple(name for name in STEPS if name not in OPT_IN_STEPS)

# The simulator's composition rows (BENCHMARKS.md, "Microbatch composition"): (name, corpus lengths, P, V, m, D,
# layers of the simulated model: the curves' layer cost times this, spread over P x V chunks).
COMPOSITION_ROWS = [("c2048-p4v2m16", "copyright_2048", 4, 2, 16, 1, 8), ("c8192-p4v2m16", "copyright_8192", 4, 2, 16, 1, 8),
                    ("c8192-p8v2m32", "copyright_8192", 8, 2, 32, 1, 16), ("c2048-d4-p4v2m16", "copyright_2048", 4, 2, 16, 4, 8),
                    ("c8192-d4-p4v2m16", "copyright_8192", 4, 2, 16, 4, 8)]


def write_text_report(report: dict) -> str:
    lines = [f"gpu_check: {'PASS' if report['passed'] else 'FAIL'} ({report['mode']}, {report['seconds']:.0f} s)"]
    for name, step in report["steps"].items():
        detail = step.get("error") or step.get("reason") or ""
        lines.append(f"{name:<11} {step['status']:<5} {step.get('seconds', 0):>6.1f} s  {detail}")
        if name == "host":
            lines.append("            " + ", ".join(f"{k}={v}" for k, v in step.items()
                                                   if k not in ("status", "seconds")))
        for row, entry in step.get("rows", {}).items():
            summary = {k: entry[k] for k in ("max_relative_difference", "tolerance", "median_abs_error", "target",
                                             "span_coverage", "task_gap_us", "host_bound_share", "gc", "replay",
                                             "peak_memory_mib", "profile", "send_share",
                                             "send_share_target",
                                             "balanced_over_packed", "balanced_over_dp_balanced", "transport",
                                             "error")
                       if k in entry}
            lines.append(f"            {row:<24} {entry['status']:<5} {json.dumps(summary)}")
        for key, curve in step.get("curves", {}).items():
            said = f"fail: {curve.get('error')}"
            if "layer" in curve:
                tokens = [round(t) for t in curve.get("tokens_range") or []] or ["?", "?"]
                documents = curve.get("documents_range") or ["?", "?"]
                said = (f"fitted on {tokens[0]}..{tokens[1]} tokens, {documents[0]}..{documents[1]} documents a "
                        f"microbatch; layer {json.dumps(curve['layer'])}")
            lines.append(f"            {key}: {said}")
        for line in step.get("table", []):
            lines.append(f"            {line}")
        for line in step.get("failures", []):
            lines.append(f"            {line}")
    launch = report.get("launch")
    if launch:
        typical = launch.get("median_alone") or launch["median_all"]
        which = "launches that ran alone" if "median_alone" in launch else "all launches"
        ahead = launch.get("started_ahead")
        lines.append(f"launch      median seconds of the {which} (of {launch['launches']}"
                     + (f"; {ahead} started ahead behind a gate, at most {launch.get('ahead_overlap_max', 0):g} s "
                        "of a start-up beside the previous run's iterations" if ahead else "") + "): "
                     + ", ".join(f"{key} {value:g}" for key, value in typical.items()))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for report.json, report.txt and the runs' files")
    parser.add_argument("--cpu", action="store_true", help="the rehearsal: the same steps at small sizes on CPU")
    parser.add_argument("--setup-seconds", type=float, default=None)
    parser.add_argument("--steps", default=",".join(DEFAULT_STEPS),
                        help=f"comma-separated subset of {','.join(STEPS)} (default: all but {','.join(OPT_IN_STEPS)})")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds for all steps: a step is not started once they are spent (reported as 'cut', "
                             "which fails the check), and a running command gets only what is left")
    parser.add_argument("--no-ahead", action="store_true",
                        help="start each timed run only when the one before has ended (no start gate; to measure "
                             "what starting them ahead saves)")
    args = parser.parse_args(argv)
    if args.budget_s is not None and not args.budget_s > 0:
        print(f"gpu_check: --budget-s must be a positive number of seconds, got {args.budget_s}", file=sys.stderr)
        return 2
    steps = [s for s in args.steps.split(",") if s]
    unknown = sorted(set(steps) - set(STEPS))
    if unknown:
        print(f"gpu_check: unknown step(s) {', '.join(unknown)}; known: {', '.join(STEPS)}", file=sys.stderr)
        return 2
    import torch

    if not args.cpu and not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible (torch.cuda.is_available() is False); use --cpu for the rehearsal",
              file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    budget_started = time.monotonic()
    deadline = None if args.budget_s is None else budget_started + args.budget_s
    check = Check(out, CPU if args.cpu else GPU, sys.executable, deadline)
    if not args.no_ahead:
        check.set_timed_plan(steps)

    def stop_on(signum, _frame):   # a runner's timeout or Ctrl-C: no launch outlives the check
        check.close()
        raise SystemExit(128 + signum)

    report = {"mode": "cpu rehearsal" if args.cpu else "gpu", "steps": {}}
    if args.setup_seconds is not None:
        report["steps"]["setup"] = {"status": "pass", "seconds": args.setup_seconds}
    started = time.perf_counter()
    budget = None if args.budget_s is None else f"{args.budget_s:.0f} s"

    def run_step(name: str) -> dict:
        step_start = time.perf_counter()
        if deadline is not None and time.monotonic() >= deadline:
            result = {"status": "cut", "reason": f"not started: the {budget} budget was spent"}
        else:
            print(f"gpu_check: {name} ...", flush=True)
            try:
                result = getattr(check, name.replace("-", "_"))()
            except Exception as error:   # noqa: BLE001 (a step's failure is its report line, the rest still run)
                result = {"status": "fail", "error": f"{type(error).__name__}: {error}"}
            if result["status"] == "fail" and deadline is not None and time.monotonic() >= deadline - 1.0:
                # its commands were stopped at the budget's end: not a verdict on the step (still not a pass)
                result = {**result, "status": "cut", "reason": f"stopped when the {budget} budget ran out "
                                                               f"({result.get('error', 'see its rows')})"}
        result["seconds"] = round(time.perf_counter() - step_start, 1)
        print(f"gpu_check: {name} {result['status']} ({result['seconds']} s)", flush=True)
        return result

    previous = {signum: signal.signal(signum, stop_on) for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        for phase in PHASES:
            names = [name for name in phase if name in steps]
            if names and set(names) <= EARLY_START_STEPS:
                check.start_first_ahead()
            with ThreadPoolExecutor(max_workers=max(1, len(names))) as pool:   # a phase's steps run side by side
                for name, result in zip(names, pool.map(run_step, names)):
                    report["steps"][name] = result
            report["launch"] = launch_summary(check.launches)
            _write(out, report, started)
    finally:
        check.close()
        for signum, handler in previous.items():   # a caller's process (a test calling main) keeps its own
            signal.signal(signum, handler)
    report = _write(out, report, started)
    with tarfile.open(out / "runs.tar.gz", "w:gz") as archive:   # every run's output, logs and traces
        archive.add(check.work, arcname="runs", filter=lambda info: None if info.name.endswith("/corpus") or
                    "/corpus/" in info.name else info)
    print(write_text_report(report), end="")
    return 0 if report["passed"] else 1


def _write(out: Path, report: dict, started: float) -> dict:
    report["seconds"] = time.perf_counter() - started
    report["passed"] = all(step["status"] in ("pass", "skip") for step in report["steps"].values())
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "report.txt").write_text(write_text_report(report))
    return report


if __name__ == "__main__":
    raise SystemExit(main())
