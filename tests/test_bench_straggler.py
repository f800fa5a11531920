"""tools/bench_straggler.py's logic (megatron_app.bench.straggler): the competitor's life (pinned, busy, switched on
and off, always killed: normal end, failed run, Ctrl-C, SIGTERM, the benchmark killed outright), pinning every
thread of a process, finding a job's ranks, ending what a failed run leaves, flags, rows and the report; one short
real run."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

from megatron_app.bench import real_composition, straggler
from megatron_app.bench.real_composition import CompositionRun, summarise
from megatron_app.bench.straggler import (COMPETITOR_MARK, Competitor, RankPinner, SlowdownRecord, Straggler,
                                          end_job, job_processes, job_ranks, parse_args, pin_threads, row_flags,
                                          slowed)
from pipeline_runs import run_env

REPO = Path(__file__).resolve().parents[1]
CORES = sorted(os.sched_getaffinity(0))
two_cores = pytest.mark.skipif(len(CORES) < 2, reason="needs two usable cores (one per rank)")


def competitors():
    """pids of live competitor processes (any benchmark's)."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if COMPETITOR_MARK.encode() in Path(f"/proc/{entry.name}/cmdline").read_bytes() and \
                        straggler._alive(int(entry.name)):
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def state(pid):
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def cpu_ticks(pid):
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])      # utime + stime


def wait_until(condition, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


# ---- the competitor ---------------------------------------------------------------------------------------------
def test_a_steady_competitor_is_pinned_busy_and_killed_at_the_end():
    core = CORES[-1]
    with Competitor(core) as competitor:
        pid = competitor.pid
        assert os.sched_getaffinity(pid) == {core}
        before = cpu_ticks(pid)
        assert wait_until(lambda: cpu_ticks(pid) >= before + 10), "the competitor does not burn CPU"
        assert pid in competitors()
    assert competitor.process.returncode == -signal.SIGKILL and not straggler._alive(pid)
    assert competitor.on_fraction == 1.0 and pid not in competitors()


@pytest.mark.parametrize("error", [RuntimeError("run failed"), KeyboardInterrupt()])
def test_the_competitor_is_killed_when_the_run_fails_or_is_interrupted(error):
    with pytest.raises(type(error)):
        with Competitor(CORES[0]) as competitor:
            raise error
    assert competitor.process.returncode == -signal.SIGKILL and competitor.pid not in competitors()


def test_an_intermittent_competitor_is_switched_on_and_off_and_killed_even_while_stopped():
    with Competitor(CORES[0], period_s=0.06, seed=1) as competitor:
        seen = ["R"]      # states in turn: running (on) and stopped (off)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and len(seen) < 4:
            now = state(competitor.pid)
            if now != seen[-1]:
                seen.append(now)
            time.sleep(0.002)
        assert seen == ["R", "T", "R", "T"], seen
        assert wait_until(lambda: state(competitor.pid) == "T")    # end it while it is stopped
    assert competitor.process.returncode == -signal.SIGKILL and competitor.switches >= 2
    assert 0.0 < competitor.on_fraction < 1.0


def test_the_on_off_schedule_is_seeded_with_the_mean_period():
    from itertools import islice

    first, again, other = (list(islice(straggler.on_off_phases(0.3, seed), 20000)) for seed in (0, 0, 1))
    assert first == again != other
    assert sum(first) / len(first) == pytest.approx(0.15, rel=0.03) and min(first) > 0


CHILD = textwrap.dedent("""
    import sys, time
    import megatron_app.bench.straggler as s
    {body}
""")


def start_child(body, *args):
    child = subprocess.Popen([sys.executable, "-c", CHILD.format(body=textwrap.dedent(body)), *args],
                             stdout=subprocess.PIPE, text=True, env=run_env())
    lines = [child.stdout.readline()]
    while lines[-1] and not lines[-1].startswith("running"):
        lines.append(child.stdout.readline())
    kids = []

    def found():
        kids[:] = [pid for pid in competitors() if parent_of(pid) == child.pid]
        return len(kids) == 1

    # Popen returns once the competitor's exec has begun; its command line (the mark) is readable a moment later.
    if not (lines[-1].startswith("running") and wait_until(found, timeout=10.0)):
        child.kill()          # a leftover child would keep its competitor alive into the next tests
        child.wait()
        pytest.fail(f"the child's competitor was not found: {kids}, {lines}")
    return child, kids[0]


def parent_of(pid):
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError):
        return None


def test_the_competitor_dies_with_a_benchmark_killed_outright():
    child, competitor = start_child("""
        with s.Competitor(0):
            print("running", flush=True)
            time.sleep(60)
    """)
    child.kill()
    child.wait()
    assert wait_until(lambda: not straggler._alive(competitor)), "the competitor outlived its benchmark"


@two_cores
def test_sigterm_unwinds_the_benchmark_like_ctrl_c(tmp_path):
    """main() under SIGTERM: the run in progress (here a sleep inside the slowdown) ends, the competitor is killed,
    exit 130."""
    (tmp_path / "corpus_text_document.idx").write_text("")
    child, competitor = start_child("""
        def measure(rows, rounds, flags, straggler, **kwargs):
            with s.slowed(straggler, "no-such-job", s.SlowdownRecord(rows[0], 0)):
                print("running", flush=True)
                time.sleep(60)
        s.measure = measure
        sys.exit(s.main(["--data-dir", sys.argv[1], "--straggler", "intermittent"]))
    """, str(tmp_path))
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=30) == 130
    assert not straggler._alive(competitor)


# ---- pinning, a job's processes ---------------------------------------------------------------------------------
def test_pin_threads_pins_every_thread_of_a_process_and_new_threads_inherit_it():
    original = os.sched_getaffinity(0)
    release = threading.Event()
    helper = threading.Thread(target=release.wait, daemon=True)
    helper.start()
    try:
        threads = os.listdir("/proc/self/task")
        assert pin_threads(os.getpid(), {CORES[0]}) == len(threads) >= 2
        assert all(os.sched_getaffinity(int(tid)) == {CORES[0]} for tid in threads)
        seen = []
        late = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
        late.start()
        late.join()
        assert seen == [{CORES[0]}]
        assert pin_threads(2**22 + 12345, {CORES[0]}) == 0          # no such process
    finally:
        release.set()
        helper.join()
        pin_threads(os.getpid(), original)
    assert os.sched_getaffinity(0) == original


def sleeper(job_id, rank=None, ignore_sigterm=False):
    """A process that sleeps, with MEGATRON_APP_JOB_ID=job_id and (when given) RANK=rank in its environment."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "MEGATRON_APP_JOB_ID")}
    env["MEGATRON_APP_JOB_ID"] = job_id
    if rank is not None:
        env["RANK"] = str(rank)
    code = ("import signal, time\n" + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if ignore_sigterm else "")
            + "print('up', flush=True)\ntime.sleep(60)")
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)


@pytest.fixture
def fake_job():
    """A job's processes: two ranks, its launcher (job id, no RANK); and a rank of another job."""
    job = f"test-straggler-{uuid.uuid4().hex[:8]}"
    procs = {"rank0": sleeper(job, 0), "rank1": sleeper(job, 1), "agent": sleeper(job, ignore_sigterm=True),
             "other": sleeper(f"{job}-other", 0)}
    for proc in procs.values():
        assert proc.stdout.readline() == "up\n"
    yield job, procs
    for proc in procs.values():
        proc.kill()
        proc.wait()


def test_a_jobs_ranks_are_found_by_its_id_and_pinned_one_core_each(fake_job):
    job, procs = fake_job
    assert job_ranks(job) == {procs["rank0"].pid: 0, procs["rank1"].pid: 1}
    assert set(job_processes(job)) == {procs[name].pid for name in ("rank0", "rank1", "agent")}
    if len(CORES) < 2:
        pytest.skip("needs two usable cores")
    other_before = os.sched_getaffinity(procs["other"].pid)
    with RankPinner(job, CORES[:2], world_size=2, poll_s=0.05) as pinner:
        assert wait_until(lambda: len(pinner.pinned) == 2)
    for rank in (0, 1):
        assert os.sched_getaffinity(procs[f"rank{rank}"].pid) == {CORES[rank]}
        assert pinner.pinned[rank][:2] == (procs[f"rank{rank}"].pid, CORES[rank]) and pinner.pinned[rank][2] >= 1
    assert os.sched_getaffinity(procs["other"].pid) == other_before
    assert os.sched_getaffinity(procs["agent"].pid) == set(CORES)


def test_a_failed_run_ends_its_jobs_processes_and_the_competitor(fake_job):
    job, procs = fake_job
    plan = Straggler("steady", 1, (CORES[0], CORES[-1]), 2)
    with pytest.raises(RuntimeError, match="run failed"):
        with slowed(plan, job, SlowdownRecord("planned", 0)):
            assert wait_until(competitors)
            competitor = competitors()
            raise RuntimeError("run failed")
    for name in ("rank0", "rank1", "agent"):     # the agent ignores SIGTERM: SIGKILL after the grace period
        assert procs[name].wait(timeout=10) is not None
    assert procs["other"].poll() is None
    assert not any(straggler._alive(pid) for pid in competitor)


def test_end_job_signals_only_the_jobs_processes(fake_job):
    job, procs = fake_job
    signalled = end_job(job, grace_s=0.3)
    assert sorted(signalled) == sorted(procs[name].pid for name in ("rank0", "rank1", "agent"))
    assert procs["rank0"].wait(timeout=5) == -signal.SIGTERM and procs["agent"].wait(timeout=5) == -signal.SIGKILL
    assert procs["other"].poll() is None


def test_measure_refuses_runs_whose_ranks_were_not_all_pinned(monkeypatch):
    def fake_run_once(row, round_index, flags, warmup, env, row_flags, trace_dir=None):
        assert env["MEGATRON_APP_JOB_ID"].startswith("straggler") and row_flags(row)[1] == row
        return CompositionRun(row, round_index, [1.0], [100.0], [7.0])

    monkeypatch.setattr(real_composition, "run_once", fake_run_once)
    plan = Straggler("intermittent", 0, (CORES[0],) * 2, 2, period_ms=50.0)
    with pytest.raises(RuntimeError, match=r"row planned round 1: pinned ranks \[\] of 2"):
        straggler.measure(["planned", "interleaved"], 1, [], plan, progress=lambda line: None)
    assert competitors() == []


# ---- flags, rows, report ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["-P", "3"], "-P 3 needs 3 cores to give every rank its own; this process may use 2"),
    (["--iters", "1"], "--iters must be >= 2 (the first is a warm-up)"),
    (["--rows", "planned,nope"], "--rows: unknown policy nope; choose from"),
    (["--straggler", "none", "--slow-rank", "1"], "--slow-rank needs --straggler steady or intermittent"),
    (["--slow-rank", "2"], "--slow-rank must be a pipeline rank 0..1, got 2"),
    (["--jitter-period-ms", "100"], "--jitter-period-ms applies to --straggler intermittent only"),
    (["--straggler", "intermittent", "--jitter-period-ms", "0"], "--jitter-period-ms must be > 0, got 0"),
    (["--straggler", "sometimes"], "invalid choice: 'sometimes'"),
    (["--global-batch-size", "15"], "--global-batch-size 15 is not a multiple of --micro-batch-size 2"),
])
def test_bad_flags_are_one_line_and_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv, cores=[0, 1])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and message in err, err


def test_defaults_slow_the_last_rank_and_rows_come_from_the_registry():
    from megatron_app.train.args import parse_args as trainer_args

    args = parse_args([], cores=[3, 5, 7])
    assert (args.straggler, args.slow_rank, args.cores, args.row_names) == (
        "steady", 1, (3, 5), ["planned", "planned-fixed", "interleaved"])
    assert parse_args(["--straggler", "intermittent"], cores=[0, 1]).jitter_period_ms == 300.0
    assert parse_args(["--straggler", "none"], cores=[0, 1]).slow_rank is None
    assert row_flags("planned-fixed") == ["--policy", "planned-fixed", "--composition", "packed"]
    assert row_flags("interleaved") == ["--schedule", "interleaved", "--composition", "packed"]
    for row in args.row_names:     # the trainer takes every row's flags
        parsed = trainer_args(["--pipeline_parallel", "2", "--model_chunks", "2", "--emulate-compute", "1,2",
                               "--emulate-lengths-file", str(REPO / "docs/results/lengths/copyright_2048.txt"),
                               *row_flags(row)], environ={"WORLD_SIZE": "2", "MASTER_ADDR": "localhost"})
        assert parsed.policy == row and parsed.composition == "packed"


def test_the_report_gives_medians_ratios_loss_agreement_and_load(tmp_path):
    runs = [CompositionRun("planned", 0, [1.0, 1.0], [110.0, 100.0], [7.0, 6.0]),
            CompositionRun("planned-fixed", 0, [1.0, 1.0], [100.0, 100.0], [7.0, 6.0]),
            CompositionRun("interleaved", 0, [1.2, 1.2], [84.0, 84.0], [7.0, 6.0 + 2e-6])]
    summaries = summarise(runs, "interleaved")
    plan = Straggler("steady", 1, (0, 1), 2)
    load = {"before": [1.0, 2.0, 3.0], "after": [1.5, 2.0, 3.0]}
    report = straggler.format_report(summaries, "interleaved", plan, load).splitlines()
    assert report[0] == "pipeline rank 1 slowed by a busy process on its core 1, for the whole run"
    assert report[1].split() == ["row", "tokens/s", "iter", "ms", "n", "x", "interleaved", "max", "|loss", "diff|",
                                 "|predicted/measured", "-", "1|:", "median,", "max"]
    assert report[2].split()[:5] == ["planned", "105", "1000", "2", "1.250"] and report[2].split()[5:] == ["2.00e-06", "not", "predicted"]
    assert report[3].split()[:2] == ["planned-fixed", "100"]
    assert report[5].split()[:4] == ["planned", "/", "planned-fixed", "1.050"] and "target >= 1.05" in report[5]
    assert report[6].split()[:4] == ["planned", "/", "interleaved", "1.250"]
    assert report[-1] == "load average (1, 5, 15 min): before 1.00, 2.00, 3.00; after 1.50, 2.00, 3.00"
    records = [SlowdownRecord("planned", 0, {0: (11, 0, 5), 1: (12, 1, 6)}, 1.0, 0)]
    straggler.write_json(str(tmp_path / "out.json"), summaries, records, plan, ["--iters", "6"], load)
    payload = json.loads((tmp_path / "out.json").read_text())
    assert payload["ratios"]["planned / planned-fixed"] == pytest.approx(1.05)
    assert payload["straggler"]["core"] == 1 and payload["load_average"] == load
    assert payload["slowdowns"][0]["pinned"] == {"0": [11, 0, 5], "1": [12, 1, 6]}


# ---- did a run keep its plans? ------------------------------------------------------------------------------------
def test_plan_orders_are_recognised_in_a_trace_and_a_moved_task_is_not(tmp_path):
    from megatron_app.schedule import PipelineShape, make_policy
    from megatron_app.schedule.plan_search import Plan, plan_order
    from megatron_app.sim.costs import ComputeCosts, ComputePerturbations
    from megatron_app.sim.lengths import MicrobatchLengths
    from megatron_app.sim.simulator import SimConfig, simulate

    shape = PipelineShape(2, 2, 8)
    config = SimConfig(shape, ComputeCosts.uniform(shape, 10e3, 20e3), iterations=3, lengths=MicrobatchLengths(1.0),
                       perturbations=ComputePerturbations(slow_rank=1, slow_factor=2.0))
    for name in ("planned-fixed", "interleaved", "dfc"):
        simulate(config, [make_policy(name, shape, rank) for rank in range(2)], trace_dir=tmp_path / name)
        orders = straggler.compute_orders(tmp_path / name, 2, 2)
        assert len(orders) == 3 and all(len(per_rank[r]) == 32 for per_rank in orders.values() for r in range(2))
        kept = [straggler.follows_a_plan(shape, per_rank) for per_rank in orders.values()]
        assert kept == [name != "dfc"] * 3, name       # greedy dfc runs no plan's order
    plan = Plan((3, 1, 0, 2, 7, 6, 4, 5), (1, 0))
    orders = [list(plan_order(shape, rank, plan)) for rank in range(2)]
    assert straggler.follows_a_plan(shape, orders)
    backwards = [i for i, task in enumerate(orders[0]) if task.kind.value == "B"]
    orders[0][backwards[2]], orders[0][backwards[3]] = orders[0][backwards[3]], orders[0][backwards[2]]
    assert not straggler.follows_a_plan(shape, orders)


# ---- one short real run -----------------------------------------------------------------------------------------
@pytest.mark.slow
@two_cores
def test_a_short_real_run_pins_both_ranks_slows_one_and_leaves_nothing_behind(tmp_path, real_corpus):
    out = tmp_path / "straggler.json"
    done = subprocess.run([sys.executable, str(REPO / "tools" / "bench_straggler.py"), "--data-dir",
                           str(real_corpus["dir"]), "--seq-length", "256", "--global-batch-size", "8", "--iters", "2",
                           "--rounds", "1", "--rows", "planned-fixed", "--straggler", "intermittent",
                           "--jitter-period-ms", "100", "--json", str(out), "--trace-dir", str(tmp_path / "traces")],
                          cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "planned-fixed" in done.stdout and "load average" in done.stdout
    assert "iterations in which every rank ran a plan's order exactly (no task moved at run time): planned-fixed 2/2" \
        in done.stdout
    payload = json.loads(out.read_text())
    (record,) = payload["slowdowns"]
    assert {rank: core for rank, (_, core, _) in record["pinned"].items()} == {"0": CORES[0], "1": CORES[1]}
    assert all(threads >= 2 for _, _, threads in record["pinned"].values())
    assert record["competitor_switches"] > 0 and 0.0 < record["competitor_on_fraction"] < 1.0
    assert payload["summaries"][0]["median_tokens_per_s"] > 0
    assert competitors() == []
