"""Several trainings in one process group (bench_schedule's workers, tests) each get their own agreed run directory."""

import types

import torch.distributed as dist

from megatron_app.train import trace_run


def _fake_dist(rank, store):
    return types.SimpleNamespace(get_rank=lambda: rank, get_world_size=lambda: 2,
                                 distributed_c10d=types.SimpleNamespace(_get_default_store=lambda: store))


def test_a_rank_that_falls_behind_joins_the_run_of_the_same_training(tmp_path, monkeypatch):
    store = dist.HashStore()
    monkeypatch.setenv("MEGATRON_APP_JOB_ID", "jobx")
    # Rank 0 starts two trainings before rank 1 asks for the first one's directory.
    monkeypatch.setattr(trace_run, "dist", _fake_dist(0, store))
    monkeypatch.setattr(trace_run, "_runs_started", 0, raising=False)
    monkeypatch.setattr(trace_run, "new_run_name", lambda job, names=iter(["run-a", "run-b"]): next(names))
    first, second = trace_run.start_trace_run(tmp_path), trace_run.start_trace_run(tmp_path)
    monkeypatch.setattr(trace_run, "dist", _fake_dist(1, store))
    monkeypatch.setattr(trace_run, "_runs_started", 0, raising=False)
    assert [trace_run.start_trace_run(tmp_path), trace_run.start_trace_run(tmp_path)] == [first, second]
    assert (first.name, second.name) == ("run-a", "run-b")
