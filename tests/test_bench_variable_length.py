"""tools/bench_schedule.py's variable-length scenario: microbatch lengths from a real corpus's token counts, emulated
compute scaled by the simulator's f(tokens), activations sized by tokens, the lengths told to the schedule. A tiny run
end to end (rows, peak tokens, simulator columns, torch skipped with its reason), the emulation's agreement with
megatron_app.sim, and the trainer flag's errors."""

import json
import subprocess
import sys

import pytest

from pipeline_runs import REPO, run_env

from megatron_app.bench.schedule.analysis import spec_of
from megatron_app.bench.schedule.scenarios import FIXED_SHAPE_NOTE, VARIABLE_LENGTH
from megatron_app.emulation.sim_replay import simulate_emulation
from megatron_app.emulation.spec import EmulationSpec
from megatron_app.schedule import PipelineShape
from megatron_app.sim import SimConfig, simulate
from megatron_app.sim.costs import ComputeCosts
from megatron_app.sim.lengths import MicrobatchLengths
from megatron_app.trace.schema import FIRST_ITERATION

pytestmark = pytest.mark.filterwarnings("ignore:.*not installed")
TOOL = REPO / "tools" / "bench_schedule.py"
ROW_KEYS = {"interleaved", "planned", "planned-x1.25", "dfc", "adaptive"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """P=2 V=2 m=4, lengths from tools/corpus_lengths.py's default corpus (made by the benchmark itself)."""
    out = tmp_path_factory.mktemp("varbench")
    result = subprocess.run(
        [sys.executable, str(TOOL), "--quick", "--scenarios", "variable-length",
         "--schedules", "interleaved,planned,dfc,adaptive,torch-interleaved", "--planned-memory-factors", "1.0,1.25",
         "--json", out / "bench.json", "--work-dir", out / "work"],
        cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_dir = next(p for p in (out / "work").iterdir() if p.is_dir())
    return json.loads((out / "bench.json").read_text()), run_dir, result.stdout


def test_rows_hold_measured_peak_tokens_and_simulator_columns(tiny):
    payload, _, stdout = tiny
    rows = {row["key"]: row for row in payload["rows"]}
    assert set(rows) == ROW_KEYS                                 # torch's fixed-shape schedules are skipped ...
    assert FIXED_SHAPE_NOTE in stdout                            # ... and the output says why
    lengths = MicrobatchLengths.from_file(payload["lengths_file"])
    assert len(lengths.corpus) > 500                             # a real corpus, not a handful of numbers
    P = payload["config"]["pipeline_parallel"]
    for key, row in rows.items():
        assert row["scenario"] == VARIABLE_LENGTH
        assert row["iteration_ms"] > 0 and row["sim_ms"] >= row["bound_ms"] - 1e-6
        assert len(row["peak_tokens"]) == P and min(row["peak_tokens"]) >= min(lengths.corpus)
        assert len(row["sim_peak_tokens"]) == P
    assert rows["planned-x1.25"]["memory_factor"] == 1.25 and rows["planned"]["memory_factor"] == 1.0
    # A static order holds the same microbatches at its peak however long the waits take: measured == simulated.
    assert rows["interleaved"]["peak_tokens"] == rows["interleaved"]["sim_peak_tokens"]
    # planned at 1.0x never holds more activation tokens than Megatron's order on any rank (its cap).
    assert all(a <= b for a, b in zip(rows["planned"]["peak_tokens"], rows["interleaved"]["peak_tokens"]))
    targets = [check["target"] for check in payload["targets"]]
    assert any("faster than Megatron interleaved" in t for t in targets)
    assert any(t.startswith("simulator predicts APP planned within 10%") for t in targets)


def test_emulated_tasks_last_their_length_cost_and_carry_their_tokens(tiny):
    """The traces show each task lasting at least the simulator's f(tokens) draw, and the schedule sent
    activations of each microbatch's own length."""
    from megatron_app.emulation.sim_replay import measured_durations
    from megatron_app.trace import read_trace_dir

    _, run_dir, _ = tiny
    plan = json.loads((run_dir / "plan.json").read_text())
    run = next(r for r in plan["runs"] if r["key"] == "interleaved")
    spec = spec_of(run)
    shape = PipelineShape(run["pipeline_parallel"], run["model_chunks"], run["microbatches"])
    trace = read_trace_dir(run_dir / run["id"] / "trace", shape.num_stages, shape.num_chunks)
    for iteration in range(run["iterations"]):
        lengths = spec.microbatch_lengths(shape, iteration)
        traced = iteration + FIRST_ITERATION   # draws count from 0, the trace (as the log) from 1
        drawn, measured = spec.draw(shape, iteration), measured_durations(trace, traced)
        forward_0 = [measured[0][0][0][mb] - drawn[0][0][0][mb] for mb in range(shape.num_microbatches)]
        assert min(forward_0) >= -200.0
        sends = {e.microbatch: e.nbytes for e in trace.ranks[0].events_of(traced, ["send"]) if e.chunk == 0}
        per_token = {sends[mb] / lengths[mb] for mb in sends}
        assert len(sends) == shape.num_microbatches and len(per_token) == 1   # bytes proportional to tokens


@pytest.mark.parametrize("policy, factor", [("interleaved", None), ("planned", 1.0), ("planned", 1.25),
                                            ("adaptive", None)])
def test_emulation_predicts_what_the_simulator_cli_simulates(tmp_path, policy, factor):
    """simulate_emulation with a lengths file is megatron_app.sim's own variable-length run (same lengths, costs,
    planning), so the benchmark's sim column is the frontier's number for the same draws."""
    path = tmp_path / "lengths.txt"
    path.write_text("".join(f"{n}\n" for n in (5, 12, 40, 72, 90, 130, 300, 820, 64, 18)))
    lengths = MicrobatchLengths.from_file(path)
    shape = PipelineShape(4, 2, 8)
    spec = EmulationSpec.parse("10,20", seed=3, lengths=lengths)
    emulated = simulate_emulation(spec, shape, policy, iterations=3, memory_factor=factor)
    sim = simulate(SimConfig(shape, ComputeCosts.uniform(shape, 10_000, 20_000), iterations=3, seed=3,
                             lengths=lengths, memory_factor=factor), policy)
    assert [it.makespan_us for it in emulated] == pytest.approx([it.makespan_us for it in sim.iterations])
    assert [max(values) for values in zip(*(it.peak_activation_tokens for it in emulated))] == \
        pytest.approx(sim.peak_activation_tokens)
    assert spec.microbatch_lengths(shape, 1) == lengths.draw(8, 3, 1)


def test_trainer_lengths_flag_errors_are_one_line(tmp_path):
    from megatron_app.train.args import UsageError, parse_args

    with pytest.raises(UsageError, match="needs --emulate-compute"):
        parse_args(["--emulate-lengths-file", str(tmp_path / "x")], environ={})
    bad = tmp_path / "bad.txt"
    bad.write_text("12\nzero\n")
    with pytest.raises(UsageError, match="expected a token count"):
        parse_args(["--emulate-compute", "1,2", "--emulate-lengths-file", str(bad)], environ={})
    with pytest.raises(UsageError, match="cannot read lengths file"):
        parse_args(["--emulate-compute", "1,2", "--emulate-lengths-file", str(tmp_path / "missing")], environ={})


def test_bad_lengths_file_for_the_benchmark_is_one_line(tmp_path):
    result = subprocess.run([sys.executable, str(TOOL), "--scenarios", "variable-length", "--lengths-file",
                             str(tmp_path / "missing.txt")], cwd=REPO, env=run_env(), capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2
    assert "cannot read lengths file" in result.stderr and len(result.stderr.strip().splitlines()) == 1
