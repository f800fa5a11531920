"""Straggler and jitter on real compute (issue #30, item 5): real GPT training on CPU with one pipeline rank slowed
for real by a competing CPU-bound process: `planned` against `planned-fixed` (the same plans, run-time reordering
off) and Megatron's `interleaved` order, tokens/s, runs alternated (real_composition.run_alternated).

    python tools/bench_straggler.py [-P 2 -V 2 --seq-length 2048 --micro-batch-size 2 --global-batch-size 16]
        [--iters 6 --rounds 2] [--straggler none|steady|intermittent] [--slow-rank R] [--jitter-period-ms 300]
        [--rows planned,planned-fixed,interleaved] [--data-dir data/copyright] [--json FILE] [--trace-dir DIR]
        [-- trainer flags]

Same microbatches in every row: --variable-seq-lengths --composition packed (the loader's microbatches, each packed
into one row without padding); a row chooses only their order, so the rows' losses agree (printed as a check).

Pinning. For the competitor to slow one rank only, every rank runs on a core of its own: while a run lasts, a thread
of the benchmark finds the run's rank processes (the MEGATRON_APP_JOB_ID the benchmark gives run_single.sh, and
RANK, in /proc/PID/environ) and pins every thread of rank r (/proc/PID/task/*) to the r-th core this process may
use, again every POLL_S, so threads started later are pinned as well (they inherit it from a pinned thread anyway).
Done from outside rather than by a trainer flag: the slowdown is the benchmark's setting, so the trainer and the
launchers stay as they are and the same code pins the competitor; the second or so of start-up before the ranks are
found is in the warm-up iteration, which is left out. With D = T = 1 the global rank is the pipeline rank.

Slowdowns (--straggler), started before each run and stopped after it, on the slowed rank's core:
  none          no competitor (the ranks are pinned all the same)
  steady        one busy process (a spin loop: the one deliberate busy loop, it is the load) for the whole run
  intermittent  the same process stopped and continued (SIGSTOP/SIGCONT) on a seeded random schedule: each on and
                each off phase lasts an exponentially distributed time of mean --jitter-period-ms / 2, so a cycle
                averages the period and the competitor is on about half the time, at moments no plan can know.
With --trace-dir the runs are traced and the report counts, per row, the iterations in which every rank ran exactly
the order of a plan (follows_a_plan): run-time reordering that moved a task shows there.

The competitor is killed (SIGKILL, then reaped) when the run ends, fails or is interrupted (Ctrl-C or SIGTERM), and
dies with the benchmark (PR_SET_PDEATHSIG) should that be killed outright.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from megatron_app.schedule import POLICIES, PipelineShape
from megatron_app.schedule.composition import PACKED
from megatron_app.schedule.plan_search import MAX_EXTRA_WARMUP, Plan, plan_order
from megatron_app.schedule.tasks import Kind, Task
from megatron_app.schedule.planned import FIXED_NAME
from megatron_app.schedule.policies import BASELINE_POLICY, DEFAULT_POLICY
from megatron_app.trace.cli import OneLineArgumentParser, positive_int

from .real_composition import (REPO_ROOT, CompositionRun, CompositionSummary, format_table, run_alternated,
                               summarise, trace_run_dir)

PROG = "bench_straggler.py"
NONE, STEADY, INTERMITTENT = "none", "steady", "intermittent"
MODES = (NONE, STEADY, INTERMITTENT)
DEFAULT_ROWS = (DEFAULT_POLICY, FIXED_NAME, BASELINE_POLICY)
DEFAULT_JITTER_PERIOD_MS = 300.0
TARGET = 1.05            # the target: planned >= 1.05x planned-fixed with one rank slowed by a competitor
POLL_S = 0.2             # how often the pinner looks for rank processes and threads
JOB_ID_VARIABLE = "MEGATRON_APP_JOB_ID"
COMPETITOR_MARK = "megatron_app-straggler-competitor"   # in the competitor's command line (tests look for it)
# The competitor: die with the benchmark (prctl PR_SET_PDEATHSIG = 1), unless it already died, then spin.
_SPIN = ("import ctypes, os, signal, sys\n"
         "ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))\n"
         "if os.getppid() != int(sys.argv[1]):\n"
         "    sys.exit(0)\n"
         "while True:\n"
         "    pass\n")


# ---- pinning ------------------------------------------------------------------------------------------------------
def usable_cores() -> List[int]:
    """The cores this process may run on, in order (rank r gets the r-th)."""
    return sorted(os.sched_getaffinity(0))


def pin_threads(pid: int, cores) -> int:
    """Pin every thread of process `pid` to `cores`; returns how many were pinned (0 when the process is gone).
    A thread that ends meanwhile is skipped."""
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except (FileNotFoundError, ProcessLookupError):
        return 0
    pinned = 0
    for thread in threads:
        try:
            os.sched_setaffinity(int(thread), set(cores))
            pinned += 1
        except (ProcessLookupError, FileNotFoundError):
            pass
    return pinned


def job_processes(job_id: str) -> Dict[int, Optional[int]]:
    """{pid: RANK or None} of this user's processes whose environment holds MEGATRON_APP_JOB_ID=job_id
    (run_single.sh, torchrun and its workers, which alone have a RANK), this process excepted."""
    wanted = job_id.encode()
    found: Dict[int, Optional[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            raw = Path(f"/proc/{entry.name}/environ").read_bytes()
        except OSError:         # gone, or another user's
            continue
        variables = dict(item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
        if variables.get(JOB_ID_VARIABLE.encode()) != wanted:
            continue
        rank = variables.get(b"RANK")
        found[int(entry.name)] = int(rank) if rank is not None and rank.isdigit() else None
    return found


def job_ranks(job_id: str) -> Dict[int, int]:
    """{pid: RANK} of job `job_id`'s rank processes (torchrun's workers)."""
    return {pid: rank for pid, rank in job_processes(job_id).items() if rank is not None}


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def end_job(job_id: str, grace_s: float = 5.0) -> List[int]:
    """End what is left of an interrupted or failed run: SIGTERM to every process of the job (torchrun then stops
    its workers), SIGKILL to those still alive after grace_s. Returns the pids it signalled."""
    pids = list(job_processes(job_id))
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.1)
    for pid in pids:
        if _alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    return pids


class RankPinner:
    """While the context lasts: every POLL_S, pin each thread of job `job_id`'s rank r to cores[r]. Looks for
    rank processes until `world_size` are found, then re-pins their threads only."""

    def __init__(self, job_id: str, cores: Sequence[int], world_size: int, poll_s: float = POLL_S):
        self.job_id, self.cores, self.world_size, self.poll_s = job_id, list(cores), world_size, poll_s
        self.pinned: Dict[int, Tuple[int, int, int]] = {}   # rank -> (pid, core, most threads pinned at once)
        self._ranks: Dict[int, int] = {}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def pin_once(self) -> None:
        if len(self._ranks) < self.world_size:
            self._ranks = job_ranks(self.job_id)
        for pid, rank in list(self._ranks.items()):
            if rank >= len(self.cores):
                continue
            threads = pin_threads(pid, {self.cores[rank]})
            if threads == 0:
                continue
            before = self.pinned.get(rank, (pid, 0, 0))[2]
            self.pinned[rank] = (pid, self.cores[rank], max(before, threads))

    def _loop(self) -> None:
        while True:
            self.pin_once()
            if self._stop.wait(self.poll_s):
                return

    def __enter__(self) -> "RankPinner":
        self._thread = threading.Thread(target=self._loop, name="rank-pinner", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


# ---- the competitor -----------------------------------------------------------------------------------------------
def on_off_phases(period_s: float, seed: int) -> Iterator[float]:
    """The intermittent competitor's phase lengths in seconds (on, off, on, ...): exponentially distributed, mean
    period_s / 2 each, from Random(seed)."""
    rng = random.Random(seed)
    while True:
        yield rng.expovariate(2.0 / period_s)


class Competitor:
    """A CPU-bound process pinned to `core` while the context lasts. period_s: switched on and off (SIGSTOP/SIGCONT)
    with each phase exponentially distributed of mean period_s / 2, drawn from Random(seed); None: on throughout.
    Start it from the thread that will outlive it (PR_SET_PDEATHSIG follows the parent thread)."""

    def __init__(self, core: int, period_s: Optional[float] = None, seed: int = 0):
        if period_s is not None and not period_s > 0:
            raise ValueError(f"period must be > 0 seconds, got {period_s!r}")
        self.core, self.period_s, self.seed = core, period_s, seed
        self.process: Optional[subprocess.Popen] = None
        self.switches = 0
        self.on_s = 0.0
        self.lasted_s = 0.0
        self._started = 0.0
        self._stop = threading.Event()
        self._toggler: Optional[threading.Thread] = None

    @property
    def pid(self) -> Optional[int]:
        return None if self.process is None else self.process.pid

    @property
    def on_fraction(self) -> float:
        """Share of its life the competitor was switched on (1 when steady)."""
        return self.on_s / self.lasted_s if self.lasted_s > 0 else 0.0

    def __enter__(self) -> "Competitor":
        self.process = subprocess.Popen([sys.executable, "-c", _SPIN, str(os.getpid()), COMPETITOR_MARK],
                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
        self._started = time.monotonic()
        try:
            pin_threads(self.process.pid, {self.core})
            if self.period_s is not None:
                self._toggler = threading.Thread(target=self._toggle, name="competitor-toggler", daemon=True)
                self._toggler.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _toggle(self) -> None:
        phases = on_off_phases(self.period_s, self.seed)
        on, since = True, time.monotonic()
        while not self._stop.wait(next(phases)):
            now = time.monotonic()
            try:
                os.kill(self.process.pid, signal.SIGSTOP if on else signal.SIGCONT)
            except ProcessLookupError:
                break
            if on:
                self.on_s += now - since
            on, since = not on, now
            self.switches += 1
        if on:
            self.on_s += time.monotonic() - since

    def stop(self) -> None:
        """Kill and reap the competitor (a stopped one too); safe to call twice."""
        self._stop.set()
        if self._toggler is not None:
            self._toggler.join()
            self._toggler = None
        if self.process is not None and self.process.returncode is None:
            self.process.kill()                 # SIGKILL ends a stopped process as well
            self.process.wait()
            self.lasted_s = time.monotonic() - self._started
            if self.period_s is None:
                self.on_s = self.lasted_s


# ---- one slowdown around each run ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Straggler:
    mode: str                                   # none | steady | intermittent
    slow_rank: Optional[int]                    # None with mode none
    cores: Tuple[int, ...]                      # rank r runs on cores[r]
    world_size: int
    period_ms: Optional[float] = None           # intermittent only
    seed: int = 0

    @property
    def core(self) -> Optional[int]:
        return None if self.slow_rank is None else self.cores[self.slow_rank]

    def describe(self) -> str:
        if self.mode == NONE:
            return "no straggler (ranks pinned, no competitor)"
        how = "for the whole run" if self.mode == STEADY else \
            f"switched on and off at random, mean period {self.period_ms:g} ms (seed {self.seed})"
        return f"pipeline rank {self.slow_rank} slowed by a busy process on its core {self.core}, {how}"


@dataclass
class SlowdownRecord:
    row: str
    round: int
    pinned: Dict[int, Tuple[int, int, int]] = field(default_factory=dict)   # rank -> (pid, core, threads)
    competitor_on_fraction: Optional[float] = None
    competitor_switches: int = 0


@contextlib.contextmanager
def slowed(straggler: Straggler, job_id: str, record: SlowdownRecord) -> Iterator[SlowdownRecord]:
    """The run's slowdown: the competitor (when any) and the rank pinner, both stopped whatever happens inside; when
    the run inside fails or is interrupted, what is left of job `job_id` is ended too (end_job)."""
    competitor = None
    with contextlib.ExitStack() as stack:
        if straggler.mode != NONE:
            period = straggler.period_ms / 1e3 if straggler.mode == INTERMITTENT else None
            competitor = stack.enter_context(Competitor(straggler.core, period, straggler.seed))
        pinner = stack.enter_context(RankPinner(job_id, straggler.cores, straggler.world_size))
        try:
            yield record
        except BaseException:
            end_job(job_id)
            raise
    record.pinned = dict(pinner.pinned)
    if competitor is not None:
        record.competitor_on_fraction = competitor.on_fraction
        record.competitor_switches = competitor.switches


def row_flags(row: str) -> List[str]:
    """A row's trainer flags: the registry's policy (a static order by --schedule, an adaptive one by --policy) on
    the loader's microbatches packed."""
    entry = POLICIES[row]
    return ["--schedule" if entry.static else "--policy", row, "--composition", PACKED]


def measure(rows: Sequence[str], rounds: int, launcher_flags: Sequence[str], straggler: Straggler,
            warmup: int = 1, progress=print, trace_root: Optional[str] = None
            ) -> Tuple[List[CompositionRun], List[SlowdownRecord]]:
    """Every row once per round (alternated), each run under `straggler` (traced under trace_root when given).
    Raises RuntimeError when a run fails or when a run's ranks were not all pinned (its numbers would not say what
    they claim)."""
    job_id = f"straggler{os.getpid()}"
    env = dict(os.environ, **{JOB_ID_VARIABLE: job_id})
    records: List[SlowdownRecord] = []

    def around(row: str, round_index: int):
        records.append(SlowdownRecord(row, round_index))
        return slowed(straggler, job_id, records[-1])

    runs = run_alternated(rows, rounds, launcher_flags, warmup, progress, row_flags, env=env, around_run=around,
                          trace_root=trace_root)
    for record in records:
        if sorted(record.pinned) != list(range(straggler.world_size)):
            raise RuntimeError(f"row {record.row} round {record.round + 1}: pinned ranks {sorted(record.pinned)} "
                               f"of {straggler.world_size} (the run ended before its ranks were found?)")
    return runs, records


# ---- did a run leave its plans? (traced runs) ---------------------------------------------------------------------
def compute_orders(trace_dir, pipeline_parallel: int, model_chunks: int) -> Dict[int, List[List[Task]]]:
    """{iteration: per pipeline rank, its forwards and backwards in start order} of a traced run (W's of a split
    backward left out: they are not planned)."""
    from megatron_app.trace import read_trace_dir

    planned = {kind.trace_name: kind for kind in (Kind.FORWARD, Kind.BACKWARD)}
    orders: Dict[int, List[List[Task]]] = {}
    for rank_trace in read_trace_dir(trace_dir, pipeline_parallel, model_chunks).ranks:
        for event in sorted((e for e in rank_trace.events if e.kind in planned), key=lambda e: e.start):
            per_rank = orders.setdefault(event.iteration, [[] for _ in range(pipeline_parallel)])
            per_rank[event.pp_rank].append(Task(planned[event.kind], event.chunk, event.microbatch))
    return orders


def follows_a_plan(shape: PipelineShape, orders: Sequence[Sequence[Task]]) -> bool:
    """Whether every rank's order is its order under one plan (planned's: Megatron's order over a start order, with
    0..MAX_EXTRA_WARMUP extra warm-up per rank; Megatron's own is the plan of data order and none): the start order
    is the one rank 0's first chunk shows (run-time reordering moves only backwards), each rank's warm-up is tried.
    A task run ahead of its plan shows as False."""
    start = tuple(task.microbatch for task in orders[0] if task.chunk == 0 and task.kind is Kind.FORWARD)
    if sorted(start) != list(range(shape.num_microbatches)):
        return False
    for rank, order in enumerate(orders):
        extras = (tuple(extra if r == rank else 0 for r in range(shape.num_stages))
                  for extra in range(MAX_EXTRA_WARMUP + 1))
        if not any(plan_order(shape, rank, Plan(start, extra)) == tuple(order) for extra in extras):
            return False
    return True


def plan_order_counts(trace_root: str, records: Sequence[SlowdownRecord], pipeline_parallel: int,
                      model_chunks: int, microbatches: int) -> Dict[str, Tuple[int, int]]:
    """{row: (iterations in which every rank ran a plan's order exactly, iterations)} over the traced runs."""
    shape = PipelineShape(pipeline_parallel, model_chunks, microbatches)
    counts: Dict[str, Tuple[int, int]] = {}
    for record in records:
        orders = compute_orders(trace_run_dir(trace_root, record.row, record.round), pipeline_parallel,
                                model_chunks)
        kept = sum(follows_a_plan(shape, per_rank) for per_rank in orders.values())
        before = counts.get(record.row, (0, 0))
        counts[record.row] = (before[0] + kept, before[1] + len(orders))
    return counts


# ---- report -------------------------------------------------------------------------------------------------------
def ratios(summaries: Sequence[CompositionSummary]) -> Dict[str, float]:
    """planned / planned-fixed and planned / interleaved (median tokens/s), for the rows that ran."""
    rate = {s.composition: s.median_tokens_per_s for s in summaries}
    pairs = ((DEFAULT_POLICY, FIXED_NAME), (DEFAULT_POLICY, BASELINE_POLICY), (FIXED_NAME, BASELINE_POLICY))
    return {f"{a} / {b}": rate[a] / rate[b] for a, b in pairs if a in rate and b in rate}


def format_report(summaries: Sequence[CompositionSummary], baseline: str, straggler: Straggler,
                  load: Dict[str, Sequence[float]], plan_orders: Optional[Dict[str, Tuple[int, int]]] = None) -> str:
    """The table, the ratios, (traced runs) how many iterations followed a plan's order exactly, the load."""
    lines = [straggler.describe(), format_table(summaries, baseline, label="row")]
    for name, value in ratios(summaries).items():
        target = f"   (target >= {TARGET:g} with a competitor)" if name == f"{DEFAULT_POLICY} / {FIXED_NAME}" else ""
        lines.append(f"{name:<28} {value:>6.3f}{target}")
    if plan_orders:
        lines.append("iterations in which every rank ran a plan's order exactly (no task moved at run time): "
                     + ", ".join(f"{row} {kept}/{total}" for row, (kept, total) in plan_orders.items()))
    lines.append("load average (1, 5, 15 min): before " + ", ".join(f"{v:.2f}" for v in load["before"])
                 + "; after " + ", ".join(f"{v:.2f}" for v in load["after"]))
    return "\n".join(lines)


def write_json(path: str, summaries: Sequence[CompositionSummary], records: Sequence[SlowdownRecord],
               straggler: Straggler, launcher_flags: Sequence[str], load: Dict[str, Sequence[float]],
               plan_orders: Optional[Dict[str, Tuple[int, int]]] = None) -> None:
    import json

    payload = {"launcher_flags": list(launcher_flags), "straggler": asdict(straggler) | {"core": straggler.core},
               "load_average": load, "ratios": ratios(summaries), "target": TARGET,
               "summaries": [asdict(s) for s in summaries], "slowdowns": [asdict(r) for r in records],
               "plan_order_iterations": plan_orders}
    Path(path).write_text(json.dumps(payload, indent=1))


# ---- command line -------------------------------------------------------------------------------------------------
def parse_args(argv: Optional[Sequence[str]] = None, cores: Optional[Sequence[int]] = None) -> argparse.Namespace:
    """Flags, checked: a bad one is one line on stderr and exit 2. cores: the usable cores (default: this
    process's)."""
    parser = OneLineArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default="data/copyright",
                        help="tools/make_corpus.py's output; built with --sources copyright when missing")
    parser.add_argument("-P", "--pipeline-parallel", type=positive_int, default=2)
    parser.add_argument("-V", "--model-chunks", type=positive_int, default=2)
    parser.add_argument("--seq-length", type=positive_int, default=2048)
    parser.add_argument("--micro-batch-size", type=positive_int, default=2)
    parser.add_argument("--global-batch-size", type=positive_int, default=16)
    parser.add_argument("--iters", type=positive_int, default=6, help="iterations per run, the first a warm-up")
    parser.add_argument("--rounds", type=positive_int, default=2)
    parser.add_argument("--rows", default=",".join(DEFAULT_ROWS), help="policies of the registry, comma-separated")
    parser.add_argument("--straggler", choices=MODES, default=STEADY)
    parser.add_argument("--slow-rank", type=int, default=None, help="pipeline rank slowed (default: the last)")
    parser.add_argument("--jitter-period-ms", type=float, default=None,
                        help=f"intermittent: mean on+off period (default {DEFAULT_JITTER_PERIOD_MS:g})")
    parser.add_argument("--seed", type=int, default=0, help="intermittent: seed of the on/off schedule")
    parser.add_argument("--json")
    parser.add_argument("--trace-dir", default=None,
                        help="trace every run under DIR/<row>-round<k> and report the iterations in which every rank "
                             "ran a plan's order exactly (default: runs untraced)")
    parser.add_argument("extra", nargs="*", help="more trainer flags, after --")
    args = parser.parse_args(argv)
    cores = usable_cores() if cores is None else list(cores)
    P = args.pipeline_parallel
    if args.iters < 2:
        parser.error("--iters must be >= 2 (the first is a warm-up)")
    if args.global_batch_size % args.micro_batch_size:
        parser.error(f"--global-batch-size {args.global_batch_size} is not a multiple of --micro-batch-size "
                     f"{args.micro_batch_size}")
    args.microbatches = args.global_batch_size // args.micro_batch_size
    if P > len(cores):
        parser.error(f"-P {P} needs {P} cores to give every rank its own; this process may use {len(cores)}")
    args.row_names = [name.strip() for name in args.rows.split(",") if name.strip()]
    unknown = [name for name in args.row_names if name not in POLICIES]
    if unknown or not args.row_names:
        parser.error(f"--rows: unknown policy {', '.join(unknown) or '(none given)'}; choose from "
                     f"{', '.join(POLICIES)}")
    if args.straggler == NONE and args.slow_rank is not None:
        parser.error("--slow-rank needs --straggler steady or intermittent")
    if args.straggler != INTERMITTENT and args.jitter_period_ms is not None:
        parser.error("--jitter-period-ms applies to --straggler intermittent only")
    if args.straggler != NONE:
        args.slow_rank = P - 1 if args.slow_rank is None else args.slow_rank
        if not 0 <= args.slow_rank < P:
            parser.error(f"--slow-rank must be a pipeline rank 0..{P - 1}, got {args.slow_rank}")
    if args.straggler == INTERMITTENT:
        args.jitter_period_ms = DEFAULT_JITTER_PERIOD_MS if args.jitter_period_ms is None else args.jitter_period_ms
        if not args.jitter_period_ms > 0:
            parser.error(f"--jitter-period-ms must be > 0, got {args.jitter_period_ms:g}")
    args.cores = tuple(cores[:P])
    return args


def launcher_flags(args: argparse.Namespace, prefix: Path) -> List[str]:
    data_dir = Path(args.data_dir)
    return ["--pipeline_parallel", str(args.pipeline_parallel), "--model_chunks", str(args.model_chunks),
            "--variable-seq-lengths", "--seq-length", str(args.seq_length), "--data-path", str(prefix.resolve()),
            "--tokenizer-json", str((data_dir / "tokenizer.json").resolve()), "--micro-batch-size",
            str(args.micro_batch_size), "--global-batch-size", str(args.global_batch_size), "--iters",
            str(args.iters), *args.extra]


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """0 done, 1 a run failed (its last line printed), 2 bad flags, 130 interrupted (Ctrl-C or SIGTERM)."""
    args = parse_args(argv)
    straggler = Straggler(args.straggler, args.slow_rank, args.cores, args.pipeline_parallel,
                          args.jitter_period_ms, args.seed)
    previous = signal.signal(signal.SIGTERM, _interrupt)   # SIGTERM unwinds like Ctrl-C: the competitor is killed
    try:
        prefix = Path(args.data_dir) / "corpus_text_document"
        if not prefix.with_suffix(".idx").exists():
            print(f"building the copyright corpus in {args.data_dir}", flush=True)
            subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "make_corpus.py"), "--output-dir",
                            args.data_dir, "--sources", "copyright"], check=True)
        flags = launcher_flags(args, prefix)
        load = {"before": list(os.getloadavg())}
        print(straggler.describe(), flush=True)
        runs, records = measure(args.row_names, args.rounds, flags, straggler, trace_root=args.trace_dir)
        load["after"] = list(os.getloadavg())
        plan_orders = None if args.trace_dir is None else plan_order_counts(
            args.trace_dir, records, args.pipeline_parallel, args.model_chunks, args.microbatches)
    except RuntimeError as error:
        print(f"{PROG}: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    baseline = BASELINE_POLICY if BASELINE_POLICY in args.row_names else args.row_names[0]
    summaries = summarise(runs, baseline)
    print(format_report(summaries, baseline, straggler, load, plan_orders))
    if args.json:
        write_json(args.json, summaries, records, straggler, flags, load, plan_orders)
    return 0

