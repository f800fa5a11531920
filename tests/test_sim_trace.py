"""Simulated runs write the trace format: the reader accepts them, and tools/process_trace.py and
tools/visualize_trace.py analyse them like real runs (metrics agree with the simulator's own numbers)."""

import importlib
import json
from collections import defaultdict
from pathlib import Path

import pytest

from megatron_app.schedule import PipelineShape
from megatron_app.sim import ComputeCosts, ComputePerturbations, LinkCosts, SimConfig, simulate
from megatron_app.trace import read_trace_dir
from megatron_app.trace.cli import run_cli
from megatron_app.trace.schema import FIRST_ITERATION

REPO = Path(__file__).resolve().parent.parent
SHAPE = PipelineShape(4, 2, 8)
ROUNDING_US = 1e-3    # the tracer writes times with 3 decimals
LINKS = LinkCosts(latency_us=50.0, gbps=10.0, tensor_bytes=4 * 2**20)     # 3355 us per message


def load_tool(name):
    return importlib.import_module(f"megatron_app.trace.{name}")


@pytest.fixture(scope="module")
def simulated(tmp_path_factory):
    trace_dir = tmp_path_factory.mktemp("sim_trace")
    config = SimConfig(SHAPE, ComputeCosts.uniform(SHAPE, 10_000, 20_000), links=LINKS,
                       perturbations=ComputePerturbations(jitter=0.2), iterations=2, seed=3)
    return trace_dir, simulate(config, "adaptive", trace_dir=trace_dir)


def test_trace_files_hold_the_simulated_run(simulated):
    trace_dir, result = simulated
    run = read_trace_dir(trace_dir, 4, 2)
    assert (run.source, run.policy, run.microbatches, len(run.ranks)) == ("sim", "adaptive", 8, 4)
    assert run.iterations() == [1, 2]   # counted from 1, as the trainer's log and its traces
    for rank in run.ranks:
        r = rank.meta.pp_rank
        assert rank.meta.host == "sim" and rank.meta.clock_offset_us == 0.0 and rank.meta.extra["seed"] == 3
        for outcome in result.iterations:
            events = rank.events_of(outcome.iteration + FIRST_ITERATION)   # the engine counts from 0
            compute = [e for e in events if e.kind in ("forward", "backward")]
            assert [(e.kind[0].upper(), e.chunk, e.microbatch) for e in compute] == [
                (t.kind.value, t.chunk, t.microbatch) for t in outcome.orders[r]]
            assert sum(e.duration for e in compute) == pytest.approx(outcome.busy_us[r])
            (span,) = [e for e in events if e.kind == "iteration"]
            assert span.start == pytest.approx(outcome.start_us, abs=ROUNDING_US)
            assert span.end <= outcome.end_us + ROUNDING_US
            sends = [e for e in events if e.kind == "send"]
            assert sends and all(e.duration >= LINKS.min_transfer_us - 2 * ROUNDING_US for e in sends)
            assert all(e.nbytes == LINKS.tensor_bytes and e.extra["direction"] in ("forward", "backward")
                       for e in sends)
            receives = [e for e in events if e.kind == "recv"]
            assert receives and all(e.start == e.end for e in receives)
        if r > 0:   # waits for its first input
            first_wait = [e for e in rank.events_of(FIRST_ITERATION) if e.kind == "wait"][0]
            assert first_wait.start == 0.0 and first_wait.end >= r * 10_000 * 0.8


def test_sends_on_one_link_never_overlap_their_transmissions(simulated):
    trace_dir, _ = simulated
    run = read_trace_dir(trace_dir, 4, 2)
    per_link = defaultdict(list)
    for rank in run.ranks:
        for event in rank.events:
            if event.kind == "send":
                per_link[(rank.meta.pp_rank, event.peer)].append(event)
    assert len(per_link) == 8        # with V=2: both directions between neighbours, and 3 <-> 0
    for sends in per_link.values():
        arrivals = sorted(e.end for e in sends)
        gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
        assert min(gaps) >= LINKS.transmit_us - 2 * ROUNDING_US


def test_process_trace_reads_a_simulated_run(simulated, tmp_path, capsys):
    trace_dir, result = simulated
    tool = load_tool("process_trace")
    code = run_cli(tool.PROG, tool.main, ["--pipeline_parallel", "4", "--model_chunks", "2", "--trace-dir",
                                          str(trace_dir), "--out-dir", str(tmp_path), "--strict"])
    out = capsys.readouterr().out
    assert code == 0 and "causality: ok" in out and "source=sim" in out
    metrics = json.loads((tmp_path / "trace_pipeline_4_model_chunks_2_metrics.json").read_text())
    (last,) = metrics["iterations"]
    outcome = result.iterations[-1]
    assert last["iteration"] == 2
    assert last["makespan_us"] == pytest.approx(outcome.makespan_us, abs=0.01)
    assert last["mean_bubble_ratio"] == pytest.approx(outcome.bubble_ratio, abs=1e-6)
    assert [r["peak_activations"] for r in last["ranks"]] == outcome.peak_activations
    # The same lower bound as the simulator's (its link latency from the trace header, once per hop).
    assert last["lower_bound_us"] == pytest.approx(result.bounds[-1].best_us, abs=0.1)
    assert f"lower bound {last['lower_bound_us'] / 1e3:.3f} ms" in out
    assert (tmp_path / "trace_pipeline_4_model_chunks_2.json").stat().st_size > 0


def test_the_trace_tools_bound_is_the_simulators_for_every_iteration(simulated):
    from megatron_app.trace.metrics import iteration_metrics

    trace_dir, result = simulated
    run = read_trace_dir(trace_dir, 4, 2)
    for k, bounds in enumerate(result.bounds, start=FIRST_ITERATION):
        metrics = iteration_metrics(run, k)
        assert metrics.lower_bound_us == pytest.approx(bounds.best_us, abs=0.1)
        assert bounds.path_us > bounds.work_us            # the path bound counts, so latency per hop counts
        assert metrics.lower_bound_us > metrics.ideal_us


def test_visualize_trace_draws_a_simulated_run(simulated, tmp_path, capsys):
    trace_dir, result = simulated
    tool = load_tool("visualize_trace")
    code = run_cli(tool.PROG, tool.main, ["--pipeline_parallel", "4", "--model_chunks", "2", "--trace-dir",
                                          str(trace_dir), "--out-dir", str(tmp_path), "--iteration", "1"])
    assert code == 0
    assert f"makespan {result.iterations[0].makespan_us / 1e3:.3f} ms" in capsys.readouterr().out
    for suffix in ("xlsx", "png"):
        assert (tmp_path / f"trace_pipeline_4_model_chunks_2.{suffix}").stat().st_size > 1000
