"""The cost model's features replayed over a trace (bench/cost_model_replay.py): a run whose last stage costs more
than the others is predicted right only by the model that learns every pipeline rank."""

from pathlib import Path

import numpy as np
import pytest

from megatron_app.bench.cost_model_replay import VARIANTS, format_table, main, replay
from megatron_app.schedule import Kind, PipelineShape
from megatron_app.schedule.plan_search import plan_graph_for
from megatron_app.trace.reader import RankTrace, TraceRun
from megatron_app.trace.schema import TraceEvent, TraceMeta

P, V = 2, 2


def _true_seconds(kind, rank, chunk, tokens, squared):
    base = 1e-3 + 2e-6 * tokens + 4e-10 * squared
    head = 1.4 if (rank, chunk) == (P - 1, V - 1) else 1.0       # the last stage holds the output layer and loss
    return base * head * (2.0 if kind is Kind.BACKWARD else 1.0)


def _traced_run(iterations=6, seed=3, gap=0.0) -> TraceRun:
    """Events laid out as the plan evaluator times Megatron's order under the true per-rank costs, each task
    followed by `gap` seconds of its rank's own time (the runtime's between tasks)."""
    rng = np.random.default_rng(seed)
    events = {rank: [] for rank in range(P)}
    clock = 0.0
    for iteration in range(1, iterations + 1):
        m = 4
        tokens = rng.integers(200, 4000, size=m).astype(float)
        squared = tokens ** 2 * rng.uniform(0.3, 1.0, size=m)
        table = np.array([[_true_seconds(kind, rank, chunk, t, s) for t, s in zip(tokens, squared)]
                          for kind in (Kind.FORWARD, Kind.BACKWARD) for rank in range(P) for chunk in range(V)]) + gap
        shape = PipelineShape(P, V, m)
        graph = plan_graph_for(shape, (0,) * P)
        span = 0.0
        for rank in range(P):
            free = None    # when the rank was done with its previous task (its gap included)
            for kind, chunk, mb, start, duration in graph.timeline(rank, tuple(range(m)), table):
                if free is not None and start > free + 1e-9:    # idle until its input came: traced as a wait
                    events[rank].append(TraceEvent(rank=rank, pp_rank=rank, iteration=iteration, kind="wait",
                                                   start=(clock + free) * 1e6, end=(clock + start) * 1e6))
                free = start + duration
                name = "forward" if kind == Kind.FORWARD.index else "backward"
                events[rank].append(TraceEvent(rank=rank, pp_rank=rank, iteration=iteration, kind=name,
                                               start=(clock + start) * 1e6,
                                               end=(clock + start + duration - gap) * 1e6,
                                               chunk=chunk, microbatch=mb,
                                               extra={"tokens": int(tokens[mb]), "squared_tokens": float(squared[mb])}))
                span = max(span, start + duration)
        clock += span + 0.01
    ranks = [RankTrace(Path(f"trace_rank{rank}.jsonl"), "1.4",
                       TraceMeta(global_rank=rank, pp_rank=rank, pipeline_parallel=P, model_chunks=V, microbatches=4),
                       events[rank]) for rank in range(P)]
    return TraceRun(Path("synthetic"), ranks)


def test_learning_every_rank_predicts_a_costlier_last_stage_and_rank_zero_alone_does_not():
    results = replay(_traced_run(), warmup=2)
    assert set(results) == set(VARIANTS)
    now = results["per rank, growth aside, gaps (now)"]
    assert len(now.errors) == 4 and now.max_abs < 0.02
    before = results["rank 0 only, plain fit"]
    assert before.bias < -0.05                      # it never saw the last stage's head: it predicts too short
    assert results["all ranks pooled"].max_abs > now.max_abs
    assert "per rank, growth aside, gaps (now)" in format_table("synthetic", results)


def test_the_time_between_a_ranks_tasks_is_learnt_and_predicted():
    """1 ms after every task (a forward takes 2-9 ms): without the gaps the pipeline is predicted short."""
    results = replay(_traced_run(gap=1e-3), warmup=2)
    now = results["per rank, growth aside, gaps (now)"]
    assert now.max_abs < 0.02
    assert results["per rank, growth aside"].bias < -0.05


def test_an_unreadable_trace_is_one_line_and_exit_2(tmp_path, capsys):
    assert main([str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bench_cost_model:") and len(err.strip().splitlines()) == 1
    with pytest.raises(SystemExit) as stopped:
        main([str(tmp_path), "--warmup", "0"])
    assert stopped.value.code == 2
